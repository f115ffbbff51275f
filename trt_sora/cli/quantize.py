"""``trt-sora quantize --onnx DIR/model.onnx --stats DIR/stats.safetensors --recipe R --out QDIR``."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="insert calibrated FP8/INT8 Q/DQ into an exported ONNX graph",
                       description="Write QDIR/model.qdq.onnx (+ .data), QDIR/qdq_map.json and QDIR/manifest.json.")
    p.add_argument("--onnx", required=True, help="model.onnx from `trt-sora export`")
    p.add_argument("--stats", default=None, help="stats.safetensors from `trt-sora calibrate` "
                   "(not needed with quantization.format: none)")
    p.add_argument("--weights", default=None, help="weights.safetensors from `trt-sora calibrate` with "
                   "calibration.weight_rounding: gptq (the rounded weights replace the graph's)")
    p.add_argument("--recipe", required=True, help="recipe name (recipes/*.yaml) or path")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--format", choices=["fp8_e4m3", "int8", "none"], default=None,
                   help="override quantization.format")
    p.add_argument("--graph-dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="override quantization.graph_dtype (fp32: for ONNX Runtime parity on CPU)")
    p.add_argument("--no-fused-qkv", action="store_true", help="keep Q, K, V as three GEMMs")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from trt_sora.cli.common import stage_line
    from trt_sora.config import load_recipe
    from trt_sora.config.recipe import DType, QuantFormat
    from trt_sora.manifest import check_out_dir
    from trt_sora.quantize import quantize_onnx

    check_out_dir(args.out)  # fail before the work, not after it

    recipe = load_recipe(args.recipe)
    cfg = recipe.quantization
    if args.format:
        cfg = dataclasses.replace(cfg, format=QuantFormat(args.format))
    if args.graph_dtype:
        cfg = dataclasses.replace(cfg, graph_dtype=DType(args.graph_dtype))
    if args.no_fused_qkv:
        cfg = dataclasses.replace(cfg, fused_qkv=False)
    with stage_line("quantize"):
        res = quantize_onnx(args.onnx, args.stats, cfg, args.out, weights=args.weights)
    c = res.counts
    print(f"  {c['quantized_linears']}/{c['graph_linears']} GEMMs {cfg.format.value} "
          f"({c['fused_groups']} fused QKV/KV groups, {c['activation_quantizers']} activation quantizers), "
          f"graph {cfg.graph_dtype.value}")
    print(res.onnx_path)
    return 0
