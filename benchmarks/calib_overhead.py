"""Calibration observer overhead on the GPU: a plain transformer forward vs the same forward with every
calibration observer installed (minmax, EMA, percentile, MSE on every linear input and attention q/k/v).

    python benchmarks/calib_overhead.py --model wan2.1-t2v-1.3b --cfg split
    python benchmarks/calib_overhead.py --model wan2.1-t2v-14b --cfg batched --out bench_14b.json

480p x 81 frames (latent 21 x 60 x 104, text 512), bf16 weights on cuda:0, random-init weights
(same shapes and op counts as the release checkpoints). ``--cfg split``: one forward per CFG branch
(batch 1); ``--cfg batched``: both branches in one forward (batch 2, half the observer calls per
sample). Prints and writes: ms per forward (plain, observed), the ratio, forwards per second, and
the per-sample cost. Runs with the observers of whatever trt_sora is on PYTHONPATH, so the same
command on an older checkout measures "before" (that one only knows ``--cfg split``).
``--variants torch,r1,r4,cuda_c2,serial`` times the observed forward once per observer path in the same
process (``torch``: fp32 copy + abs + multiply + histc; ``r<k>``: the Triton pass with k bin replicas,
then histc; ``cuda_c<k>``: the NVRTC counting kernel with k sub-histograms per block, the shipped path
(trt_sora.kernels.cuda_hist); ``serial``: the observers on the forward's own stream instead of a side
stream). ``--profile``: GPU time by kernel
of one plain and one observed forward per variant.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _time(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def _select(histogram, variant: str, replicas: int, kernel, counting) -> None:
    """Point the histogram at one observer path: ``torch``, ``r<k>`` (Triton + histc, k replicas),
    ``cuda_c<copies>`` (the NVRTC kernel), anything else the shipped one."""
    histogram._gpu_abs_scaled = (lambda: None) if variant == "torch" else kernel
    histogram.REPLICAS = int(variant[1:]) if variant.startswith("r") else replicas
    if variant == "torch" or variant.startswith("r"):
        histogram.CUDA_COPIES = None
    elif variant.startswith("cuda_c"):
        histogram.CUDA_COPIES = int(variant[len("cuda_c"):])
    else:
        histogram.CUDA_COPIES = counting


def main() -> None:
    from trt_sora.calibrate.hooks import CollectionHooks
    from trt_sora.calibrate.run import ALL_METHODS, observer_kwargs
    from trt_sora.config.recipe import CalibConfig
    from trt_sora.models import get_adapter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--cfg", choices=("split", "batched"), default="split")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames)")
    ap.add_argument("--height", type=int, default=60)
    ap.add_argument("--width", type=int, default=104)
    ap.add_argument("--variants", default="shipped",
                    help="comma list of observer paths to time: torch (fp32 copy + histc), r<k> (the Triton pass "
                         "with k bin replicas), cuda_c<k> (the NVRTC kernel), serial (observers on the forward's own "
                         "stream), shipped; the last one is the headline")
    ap.add_argument("--profile", action="store_true",
                    help="also a profiler split (top kernels by GPU time) of one plain and one observed forward")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from trt_sora.calibrate import histogram

    shipped, kernel, counting = histogram.REPLICAS, histogram._gpu_abs_scaled, histogram.CUDA_COPIES

    adapter = get_adapter(args.model)
    model = adapter.load("bf16", "cuda")
    batch = 2 if args.cfg == "batched" else 1
    point = {"batch": batch, "latent_frames": args.frames, "latent_height": args.height,
             "latent_width": args.width, "text_len": 512}
    inputs = adapter.example_inputs(point, dtype="bf16", device="cuda")
    branch = "cond+uncond" if batch == 2 else "cond"

    @torch.inference_mode()
    def plain():
        adapter.forward(model, inputs)

    plain()  # warm-up (kernels, allocator)
    t_plain = _time(plain, args.reps)
    okw = observer_kwargs(CalibConfig(), "fp8_e4m3")
    variants = {}
    if args.profile:
        from benchmarks.fp8_bench import profile_split
    profiles = {"plain": profile_split(plain)} if args.profile else {}
    for v in args.variants.split(","):
        _select(histogram, v, shipped, kernel, counting)
        with CollectionHooks(model, methods=ALL_METHODS, branches=("cond", "uncond"), observer_kwargs=okw,
                             overlap=v != "serial") as hooks:
            step = [0]

            @torch.inference_mode()
            def observed():
                with hooks.at(step=step[0] % 50, branch=branch):
                    adapter.forward(model, inputs)
                step[0] += 1

            observed()
            t_obs = _time(observed, args.reps)
            n_sites = len(hooks.sites)
            if args.profile:
                profiles[v] = profile_split(observed)
        variants[v] = {"observed_ms": round(t_obs * 1e3, 1), "overhead_ratio": round(t_obs / t_plain, 3),
                       "observed_forwards_per_s": round(1.0 / t_obs, 3),
                       "observed_ms_per_sample_and_branch": round(t_obs * 1e3 / batch, 1)}
        print(v, variants[v], flush=True)
    histogram._gpu_abs_scaled, histogram.REPLICAS, histogram.CUDA_COPIES = kernel, shipped, counting
    res = {"model": args.model, "cfg": args.cfg, "batch": batch, "point": point, "sites": n_sites,
           "plain_ms": round(t_plain * 1e3, 1), **variants[args.variants.split(",")[-1]], "variants": variants,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           **({"profiles": profiles} if args.profile else {})}
    print(json.dumps(res, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
