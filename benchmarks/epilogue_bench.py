"""The torch-fp8 backend's memory-bound kernels at Wan 14B 480p x 81 (32,760 tokens, 5,120 channels, 40 heads
of 128), one setting at a time: the time, the DRAM rate it implies, and its outputs against the shipped setting's.

* ``norm``: ``residual_norm_quant`` in the three forms a Wan block calls it (AdaLN modulation before self-attention;
  gated residual + LayerNorm affine before cross-attention; residual + modulation before the FFN), by the most warps
  a row's program takes (``NORM_MAX_WARPS``).
* ``qkv``: the fused-QKV epilogue after the RMS statistics (the tile pass, the K mean / V scale reductions and the
  K/V pass), by the two passes' warps (``EPILOGUE_WARPS``), with each kernel's own time from the profiler.
* ``gelu``: ``gelu_quant`` on the FFN's hidden state (13,824 channels), against torch's tanh GELU + ``quantize``
  (and the previous commit's kernel, as below).

results/h100_epilogue_settings_2026-12-07.json came from this file at f0f2c89, whose grid also had rows a norm
program and token sub-tiles of the epilogue's passes (both slower at every value; removed).

With ``benchmarks/_prev_triton_ops.py`` beside it (``git show REV:trt_sora/kernels/triton_ops.py >
benchmarks/_prev_triton_ops.py``), that commit's kernels run on the same inputs in the same process.

    python benchmarks/epilogue_bench.py --out benchmarks/results/h200_epilogue_2026-12-07.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fp8_bench import bench_ms, prev_triton_ops  # noqa: E402
from trt_sora.kernels.reference import example_qkv  # noqa: E402

S, C, H, D = 32760, 5120, 40, 128
DEVICE = "cuda"
NORM_GRID = (16, 8, 4)  # the most warps of a row's program
QKV_GRID = ((8, 8), (16, 16), (4, 8), (8, 16), (4, 4))  # (the tile pass's warps, the K/V pass's)


def norm_inputs(g) -> dict:
    """The three calls of a Wan block (keyword arguments of ``residual_norm_quant``) on one [1, S, C] stream."""
    dev = g.device
    x = torch.randn(1, S, C, device=dev, generator=g).to(torch.bfloat16)
    r = torch.randn(1, S, C, device=dev, generator=g).to(torch.bfloat16)
    vec = [torch.randn(1, C, device=dev, generator=g) * 0.3 for _ in range(3)]
    w, bi = torch.randn(C, device=dev, generator=g), torch.randn(C, device=dev, generator=g)
    sc = torch.tensor(6.0 / 448, device=dev)
    return {"x": x, "forms": {
        "mod": dict(mod_scale=vec[0], mod_shift=vec[1], act_scale=sc),
        "residual_gate_affine": dict(branch=r, gate=vec[2], weight=w, bias=bi, act_scale=sc),
        "residual_mod": dict(branch=r, mod_scale=vec[0], mod_shift=vec[1], act_scale=sc)}}


def norm_bytes(kw: dict) -> int:
    """DRAM bytes of one call: x read, the branch read and the new residual written, FP8 y written."""
    per = 2 + 1 + (4 if "branch" in kw else 0)
    return S * C * per


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b) -> float:
    """Fraction of equal elements (as bytes for 8-bit tensors)."""
    return (_u8(a) == _u8(b)).float().mean().item()


def _norm_row(run, want, nbytes: int) -> dict:
    """One setting's time, DRAM rate and outputs against ``want`` (``run``: one call)."""
    got, ms = run(), bench_ms(run)
    return {"ms": ms, "tb_s": nbytes / (ms * 1e-3) / 1e12, "x_equal": _same(got[0], want[0]),
            "y_equal": _same(got[1], want[1])}


def norm_part(t, prev) -> dict:
    inp = norm_inputs(torch.Generator(device=DEVICE).manual_seed(0))
    x, out = inp["x"], {}
    shipped = t.NORM_MAX_WARPS
    for form, kw in inp["forms"].items():
        want = t.residual_norm_quant(x, **kw)
        rows = {}
        try:
            for w in NORM_GRID:
                t.NORM_MAX_WARPS = w
                rows[f"warps{w}"] = _norm_row(lambda: t.residual_norm_quant(x, **kw), want, norm_bytes(kw))  # noqa: B023
        finally:
            t.NORM_MAX_WARPS = shipped
        if prev is not None:
            rows["prev"] = _norm_row(lambda: prev.residual_norm_quant(x, **kw), want, norm_bytes(kw))  # noqa: B023
        out[form] = {"bytes": norm_bytes(kw), "by_setting": rows}
    out["shipped"] = {"max_warps": shipped}
    return out


