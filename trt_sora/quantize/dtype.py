"""Convert an fp32 graphsurgeon graph to fp16 / bf16, keeping the timestep path and norm statistics fp32.

Rules, applied in topological order (each node gets one compute dtype):

* *timestep-only* nodes (every non-constant float input derives from the fp32
  inputs, e.g. ``timestep`` -> sinusoids -> time embedder -> AdaLN tables) stay fp32;
* normalisation-statistics ops (``LayerNormalization`` and the RMSNorm chain
  ``Pow``/``ReduceMean``/``Sqrt``/``Reciprocal``) run in fp32 (inputs cast up),
  and cheap elementwise ops fed only by fp32 tensors stay fp32 (the AdaLN
  ``norm(x) * (1 + scale) + shift`` as diffusers computes it);
* everything else - every MatMul/Gemm/Conv/Softmax, the residual stream - runs in
  the graph dtype; fp32 inputs get a ``Cast`` at the boundary (one per tensor and dtype).

Float constants are cast per consumer dtype (copied when both dtypes use one).
"""
from __future__ import annotations

import logging

import numpy as np

from trt_sora.config.recipe import DType
from trt_sora.quantize import tensors

log = logging.getLogger("trt_sora")

#: Ops whose statistics overflow/underflow in fp16: computed in fp32.
FP32_OPS = frozenset({"LayerNormalization", "ReduceMean", "Pow", "Sqrt", "Reciprocal", "RMSNormalization"})
#: Heavy ops that always run in the graph dtype unless timestep-only.
COMPUTE_OPS = frozenset({"MatMul", "Gemm", "Conv", "Softmax", "Gelu", "QuantizeLinear", "DequantizeLinear"})
_FLOATS = (np.float32, np.float16)


def np_dtype(dtype: DType):
    """numpy dtype of a graph dtype (bf16 via ``ml_dtypes``)."""
    if dtype is DType.BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({DType.FP32: np.float32, DType.FP16: np.float16}[dtype])


def onnx_elem(dtype: DType) -> int:
    import onnx

    return {DType.FP32: onnx.TensorProto.FLOAT, DType.FP16: onnx.TensorProto.FLOAT16,
            DType.BF16: onnx.TensorProto.BFLOAT16}[dtype]


def source_dtype(graph, *, input_name: str | None = None) -> DType:
    """The float dtype an exported graph was traced in: that of its first float input other than the
    fp32 ``timestep`` (``hidden_states`` for the DiTs)."""
    for t in graph.inputs:
        if t.name == "timestep" or (input_name and t.name != input_name) or t.dtype is None:
            continue
        d = tensors._np_dtype(t.dtype)  # graphsurgeon gives an onnx enum for bf16
        for dt in (DType.FP32, DType.FP16, DType.BF16):
            if d == np_dtype(dt):
                return dt
    return DType.FP32


def _is_float(t) -> bool:
    return t.dtype is not None and np.dtype(t.dtype) == np.float32


