"""``trt-sora export --model M --recipe R --out DIR``."""
from __future__ import annotations

from trt_sora.cli.common import add_stage_args, overridden, stage_line, stage_recipe


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="PyTorch -> ONNX with named dynamic dims, verified in ONNX Runtime",
                       description="Export a model to DIR/model.onnx (+ .data) and DIR/manifest.json.")
    add_stage_args(p, model=True)
    p.add_argument("--external-data", choices=["auto", "always", "never"], default=None,
                   help="override export.external_data")
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime parity check (not advised)")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.export import export_onnx

    recipe = stage_recipe(args)
    cfg = overridden(recipe.export, external_data=args.external_data, verify=False if args.no_verify else None)
    with stage_line("export"):
        res = export_onnx(recipe.model.default if args.model is None else args.model, cfg, args.out)
    for p in res.parity:
        print(f"  ORT vs PyTorch at {p['point']}: cosine {p['cosine']:.8f}, max-abs {p['max_abs']:.2e}")
    print(res.onnx_path)
    return 0
