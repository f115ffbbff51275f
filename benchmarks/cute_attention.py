"""The CuTe DSL 8-bit attention kernel (:mod:`trt_sora.kernels.cute_attention`) against the Triton kernel
(:func:`trt_sora.kernels.triton_ops.attention_fp8`) in one process on one GPU: agreement on ragged, one-tile,
batch-2 and many-tile shapes (bf16 output: bits equal, max |diff|, and both against
:func:`trt_sora.kernels.reference.attention_fp8`), then speed at Wan 14B's 1 x 40 heads x 32,760 x 128 for each
``--variants`` entry, GPU clock and power sampled during each timing, and the cosine against fp32 attention.

    python benchmarks/cute_attention.py --site /tmp/fa4site --out results.json      # H100/H200

``--trace NAMES``: those variants (overlap or lookahead schedules) run once more with the kernel's ``trace``
buffer at the same length: SM clocks at each key tile's phases in lane 0 of each consumer warp of four CTAs,
summarized by :func:`trace_phases` (cycles each phase takes, and how much the two warpgroups' softmaxes
overlap). In the lookahead schedule the phases read: K wait, the next Q K^T's issue, softmax, P V wait, then
P's pack, P V's issue and the wait for the next Q K^T together (``pack``). ``NAME@exp+pv`` traces NAME with
the kernel's ``ablate`` (the EX2s, the P V products left out of each step): what each costs in cycles.
"""
import argparse
import json
import os
import site
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: every Attention8 option off; each variant names all of them, so a change of SCHEDULE's defaults changes none
OFF = {"stages": 2, "overlap": False, "pingpong": False, "lookahead": False, "lazy_rescale": False,
       "early_pack": False, "split_sum": False, "int_max": False}


def _v(**on) -> dict:
    return OFF | on


#: name -> Attention8 options (``overlap_lazy_epssim`` is trt_sora.kernels.cute_attention.SCHEDULE)
VARIANTS = {
    "plain": _v(),
    "overlap": _v(overlap=True),
    "overlap_s3": _v(stages=3, overlap=True),
    "overlap_s4": _v(stages=4, overlap=True),
    "pingpong": _v(pingpong=True),
    "overlap_pingpong": _v(overlap=True, pingpong=True),
    "overlap_pingpong_s3": _v(stages=3, overlap=True, pingpong=True),
    "lookahead": _v(lookahead=True),
    "lookahead_s3": _v(stages=3, lookahead=True),
    "overlap_lazy": _v(overlap=True, lazy_rescale=True),
    "lookahead_lazy": _v(lookahead=True, lazy_rescale=True),
    "overlap_pingpong_lazy": _v(overlap=True, pingpong=True, lazy_rescale=True),
    "overlap_lazy_ep": _v(overlap=True, lazy_rescale=True, early_pack=True),
    "overlap_lazy_ss": _v(overlap=True, lazy_rescale=True, split_sum=True),
    "overlap_lazy_epss": _v(overlap=True, lazy_rescale=True, early_pack=True, split_sum=True),
    "overlap_lazy_im": _v(overlap=True, lazy_rescale=True, int_max=True),
    "overlap_lazy_epssim": _v(overlap=True, lazy_rescale=True, early_pack=True, split_sum=True, int_max=True),
}
SHAPES = ((1, 100, 2), (1, 128, 2), (1, 129, 2), (2, 1000, 2), (1, 4133, 2), (1, 32760, 3))


PHASES = (("k_wait", 0, 1), ("qk", 1, 2), ("softmax", 2, 3), ("pv_wait", 3, 4), ("pack", 4, 5))


