"""Q/DQ insertion by TensorRT's explicit-quantization rules (graphsurgeon).

* Activation: one per-tensor ``QuantizeLinear -> DequantizeLinear`` on each quantized
  linear's input tensor, shared by every quantized linear that reads that tensor
  (other consumers, e.g. the residual stream, keep the unquantized tensor).
* Weight: stored already quantized (FP8 E4M3 / INT8 initializer) followed by a
  per-output-channel ``DequantizeLinear`` only (axis = the weight's output axis:
  1 for MatMul's pre-transposed ``[in, out]``, 0 for Gemm ``transB=1``).
* Scales: ``amax / 448`` (FP8 E4M3) or ``amax / 127`` (INT8, symmetric, zero point 0),
  stored in the graph's activation dtype; the weight is quantized with the *stored*
  (rounded) scale so DequantizeLinear reproduces exactly what was meant.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from trt_sora.config.recipe import DType, QuantFormat
from trt_sora.errors import QuantizeError
from trt_sora.formats import FP8_E4M3_MAX, qmax
from trt_sora.quantize.dtype import np_dtype
from trt_sora.quantize.sites import Attention, Linear


def stored_scale(amax: np.ndarray, fmt: QuantFormat, dtype: DType, what: str) -> np.ndarray:
    """``amax / qmax`` in fp32, then rounded to the graph dtype (0 amax channel -> scale 1).

    Raises QuantizeError when a scale underflows to 0 or overflows in the graph dtype.
    """
    a = np.asarray(amax, dtype=np.float32)
    s = np.where(a > 0, a / np.float32(qmax(fmt)), np.float32(1.0)).astype(np.float32)
    st = s.astype(np_dtype(dtype))
    back = st.astype(np.float32)
    if not np.all(np.isfinite(back)) or np.any(back == 0):
        raise QuantizeError(f"{what}: scale {float(s.min()):.3g}..{float(s.max()):.3g} does not fit "
                            f"{dtype.value}; use graph_dtype bf16/fp32 or exclude the site")
    return st


def quantize_weight(w: np.ndarray, scale: np.ndarray, axis: int, fmt: QuantFormat) -> np.ndarray:
    """Quantize fp32 weight ``w`` (2-D) per channel along ``axis`` with ``scale`` [C] (ONNX semantics).

    Returns ``ml_dtypes.float8_e4m3fn`` (saturated, round-to-nearest-even) or ``int8``
    (round half to even, saturated to [-128, 127]) values of ``w``'s shape.
    """
    shape = [1, 1]
    shape[axis] = -1
    x = np.asarray(w, dtype=np.float32) / scale.astype(np.float32).reshape(shape)  # the one fp32 temporary
    if fmt is QuantFormat.INT8:
        return np.clip(np.rint(x, out=x), -128, 127, out=x).astype(np.int8)
    import ml_dtypes

    return np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX, out=x).astype(ml_dtypes.float8_e4m3fn)


def zero_point(fmt: QuantFormat, n: int | None = None) -> np.ndarray:
    """Zero point(s) of the quantized type: FLOAT8E4M3FN 0 or int8 0; scalar when ``n`` is None."""
    shape = () if n is None else (n,)
    if fmt is QuantFormat.INT8:
        return np.zeros(shape, dtype=np.int8)
    import ml_dtypes

    return np.zeros(shape, dtype=ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass
class QDQCounter:
    activation_q: int = 0
    weight_dq: int = 0
    attention_q: int = 0


def _quant_np(fmt: QuantFormat):
    if fmt is QuantFormat.INT8:
        return np.int8
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def insert_activation_qdq(graph, tensor, consumers: list, scale: np.ndarray, fmt: QuantFormat, name: str):
    """Insert Q -> DQ on ``tensor`` and rewire ``consumers`` (nodes) to the DQ output. Returns it."""
    import onnx_graphsurgeon as gs

    sc = gs.Constant(f"{name}__act_scale", np.asarray(scale).reshape(()))
    zp = gs.Constant(f"{name}__act_zp", zero_point(fmt))
    q = gs.Variable(f"{name}__act_q", dtype=_quant_np(fmt), shape=tensor.shape)
    dq = gs.Variable(f"{name}__act_dq", dtype=tensor.dtype, shape=tensor.shape)
    graph.nodes.append(gs.Node("QuantizeLinear", name=f"{name}__act_Q", inputs=[tensor, sc, zp], outputs=[q]))
    graph.nodes.append(gs.Node("DequantizeLinear", name=f"{name}__act_DQ", inputs=[q, sc, zp], outputs=[dq]))
    for node in consumers:
        for i, t in enumerate(node.inputs):
            if t is tensor:
                node.inputs[i] = dq
    return dq


def quantize_linear_weight(graph, lin: Linear, w_amax: np.ndarray, fmt: QuantFormat, dtype: DType) -> dict:
    """Replace ``lin``'s weight by quantized values + per-channel DequantizeLinear; returns map info.

    The quantized weight is computed from the (fp32) weight when the file is written
    (:mod:`trt_sora.quantize.tensors`), one weight at a time."""
    import onnx_graphsurgeon as gs

    from trt_sora.quantize import tensors

    scale = stored_scale(w_amax, fmt, dtype, f"site {lin.site!r} weight")
    s32, axis = scale.astype(np.float32), lin.weight_axis
    w = tensors.of(lin.weight).astype(np.float32)
    wq = w.map(lambda v: quantize_weight(v, s32, axis, fmt), _quant_np(fmt), f"{lin.site}.weight_quantized")
    qc = gs.Constant(f"{lin.site}.weight_quantized", wq)
    sc = gs.Constant(f"{lin.site}.weight_scale", scale)
    zp = gs.Constant(f"{lin.site}.weight_zp", zero_point(fmt, scale.shape[0]))
    out = gs.Variable(f"{lin.site}.weight_dq", dtype=np_dtype(dtype), shape=list(w.shape))
    graph.nodes.append(gs.Node("DequantizeLinear", name=f"{lin.site}__weight_DQ", inputs=[qc, sc, zp],
                               outputs=[out], attrs={"axis": lin.weight_axis}))
    lin.node.inputs[1] = out
    return {"weight_axis": lin.weight_axis, "weight_scale_min": float(scale.astype(np.float32).min()),
            "weight_scale_max": float(scale.astype(np.float32).max()), "weight_channels": int(scale.shape[0])}


def insert_attention_qdq(graph, att: Attention, amax_q: float, amax_k: float, amax_v: float, dtype: DType) -> dict:
    """FP8 Q/DQ on BMM1's inputs (q*c, k^T*c; amax scaled by c), BMM2's v and the softmax output (amax 1)."""
    fmt = QuantFormat.FP8_E4M3
    specs = [(att.bmm1, 0, amax_q * att.q_mul, "q"), (att.bmm1, 1, amax_k * att.k_mul, "k"),
             (att.bmm2, 0, 1.0, "softmax"), (att.bmm2, 1, amax_v, "v")]
    info = {}
    for node, idx, amax, tag in specs:
        if not (math.isfinite(amax) and amax > 0):
            raise QuantizeError(f"attention {att.module!r}: {tag} amax {amax} is not finite and > 0; recalibrate")
        scale = stored_scale(np.float32(amax), fmt, dtype, f"attention {att.module}.{tag}")
        insert_activation_qdq(graph, node.inputs[idx], [node], scale, fmt, f"{att.module}.{tag}")
        info[tag] = {"amax": float(amax), "scale": float(np.float32(scale))}
    return info
