"""The quantized formats' numeric facts, in one table: what every stage's scale ``amax / qmax`` uses.

    qmax("fp8_e4m3")        # 448.0: the largest finite E4M3 magnitude
    quant_format("int8")    # QuantFormat.INT8; ConfigError (with a hint) for "none" or a typo

INT8 is symmetric with zero point 0: values saturate to ``[-128, 127]`` (``[-127, 127]`` narrow range);
FP8 E4M3 saturates to ``+-448``. No heavy imports.
"""
from __future__ import annotations

from trt_sora.config.base import did_you_mean
from trt_sora.config.recipe import QuantFormat
from trt_sora.errors import ConfigError

__all__ = ["FP8_E4M3_MAX", "INT8_MAX", "QMAX", "QuantFormat", "qmax", "quant_format"]

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
#: The magnitude a quantized format's scale maps ``amax`` onto.
QMAX: dict[QuantFormat, float] = {QuantFormat.FP8_E4M3: FP8_E4M3_MAX, QuantFormat.INT8: INT8_MAX}


def quant_format(fmt: QuantFormat | str) -> QuantFormat:
    """``fmt`` as a quantized :class:`QuantFormat`; ConfigError naming the choices for ``"none"`` or an
    unknown name."""
    choices = [f.value for f in QMAX]
    try:
        f = QuantFormat(fmt)
    except ValueError:
        raise ConfigError(f"unknown quantization format {fmt!r}{did_you_mean(str(fmt), choices)}; "
                          f"use one of {choices}") from None
    if f not in QMAX:
        raise ConfigError(f"quantization format {f.value!r} has no quantized values; use one of {choices}")
    return f


def qmax(fmt: QuantFormat | str) -> float:
    """Largest representable magnitude the scale maps ``amax`` onto (448 for FP8 E4M3, 127 for INT8)."""
    return QMAX[quant_format(fmt)]
