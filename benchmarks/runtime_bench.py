"""One-call runtime measurement: load time, warm-up, per-bucket latency percentiles, thread safety.

    python benchmarks/runtime_bench.py --device cuda --model wan-tiny            # on the H200
    python benchmarks/runtime_bench.py --device cpu --model wan-tiny --iters 5   # CI smoke

Builds a run folder (export + parity check) when --run is not given, then measures the backends
torch (bf16 on GPU / fp32 on CPU, eager and optionally torch.compile) and ort: its CPU provider and,
with --device cuda, its CUDA provider (onnxruntime-gpu, the `ort-gpu` extra; without it that row records
the error instead of ORT's silent CPU fallback), each row with the providers the session really used.
Prints JSON to stdout and writes it to $OUT/runtime_bench.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def _feeds(point, channels, text_dim, device, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    b = point["batch"]
    return {"hidden_states": torch.randn(b, channels, point["latent_frames"], point["latent_height"],
                                         point["latent_width"], generator=g).to(device, dtype),
            "timestep": torch.full((b,), 500.0).to(device),
            "encoder_hidden_states": torch.randn(b, point["text_len"], text_dim, generator=g).to(device, dtype)}


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measure(runner, device, dtype, iters, threads) -> dict:
    import numpy as np
    import torch

    cfg = runner.model_config
    out = {"load_s": round(runner.load_seconds, 3),
           "warmup_s": {k: round(v, 3) for k, v in runner.warmup_seconds.items()},
           "buckets": {}}
    for b in runner.buckets:
        p = b.point("opt")
        f = _feeds(p, int(cfg["in_channels"]), int(cfg["text_dim"]), device, dtype)
        if runner.backend == "ort":
            f = {k: v.float().cpu().numpy() for k, v in f.items()}
        lat = []
        for _ in range(iters):
            t0 = time.perf_counter()
            runner.infer(f)
            _sync(device)
            lat.append((time.perf_counter() - t0) * 1e3)
        q = np.percentile(lat, [50, 90, 99])
        ref = runner.infer(f)["sample"]
        results = [None] * threads

        def work(i):
            results[i] = runner.infer(f)["sample"]

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        [t.start() for t in ts]
        [t.join() for t in ts]
        _sync(device)
        wall = time.perf_counter() - t0
        to_np = (lambda x: x.float().cpu().numpy()) if torch.is_tensor(ref) else (lambda x: x)
        equal = all(np.array_equal(to_np(r), to_np(ref)) for r in results)
        maxdiff = max(float(np.abs(to_np(r) - to_np(ref)).max()) for r in results)
        out["buckets"][b.name] = {"point": p, "iters": iters, "p50_ms": round(q[0], 3), "p90_ms": round(q[1], 3),
                                  "p99_ms": round(q[2], 3), "mean_ms": round(statistics.mean(lat), 3),
                                  "threads": threads, "threaded_wall_s": round(wall, 4),
                                  "threaded_equal_single": equal, "threaded_max_abs_diff": maxdiff}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan-tiny")
    ap.add_argument("--recipe", default="rtx4090-fp8")
    ap.add_argument("--run", default=None, help="checked run folder; default: build one in a temp folder")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="torch dtype (default bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--backends", default="torch,ort")
    ap.add_argument("--compile", action="store_true", help="also measure torch.compile")
    args = ap.parse_args(argv)
    import torch

    import trt_sora.runtime as rt

    info = {"device": args.device, "model": args.model, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    t0 = time.perf_counter()
    run = Path(args.run) if args.run else None
    if run is None:
        from trt_sora.config import load_recipe
        from trt_sora.export import export_onnx
        from trt_sora.parity import check_artifacts

        run = Path(tempfile.mkdtemp(prefix="trt_sora_bench_")) / "run"
        export_onnx(args.model, load_recipe(args.recipe).export, run / "export")
        rep = check_artifacts(run, args.recipe)
        info["parity_passed"] = rep["passed"]
    info["prepare_s"] = round(time.perf_counter() - t0, 2)
    dtype_name = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    from trt_sora.models.base import torch_dtype

    results = {"info": info, "backends": {}}
    variants = []
    for b in args.backends.split(","):
        if b == "torch":
            variants.append(("torch-" + dtype_name, dict(backend="torch", device=args.device, dtype=dtype_name)))
            if args.compile:
                variants.append(("torch-compile-" + dtype_name,
                                 dict(backend="torch", device=args.device, dtype=dtype_name, compile=True)))
        elif b == "ort":
            variants.append(("ort-cpu", dict(backend="ort", device="cpu")))
            if args.device.startswith("cuda"):
                variants.append(("ort-cuda", dict(backend="ort", device=args.device)))
    for name, kw in variants:
        try:
            r = rt.load(run, concurrency=args.threads, force=True, **kw)
            dev = kw.get("device", "cpu") if kw["backend"] != "ort" else "cpu"  # ORT is fed host arrays
            dt = torch_dtype(kw.get("dtype", "fp32"))
            results["backends"][name] = measure(r, dev, dt, args.iters, args.threads)
            if kw["backend"] == "ort":
                results["backends"][name]["providers"] = r._runners[0].providers_in_use
            r.close()
        except Exception as exc:  # one backend failing must not lose the others' numbers
            results["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "runtime_bench.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