def trace_phases(tr, first: int = 8) -> dict:
    """SM clocks [CTAs, 8 warps, tiles, 6 events] (the kernel's ``TRACE_EVENTS``; tiles never reached hold 0)
    -> median cycles of each phase and of a whole step per warpgroup (warps 0-3, 4-7), over tiles ``first``..
    (the pipeline filled), and ``softmax_overlap``: the share of warpgroup 0's softmax time during which the
    warp of warpgroup 1 on the same SM sub-partition (warp w + 4) is in its softmax too (0: they take turns,
    1: in lockstep)."""
    tr = tr.to(torch.int64)
    reached = (tr[:, :, first:] != 0).all(-1).all(1).all(0)  # tiles every traced warp finished
    r = int(reached.long().cumprod(0).sum())
    if r < 3:
        raise ValueError(f"trace: fewer than 2 complete key tiles past tile {first}")
    t = tr[:, :, first:first + r]
    out = {"tiles": r - 1, "first": first}
    for wg in (0, 1):
        w = t[:, 4 * wg:4 * wg + 4]
        row = {name: float((w[:, :, :-1, b] - w[:, :, :-1, a]).double().median()) for name, a, b in PHASES}
        row["gap"] = float((w[:, :, 1:, 0] - w[:, :, :-1, 5]).double().median())
        row["step"] = float((w[:, :, 1:, 0] - w[:, :, :-1, 0]).double().median())
        out[f"wg{wg}"] = row
    a0, a1 = t[:, :4, 1:-1, 2], t[:, :4, 1:-1, 3]  # inner tiles: warpgroup 1's neighbours of each are traced
    b0, b1 = t[:, 4:, :, 2], t[:, 4:, :, 3]
    both = torch.zeros_like(a0)
    for k in range(b0.shape[2]):  # each of warpgroup 1's softmax intervals against all of warpgroup 0's
        lo, hi = torch.maximum(a0, b0[:, :, k:k + 1]), torch.minimum(a1, b1[:, :, k:k + 1])
        both += (hi - lo).clamp(min=0)
    out["softmax_overlap"] = float(both.sum()) / max(float((a1 - a0).sum()), 1.0)
    return out


