"""``trt-sora export-checkpoint --stats DIR/stats.safetensors --recipe R --out CDIR``: a ModelOpt-format checkpoint."""
from __future__ import annotations

from trt_sora.cli.common import add_stage_args, overridden, stage_line


def add_parser(sub) -> None:
    p = sub.add_parser("export-checkpoint",
                       help="write the calibrated model as a quantized diffusers checkpoint in NVIDIA ModelOpt's "
                            "format (for TensorRT-LLM VisualGen, vLLM-Omni, SGLang-Diffusion)",
                       description="Write CDIR/config.json (with quantization_config), CDIR/diffusion_pytorch_model*"
                                   ".safetensors and CDIR/manifest.json from the PyTorch weights and the calibration "
                                   "stats; the recipe's quantization section picks the format and the exclusions.")
    p.add_argument("--stats", required=True, help="stats.safetensors from `trt-sora calibrate`")
    add_stage_args(p, out_help="output folder (a diffusers component: the pipeline's transformer)")
    p.add_argument("--model", default=None, help="model name or checkpoint folder (default: the one the "
                   "calibration folder's manifest names)")
    p.add_argument("--format", choices=["fp8_e4m3", "int8"], default=None,
                   help="override quantization.format (fp8_e4m3 -> ModelOpt FP8, int8 -> W8A8_SQ_PER_CHANNEL)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="dtype of the unquantized tensors (default bf16)")
    p.add_argument("--max-shard-size", default="10GB", help="safetensors shard limit (default 10GB)")
    p.add_argument("--weights", default=None, help="GPTQ-rounded weights (weights.safetensors of a calibration with "
                   "calibration.weight_rounding: gptq; default: the calibration folder's, when it has one)")
    p.add_argument("--nearest-weights", action="store_true",
                   help="ignore GPTQ-rounded weights: round the original weights to nearest (as ModelOpt does)")
    p.add_argument("--verify-modelopt", action="store_true",
                   help="also run NVIDIA ModelOpt's own export with our amax and require identical checkpoints")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.checkpoint import export_checkpoint
    from trt_sora.config import load_recipe

    cfg = overridden(load_recipe(args.recipe).quantization, format=args.format)
    with stage_line("export-checkpoint"):
        res = export_checkpoint(args.stats, cfg, args.out, model=args.model, dtype=args.dtype,
                                max_shard_size=args.max_shard_size, verify=args.verify_modelopt,
                                weights=False if args.nearest_weights else args.weights)
    r = res.manifest["results"]
    print(f"  {r['counts']['quantized_linears']} linears {r['quant_algo']} ({r['weight_granularity']} weights rounded "
          f"{r['weight_rounding']}, static "
          f"input scales), {r['counts']['excluded_modules']} modules kept in {args.dtype}: ignore {r['ignore']}")
    if r.get("modelopt_match"):
        print(f"  identical to NVIDIA ModelOpt {r['modelopt_match']['modelopt']}'s export "
              f"({r['modelopt_match']['tensors']} tensors)")
    print(res.folder)
    return 0
