"""Compute capability (SM) values: one parser for the forms artifacts and recipes carry.

Reports and manifests hold an SM as ``"8.9"`` (recipes, the parity report's ``candidate.device.sm``,
written by :func:`sm_dotted`) or ``89`` (build reports, engine file names); comparing those as strings
orders ``"10.0"`` (Blackwell) below ``"8.9"``. Read any of them with :func:`sm_int` (or
:func:`parse_sm`), ask this machine with :func:`device_sm`, and compare integers.
"""
from __future__ import annotations

import re

from trt_sora.errors import ConfigError

__all__ = ["FP8_MIN_SM", "HOPPER_SM", "device_sm", "parse_sm", "sm_dotted", "sm_int", "sm_or_none"]

#: FP8 E4M3 tensor cores: Ada (8.9), Hopper (9.0) and newer.
FP8_MIN_SM = 89
#: Hopper: TMA, wgmma.
HOPPER_SM = 90

_DOTTED = re.compile(r"^(?:sm_?)?(\d+)\.(\d)$", re.I)
_PACKED = re.compile(r"^(?:sm_?)?(\d+)$", re.I)


def parse_sm(value) -> tuple[int, int]:
    """``(major, minor)`` of ``"8.9"``, ``8.9`` (YAML), ``"10.0"``, ``89``, ``"sm_90"``, ``"SM100"`` or ``(9, 0)``.

    A packed integer carries the minor version in its last digit (``100`` is 10.0, ``121`` is 12.1).
    Raises ConfigError for anything else.
    """
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, int) for x in value):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10:
        return divmod(value, 10)
    text = str(value).strip()
    m = _DOTTED.match(text)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = _PACKED.match(text)
    if m and len(m.group(1)) >= 2:
        return divmod(int(m.group(1)), 10)
    raise ConfigError(f"compute capability {value!r} is not of the form '8.9', 89 or 'sm_90'")


def sm_int(value) -> int:
    """The packed integer of :func:`parse_sm` (``89`` for 8.9, ``100`` for 10.0): orders correctly."""
    major, minor = parse_sm(value)
    return major * 10 + minor


def sm_or_none(value) -> int | None:
    """:func:`sm_int` of ``value``, or None where a report has no (or no readable) SM."""
    try:
        return sm_int(value) if value is not None else None
    except ConfigError:
        return None


def sm_dotted(value) -> str:
    """The dotted form reports and recipes carry: ``"9.0"`` for ``90``, ``(9, 0)`` or ``"sm_90"``."""
    major, minor = parse_sm(value)
    return f"{major}.{minor}"


def device_sm(device=None) -> int | None:
    """SM of a CUDA device as an int (``90`` for an H100/H200; ``device``: None = the current one),
    or None without torch, without a CUDA GPU, or for a non-CUDA ``device``."""
    try:
        import torch
    except ImportError:
        return None
    dev = f"cuda:{device}" if isinstance(device, int) else str(device or "cuda")
    if not torch.cuda.is_available() or not dev.startswith("cuda"):
        return None
    return sm_int(torch.cuda.get_device_capability(torch.device(dev)))
