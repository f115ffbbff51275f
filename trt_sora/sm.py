"""Compute capability (SM) values: one parser for the forms artifacts and recipes carry.

Reports and manifests hold an SM as ``"8.9"`` (recipes, runner reports), ``89`` (build reports) or
``"89"``; comparing those as strings orders ``"10.0"`` (Blackwell) below ``"8.9"``. Compare
:func:`parse_sm` tuples or :func:`sm_int` integers instead.
"""
from __future__ import annotations

import re

from trt_sora.errors import ConfigError

__all__ = ["parse_sm", "sm_int"]

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
