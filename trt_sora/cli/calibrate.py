"""``trt-sora calibrate --model M --recipe R --method {minmax,ema,percentile,mse} --out DIR``."""
from __future__ import annotations

METHODS = ("minmax", "ema", "percentile", "mse")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="collect FP8/INT8 activation ranges over real denoising trajectories",
                       description="Calibrate a model: DIR/stats.safetensors, DIR/report.md (+ figures/), "
                                   "DIR/manifest.json.")
    p.add_argument("--model", default=None, help="registry name (see `trt-sora info`) or a diffusers checkpoint "
                   "folder; default: the recipe's model.default")
    p.add_argument("--recipe", required=True, help="recipe name (recipes/*.yaml) or path")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="observer whose amax goes into the stats (default: the recipe's calibration.method); "
                        "all four are collected and compared in the report")
    p.add_argument("--out", required=True, help="output folder")
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
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from trt_sora.calibrate.run import ReportOptions, calibrate
    from trt_sora.config import load_recipe
    from trt_sora.config.recipe import CalibMethod
    from trt_sora.manifest import check_out_dir
    from trt_sora.models import get_adapter

    check_out_dir(args.out)  # fail before the work, not after it

    recipe = load_recipe(args.recipe)
    cfg = recipe.calibration
    if args.method:
        cfg = dataclasses.replace(cfg, method=CalibMethod(args.method))
    adapter = get_adapter(recipe.model.default if args.model is None else args.model)
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

    try:
        res = calibrate(adapter, cfg, args.out, preset=preset, quant_format=fmt,
                        text_encoder=args.text_embeddings, device=args.device, progress=progress,
                        report=not args.no_report, quant_config=recipe.quantization,
                        report_options=ReportOptions(eval_prompts=args.eval_prompts, sensitivity=args.sensitivity),
                        dtype=args.dtype or recipe.model.dtype.value)
    finally:
        for bar in bars.values():
            bar.close()
    ev = res.evaluation
    if ev:
        for row in ev["comparison"]:
            print(f"  {row['method']:>10} {row['format']:>8}: cosine {row['cosine']:.6f}, PSNR {row['psnr_db']:.2f} dB")
        if ev["skip"]["patterns"]:
            print("  suggested quantization.exclude: " + ", ".join(ev["skip"]["patterns"]))
    print(res.stats_path)
    if res.report_path:
        print(res.report_path)
    return 0
