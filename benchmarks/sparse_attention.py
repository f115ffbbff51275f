"""Block-sparse 8-bit self-attention vs our dense path at Wan 14B 720p x 81 (one GPU, one run).

One self-attention layer of Wan 2.1 14B at 1280x720, 81 frames: latent 21 x 90 x 160, patch 1 x 2 x 2, so a
token grid of 21 x 45 x 80 = 75,600 tokens, 40 heads of 128, batch 1, inputs with a per-channel K bias
(:func:`trt_sora.kernels.reference.example_qkv`). For each window of ``--windows`` (tile ``--tile``, the
first ``--global-frames`` latent frames global):

* ``kernel``: :func:`trt_sora.kernels.triton_ops.attention_fp8` over the pattern's key tiles vs dense, on
  the same 8-bit operands (FP8 output, as the model runs it): ms, speed-up, the block density;
* ``layer``: :func:`trt_sora.kernels.ops.self_attention` (QKV epilogue, attention, and for sparse the token
  permutation into tile order and back) vs dense: ms and speed-up, the per-call cost the model sees;
* a check that the widest pattern (every tile listed) gives the dense kernel's bits.

    python benchmarks/sparse_attention.py --windows 0,1,1:1,1,1:2,2,2:4,2,2 --out benchmarks/results/x.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_ms(fn, iters: int) -> float:
    """Median ms over ``iters`` CUDA-event-timed calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", default="21,45,80", help="token grid: latent frames, height, width after patching")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--tile", default="1,8,16")
    p.add_argument("--windows", default="0,1,1:1,1,1:1,2,2:2,2,2:4,2,2")
    p.add_argument("--global-frames", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from trt_sora.kernels import ops
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t
    from trt_sora.sparse import block_mask, tile_sparse

    grid = tuple(int(x) for x in args.grid.split(","))
    tile = tuple(int(x) for x in args.tile.split(","))
    windows = [tuple(int(x) for x in w.split(",")) for w in args.windows.split(":")]
    s, h, d = math.prod(grid), args.heads, 128
    qkv, wq, wk, cos, sin = ref.example_qkv(1, s, h, d, seed=0)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    osc = torch.tensor(0.02, device="cuda")
    flops = 4.0 * s * s * d * h
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "grid": list(grid), "tokens": s,
           "heads": h, "head_dim": d, "tile": list(tile), "global_frames": args.global_frames, "iters": args.iters,
           "dense": {}, "sparse": []}
    dense_k = bench_ms(lambda: t.attention_fp8(*ops8, out_scale=osc), args.iters)
    dense_l = bench_ms(lambda: ops.self_attention(qkv, wq, wk, cos, sin, h, 1e-6, fp8=True, out_scale=osc),
                       args.iters)
    out["dense"] = {"kernel_ms": round(dense_k, 3), "kernel_tflops": round(flops / dense_k / 1e9, 1),
                    "layer_ms": round(dense_l, 3), "kernel": t.attention_kernel(qkv.device)}
    print(json.dumps(out["dense"]), flush=True)
    for w in windows:
        seam = tile_sparse(grid, tile, w, args.global_frames, "cuda")
        density = float(block_mask(grid, tile, w, args.global_frames).mean())
        blocks = seam.kernel_blocks
        k_ms = bench_ms(lambda: t.attention_fp8(*ops8, out_scale=osc, blocks=blocks), args.iters)
        l_ms = bench_ms(lambda: ops.self_attention(qkv, wq, wk, cos, sin, h, 1e-6, fp8=True, out_scale=osc,
                                                   sparse=seam), args.iters)
        row = {"window": list(w), "density": round(density, 4), "kernel_ms": round(k_ms, 3),
               "kernel_speedup": round(dense_k / k_ms, 3), "layer_ms": round(l_ms, 3),
               "layer_speedup": round(dense_l / l_ms, 3),
               "effective_tflops": round(flops * density / k_ms / 1e9, 1)}
        out["sparse"].append(row)
        print(json.dumps(row), flush=True)
    full = tile_sparse(grid, tile, (grid[0], grid[1], grid[2]), 0, "cuda").kernel_blocks
    out["full_pattern_equals_dense"] = bool(torch.equal(t.attention_fp8(*ops8, blocks=full),
                                                        t.attention_fp8(*ops8, tma=None)))
    out["date"] = time.strftime("%Y-%m-%d")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("sparse", "dense")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
