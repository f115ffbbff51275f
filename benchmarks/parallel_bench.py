"""CFG-parallel x Ulysses: one transformer call (one denoising step's CFG pair, batch 2) on N
processes against the same call on one, in one torchrun job (the benchmark of issue #18).

    torchrun --nproc-per-node 2 benchmarks/parallel_bench.py --model wan2.1-t2v-14b --size 480p \
        --parallel cfg=2 --parallel ulysses=2 --out results.json
    torchrun --nproc-per-node 2 benchmarks/parallel_bench.py --model wan-tiny --device cpu   # CPU smoke run

Rank 0 first times the call alone (the other ranks wait), then every ``--parallel`` layout whose
world size is the job's: median of ``--iters`` calls after warm-up, speed-up, scaling efficiency
(speed-up / GPUs) and cosine against the one-process output. Random-init weights at real sizes.
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0, set by trt_sora.parallel.init_process_group).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"tiny": (3, 6, 6), "480p": (21, 60, 104), "720p": (21, 90, 160)}


def _timed(fn, iters: int, sync) -> tuple[object, float]:
    y = fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        y = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return y, statistics.median(ts)


def main(argv=None) -> None:
    import torch
    import torch.distributed as dist

    from trt_sora.models import get_adapter
    from trt_sora.parallel import ParallelConfig, init_process_group
    from trt_sora.runners.parallel_runner import ParallelRunner
    from trt_sora.runners.torch_runner import TorchRunner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-t2v-14b")
    ap.add_argument("--size", default="480p", choices=sorted(SIZES))
    ap.add_argument("--parallel", action="append", default=None, help="cfg=2 / ulysses=2 / cfg=2,ulysses=2 (repeat)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    init_process_group(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    adapter = get_adapter(a.model)
    dtype = "bf16" if cuda else "fp32"
    f, h, w = SIZES["tiny" if a.model == "wan-tiny" else a.size]
    point = {"batch": 2, "latent_frames": f, "latent_height": h, "latent_width": w, "text_len": 512 if cuda else 5}
    dev = "cuda" if cuda else "cpu"
    feeds = adapter.example_inputs(point, dtype=dtype, device=dev, seed=1)
    feeds["timestep"] = torch.full((2,), 700.0, device=dev)
    model = adapter.load(dtype, dev)
    res = {"model": a.model, "size": a.size, "world": world, "point": point, "layouts": {}}
    if rank == 0:
        single = TorchRunner(adapter, dtype=dtype, device=dev, model=model).activate()
        y1, t1 = _timed(lambda: single.infer(feeds)["sample"], a.iters, sync)
        res["one_process_s"] = t1
        print(f"1 process: {t1:.4f} s", flush=True)
    dist.barrier()
    for spec in a.parallel or ["cfg=2" if world == 2 else f"cfg=2,ulysses={world // 2}"]:
        pc = ParallelConfig.parse(spec)
        if pc.world_size != world:
            continue
        import copy

        r = ParallelRunner(TorchRunner(adapter, dtype=dtype, device=dev, model=copy.deepcopy(model)), pc).activate()
        y, t = _timed(lambda: r.infer(feeds)["sample"], a.iters, sync)
        if rank == 0:
            c = torch.nn.functional.cosine_similarity(y.double().flatten(), y1.double().flatten(), dim=0).item()
            sp = res["one_process_s"] / t
            res["layouts"][spec] = {"s": t, "speedup": sp, "efficiency": sp / world, "cosine_vs_one_process": c}
            print(f"{spec}: {t:.4f} s  speed-up {sp:.2f}x  efficiency {sp / world:.2f}  cosine {c:.6f}", flush=True)
        r.deactivate()
    if rank == 0 and a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
