"""``trt-sora build --onnx QDIR/model.qdq.onnx --recipe R --out EDIR``."""
from __future__ import annotations

from trt_sora.cli.common import add_stage_args, stage_line, stage_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="(Q/DQ) ONNX -> TensorRT / TensorRT-RTX engine + build report",
                       description="Build engine(s) into OUT with build_report.json/.md and manifest.json; "
                                   "fails when the engine misses the recipe's build.requirements.")
    p.add_argument("--onnx", required=True, help="ONNX file (quant/model.qdq.onnx for fp8/int8 recipes)")
    add_stage_args(p, out_help="output folder (engine, report, manifest)")
    p.add_argument("--export-manifest", default=None,
                   help="export folder or manifest.json giving the exported dynamic ranges the buckets must "
                        "lie in (default: found beside the ONNX or in ../export)")
    p.add_argument("--model-name", default=None, help="engine file name prefix (default: the exported model)")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.build import build_engine

    recipe = stage_recipe(args)
    with stage_line("build"):
        res = build_engine(args.onnx, recipe, args.out, export_manifest=args.export_manifest,
                           model_name=args.model_name)
    a = res.report["analysis"]
    print(f"  GEMMs: {a['gemm_counts']} (fp8 fraction {a['fp8_gemm_fraction']:.3f}); attention fused: "
          f"{a['attention']['fused']} ({', '.join(a['attention']['precisions']) or '-'}); "
          f"profiles in engine: {res.report['profiles']['in_engine']}")
    for p in res.engine_paths:
        print(p)
    return 0