def agreement(got, want, ref32):
    g, w = got.float(), want.float()
    return {"bf16_equal": bool(torch.equal(got, want)), "frac_equal": float((g == w).float().mean()),
            "max_abs_vs_triton": float((g - w).abs().max()), "max_abs_vs_ref": float((g - ref32).abs().max()),
            "triton_max_abs_vs_ref": float((w - ref32).abs().max()), "finite": bool(torch.isfinite(g).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default=None, help="a pip --target folder holding nvidia-cutlass-dsl (py3.12)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--reps", type=int, default=3, help="timing rounds (each kernel once per round)")
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--tokens-720p", type=int, default=75600, help="one more timing round at this length (0: none)")
    ap.add_argument("--probe", default=None, help="(internal) run variant NAME once on two small shapes, exit 0 if "
                    "it finishes: each variant is probed in a child process first, so a kernel that hangs costs its "
                    "probe's timeout, not the run")
    ap.add_argument("--probe-timeout", type=float, default=120.0)
    ap.add_argument("--watchdog", type=float, default=0.0, help="seconds after which the partial JSON is written and "
                    "the process exits (0: none)")
    ap.add_argument("--trace", default="", help="comma-separated VARIANTS (overlap or lookahead schedules) to "
                    "trace, first; NAME@exp+pv: with that work left out (the kernel's ablate)")
    ap.add_argument("--trace-only", action="store_true", help="stop after the traces")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.site:
        site.addsitedir(a.site)
    if a.probe:
        return probe(a.probe)
    import triton

    from benchmarks.fp8_bench import GpuSampler, attention_tflops, cos, fp32_heads
    from trt_sora.kernels import cute_attention as ca
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    names = [n for n in a.variants.split(",") if n]
    for n in filter(None, a.trace.split(",")):
        trace_spec(n)  # a bad entry stops the run here, not after the other traces
    res = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "variants":
           {n: VARIANTS[n] for n in names}, "bits": [], "errors": {}, "ms": {}, "probes": {}}

    def dump():
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")

    if a.watchdog:
        def give_up():
            res["watchdog"] = f"gave up after {a.watchdog} s"
            dump()
            os._exit(3)
        threading.Timer(a.watchdog, give_up).start()
    if a.trace:
        run_traces(a, res, dump)
        if a.trace_only:
            os._exit(0)
    probed = []
    for n in names:
        cmd = [sys.executable, __file__, "--probe", n] + (["--site", a.site] if a.site else [])
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.probe_timeout)
            res["probes"][n] = {"rc": p.returncode, "s": round(time.time() - t0, 1), "tail": p.stdout[-600:] +
                                p.stderr[-1500:]}
            if p.returncode == 0:
                probed.append(n)
        except subprocess.TimeoutExpired:
            res["probes"][n] = {"rc": "timeout", "s": round(time.time() - t0, 1)}
        print(n, "probe", res["probes"][n]["rc"], flush=True)
    dump()
    ok = []
    for n in probed:  # compile (and catch what fails) before anything is timed
        t0 = time.time()
        try:
            ops = t.qkv_rmsnorm_rope(*ref.example_qkv(1, 256, 2, seed=1), 2, fp8=True)
            ca.attention_fp8(*ops, **VARIANTS[n])
            torch.cuda.synchronize()
            ok.append(n)
            res.setdefault("compile_s", {})[n] = round(time.time() - t0, 2)
        except Exception as e:  # noqa: BLE001  (a variant that fails is reported, the others still run)
            res["errors"][n] = f"{type(e).__name__}: {str(e)[:1500]}"
        print(n, res["errors"].get(n, "ok"), flush=True)
    for b, s, h in SHAPES:
        ops = t.qkv_rmsnorm_rope(*ref.example_qkv(b, s, h, seed=1), h, fp8=True)
        want = t.attention_fp8(*ops, ws=False)
        sc = torch.tensor(float(want.float().abs().max()) / 448, device="cuda")
        want8 = t.attention_fp8(*ops, out_scale=sc, ws=False).view(torch.uint8)
        row = {"b": b, "s": s, "h": h}
        if s <= 4133:
            q8, qs, k8, ks, vt8, vs = ops
            ref32 = ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, s), vs).transpose(1, 2).reshape(b, s, -1)
        else:
            ref32 = want.float()
        for n in ok:
            try:
                row[n] = agreement(ca.attention_fp8(*ops, **VARIANTS[n]), want, ref32)
                got8 = ca.attention_fp8(*ops, out_scale=sc, **VARIANTS[n]).view(torch.uint8)
                row[n]["fp8_equal"] = bool(torch.equal(got8, want8))
                row[n]["fp8_frac_equal"] = float((got8 == want8).float().mean())
            except Exception as e:  # noqa: BLE001
                row[n] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        res["bits"].append(row)
        print(json.dumps(row), flush=True)
        dump()
    s, h, d = a.tokens, 40, 128
    qkv, wq, wk, cs, sn = ref.example_qkv(1, s, h, d)
    ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    osc = torch.tensor(0.01, device="cuda")
    res["clocks"] = {}

    def bench(name, fn):
        with GpuSampler() as smp:
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        res["ms"].setdefault(name, []).append(ms)
        res["clocks"].setdefault(name, []).append(smp.summary())

    for _ in range(a.reps):
        bench("triton", lambda: t.attention_fp8(*ops, ws=False))
        bench("triton_fp8_out", lambda: t.attention_fp8(*ops, out_scale=osc, ws=False))
        for n in ok:
            bench(n, lambda n=n: ca.attention_fp8(*ops, **VARIANTS[n]))
            bench(f"{n}_fp8_out", lambda n=n: ca.attention_fp8(*ops, out_scale=osc, **VARIANTS[n]))
        print(json.dumps(res["ms"]), flush=True)
        dump()
    res["tflops"] = attention_tflops(res["ms"], s, h, d)
    if a.tokens_720p:  # one round at 720p x 81's length, the operands freed after
        s2 = a.tokens_720p
        ops2 = t.qkv_rmsnorm_rope(*ref.example_qkv(1, s2, h, d), h, fp8=True)
        ms2 = {"triton_fp8_out": triton.testing.do_bench(lambda: t.attention_fp8(*ops2, out_scale=osc, ws=False),
                                                         warmup=25, rep=200, return_mode="median")}
        for n in ok:
            ms2[n + "_fp8_out"] = triton.testing.do_bench(
                lambda n=n: ca.attention_fp8(*ops2, out_scale=osc, **VARIANTS[n]), warmup=25, rep=200,
                return_mode="median")
        res["tokens_720p"] = {"s": s2, "ms": ms2, "tflops": {k: v[0] for k, v in attention_tflops(
            {k: [m] for k, m in ms2.items()}, s2, h, d).items()}}
        del ops2
        dump()
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    heads, want = fp32_heads(q, k, v)
    score = lambda o: cos(o.float().view(1, s, h, d)[:, :, heads], want)  # noqa: E731
    res["cosine_vs_fp32"] = {"triton": score(t.attention_fp8(*ops, ws=False)),
                             **{n: score(ca.attention_fp8(*ops, **VARIANTS[n])) for n in ok}}
    print(json.dumps({k: res[k] for k in ("tflops", "cosine_vs_fp32")}, indent=1))
    dump()
    os._exit(0)  # the watchdog timer thread must not hold the process


