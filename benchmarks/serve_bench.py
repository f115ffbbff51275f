"""Server latency and throughput with and without dynamic batching (`trt-sora serve` over HTTP).

For each mode a fresh `trt-sora serve` process is started on 127.0.0.1, warmed up, and sent
``--requests`` jobs by ``--concurrency`` closed-loop clients (each posts ``POST /v1/generate`` and
waits for its clip). Reported per mode: request latency p50/p95/max, throughput (clips/s over the
wall time of the whole run), the formed batch sizes (``trt_sora_batches_total`` from /metrics) and
the mean transformer-call latency per call batch.

    python benchmarks/serve_bench.py --run build/wan-shapes/rtx4090-fp8 --requests 16 --concurrency 4 \\
        --steps 4 --out benchmarks/results/serve_cpu_wan-shapes.json
    # on the H200 (GPU backend picked by --backend auto):
    python benchmarks/serve_bench.py --run build/wan-shapes/h200-fp8 --backend auto --requests 64 --concurrency 8

Modes: ``batched`` (dynamic batching: --max-wait-ms, cap from the buckets and memory) and
``unbatched`` (--max-batch 1: each request alone; CFG pairs still share a call when the bucket allows).

A box without text encoder weights serves a text-embeddings file (``--text-encoder FILE``, written by
``benchmarks/peer_modelopt.py embed``); the prompts sent are then its captions (``--prompts-from FILE``).
The JSON is rewritten after each mode (a run cut off keeps the modes it finished) and records the
first clip's metadata: the stages' seconds and the step caching it was served with.

    python benchmarks/serve_bench.py --run /tmp/cc/run --backend torch-fp8 --device cuda --steps 50 \
        --text-encoder build/wan_shapes_peer_prompts.safetensors \
        --prompts-from build/wan_shapes_peer_prompts.safetensors --out serve.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _metrics(base: str) -> dict:
    text = _get(base + "/metrics")[1].decode()
    batches = {int(m.group(1)): float(m.group(2)) for m in
               re.finditer(r'^trt_sora_batches_total\{clips="(\d+)"\} ([0-9.e+]+)$', text, re.M)}
    calls = {}
    for m in re.finditer(r'^trt_sora_transformer_call_seconds_(sum|count)\{call_batch="(\d+)"\} ([0-9.e+]+)$', text,
                         re.M):
        calls.setdefault(int(m.group(2)), {})[m.group(1)] = float(m.group(3))
    return {"batches": batches, "calls": calls}


def server_env(environ) -> dict:
    """The server's environment: this checkout first on ``PYTHONPATH``, the caller's entries kept (the
    device installs the serve extra's wheels into a folder named there)."""
    path = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH")) if p)
    return {**environ, "PYTHONPATH": path}


def run_mode(args, mode: str) -> dict:
    port = _port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "trt_sora", "serve", "--run", args.run, "--backend", args.backend, "--port", str(port),
           "--max-queue", str(max(64, args.requests)), "--warmup-steps", "1"]
    cmd += ["--max-wait-ms", str(args.max_wait_ms)] if mode == "batched" else ["--max-batch", "1", "--max-wait-ms", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    if args.text_encoder:
        cmd += ["--text-encoder", args.text_encoder]
    if args.force:  # speed of an artifact whose parity gate failed (never for serving it)
        cmd += ["--force"]
    proc = subprocess.Popen(cmd, env=server_env(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if _get(base + "/readyz", 5)[0] == 200:
                    break
            except urllib.error.HTTPError as exc:  # 503: warming up, or a start-up that failed
                why = json.loads(exc.read() or b"{}").get("error", "")
                if why.startswith("failed"):
                    raise SystemExit(f"server start-up {why}") from None
            except (TimeoutError, urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() - t0 > 900:
                raise SystemExit("server not ready after 900 s")
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        info = json.loads(_get(base + "/v1/info")[1])
        before = _metrics(base)
        latencies: list[float] = []
        jobs: list[str] = []
        lock = threading.Lock()
        counter = iter(range(args.requests))

        def client():
            for i in counter:
                body = {"prompt": args.prompts[i % len(args.prompts)], "seed": 1000 + i}
                if args.steps:
                    body["steps"] = args.steps
                if args.guidance is not None:
                    body["guidance"] = args.guidance
                req = urllib.request.Request(base + "/v1/generate?format=npy", data=json.dumps(body).encode(),
                                             method="POST", headers={"Content-Type": "application/json"})
                s = time.perf_counter()
                with urllib.request.urlopen(req, timeout=3600) as r:
                    r.read()
                    job = re.search(r'filename="?([0-9a-f]+)\.npy', r.headers.get("content-disposition", ""))
                with lock:
                    latencies.append(time.perf_counter() - s)
                    jobs.extend([job.group(1)] if job else [])

        wall0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        wall = time.perf_counter() - wall0
        after = _metrics(base)
        clip = json.loads(_get(f"{base}/v1/jobs/{jobs[0]}")[1]).get("metadata", {}) if jobs else {}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    lat = np.asarray(latencies)
    formed = {k: int(after["batches"].get(k, 0) - before["batches"].get(k, 0)) for k in after["batches"]}
    calls = {}
    for k, v in after["calls"].items():
        n = v.get("count", 0) - before["calls"].get(k, {}).get("count", 0)
        if n:
            calls[str(k)] = {"calls": int(n), "mean_ms": round(1000 * (v["sum"] - before["calls"].get(k, {}).get(
                "sum", 0)) / n, 2)}
    return {"mode": mode, "backend": info["backend"], "requests": len(lat), "concurrency": args.concurrency,
            "p50_s": round(float(np.percentile(lat, 50)), 3), "p95_s": round(float(np.percentile(lat, 95)), 3),
            "max_s": round(float(lat.max()), 3), "throughput_clips_per_s": round(len(lat) / wall, 4),
            "wall_s": round(wall, 2), "formed_batches": {str(k): v for k, v in sorted(formed.items()) if v},
            "transformer_calls": calls, "batch_cap_default_request": info["memory"].get("cap"),
            "ready_s": round(ready_s, 1), "forced": args.force, "checked": info.get("checked"),
            "text_encoder": info.get("text_encoder"), "prompts": len(args.prompts),
            "first_clip": {k: clip.get(k) for k in ("seconds", "caching", "batch", "size")},
            "sampling": {**info["sampling"], **({"num_steps": args.steps} if args.steps else {}),
                         **({"guidance_scale": args.guidance} if args.guidance is not None else {})}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True)
    p.add_argument("--backend", default="ort")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="denoising steps per clip (default: the artifact's)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--max-wait-ms", type=float, default=200.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None, help="the server's torch / trt device (default: its own)")
    p.add_argument("--text-encoder", default=None, help="the server's text encoder: a text-embeddings file on a "
                   "box without encoder weights (peer_modelopt.py embed), hash, minilm, a pipeline folder")
    p.add_argument("--prompts-from", default=None, metavar="FILE", help="send the captions of this text-embeddings "
                   "file (in order, cycled) instead of --prompts")
    p.add_argument("--modes", default="batched,unbatched")
    p.add_argument("--force", action="store_true", help="serve even when the parity report failed (to measure speed)")
    p.add_argument("--prompts", nargs="*", default=["a red circle moves up over a plain black background",
                                                     "a blue square moves down over a plain black background"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.prompts_from:
        args.prompts = captions(args.prompts_from)
    results = {"run": args.run, "machine": f"{os.cpu_count()} CPUs", "device": args.device,
               "load_average": os.getloadavg(), "modes": []}
    for mode in args.modes.split(","):
        results["modes"].append(run_mode(args, mode))
        text = json.dumps(results, indent=2)
        if args.out:
            tmp = Path(f"{args.out}.tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, args.out)
    print(text)
    return 0


def captions(path: str) -> list[str]:
    """The captions of a text-embeddings file (``trt_sora.models.text.save_embeddings``), in order."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        caps = json.loads((f.metadata() or {}).get("prompts", "[]"))
    if not caps:
        raise SystemExit(f"{path} lists no captions (its metadata has no 'prompts'); write it with "
                         "benchmarks/peer_modelopt.py embed")
    return caps


if __name__ == "__main__":
    raise SystemExit(main())
