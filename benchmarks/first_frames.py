"""Seconds to a clip's first decoded frames vs the whole clip, in process (``generate(on_frames=)``).

The run folder is loaded on ``--backend``; ``--requests`` clips are generated one after another
(after one warm-up clip) with an ``on_frames`` callback that notes when each group of frames comes.
Reported per clip: seconds from the call to the first group and to the end, the generator's decode
seconds and the groups' frame counts; medians in ``summary``. Run it from an older checkout
(``PYTHONPATH`` at it) for the before-and-after of a decoder change.

    python benchmarks/first_frames.py --run RUN --size 13,128,128 --requests 5 --threads 1 --out results/x.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from medians import finish


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--size", default=None, help="F,H,W: num_frames, height, width (default: the model's)")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    import trt_sora.runtime as rt

    if args.threads:
        torch.set_num_threads(args.threads)
    runner = rt.load(args.run, backend=args.backend)
    size = dict(zip(("num_frames", "height", "width"), (int(v) for v in args.size.split(",")))) if args.size else {}
    rows = []
    for i in range(args.requests + 1):
        marks: list[tuple[float, int]] = []
        t0 = time.perf_counter()
        (clip,) = rt.generate(runner, "a red circle moving right", seed=i, **size,
                              on_frames=lambda _j, f: marks.append((time.perf_counter() - t0, int(f.shape[0]))))
        total = time.perf_counter() - t0
        if i:  # the first clip warms up
            rows.append({"first_frames_s": round(marks[0][0], 4), "total_s": round(total, 4),
                         "decode_s": clip.metadata["seconds"]["decode"], "groups": [n for _, n in marks]})
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(rt.__file__).parent).stdout.strip()
    return finish({"run": args.run, "backend": args.backend, "size": args.size, "threads": args.threads,
                   "commit": commit}, rows, ("first_frames_s", "total_s", "decode_s"), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