def trace_spec(spec: str) -> tuple[str, tuple]:
    """``--trace`` entry -> (variant, ablations): ``NAME`` or ``NAME@exp+pv`` (the kernel's ``ablate``: that work
    left out of the traced step, to see what it costs)."""
    from trt_sora.kernels.cute_attention import ABLATIONS

    name, _, cut = spec.partition("@")
    ablate = tuple(x for x in cut.split("+") if x)
    if name not in VARIANTS or set(ablate) - set(ABLATIONS):
        raise SystemExit(f"--trace {spec!r}: NAME[@ABLATION+...] with NAME in VARIANTS, ABLATION in {ABLATIONS}")
    return name, ablate


def run_traces(a, res, dump) -> None:
    """Each ``--trace`` variant at ``--tokens``: 20 untraced launches to warm the clocks, then traced ones; the
    last trace's phases (:func:`trace_phases`) into ``res["trace"]``."""
    from trt_sora.kernels import cute_attention as ca
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    ops = t.qkv_rmsnorm_rope(*ref.example_qkv(1, a.tokens, 40, 128), 40, fp8=True)
    res["trace"] = {}
    for n in a.trace.split(","):
        name, ablate = trace_spec(n)
        try:
            buf = torch.zeros(ca.TRACE_SHAPE, dtype=torch.int64,
                              device="cuda")
            for _ in range(20):
                ca.attention_fp8(*ops, **VARIANTS[name])
            for _ in range(5):
                ca.attention_fp8(*ops, trace=buf, ablate=ablate, **VARIANTS[name])
            torch.cuda.synchronize()
            res["trace"][n] = trace_phases(buf.cpu())
        except Exception as e:  # noqa: BLE001  (a variant that fails is reported, the others still run)
            res["trace"][n] = {"error": f"{type(e).__name__}: {str(e)[:1000]}"}
        print(n, "trace", json.dumps(res["trace"][n]), flush=True)
        dump()
    del ops


def probe(name: str) -> None:
    from trt_sora.kernels import cute_attention as ca
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    for b, s, h in ((1, 129, 2), (2, 1000, 2)):
        ops = t.qkv_rmsnorm_rope(*ref.example_qkv(b, s, h, seed=1), h, fp8=True)
        o = ca.attention_fp8(*ops, **VARIANTS[name])
        torch.cuda.synchronize()
        want = t.attention_fp8(*ops, ws=False)
        print(name, b, s, h, "finite", bool(torch.isfinite(o.float()).all()), "max_abs",
              float((o.float() - want.float()).abs().max()), flush=True)


if __name__ == "__main__":
    main()
