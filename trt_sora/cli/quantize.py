"""``trt-sora quantize --onnx DIR/model.onnx --stats DIR/stats.safetensors --recipe R --out QDIR``."""
from __future__ import annotations

from trt_sora.cli.common import add_stage_args, overridden, stage_line, stage_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="insert calibrated FP8/INT8 Q/DQ into an exported ONNX graph",
                       description="Write QDIR/model.qdq.onnx (+ .data), QDIR/qdq_map.json and QDIR/manifest.json.")
    p.add_argument("--onnx", required=True, help="model.onnx from `trt-sora export`")
    p.add_argument("--stats", default=None, help="stats.safetensors from `trt-sora calibrate` "
                   "(not needed with quantization.format: none)")
    p.add_argument("--weights", default=None, help="weights.safetensors from `trt-sora calibrate` with "
                   "calibration.weight_rounding: gptq (the rounded weights replace the graph's)")
    add_stage_args(p)
    p.add_argument("--format", choices=["fp8_e4m3", "int8", "none"], default=None,
                   help="override quantization.format")
    p.add_argument("--graph-dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="override quantization.graph_dtype (fp32: for ONNX Runtime parity on CPU)")
    p.add_argument("--no-fused-qkv", action="store_true", help="keep Q, K, V as three GEMMs")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.quantize import quantize_onnx

    recipe = stage_recipe(args)
    cfg = overridden(recipe.quantization, format=args.format, graph_dtype=args.graph_dtype,
                     fused_qkv=False if args.no_fused_qkv else None)
    with stage_line("quantize"):
        res = quantize_onnx(args.onnx, args.stats, cfg, args.out, weights=args.weights)
    c = res.counts
    print(f"  {c['quantized_linears']}/{c['graph_linears']} GEMMs {cfg.format.value} "
          f"({c['fused_groups']} fused QKV/KV groups, {c['activation_quantizers']} activation quantizers), "
          f"graph {cfg.graph_dtype.value}")
    print(res.onnx_path)
    return 0
