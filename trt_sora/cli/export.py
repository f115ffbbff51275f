"""``trt-sora export --model M --recipe R --out DIR``."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="PyTorch -> ONNX with named dynamic dims, verified in ONNX Runtime",
                       description="Export a model to DIR/model.onnx (+ .data) and DIR/manifest.json.")
    p.add_argument("--model", default=None, help="registry name (see `trt-sora info`) or a diffusers "
                   "checkpoint folder; default: the recipe's model.default")
    p.add_argument("--recipe", required=True, help="recipe name (recipes/*.yaml) or path")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--external-data", choices=["auto", "always", "never"], default=None,
                   help="override export.external_data")
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime parity check (not advised)")
    p.set_defaults(func=run)


def run(args) -> int:
    import dataclasses

    from trt_sora.cli.common import stage_line
    from trt_sora.config import ExternalData, load_recipe
    from trt_sora.export import export_onnx
    from trt_sora.manifest import check_out_dir

    check_out_dir(args.out)  # fail before the work, not after it

    recipe = load_recipe(args.recipe)
    cfg = recipe.export
    if args.external_data:
        cfg = dataclasses.replace(cfg, external_data=ExternalData(args.external_data))
    if args.no_verify:
        cfg = dataclasses.replace(cfg, verify=False)
    with stage_line("export"):
        res = export_onnx(recipe.model.default if args.model is None else args.model, cfg, args.out)
    for p in res.parity:
        print(f"  ORT vs PyTorch at {p['point']}: cosine {p['cosine']:.8f}, max-abs {p['max_abs']:.2e}")
    print(res.onnx_path)
    return 0
