"""``trt-sora batch --run DIR --prompts prompts.jsonl --out DIR``: resumable batch generation."""
from __future__ import annotations

import sys

from trt_sora.cli.common import add_cfg_arg, add_runtime_args


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="a JSONL file of jobs -> clips + manifest + summary (resumable)",
                       description="Generate one clip per line of a JSONL file (prompt, seed, steps, guidance, "
                                   "shift, negative_prompt, num_frames, height, width, image, id; image: the "
                                   "conditioning image's path of an image-to-video model, relative to the jobs "
                                   "file's folder). Rerun the same command "
                                   "after a crash or kill: finished clips are skipped, partial ones redone. Exit 1 "
                                   "when a job failed or a clip failed its quality gate.")
    add_runtime_args(p)
    p.add_argument("--prompts", required=True, help="jobs file: one JSON object per line")
    p.add_argument("--out", required=True, help="output folder (clips/, manifest.json, summary.json, summary.md), or "
                   "s3://bucket/prefix (the same layout; endpoint, credentials and region from AWS_ENDPOINT_URL, "
                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_DEFAULT_REGION; "
                   "pip install 'trt_sora[s3]')")
    p.add_argument("--formats", default="mp4", help="comma-separated: mp4, gif, png (contact sheet), npy (default mp4)")
    p.add_argument("--scale", type=int, default=1, help="pixel-repeat upscaling of mp4/gif/png")
    p.add_argument("--retries", type=int, default=2, help="extra attempts for transient errors (default 2)")
    p.add_argument("--retry-wait", type=float, default=1.0, help="first backoff in seconds (doubles)")
    p.add_argument("--max-batch", type=int, default=None, help="at most N clips per transformer call group")
    add_cfg_arg(p)
    g = p.add_argument_group("quality gate (each clip made again by a reference backend and compared; any of these "
                             "options turns it on; a clip under a bar is a failed job and the command exits 1)")
    g.add_argument("--gate-against", default=None, choices=["torch", "ort"],
                   help="reference backend (torch: the PyTorch model, the default; ort: the unquantized ONNX export)")
    g.add_argument("--psnr-threshold", "--min-psnr", dest="min_psnr", type=float, default=None, metavar="DB",
                   help="worst-frame PSNR bar in dB (default: the run folder's parity.frames gate, else 25)")
    g.add_argument("--vmaf-threshold", type=float, default=None, metavar="SCORE",
                   help="mean VMAF bar, 0-100 (ffmpeg's libvmaf, default model; needs an ffmpeg with libvmaf)")
    g.add_argument("--min-ssim", type=float, default=None, help="mean SSIM bar (default: reported only)")
    g.add_argument("--vmaf", action="store_true", help="also report VMAF without gating on it (needs libvmaf)")
    r = p.add_argument_group("Ray (spread the jobs over a cluster's workers; pip install 'trt_sora[ray]')")
    r.add_argument("--ray", action="store_true", help="run the clip groups on Ray workers")
    r.add_argument("--ray-address", default=None, help="cluster address (default: start a local Ray)")
    r.add_argument("--workers", type=int, default=None, help="Ray workers (default: the cluster's GPUs, else 1 CPU "
                   "worker)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.serve.batch import BatchConfig, GateConfig, is_remote, open_output, read_jobs, run_batch
    from trt_sora.serve.quality import require_vmaf

    gated = args.gate_against or args.vmaf or any(v is not None for v in (args.min_psnr, args.min_ssim,
                                                                          args.vmaf_threshold))
    gate = GateConfig(reference=args.gate_against or "torch", min_psnr_db=args.min_psnr, min_ssim=args.min_ssim,
                      vmaf=args.vmaf, min_vmaf=args.vmaf_threshold) if gated else None
    config = BatchConfig(formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()), scale=args.scale,
                         retries=args.retries, retry_wait=args.retry_wait, max_batch=args.max_batch, cfg=args.cfg,
                         gate=gate)
    jobs = read_jobs(args.prompts)  # a bad jobs file fails before anything loads
    if gate and gate.wants_vmaf:  # so does an ffmpeg without libvmaf
        require_vmaf("--vmaf-threshold" if gate.min_vmaf is not None else "--vmaf")
    # and so do object storage's s3fs, credentials and bucket (a local folder is made when the batch starts)
    out = open_output(args.out) if is_remote(args.out) else args.out
    kwargs = {}
    if args.ray:
        from trt_sora.serve.ray_fleet import RayExecutor

        executor = RayExecutor(args.run, backend=args.backend, workers=args.workers, address=args.ray_address,
                               force=args.force, reference=gate.reference if gate else None, cfg=config.cfg,
                               text_encoder=args.text_encoder, threads=args.threads)
        runner, ref = None, None
        kwargs["executor"] = executor
    else:
        import trt_sora.runtime as rt
        from trt_sora.cli.generate import load_runner

        runner = load_runner(args)
        ref = rt.load(args.run, backend=gate.reference, force=args.force, device=args.device) if gate else None
    bar = _progress_bar(len(jobs), args.no_progress)
    try:
        summary = run_batch(runner, args.prompts, out, config, reference_runner=ref,
                            progress=bar.update if bar else None, text_encoder=args.text_encoder, **kwargs)
    finally:
        if bar:
            bar.close()
        if args.ray:
            kwargs["executor"].close()
    d = summary.data
    print(f"{d['finished']}/{d['total']} clips in {args.out} ({d['generated']} generated now, {d['skipped']} "
          f"finished earlier), {d['failed']} failed, {d['gate_failed']} below the gate, {d['retries']} retried; "
          f"{args.out}/summary.md")
    for f in d["failures"]:
        print(f"  failed {f['id']} (line {f['line']}): {f['error']}", file=sys.stderr)
    for f in d["gate_failures"]:
        vmaf = "-" if f["vmaf"] is None else f"{f['vmaf']:.2f}"
        print(f"  below the gate {f['id']} ({', '.join(f['below'] or [])}): worst-frame PSNR "
              f"{f['worst_psnr_db']:.2f} dB, mean SSIM {f['mean_ssim']:.4f}, VMAF {vmaf}", file=sys.stderr)
    return 0 if summary.ok else 1


class _Bar:
    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="clip", file=sys.stderr, dynamic_ncols=True)

    def update(self, state: dict) -> None:
        self.bar.n = state["done"] + state["failed"]
        self.bar.set_postfix(failed=state["failed"], skipped=state["skipped"], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _progress_bar(total: int, off: bool):
    if off:
        return None
    try:
        return _Bar(total)
    except ImportError:  # tqdm is an export-extra dependency; without it, no bar
        return None