def kernel_us(fn, iters: int = 20) -> dict:
    """Each CUDA kernel's mean time in us over ``iters`` calls of ``fn`` (the profiler's device times)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {ev.key[:60]: round(ev.device_time_total / iters, 2) for ev in prof.key_averages()
            if ev.device_time_total > 0}


def _compare(got, want) -> dict:
    q8, qs, k8, ks, vt8, vs = got
    wq8, wqs, wk8, wks, wvt8, wvs = want
    return {"q8_equal": _same(q8, wq8), "q8_max_step": (q8.int() - wq8.int()).abs().max().item(),
            "qs_equal": torch.equal(qs, wqs), "vt8_equal": torch.equal(_u8(vt8), _u8(wvt8)),
            "vs_equal": torch.equal(vs, wvs), "k8_equal": _same(k8, wk8),
            "k8_max_step": (k8.int() - wk8.int()).abs().max().item(),
            "ks_max_rel": ((ks - wks).abs() / wks).max().item()}


def qkv_part(t, prev) -> dict:
    qkv, wq, wk, cs, sn = example_qkv(1, S, H, D, device=DEVICE)
    rstd = t.rms_stats(qkv)

    def call(m=t):
        return m.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, H, fp8=True, rstd=rstd)

    want = call()
    shipped = dict(t.EPILOGUE_WARPS)
    rows = {}
    def row(run):
        return {"ms": bench_ms(run), "kernels_us": kernel_us(run), **_compare(run(), want)}

    try:
        for pw, kw in QKV_GRID:
            t.EPILOGUE_WARPS.update(post=pw, kv=kw)
            rows[f"post{pw}_kv{kw}"] = row(call)
    finally:
        t.EPILOGUE_WARPS.update(shipped)
    if prev is not None:
        rows["prev"] = row(lambda: call(prev))
    moved = {"tile_pass": S * 3 * C * 2 + S * C, "kv_pass": S * 2 * C * 2 + S * C * 2}  # bytes read + written
    return {"bytes": moved, "shipped": shipped, "by_setting": rows,
            "rms_ms": bench_ms(lambda: t.rms_stats(qkv))}


FFN = 13824  # Wan 14B's FFN width


def gelu_part(t, prev) -> dict:
    from trt_sora.kernels import reference as ref

    h = (torch.randn(1, S, FFN, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(0)) * 2).to(
        torch.bfloat16)
    sc = torch.tensor(8.0 / 448, device=DEVICE)
    want = ref.gelu_quant(h, sc)
    nbytes = h.numel() * 3
    rows = {}
    for name, m in (("shipped", t), ("prev", prev)):
        if m is None:
            continue
        got = m.gelu_quant(h, sc)
        ms = bench_ms(lambda m=m: m.gelu_quant(h, sc))
        rows[name] = {"ms": ms, "tb_s": nbytes / (ms * 1e-3) / 1e12, "y_equal_torch": _same(got, want),
                      "max_step": (got.float() * sc - want.float() * sc).abs().max().item()}
    return {"bytes": nbytes, "by_setting": rows}


def best_settings(res: dict) -> dict:
    """The fastest setting of each part (norm: the least time over its three forms), as
    ``fp8_bench.py --kernel-settings`` takes them."""
    out = {}
    if "norm" in res:
        forms = [v["by_setting"] for k, v in res["norm"].items() if k != "shipped"]
        out["NORM_MAX_WARPS"] = min(NORM_GRID, key=lambda w: sum(f[f"warps{w}"]["ms"] for f in forms))
    if "qkv" in res:
        rows = res["qkv"]["by_setting"]
        pw, kw = min(QKV_GRID, key=lambda g: rows[f"post{g[0]}_kv{g[1]}"]["ms"])
        out["EPILOGUE_WARPS"] = {"post": pw, "kv": kw}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="norm,qkv,gelu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from trt_sora.kernels import triton_ops as t

    prev = prev_triton_ops()
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "ptxas": get_ptxas_version().strip().splitlines()[-1], "shape": [1, S, C, H, D], "prev": prev is not None,
           "script": "benchmarks/epilogue_bench.py"}
    parts = {"norm": norm_part, "qkv": qkv_part, "gelu": gelu_part}
    for name in args.parts.split(","):
        res[name] = parts[name](t, prev)
        res["best"] = best_settings(res)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(name, "done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
