"""Key-tile widths of the 8-bit Triton attention kernel (:func:`trt_sora.kernels.triton_ops.attention_fp8`,
``block_n``) in one process on one GPU: the default (128 keys, autotuned) against 256-key tiles, autotuned and
each of their configs (64-row tile at 1, 2 and 3 ring stages, 128-row tile at 2), at Wan 14B's 1 x 40 heads x
32,760 x 128. Per config: TFLOP/s per timing round (bf16 and FP8 output, rounds interleaved), the cosine against
fp32 attention (4 heads), the largest difference from the default's output; and on small ragged shapes, the cosine
against the default (the online softmax's steps move, so bits may differ).

    python benchmarks/attention_tiles.py --out results.json      # H100/H200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fixed(t, block_n: int, config):
    """``attention_fp8`` at ``block_n`` with one autotuner config (``.fn``: no autotuning), TMA tiles."""
    import math

    import triton

    def run(q8, qs, k8, ks, vt8, vs, out_scale=None):
        b, h, s, d = q8.shape
        o = torch.empty((b, s, h * d), device=q8.device,
                        dtype=torch.float8_e4m3fn if out_scale is not None else torch.bfloat16)
        k_arg, v_arg = t.kv_descriptors(k8, vt8, block_n)
        t._attn_fp8_kernel.fn[(triton.cdiv(s, config.kwargs["BLOCK_M"]), b * h)](
            q8, qs, k_arg, ks, v_arg, vs, o, out_scale if out_scale is not None else o, s, vt8.shape[-1], h,
            qs.shape[-1], 1.4426950408889634 / math.sqrt(d), max(1, s).bit_length(), qs, qs, qs, 0, qs, D=d,
            OUT_FP8=out_scale is not None, BLOCK_N=block_n, TMA=True, SPARSE=False, KEYS=False,
            num_warps=config.num_warps, num_stages=config.num_stages, **config.kwargs)
        return o
    return run


def kernels(t) -> dict:
    """name -> attention callable (the operands of ``qkv_rmsnorm_rope``, ``out_scale=``)."""
    ks = {"default": lambda *ops, out_scale=None: t.attention_fp8(*ops, out_scale=out_scale, ws=False),
          "n256": lambda *ops, out_scale=None: t.attention_fp8(*ops, out_scale=out_scale, block_n=256)}
    for c in t._attn_configs(256):
        ks[f"n256_m{c.kwargs['BLOCK_M']}_st{c.num_stages}"] = _fixed(t, 256, c)
    return ks


def main() -> None:
    import triton

    from benchmarks.fp8_bench import attention_tflops, fp32_heads
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="timing rounds (each kernel once per round)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ks = kernels(t)
    res = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "small": [], "ms": {}}
    cos = lambda x, y: torch.nn.functional.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0).item()  # noqa: E731
    for b, s, h in ((1, 100, 2), (1, 300, 2), (2, 1000, 2), (1, 4133, 2)):
        ops = t.qkv_rmsnorm_rope(*ref.example_qkv(b, s, h, seed=1), h, fp8=True)
        want = ks["default"](*ops)
        row = {"b": b, "s": s, "h": h, **{n: {"cos_vs_default": cos(fn(*ops), want)} for n, fn in ks.items()}}
        res["small"].append(row)
        print(json.dumps(row), flush=True)
    s, h, d = 32760, 40, 128
    qkv, wq, wk, cs, sn = ref.example_qkv(1, s, h, d)
    ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    osc = torch.tensor(0.01, device="cuda")  # FP8 output (the to_out linear's input, as in the model)
    for _ in range(a.reps):
        for name, fn in ks.items():
            res["ms"].setdefault(name, []).append(bench(lambda: fn(*ops)))
            res["ms"].setdefault(f"{name}_fp8_out", []).append(bench(lambda: fn(*ops, out_scale=osc)))
        print(json.dumps(res["ms"]), flush=True)
    res["tflops"] = attention_tflops(res["ms"], s, h, d)
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    heads, want = fp32_heads(q, k, v)
    default = ks["default"](*ops).float()
    res["cosine_vs_fp32"], res["max_abs_vs_default"] = {}, {}
    for name, fn in ks.items():
        o = fn(*ops).float()
        res["cosine_vs_fp32"][name] = cos(o.view(1, s, h, d)[:, :, heads], want)
        res["max_abs_vs_default"][name] = float((o - default).abs().max())
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
