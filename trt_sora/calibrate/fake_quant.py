"""FP8 E4M3 / INT8 fake quantization and quantization-error metrics in pure torch.

These mirror ONNX ``QuantizeLinear`` -> ``DequantizeLinear`` (opset >= 19)
bit for bit, which is what the Q/DQ graph, ONNX Runtime and TensorRT compute:

* **INT8**: ``q = saturate(round_half_to_even(x / scale))`` with
  ``scale = amax / 127`` and saturation to ``[-128, 127]`` (ONNX); pass
  ``narrow_range=True`` for ``[-127, 127]``. Dequantized: ``q * scale``.
* **FP8 E4M3** (``float8e4m3fn``, max finite 448): ``scale = amax / 448``;
  ``x / scale`` is saturated to ``[-448, 448]`` (ONNX ``saturate=1``, the
  default) and rounded to nearest-even by the ``torch.float8_e4m3fn`` cast.

Scales are ``amax / qmax`` computed in fp32 and the division ``x / scale``
is done in fp32 exactly like ONNX (not a multiplication by the reciprocal,
which differs in the last bit). An ``amax`` of 0 (an all-zero channel) uses
scale 1 there, so zeros stay zeros instead of becoming NaN.

``amax`` is a scalar (per-tensor) or a 1-D tensor of ``x.shape[axis]``
values (per-channel along ``axis``; weights of ``nn.Linear`` are
``[out, in]`` and quantize per output channel, ``axis=0``).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from trt_sora.config.recipe import QuantFormat
from trt_sora.errors import CalibrationError, ConfigError
from trt_sora.formats import FP8_E4M3_MAX, INT8_MAX, qmax, quant_format

__all__ = [
    "FP8_E4M3_MAX", "INT8_MAX", "QuantError", "QuantFormat", "fake_quant", "fake_quant_fp8_e4m3",
    "fake_quant_int8", "qmax", "quant_error", "scale_from_amax",
]


def _broadcast_amax(x: Tensor, amax: Tensor | float, axis: int | None) -> Tensor:
    """``amax`` as fp32 on ``x.device``, shaped to broadcast against ``x``; validated."""
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise CalibrationError(
            f"amax must be finite and >= 0, got {a.flatten()[:8].tolist()}...; "
            "recalibrate (the statistics are corrupt or came from NaN/inf activations)"
        )
    if axis is None:
        if a.numel() != 1:
            raise ConfigError(f"per-tensor fake-quant needs a scalar amax, got shape {tuple(a.shape)}; "
                              "pass axis= for per-channel")
        return a.reshape(())
    ax = axis % x.dim()
    if a.dim() != 1 or a.numel() != x.shape[ax]:
        raise ConfigError(f"per-channel amax has shape {tuple(a.shape)} but x.shape[{axis}] = {x.shape[ax]}; "
                          "pass one amax per channel along axis")
    shape = [1] * x.dim()
    shape[ax] = -1
    return a.reshape(shape)


def scale_from_amax(amax: Tensor | float, fmt: QuantFormat | str) -> Tensor:
    """ONNX ``y_scale = amax / qmax`` (fp32); 0 where ``amax == 0`` becomes 1 (zeros stay zeros)."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    s = a / qmax(fmt)
    return torch.where(a > 0, s, torch.ones_like(s))


def fake_quant_int8(x: Tensor, amax: Tensor | float, *, axis: int | None = None,
                    narrow_range: bool = False) -> Tensor:
    """Symmetric INT8 quantize -> dequantize (ONNX QuantizeLinear/DequantizeLinear semantics).

    Args:
        x: any shape, float dtype. Computed in fp32, returned in ``x.dtype``.
        amax: scalar, or ``[x.shape[axis]]`` for per-channel.
        axis: channel axis for per-channel amax; ``None`` = per-tensor.
        narrow_range: saturate to ``[-127, 127]`` instead of ONNX's ``[-128, 127]``.
    """
    a = _broadcast_amax(x, amax, axis)
    scale = torch.where(a > 0, a / INT8_MAX, torch.ones_like(a))
    lo = -INT8_MAX if narrow_range else -INT8_MAX - 1.0
    q = torch.round(x.float() / scale).clamp_(lo, INT8_MAX)  # torch.round: half to even, like ONNX
    return (q * scale).to(x.dtype)


def fake_quant_fp8_e4m3(x: Tensor, amax: Tensor | float, *, axis: int | None = None) -> Tensor:
    """FP8 E4M3 (``float8e4m3fn``) quantize -> dequantize with saturation (ONNX ``saturate=1``).

    Args:
        x: any shape, float dtype. Computed in fp32, returned in ``x.dtype``.
        amax: scalar, or ``[x.shape[axis]]`` for per-channel; mapped onto 448.
        axis: channel axis for per-channel amax; ``None`` = per-tensor.
    """
    a = _broadcast_amax(x, amax, axis)
    scale = torch.where(a > 0, a / FP8_E4M3_MAX, torch.ones_like(a))
    # Saturate before the cast: torch maps out-of-range values to NaN (e4m3fn has no inf).
    q = (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def fake_quant(x: Tensor, amax: Tensor | float, fmt: QuantFormat | str, *, axis: int | None = None) -> Tensor:
    """Dispatch to :func:`fake_quant_fp8_e4m3` or :func:`fake_quant_int8` by ``fmt``."""
    f = quant_format(fmt)
    if f is QuantFormat.FP8_E4M3:
        return fake_quant_fp8_e4m3(x, amax, axis=axis)
    return fake_quant_int8(x, amax, axis=axis)


@dataclasses.dataclass(frozen=True)
class QuantError:
    """How much a tensor loses when fake-quantized at ``amax``.

    Attributes:
        clipped_fraction: fraction of elements with ``|x| > amax`` (saturated), in [0, 1].
        mse: mean squared error ``mean((x - fq(x))**2)`` in the units of ``x`` squared.
        rel_mse: ``mse / mean(x**2)`` (0 when x is all zeros and the error is 0; inf if only x is 0).
        sqnr_db: ``10 * log10(mean(x**2) / mse)``; ``inf`` when lossless.
        max_abs_err: ``max |x - fq(x)|``.
    """

    clipped_fraction: float
    mse: float
    rel_mse: float
    sqnr_db: float
    max_abs_err: float


def quant_error(x: Tensor, amax: Tensor | float, fmt: QuantFormat | str, *, axis: int | None = None) -> QuantError:
    """Error metrics of fake-quantizing ``x`` (any shape) at ``amax`` in format ``fmt``; fp64 sums."""
    a = _broadcast_amax(x, amax, axis)
    xf = x.float()
    err = xf.double() - fake_quant(xf, a if axis is None else a.flatten(), fmt, axis=axis).double()
    n = max(xf.numel(), 1)
    mse = float(err.square().sum()) / n
    signal = float(xf.double().square().sum()) / n
    clipped = float((xf.abs() > a).sum()) / n
    if mse == 0.0:
        rel, sqnr = 0.0, math.inf
    elif signal == 0.0:
        rel, sqnr = math.inf, -math.inf
    else:
        rel = mse / signal
        sqnr = 10.0 * math.log10(signal / mse)
    max_abs = float(err.abs().max()) if err.numel() else 0.0
    return QuantError(clipped_fraction=clipped, mse=mse, rel_mse=rel, sqnr_db=sqnr, max_abs_err=max_abs)
