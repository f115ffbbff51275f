"""Calibration histogram cost on the GPU: one batch's ``|x|`` counts (2048 bins) of a bf16 activation the size
of Wan 1.3B's FFN-down input at 480p x 81 (32,760 x 8,960), several ways:

* ``torch``: fp32 copy, ``abs``, multiply by ``2**-e``, ``histc`` per 2**24-element chunk (``kernel=False``);
* ``fused_r{1,2,4,8}``: the earlier path, one Triton pass ``|x| * 2**-e`` -> fp32 (with r > 1: the bin's centre in
  one of r replicas of every bin, index mod r, so one bin's neighbours count at different addresses), then
  ``histc`` per chunk;
* ``split<H>``: the H lowest bins counted by ``tl.histogram`` in the Triton pass, the rest by ``histc``;
* ``hot<H>x<R>``: only the H lowest bins in R replicas (an outlier-stretched range crowds the data there),
  fewer histc bins than replicating all;
* ``cuda_c<copies>``: the shipped path, the NVRTC counting kernel (:mod:`trt_sora.kernels.cuda_hist`):
  shared-memory bins, ``copies`` sub-histograms per block (``--only-cuda``: just these and the torch path);
* ``tl_histogram``: one Triton pass with ``tl.histogram`` (no fp32 temporary at all), to show why it is not
  the shipped path (its lowering costs about num_bins / 32 instructions per element).

    python benchmarks/hist_bench.py --out hist.json

Also times ``torch.aminmax`` (the min/max every site needs anyway) as the one-read floor, and the torch and
shipped paths on data without the outlier channel (``spread_*``: counts spread over many bins). Every variant's
counts are checked equal to the torch path's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _tl_hist_kernel(X, SC, OUT, N, per_prog, NB: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    sc = tl.load(SC) * NB
    h = tl.zeros([NB], tl.int32)
    for i in range(0, per_prog, BLOCK):
        offs = pid * per_prog + i + tl.arange(0, BLOCK)
        m = offs < N
        u = tl.abs(tl.load(X + offs, mask=m, other=0.0).to(tl.float32)) * sc
        h += tl.histogram(tl.minimum(tl.maximum(u, 0.0), NB - 1.0).to(tl.int32), NB, mask=m)
    tl.atomic_add(OUT + tl.arange(0, NB), h.to(tl.int64), sem="relaxed")


@triton.jit
def _hot_kernel(X, SC, U, N, NB, HOT: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    u = tl.abs(tl.load(X + offs, mask=m, other=0.0).to(tl.float32)) * tl.load(SC)
    b = tl.minimum(tl.maximum(u * NB, 0.0), NB - 1.0).to(tl.int32)
    slot = tl.where(b < HOT, b * R + (offs % R).to(tl.int32), HOT * R + b - HOT)
    tl.store(U + offs, (slot.to(tl.float32) + 0.5) / (NB + HOT * (R - 1)), mask=m)


@triton.jit
def _split_kernel(X, SC, U, HOT_COUNTS, N, NB, per_prog, HOT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    sc = tl.load(SC)
    h = tl.zeros([HOT], tl.int32)
    for i in range(0, per_prog, BLOCK):
        offs = pid * per_prog + i + tl.arange(0, BLOCK)
        m = offs < N
        u = tl.abs(tl.load(X + offs, mask=m, other=0.0).to(tl.float32)) * sc
        b = tl.minimum(tl.maximum(u * NB, 0.0), NB - 1.0).to(tl.int32)
        hot = b < HOT
        h += tl.histogram(tl.where(hot, b, 0), HOT, mask=m & hot)
        tl.store(U + offs, tl.where(hot, -1.0, u), mask=m)  # -1: outside histc's range, skipped
    tl.atomic_add(HOT_COUNTS + tl.arange(0, HOT), h, sem="relaxed")


def split_counts(x, e, nb, hot):
    """The ``hot`` lowest bins counted by ``tl.histogram`` in a persistent Triton pass (one atomic add per
    bin and program), every other element by ``histc``."""
    from trt_sora.calibrate.histogram import CHUNK, unit_scale

    scale = unit_scale(e)
    parts, hots = [], []
    progs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    for chunk in x.reshape(-1).split(CHUNK):
        n = chunk.numel()
        u = torch.empty(n, device=x.device, dtype=torch.float32)
        c = torch.zeros(hot, device=x.device, dtype=torch.int32)
        per = triton.cdiv(triton.cdiv(n, min(triton.cdiv(n, 4096), progs)), 4096) * 4096
        _split_kernel[(triton.cdiv(n, per),)](chunk, scale, u, c, n, nb, per, HOT=hot, BLOCK=4096, num_warps=8)
        parts.append(torch.histc(u, bins=nb, min=0.0, max=1.0))
        hots.append(c)
    counts = torch.stack(parts).to(torch.int64).sum(0)
    counts[:hot] += torch.stack(hots).to(torch.int64).sum(0)
    return counts


def hot_counts(x, e, nb, hot, r):
    """Only the ``hot`` lowest bins (where an outlier-stretched range crowds the data) in ``r`` replicas:
    ``nb + hot * (r - 1)`` histc bins instead of ``nb * r``; the slot centres keep the counts exact."""
    from trt_sora.calibrate.histogram import CHUNK, unit_scale

    scale = unit_scale(e)
    total = nb + hot * (r - 1)
    parts = []
    for chunk in x.reshape(-1).split(CHUNK):
        u = torch.empty(chunk.numel(), device=x.device, dtype=torch.float32)
        _hot_kernel[(triton.cdiv(chunk.numel(), 4096),)](chunk, scale, u, chunk.numel(), nb, HOT=hot, R=r, BLOCK=4096,
                                                        num_warps=8)
        parts.append(torch.histc(u, bins=total, min=0.0, max=1.0))
    slots = torch.stack(parts).to(torch.int64).sum(0)
    return torch.cat([slots[:hot * r].view(hot, r).sum(1), slots[hot * r:]])


def tl_histogram(x, scale, nb):
    x = x.reshape(-1)
    n = x.numel()
    out = torch.zeros(nb, dtype=torch.int64, device=x.device)
    progs = min(triton.cdiv(n, 4096), 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    per = triton.cdiv(triton.cdiv(n, progs), 4096) * 4096
    _tl_hist_kernel[(triton.cdiv(n, per),)](x, scale, out, n, per, NB=nb, BLOCK=4096, num_warps=8)
    return out


def main() -> None:
    from trt_sora.calibrate import histogram
    from trt_sora.calibrate.histogram import batch_counts, exponent_of, unit_scale
    from trt_sora.kernels import cuda_hist

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--width", type=int, default=8960)
    ap.add_argument("--bins", type=int, default=2048)
    ap.add_argument("--only-cuda", action="store_true", help="only the torch path and the NVRTC kernel's variants")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(a.tokens, a.width, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    x[:, 7] *= 40.0  # an outlier channel, as FFN inputs have
    amax = x.float().abs().amax()
    e = exponent_of(amax)
    scale = unit_scale(e)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=5, rep=200, return_mode="median")  # noqa: E731
    want = batch_counts(x, e, a.bins, kernel=False)
    res = {"elements": x.numel(), "bins": a.bins, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__}
    res["aminmax_ms"] = bench(lambda: torch.aminmax(x))
    res["torch_ms"] = bench(lambda: batch_counts(x, e, a.bins, kernel=False))
    wide = (torch.randn(a.tokens, a.width, device="cuda", generator=g) * 0.5).to(torch.bfloat16)  # no outlier
    ew = exponent_of(wide.float().abs().amax())
    want_wide = batch_counts(wide, ew, a.bins, kernel=False)
    flat = torch.zeros_like(x)  # zero padding (text rows past the prompt): the worst case of one bin
    flat[0, 0] = 1.0
    ef = exponent_of(flat.float().abs().amax())
    for copies in (1, 2, 4, 8):
        if a.bins > cuda_hist.max_bins(copies):
            continue
        name = f"cuda_c{copies}"
        run = lambda t, s: cuda_hist.abs_histogram(t, s, a.bins, copies=copies)  # noqa: E731
        res[f"{name}_ms"] = bench(lambda: run(x, scale))
        res[f"{name}_equal"] = torch.equal(run(x, scale), want)
        res[f"spread_{name}_ms"] = bench(lambda: run(wide, unit_scale(ew)))
        res[f"spread_{name}_equal"] = torch.equal(run(wide, unit_scale(ew)), want_wide)
        res[f"flat_{name}_ms"] = bench(lambda: run(flat, unit_scale(ef)))  # every element in bin 0
    for dtype in (torch.float32, torch.float16):  # the other input dtypes, a ragged size: counts only
        t = wide[:1001, :777].to(dtype)
        et = exponent_of(t.float().abs().amax())
        res[f"cuda_{str(dtype)[6:]}_equal"] = torch.equal(batch_counts(t, et, a.bins),
                                                          batch_counts(t, et, a.bins, kernel=False))
    if a.only_cuda:
        return _finish(res, x.numel(), a.out)
    histogram.CUDA_COPIES = None  # the Triton + histc variants below
    shipped = histogram.REPLICAS
    for r in (1, 2, 4, 8):
        histogram.REPLICAS = r
        res[f"fused_r{r}_ms"] = bench(lambda: batch_counts(x, e, a.bins))
        res[f"fused_r{r}_equal"] = torch.equal(batch_counts(x, e, a.bins), want)
    histogram.REPLICAS = shipped
    for h in (32, 64, 128, 256):
        res[f"split{h}_ms"] = bench(lambda: split_counts(x, e, a.bins, h))
        res[f"split{h}_equal"] = torch.equal(split_counts(x, e, a.bins, h), want)
    for hot, r in ((128, 8), (256, 4), (256, 8), (512, 4)):
        res[f"hot{hot}x{r}_ms"] = bench(lambda: hot_counts(x, e, a.bins, hot, r))
        res[f"hot{hot}x{r}_equal"] = torch.equal(hot_counts(x, e, a.bins, hot, r), want)
    res["spread_torch_ms"] = bench(lambda: batch_counts(wide, ew, a.bins, kernel=False))
    res["spread_fused_ms"] = bench(lambda: batch_counts(wide, ew, a.bins))
    res["spread_fused_equal"] = torch.equal(batch_counts(wide, ew, a.bins),
                                            batch_counts(wide, ew, a.bins, kernel=False))
    try:
        res["tl_histogram_ms"] = bench(lambda: tl_histogram(x, scale, a.bins))
        res["tl_histogram_equal"] = torch.equal(tl_histogram(x, scale, a.bins), want)
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result too
        res["tl_histogram_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    _finish(res, x.numel(), a.out)


def _finish(res: dict, numel: int, out: str | None) -> None:
    for k in [k for k in res if k.endswith("_ms")]:
        res[k.replace("_ms", "_gbps")] = round(numel * 2 / (res[k] * 1e-3) / 1e9, 1)
    print(json.dumps(res, indent=1))
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