def convert_graph_dtype(graph, dtype: DType, *, fp32_inputs: tuple[str, ...] = ("timestep",),
                        skip_constants: set[str] | None = None) -> dict[str, int]:
    """Convert ``graph`` (fp32, graphsurgeon, shapes inferred) in place to ``dtype``.

    Args:
        graph: ``gs.Graph`` whose float tensors are fp32.
        dtype: target graph dtype; ``DType.FP32`` is a no-op.
        fp32_inputs: graph inputs that stay fp32 (``timestep``).
        skip_constants: names of constants left untouched (weights the Q/DQ pass replaces).

    Returns:
        counts ``{"fp32_nodes", "low_nodes", "casts"}``.
    """
    import onnx_graphsurgeon as gs

    counts = {"fp32_nodes": 0, "low_nodes": 0, "casts": 0}
    if dtype is DType.FP32:
        return counts
    low = np_dtype(dtype)
    skip = skip_constants or set()
    # Which tensors are float is decided once, before any dtype changes (outputs get rewritten as we go).
    floats = {t.name for t in graph.tensors().values() if _is_float(t)}
    kind: dict[str, str] = {}  # variable name -> "ts" | "f32" | "low"
    for t in graph.inputs:
        if _is_float(t):
            if t.name in fp32_inputs:
                kind[t.name] = "ts"
            else:
                t.dtype = low
                kind[t.name] = "low"
    const_cache: dict[tuple[str, str], object] = {}
    cast_cache: dict[tuple[str, str], object] = {}

    def as_dtype(t, want: str):
        """``t`` (float) as a tensor of compute dtype ``want`` ('f32' or 'low')."""
        target = np.float32 if want == "f32" else low
        if isinstance(t, gs.Constant):
            if t.name in skip:
                return t
            key = (t.name, want)
            if key not in const_cache:
                c = gs.Constant(t.name if want == "low" else f"{t.name}__fp32",
                                tensors.of(t).astype(target))  # cast when written
                const_cache[key] = c
            return const_cache[key]
        have = "low" if kind.get(t.name) == "low" else "f32"
        if have == want:
            return t
        key = (t.name, want)
        if key not in cast_cache:
            out = gs.Variable(f"{t.name}__to_{'fp32' if want == 'f32' else dtype.value}", dtype=target, shape=t.shape)
            graph.nodes.append(gs.Node("Cast", name=f"{t.name}__cast_{want}", inputs=[t], outputs=[out],
                                       attrs={"to": onnx_elem(DType.FP32 if want == "f32" else dtype)}))
            kind[out.name] = want if want == "low" else "f32"
            cast_cache[key] = out
            counts["casts"] += 1
        return cast_cache[key]

    opset = int(graph.opset or 20)
    low_name = {DType.FP16: "tensor(float16)", DType.BF16: "tensor(bfloat16)"}[dtype]
    graph.toposort()
    for node in list(graph.nodes):
        if node.op == "Cast" and node.name.endswith(("__cast_f32", "__cast_low")):
            continue
        float_ins = [(i, t) for i, t in enumerate(node.inputs)
                     if t is not None and t.name in floats and not (isinstance(t, gs.Constant) and t.name in skip)]
        var_kinds = [kind.get(t.name, "low") for _, t in float_ins if not isinstance(t, gs.Constant)]
        float_outs = [t for t in node.outputs if t.name in floats]
        if node.op == "Cast":
            to_float = node.attrs.get("to") == onnx_elem(DType.FP32)
            src = kind.get(node.inputs[0].name) if node.inputs else None
            if to_float:
                mode = "ts" if src == "ts" else "low"
                if mode == "low":
                    node.attrs["to"] = onnx_elem(dtype)
                for t in float_outs:
                    t.dtype = np.float32 if mode == "ts" else low
                    kind[t.name] = mode
            continue
        if not float_ins and not float_outs:
            continue
        if var_kinds and all(k == "ts" for k in var_kinds):
            mode = "ts"
        elif node.op in FP32_OPS:
            mode = "f32"
        elif node.op not in COMPUTE_OPS and var_kinds and all(k in ("ts", "f32") for k in var_kinds):
            mode = "f32"
        else:
            mode = "low" if _allows(node.op, node.domain, opset, low_name) else "f32"
        want = "low" if mode == "low" else "f32"
        for i, t in float_ins:
            node.inputs[i] = as_dtype(t, want)
        for t in float_outs:
            t.dtype = low if mode == "low" else np.float32
            kind[t.name] = mode
        counts["low_nodes" if mode == "low" else "fp32_nodes"] += 1
    for i, t in enumerate(graph.outputs):
        if t.name in floats and kind.get(t.name) != "low":
            name = t.name  # keep the graph output's name: the fp32 tensor is renamed, the Cast takes it
            t.name = f"{name}__fp32"
            out = as_dtype(t, "low")
            out.name = name
            graph.outputs[i] = out
    graph.cleanup().toposort()
    log.debug("graph dtype %s: %s", dtype.value, counts)
    return counts


def _allows(op: str, domain: str, opset: int, type_str: str) -> bool:
    """Whether the ONNX schema of ``op`` at ``opset`` accepts ``type_str`` for its float inputs
    (e.g. ``Conv`` has no bfloat16 before opset 22: such nodes run in fp32 with Casts around)."""
    import onnx

    try:
        schema = onnx.defs.get_schema(op, opset, domain or "")
    except Exception:  # unknown/custom op: assume it follows the graph dtype
        return True
    params = {p.type_str for p in schema.inputs}
    for c in schema.type_constraints:
        if c.type_param_str in params and "tensor(float)" in c.allowed_type_strs:
            return type_str in c.allowed_type_strs
    return True
