"""The warp-specialized Gluon attention kernel (:mod:`trt_sora.kernels.gluon_attention`) against the Triton
kernel (:func:`trt_sora.kernels.triton_ops.attention_fp8`), in one process on one GPU: bits on ragged, one-tile,
batch-2 and many-tile shapes (bf16 and FP8 output), then speed at Wan 14B's 1 x 40 heads x 32,760 x 128 for
each ``--configs`` entry, and the cosine against fp32 attention. With the previous commit's kernels carried
(``benchmarks/_prev_gluon_attention.py`` and ``benchmarks/_prev_triton_ops.py``, the latter importing the former),
its default kernel is timed in the same rounds on its own epilogue's operands (A/B on one machine).

    python benchmarks/gluon_attention.py --out results.json      # H100/H200
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import triton

    from benchmarks.fp8_bench import attention_tflops, cos, fp32_heads
    from trt_sora.kernels import gluon_attention as g
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="3,240,24,1;6,240,24,1",
                    help="ring slots,consumer registers,producer registers,ping-pong; semicolon-separated")
    ap.add_argument("--reps", type=int, default=3, help="timing rounds (each kernel once per round)")
    ap.add_argument("--variants", default="",
                    help="NAME=PATH,...: other builds of the Gluon module (same operands), held to the same "
                         "bits and timed")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfgs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    variants = {}
    for item in filter(None, a.variants.split(",")):
        name, path = item.split("=", 1)
        spec = importlib.util.spec_from_file_location(f"_variant_{name}", path)
        variants[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(variants[name])
    res = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "bits": [], "ms": {}}
    for b, s, h in ((1, 100, 2), (1, 128, 2), (1, 129, 2), (2, 1000, 2), (1, 4133, 2), (1, 32760, 3)):
        ops = t.qkv_rmsnorm_rope(*ref.example_qkv(b, s, h, seed=1), h, fp8=True)
        want = t.attention_fp8(*ops, ws=False)
        sc = torch.tensor(float(want.float().abs().max()) / 448, device="cuda")
        want8 = t.attention_fp8(*ops, out_scale=sc, ws=False).view(torch.uint8)
        row = {"b": b, "s": s, "h": h}
        for c in cfgs:
            got = g.attention_fp8_ws(*ops, config=c)
            got8 = g.attention_fp8_ws(*ops, out_scale=sc, config=c).view(torch.uint8)
            row[str(c)] = {"bf16_equal": torch.equal(got, want), "fp8_equal": torch.equal(got8, want8),
                           "max_abs": float((got.float() - want.float()).abs().max())}
        for name, mod in variants.items():
            got = mod.attention_fp8_ws(*ops)
            row[name] = {"bf16_equal": torch.equal(got, want),
                         "fp8_equal": torch.equal(mod.attention_fp8_ws(*ops, out_scale=sc).view(torch.uint8), want8),
                         "max_abs": float((got.float() - want.float()).abs().max())}
        res["bits"].append(row)
        print(json.dumps(row), flush=True)
    s, h, d = 32760, 40, 128
    qkv, wq, wk, cs, sn = ref.example_qkv(1, s, h, d)
    ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    osc = torch.tensor(0.01, device="cuda")  # FP8 output (the to_out linear's input, as in the model)
    try:  # A/B against the previous commit's kernels, when the bench carries them
        from benchmarks import _prev_triton_ops as prev
    except ImportError:
        prev = None
    if prev is not None:
        ops_prev = prev.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
        res["prev_kernel"] = prev.attention_kernel(qkv.device)
        res["prev_max_abs_vs_ours"] = float((prev.attention_fp8(*ops_prev).float()
                                             - t.attention_fp8(*ops).float()).abs().max())
    for _ in range(a.reps):
        if prev is not None:
            res["ms"].setdefault("prev", []).append(bench(lambda: prev.attention_fp8(*ops_prev)))
            res["ms"].setdefault("prev_fp8_out", []).append(bench(lambda: prev.attention_fp8(*ops_prev, out_scale=osc)))
        res["ms"].setdefault("triton", []).append(bench(lambda: t.attention_fp8(*ops, ws=False)))
        res["ms"].setdefault("triton_fp8_out", []).append(bench(lambda: t.attention_fp8(*ops, out_scale=osc, ws=False)))
        for name, mod in variants.items():
            res["ms"].setdefault(name, []).append(bench(lambda: mod.attention_fp8_ws(*ops)))
            res["ms"].setdefault(f"{name}_fp8_out", []).append(bench(lambda: mod.attention_fp8_ws(*ops, out_scale=osc)))
        for c in cfgs:
            res["ms"].setdefault(str(c), []).append(bench(lambda: g.attention_fp8_ws(*ops, config=c)))
            res["ms"].setdefault(f"{c}_fp8_out", []).append(
                bench(lambda: g.attention_fp8_ws(*ops, out_scale=osc, config=c)))
        print(json.dumps(res["ms"]), flush=True)
    res["tflops"] = attention_tflops(res["ms"], s, h, d)
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    heads, want = fp32_heads(q, k, v)
    score = lambda o: cos(o.float().view(1, s, h, d)[:, :, heads], want)  # noqa: E731
    res["cosine_vs_fp32"] = {"triton": score(t.attention_fp8(*ops, ws=False)),
                             **{str(c): score(g.attention_fp8_ws(*ops, config=c)) for c in cfgs},
                             **{name: score(mod.attention_fp8_ws(*ops)) for name, mod in variants.items()}}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
