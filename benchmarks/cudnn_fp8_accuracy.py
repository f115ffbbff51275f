"""Can per-tensor FP8 attention (cuDNN's FP8 SDPA) reach cosine 0.999 vs fp32? CPU emulation (issue 32).

On :func:`trt_sora.kernels.reference.example_qkv` data (per-channel K bias), one Wan-like layer: our INT8
recipe (:func:`reference.attention_fp8`), cuDNN's recipe (:func:`reference.sdpa_fp8`, bf16 and FP8 output),
and the variants one could feed cuDNN's kernel instead: no K smoothing, per-head scales (B*H batching),
Q smoothing with its per-key bias, a Hadamard rotation of Q and K along D, FP8 only in Q K^T or only in
P V (the error budget), and Q split into two FP8 halves (D = 256 for Q K^T).

    python benchmarks/cudnn_fp8_accuracy.py --points 4096:2,8192:1 --out benchmarks/results/cpu_cudnn_fp8_accuracy.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trt_sora.kernels import reference as ref  # noqa: E402


def cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def fq(x, per_head: bool = False):
    """FP8 E4M3 fake-quantized at amax / 448 per tensor (or per head), fp32."""
    amax = x.abs().amax(dim=(2, 3), keepdim=True) if per_head else x.abs().amax()
    s = ref.dequant_scale(amax)
    return ref.quantize(x, s).float() * s


def emulate(q, k, v, *, smooth_k=True, per_head=False, smooth_q=False, rot=None, qk8=True, pv8=True,
            q_split=False):
    """Per-tensor FP8 attention with the variant's changes, bf16 output [B, H, S, D] fp32."""
    q, k, v = q.float(), k.float(), v.float()
    if smooth_k:
        k = k - k.mean(2, keepdim=True)
    bias = 0.0
    if smooth_q:  # q.k = (q - m).k + m.k: the second term is a per-key bias
        m = q.mean(2, keepdim=True)
        q, bias = q - m, (m @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if rot is not None:
        q, k = q @ rot, k @ rot
    if qk8:
        qq = fq(q, per_head)
        q, k = (qq + fq(q - qq, per_head) if q_split else qq), fq(k, per_head)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    if pv8:
        p8, v = ref.quantize(p, 1 / ref.FP8_MAX).float() / ref.FP8_MAX, fq(v, per_head)
    else:
        p8 = p
    return (p8 @ v) / p.sum(-1, keepdim=True)


def point(s: int, h: int) -> dict:
    qkv, wq, wk, cs, sn = ref.example_qkv(1, s, h, seed=0, device="cpu")
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, 1e-6, fp8=False)
    want = ref.attention(q, k, v)
    tok = ref.heads_to_tokens(want).float()
    ops = ref.sdpa_fp8_operands(q, k, v)
    res = {"tokens": s, "heads": h,
           "int8_recipe": cos(ref.attention_fp8(*ref.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, 1e-6)[:6]), want),
           "cudnn_recipe_bf16_out": cos(ref.sdpa_fp8(*ops).float(), tok),
           "cudnn_recipe_fp8_out": cos(ref.sdpa_fp8(*ops, out_scale=ref.dequant_scale(tok.abs().amax())).float()
                                       * ref.dequant_scale(tok.abs().amax()), tok)}
    variants = {"per_tensor": {}, "no_k_smoothing": dict(smooth_k=False), "per_head_scales": dict(per_head=True),
                "q_smoothing_with_bias": dict(smooth_q=True), "hadamard_qk": dict(rot=hadamard(q.shape[-1])),
                "fp8_qk_only": dict(pv8=False), "fp8_pv_only": dict(qk8=False), "q_split_hi_lo": dict(q_split=True)}
    for name, kw in variants.items():
        res[name] = cos(emulate(q, k, v, **kw), want)
        print(s, h, name, round(res[name], 5), flush=True)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="4096:2,8192:1", help="tokens:heads list")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    out = {"torch": torch.__version__, "note": "cosine vs fp32 attention; bf16 output unless named",
           "points": [point(int(p.split(":")[0]), int(p.split(":")[1])) for p in a.points.split(",")]}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
