"""Time to first chunk vs total time of the gRPC stream (`trt-sora serve --grpc-port`).

A `trt-sora serve --port 0 --grpc-port 0` process is started on 127.0.0.1 and warmed up; then
``--requests`` clips are asked for one after another, each once over gRPC (TrtSora.Generate) and
once over HTTP (``POST /v1/generate?format=mp4``, which answers when the whole file is encoded).
Reported per gRPC request: seconds from the call to the first chunk (any), the first denoising
step, the first MP4 piece and the last piece, with the pieces' count, largest size and the MP4's
bytes, and the server's decode: its seconds (the job's metadata) and how long before the decode
ended the first MP4 piece arrived (``first_mp4_before_decode_end_s``, > 0: the stream began while
the VAE still decoded; the server's clock and ours are the same machine's); per HTTP request:
seconds to the whole file. Medians over the requests in ``summary``. ``--size F,H,W``: the clip size.

    python benchmarks/grpc_stream.py --run build/wan-shapes/rtx4090-fp8 --requests 5 --steps 20 --scale 4 \\
        --out benchmarks/results/grpc_stream_cpu_wan-shapes.json

``--encode F,H,W`` times the MP4 part alone on a synthetic clip of that size (a moving noisy
gradient): seconds to the first and the last fragmented-MP4 piece (``fragmented_mp4``) vs the
whole file written by ``write_mp4`` (the HTTP path), each run ``--requests`` times.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from medians import finish

ROOT = Path(__file__).resolve().parents[1]


def _wait_line(proc, pattern: str, lines: list[str]) -> re.Match:
    for line in proc.stdout:
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    raise SystemExit(f"server exited before {pattern!r}:\n{''.join(lines)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=None)
    ap.add_argument("--encode", default=None, help="F,H,W: time the MP4 streaming alone on a synthetic clip")
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", default=None, help="F,H,W: num_frames, height, width of the clips")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.encode:
        return encode_only(args)

    import grpc

    from trt_sora.serve.proto import trt_sora_pb2 as pb2
    from trt_sora.serve.proto import trt_sora_pb2_grpc as pb2_grpc

    cmd = [sys.executable, "-m", "trt_sora", "serve", "--run", args.run, "--backend", args.backend, "--port", "0",
           "--grpc-port", "0", "--max-wait-ms", "0", "--drain-grace", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        http_port = int(_wait_line(proc, r"on http://127\.0\.0\.1:(\d+) ", lines).group(1))
        grpc_port = int(_wait_line(proc, r"over gRPC on 127\.0\.0\.1:(\d+)$", lines).group(1))
        ready = _wait_line(proc, r"^ready: .*", lines).group(0)
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        fields = {"steps": args.steps} if args.steps else {}
        if args.size:
            fields.update(zip(("num_frames", "height", "width"), (int(v) for v in args.size.split(","))))
        rows = []
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb2_grpc.TrtSoraStub(channel)
            for i in range(args.requests):
                prompt = f"a red circle moves right, clip {i}"
                t0, wall0 = time.perf_counter(), time.time()
                first = first_step = first_mp4 = None
                pieces, largest, size = 0, 0, 0
                for c in stub.Generate(pb2.GenerateRequest(prompt=prompt, seed=i, scale=args.scale, **fields)):
                    t = time.perf_counter() - t0
                    first = t if first is None else first
                    if c.WhichOneof("kind") == "progress" and c.progress.phase == pb2.Progress.DENOISING:
                        first_step = t if first_step is None else first_step
                    elif c.WhichOneof("kind") == "mp4":
                        first_mp4 = t if first_mp4 is None else first_mp4
                        pieces, largest, size = pieces + 1, max(largest, len(c.mp4.data)), size + len(c.mp4.data)
                total = time.perf_counter() - t0
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/jobs/{c.job_id}") as r:
                    job = json.loads(r.read())
                took = job["metadata"]["seconds"]
                decode_end = job["started"] + took["encode"] + took["sample"] + took["decode"] - wall0
                body = json.dumps({"prompt": prompt, "seed": i, **fields}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/generate?format=mp4&scale={args.scale}",
                                             data=body, headers={"Content-Type": "application/json"})
                t0 = time.perf_counter()
                with urllib.request.urlopen(req) as r:
                    http_bytes = len(r.read())
                http_total = time.perf_counter() - t0
                rows.append({"first_chunk_s": round(first, 4), "first_step_s": round(first_step, 4),
                             "first_mp4_s": round(first_mp4, 4), "total_s": round(total, 4), "pieces": pieces,
                             "decode_s": took["decode"],
                             "first_mp4_before_decode_end_s": round(decode_end - first_mp4, 4),
                             "largest_piece_bytes": largest, "mp4_bytes": size, "http_total_s": round(http_total, 4),
                             "http_mp4_bytes": http_bytes})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    keys = ("first_chunk_s", "first_step_s", "first_mp4_s", "total_s", "decode_s", "first_mp4_before_decode_end_s",
            "http_total_s")
    return finish({"run": args.run, "backend": args.backend, "ready": ready, "steps": args.steps, "scale": args.scale,
                   "size": args.size}, rows, keys, args.out)


def encode_only(args) -> int:
    import tempfile

    import numpy as np

    from trt_sora.runtime.video import write_mp4
    from trt_sora.serve.fmp4 import fragmented_mp4

    f, h, w = (int(v) for v in args.encode.split(","))
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, w, dtype=np.float32)[None, None, :, None]
    frames = np.stack([np.clip(np.roll(ramp, 8 * i, axis=2) + rng.normal(0, 8, (h, w, 3)), 0, 255)[0]
                       for i in range(f)]).astype(np.uint8)
    rows = []
    for _ in range(args.requests):
        t0 = time.perf_counter()
        times, sizes = [], []
        for piece in fragmented_mp4(frames, 16.0):
            times.append(time.perf_counter() - t0)
            sizes.append(len(piece.data))
        with tempfile.TemporaryDirectory() as d:
            t1 = time.perf_counter()
            write_mp4(frames, Path(d) / "clip.mp4", 16.0)
            file_s = time.perf_counter() - t1
        rows.append({"first_piece_s": round(times[0], 4), "first_fragment_s": round(times[1], 4),
                     "last_piece_s": round(times[-1], 4), "pieces": len(sizes), "largest_piece_bytes": max(sizes),
                     "mp4_bytes": sum(sizes), "write_mp4_s": round(file_s, 4)})
        print(json.dumps(rows[-1]), flush=True)
    return finish({"encode": [f, h, w]}, rows, ("first_piece_s", "first_fragment_s", "last_piece_s", "write_mp4_s"),
                  args.out)


if __name__ == "__main__":
    raise SystemExit(main())
