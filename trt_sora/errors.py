"""Typed errors. Every message names the problem *and* the fix.

All errors derive from :class:`TrtSoraError`, so a server or the CLI can catch
one type and show a one-line message instead of a traceback from deep inside a
library. The two lazy-import helpers live here too: :func:`require` (an optional dependency, or
the error naming its extra) and :func:`lazy_exports` (a package's public names, imported on first use).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class TrtSoraError(Exception):
    """Base class of every error trt_sora raises on purpose."""

    exit_code = 2


class ConfigError(TrtSoraError, ValueError):
    """A recipe, preset or config value is invalid (unknown key, bad range, ...)."""


class ModelError(TrtSoraError):
    """A model name or checkpoint folder cannot be resolved or loaded."""


class ShapeError(TrtSoraError, ValueError):
    """An input shape is outside every supported profile/bucket, or malformed."""


class ExportError(TrtSoraError):
    """torch -> ONNX export failed or its verification missed the parity bar."""


class CalibrationError(TrtSoraError):
    """Calibration data or statistics are invalid (NaN/inf, empty prompt set, ...)."""


class QuantizeError(TrtSoraError):
    """Q/DQ insertion cannot be done as asked (unmatched sites, bad amax, ...)."""


class BuildError(TrtSoraError):
    """The TensorRT builder failed or the engine misses the recipe's requirements."""


class BackendMissingError(TrtSoraError, ImportError):
    """An optional backend (TensorRT, TensorRT-RTX, onnxruntime, torch) is not installed."""


class ParityError(TrtSoraError):
    """A parity gate failed (the CLI exits 1, like ``trt-sora check``; bad input exits 2)."""

    exit_code = 1


class NumericsError(TrtSoraError, ArithmeticError):
    """A backend produced NaN/inf outputs from finite inputs (an artifact broken at this shape)."""


class ArtifactError(TrtSoraError):
    """An artifact folder is missing files, has a bad manifest, or failed its gates."""


class StorageError(TrtSoraError):
    """Object storage refused or lost a request: no or refused credentials, a missing bucket, an
    unreachable endpoint, a connection dropped mid-write."""


def require(module: str, *, extra: str, pip: str | None = None):
    """Import ``module`` lazily or raise :class:`BackendMissingError` with the install command.

    ``extra`` is the trt_sora extra that provides it (e.g. ``"export"``);
    ``pip`` overrides the suggested pip command.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - message path tested via monkeypatch
        cmd = pip or f"pip install 'trt_sora[{extra}]'"
        raise BackendMissingError(
            f"{module!r} is not installed (needed here: {exc}). Install it with: {cmd}"
        ) from exc


def lazy_exports(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562): ``name`` in ``table`` comes from the module
    ``table[name]``, imported on first use, so importing the package imports none of them; any
    other name raises AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in table:
            import importlib

            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
