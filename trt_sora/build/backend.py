"""Choose the TensorRT flavour for a recipe: full ``tensorrt`` or ``tensorrt_rtx``.

Imports happen here and only when a build runs, so ``import trt_sora`` never loads
TensorRT. A missing backend raises :class:`BackendMissingError` with the exact pip
command; a target the backend cannot build for raises :class:`ConfigError`.
"""
from __future__ import annotations

import importlib
import logging
from types import ModuleType

from trt_sora.config.recipe import Backend, QuantFormat
from trt_sora.errors import BackendMissingError, ConfigError
from trt_sora.sm import FP8_MIN_SM

log = logging.getLogger("trt_sora")

#: Module names tried in order. The PyPI wheel of TensorRT-RTX ships the real
#: extension as ``tensorrt_rtx_bindings`` under a thin ``tensorrt_rtx`` package.
MODULES: dict[Backend, tuple[str, ...]] = {
    Backend.TENSORRT: ("tensorrt", "tensorrt_bindings"),
    Backend.TENSORRT_RTX: ("tensorrt_rtx", "tensorrt_rtx_bindings"),
}

#: Install commands as NVIDIA documents them for TensorRT 10.x/11.x (real wheels on PyPI: the bare
#: ``tensorrt`` package is the CUDA 13 build, ``tensorrt-cu12`` the CUDA 12 one) and TensorRT-RTX.
INSTALL: dict[Backend, str] = {
    Backend.TENSORRT: "pip install --upgrade tensorrt  (CUDA 13; on CUDA 12: pip install --upgrade tensorrt-cu12)",
    Backend.TENSORRT_RTX: "pip install 'tensorrt-rtx-cu13>=1.7,<2'",
}

#: Compute capabilities TensorRT-RTX builds for (support matrix 1.5+: Turing 7.5,
#: Ampere RTX 8.6, Ada 8.9, Blackwell RTX 12.0 and GB10 12.1). No data-center parts:
#: SM80 (A100), SM90 (H100/H200) and SM100 need full TensorRT.
RTX_SUPPORTED_SM: tuple[int, ...] = (75, 86, 89, 120, 121)
#: FP8 GEMMs need Ada (8.9) or newer.


def check_target(backend: Backend, sm: int, quant_format: QuantFormat | str | None = None) -> None:
    """Reject backend/target/precision combinations that cannot build.

    ``sm`` is the compute capability as an int (``89`` for 8.9). Raises
    :class:`ConfigError` naming the fix; returns ``None`` when the combination is fine.
    """
    backend = Backend(backend)
    if backend is Backend.TENSORRT_RTX and sm not in RTX_SUPPORTED_SM:
        listed = ", ".join(f"{s // 10}.{s % 10}" for s in RTX_SUPPORTED_SM)
        hint = ("SM90 (Hopper: H100/H200) is a data-center GPU that TensorRT-RTX does not target; "
                if sm == 90 else "")
        raise ConfigError(
            f"backend tensorrt_rtx cannot build for compute capability {sm // 10}.{sm % 10}: "
            f"{hint}TensorRT-RTX supports {listed}. Set `backend: tensorrt` in the recipe "
            "(e.g. recipes/h100-fp8.yaml) or pick a supported compute_capability")
    if quant_format is not None and QuantFormat(quant_format) is QuantFormat.FP8_E4M3 and sm < FP8_MIN_SM:
        raise ConfigError(
            f"FP8 needs compute capability >= 8.9 (Ada/Hopper/Blackwell), the recipe targets "
            f"{sm // 10}.{sm % 10}; use `quantization.format: int8` (e.g. recipes/a100-int8.yaml)")


def load_backend(backend: Backend | str) -> ModuleType:
    """Import and return the TensorRT module for ``backend`` (lazily).

    Returns the module exposing ``Builder``, ``OnnxParser``, ... Raises
    :class:`BackendMissingError` with the install command when none of the
    candidate module names imports.
    """
    backend = Backend(backend)
    errors = []
    for name in MODULES[backend]:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if hasattr(mod, "Builder"):
            return mod
        errors.append(f"{name}: has no Builder")
    raise BackendMissingError(
        f"the {backend.value} backend is not installed ({'; '.join(errors)}). "
        f"Install it with: {INSTALL[backend]}"
        + (" (needs an NVIDIA GPU box; or use a tensorrt_rtx recipe such as rtx4090-fp8, "
           "which builds ahead of time without a GPU)" if backend is Backend.TENSORRT else ""))


def backend_version(trt: ModuleType) -> str:
    """``major.minor.patch`` of the loaded module, e.g. ``1.7.1``."""
    return ".".join(str(getattr(trt, "__version__", "0")).split(".")[:3])


def is_rtx(trt: ModuleType) -> bool:
    """True for TensorRT-RTX (always strongly typed, explicit compute capability, no plugins)."""
    return "rtx" in getattr(trt, "__name__", "") or hasattr(trt, "ComputeCapability")
