"""``trt-sora calibrate --model M --recipe R --method {minmax,ema,percentile,mse} --out DIR``.

Shards: ``--shard i/n`` (one slice, no report), ``--from-shards DIR...`` (exact merge + report),
``--workers N`` (every shard in its own torchrun process, e.g. one per GPU; merged by rank 0).
A pair of experts (Wan 2.2 A14B) calibrates both over the same trajectories into ``OUT/high`` and
``OUT/low``; its shard folders hold one folder per expert, and ``--from-shards`` takes those folders.
"""
from __future__ import annotations

from trt_sora.cli.common import add_stage_args, overridden

METHODS = ("minmax", "ema", "percentile", "mse")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="collect FP8/INT8 activation ranges over real denoising trajectories",
                       description="Calibrate a model: DIR/stats.safetensors, DIR/report.md (+ figures/), "
                                   "DIR/manifest.json.")
    add_stage_args(p, model=True)
    p.add_argument("--method", choices=METHODS, default=None,
                   help="observer whose amax goes into the stats (default: the recipe's calibration.method); "
                        "all four are collected and compared in the report")
    p.add_argument("--preset", default=None, help="calibration preset name (calib/presets) or YAML path; default: "
                   "the model's own preset, else the recipe's calibration.preset")
    p.add_argument("--text-embeddings", default=None, metavar="FILE",
                   help="precomputed prompt embeddings (.safetensors, see trt_sora.models.text.save_embeddings) "
                        "or a pipeline folder with text_encoder/ + tokenizer/")
    p.add_argument("--device", default="cpu", help="torch device for the forwards (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="model load dtype (default: the recipe's model.dtype)")
    p.add_argument("--eval-prompts", type=int, default=2, help="held-out prompts of the report's comparison")
    p.add_argument("--sensitivity", choices=("kind", "block", "both", "none"), default="both",
                   help="layer groups of the report's sensitivity ranking")
    p.add_argument("--no-report", action="store_true", help="stats only: skip the PyTorch evaluation and report")
    p.add_argument("--cfg", choices=("split", "batched"), default="split",
                   help="CFG branches as two forwards (split) or one forward at twice the batch (batched: half the "
                        "forwards and observer calls; the EMA observer then sees one batch per step)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="calibrate slice I of N of the trajectories only (0-based); merge with --from-shards")
    p.add_argument("--from-shards", nargs="+", default=None, metavar="DIR",
                   help="merge these shard folders exactly (all N of one calibration) instead of calibrating")
    p.add_argument("--workers", type=int, default=1,
                   help="run N shards in parallel under torchrun (with --device cuda: one per GPU, cuda:LOCAL_RANK) "
                        "into OUT.shards/, then merge into OUT; rerunning skips the shards already done")
    p.add_argument("--peer", choices=("modelopt",), default=None,
                   help="add a peer comparison to the report: NVIDIA ModelOpt's FP8 recipe calibrated on the same "
                        "trajectories, sampled with ours at the model's default step count (needs nvidia-modelopt)")
    p.add_argument("--peer-prompts", type=int, default=2, help="held-out prompts of the peer comparison")
    p.add_argument("--peer-steps", type=int, default=None,
                   help="sampling steps of the peer comparison (default: the model's default)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    import subprocess
    import sys

    from trt_sora.calibrate import launch
    from trt_sora.calibrate.shards import parse_shard

    if args.workers > 1 and not launch.in_worker():
        argv = sys.argv[1:]
        os.makedirs(args.out, exist_ok=True)
        return subprocess.call(launch.torchrun_command(argv, args.workers))

    from pathlib import Path

    from trt_sora.calibrate.run import ReportOptions, calibrate, calibrate_experts
    from trt_sora.config import load_recipe
    from trt_sora.manifest import check_out_dir
    from trt_sora.models import get_adapter

    recipe = load_recipe(args.recipe)
    cfg = overridden(recipe.calibration, method=args.method)
    adapter = get_adapter(recipe.model.default if args.model is None else args.model)
    for e in adapter.experts or (None,):  # fail before the work, not after it (a pair: OUT/<expert> each)
        check_out_dir(Path(args.out) / e if e else args.out)
    preset = args.preset or adapter.spec.defaults.get("calib_preset") or cfg.preset
    fmt = recipe.quantization.format
    bars: dict = {}

    def progress(phase: str, done: int, total: int) -> None:
        from tqdm import tqdm

        bar = bars.get(phase)
        if bar is None:
            bar = bars[phase] = tqdm(total=total, desc=phase, unit="fwd", leave=True)
        bar.total = total
        bar.n = done
        bar.refresh()

    def go(out, device, shard=None, from_shards=None):
        """One calibration into ``out``; a pair of experts (Wan 2.2 A14B) writes ``out/<expert>/`` for each
        expert, and its shard folders hold one such folder per expert."""
        kw = dict(preset=preset, quant_format=fmt, text_encoder=args.text_embeddings, device=device,
                  progress=progress, report=not args.no_report, quant_config=recipe.quantization, cfg=args.cfg,
                  report_options=ReportOptions(eval_prompts=args.eval_prompts, sensitivity=args.sensitivity,
                                               peer=args.peer, peer_prompts=args.peer_prompts,
                                               peer_steps=args.peer_steps),
                  dtype=args.dtype or recipe.model.dtype.value, shard=shard)
        if not adapter.experts:
            return {None: calibrate(adapter, cfg, out, from_shards=from_shards, sparse=recipe.sparse_attention, **kw)}
        shards = {e: [Path(d) / e for d in from_shards] for e in adapter.experts} if from_shards else None
        return calibrate_experts(adapter, cfg, {e: Path(out) / e for e in adapter.experts}, from_shards=shards, **kw)

    try:
        if args.workers > 1:  # inside a torchrun worker
            from trt_sora.calibrate.data import load_preset
            from trt_sora.config.base import to_dict

            def expect_of(a):
                return {"config": {"calibration": to_dict(cfg), "quant_format": fmt.value,
                                   "quantization": to_dict(recipe.quantization)},
                        "model_hash": a.spec.model_hash(), "preset": load_preset(preset).to_dict()}

            def expect(sh):  # a pair's shard folder holds one finished folder per expert
                if adapter.experts:
                    return {"experts": {e: {**expect_of(adapter.expert(e)), "shard": list(sh)}
                                        for e in adapter.experts}}
                return {**expect_of(adapter), "shard": list(sh)}

            launch.run_worker(args.out, args.device,
                              run_shard=lambda sh, folder, dev: go(folder, dev, shard=sh),
                              merge=lambda folders, dev: go(args.out, dev, from_shards=folders), expect=expect)
            return 0
        results = go(args.out, args.device, shard=parse_shard(args.shard) if args.shard else None,
                     from_shards=args.from_shards)
    finally:
        for bar in bars.values():
            bar.close()
    for res in results.values():
        _print(res)
    return 0


def _print(res) -> None:
    ev = res.evaluation
    if ev:
        for row in ev["comparison"]:
            print(f"  {row['method']:>10} {row['format']:>8}: cosine {row['cosine']:.6f}, PSNR {row['psnr_db']:.2f} dB")
        for row in (ev.get("peer") or {}).get("rows", []):
            print(f"  peer {row['name']:>26}: cosine {row['cosine']:.6f}, PSNR {row['psnr_db']:.2f} dB, "
                  f"calibration {row['calib_seconds']:.1f} s")
        if ev["skip"]["patterns"]:
            print("  suggested quantization.exclude: " + ", ".join(ev["skip"]["patterns"]))
    print(f"  weight rounding: {res.manifest['results']['weight_rounding']['note']}")
    print(res.stats_path)
    if res.report_path:
        print(res.report_path)
