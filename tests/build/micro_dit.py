"""Micro ONNX graphs shaped like a one-block video DiT, built by hand with ``onnx.helper``.

Inputs follow the Wan adapter: ``hidden_states [batch, C, latent_frames, latent_height,
latent_width]``, ``timestep [batch]`` (fp32), ``encoder_hidden_states [batch, text_len, D]``.
One block: patch-in linear, time MLP, self-attention with a fused QKV linear (width 3*d),
cross-attention, GELU FFN, patch-out linear. Quantization follows the placement that
TensorRT-RTX turns into real low-precision GEMMs: a per-tensor
Quantize+Dequantize on each linear's input, weights stored quantized with a
per-output-channel DequantizeLinear only, on an fp16 graph, scales in fp16.
Attention matmuls stay fp16 (FP8 Q/DQ there breaks the fused attention kernel).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

C, D_TEXT, D, HEADS, FFN = 4, 32, 64, 2, 128
DIM_PARAMS = {
    "hidden_states": ["batch", C, "latent_frames", "latent_height", "latent_width"],
    "timestep": ["batch"],
    "encoder_hidden_states": ["batch", "text_len", D_TEXT],
}


class _G:
    def __init__(self, quant: str | None, rng: np.random.Generator):
        self.nodes, self.inits, self.quant, self.rng, self.n = [], [], quant, rng, 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def const(self, arr: np.ndarray, base: str) -> str:
        from onnx import numpy_helper

        nm = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        return nm

    def node(self, op: str, inputs, n_out: int = 1, **attrs):
        from onnx import helper

        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=self.name(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def linear(self, x: str, k: int, n: int, base: str) -> str:
        """``x @ W + b`` with W ``[k, n]``; quantized per the module docstring when asked."""
        import ml_dtypes

        w = (self.rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        b = (0.01 * self.rng.standard_normal(n)).astype(np.float16)
        if self.quant is None:
            wq = self.const(w.astype(np.float16), f"{base}.weight")
        else:
            if self.quant == "fp8":
                qmax, qdt = 448.0, ml_dtypes.float8_e4m3fn
            else:
                qmax, qdt = 127.0, np.int8
            scale = (np.abs(w).max(axis=0) / qmax).astype(np.float16)  # per output channel
            q = w / scale.astype(np.float32)
            q = np.round(q).astype(np.int8) if qdt is np.int8 else q.astype(qdt)
            a_scale = self.const(np.array(4.0 / qmax, np.float16), f"{base}.input_scale")
            zp = self.const(np.zeros((), qdt), f"{base}.input_zp")
            xq = self.node("QuantizeLinear", [x, a_scale, zp])
            x = self.node("DequantizeLinear", [xq, a_scale, zp])
            w_name = self.const(q, f"{base}.weight_q")
            w_zp = self.const(np.zeros(n, qdt), f"{base}.weight_zp")
            wq = self.node("DequantizeLinear", [w_name, self.const(scale, f"{base}.weight_scale"), w_zp], axis=1)
        y = self.node("MatMul", [x, wq])
        return self.node("Add", [y, self.const(b, f"{base}.bias")])

    def heads(self, x: str) -> str:  # [B, N, D] -> [B, H, N, dh]
        r = self.node("Reshape", [x, self.const(np.array([0, 0, HEADS, D // HEADS], np.int64), "shape")])
        return self.node("Transpose", [r], perm=[0, 2, 1, 3])

    def attention(self, q: str, k: str, v: str) -> str:
        kt = self.node("Transpose", [self.heads(k)], perm=[0, 1, 3, 2])
        s = self.node("MatMul", [self.heads(q), kt])
        s = self.node("Mul", [s, self.const(np.array(1.0 / np.sqrt(D // HEADS), np.float16), "sm_scale")])
        p = self.node("Softmax", [s], axis=-1)
        o = self.node("MatMul", [p, self.heads(v)])
        o = self.node("Transpose", [o], perm=[0, 2, 1, 3])
        return self.node("Reshape", [o, self.const(np.array([0, 0, D], np.int64), "shape")])


def make_micro_onnx(path: str | Path, *, quant: str | None = "fp8", fused_qkv: bool = True,
                    external_data: bool = True, seed: int = 0) -> Path:
    """Write the micro DiT block to ``path`` (+ ``path.data`` when ``external_data``).

    ``quant``: ``"fp8"`` (E4M3), ``"int8"`` or ``None`` (plain fp16 graph). Output
    ``[batch, latent_frames*latent_height*latent_width, C]`` fp16.
    """
    import onnx
    from onnx import TensorProto, helper

    g = _G(quant, np.random.default_rng(seed))
    hs = g.node("Cast", ["hidden_states"], to=TensorProto.FLOAT16)
    tok = g.node("Transpose", [hs], perm=[0, 2, 3, 4, 1])
    tok = g.node("Reshape", [tok, g.const(np.array([0, -1, C], np.int64), "shape")])
    x = g.linear(tok, C, D, "patch_in")
    t = g.node("Cast", ["timestep"], to=TensorProto.FLOAT16)
    t = g.node("Unsqueeze", [t, g.const(np.array([1], np.int64), "axes")])
    t = g.node("Sin", [g.node("Mul", [t, g.const(np.linspace(0.01, 1.0, D).astype(np.float16), "freqs")])])
    temb = g.linear(t, D, D, "time_embed")
    x = g.node("Add", [x, g.node("Unsqueeze", [temb, g.const(np.array([1], np.int64), "axes")])])
    # self-attention
    if fused_qkv:
        q, k, v = g.node("Split", [g.linear(x, D, 3 * D, "attn1.to_qkv"),
                                  g.const(np.array([D, D, D], np.int64), "split")], n_out=3, axis=-1)
    else:
        q, k, v = (g.linear(x, D, D, f"attn1.to_{c}") for c in "qkv")
    x = g.node("Add", [x, g.linear(g.attention(q, k, v), D, D, "attn1.to_out")])
    # cross-attention over the text tokens
    ctx = g.node("Cast", ["encoder_hidden_states"], to=TensorProto.FLOAT16)
    q = g.linear(x, D, D, "attn2.to_q")
    k = g.linear(ctx, D_TEXT, D, "attn2.to_k")
    v = g.linear(ctx, D_TEXT, D, "attn2.to_v")
    x = g.node("Add", [x, g.linear(g.attention(q, k, v), D, D, "attn2.to_out")])
    h = g.node("Gelu", [g.linear(x, D, FFN, "ffn.up")], approximate="tanh")
    x = g.node("Add", [x, g.linear(h, FFN, D, "ffn.down")])
    out = g.linear(x, D, C, "proj_out")
    g.nodes.append(helper.make_node("Identity", [out], ["sample"], name="output"))

    def vi(name, elem, dims):
        return helper.make_tensor_value_info(name, elem, dims)

    graph = helper.make_graph(
        g.nodes, "micro_dit",
        [vi("hidden_states", TensorProto.FLOAT, DIM_PARAMS["hidden_states"]),
         vi("timestep", TensorProto.FLOAT, DIM_PARAMS["timestep"]),
         vi("encoder_hidden_states", TensorProto.FLOAT, DIM_PARAMS["encoder_hidden_states"])],
        [vi("sample", TensorProto.FLOAT16, ["batch", "tokens", C])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save(model, str(path))
    return path
