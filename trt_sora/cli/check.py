"""``trt-sora check --run DIR --recipe R``: the parity matrix; exit 1 when a gate fails."""
from __future__ import annotations

from trt_sora.runners.registry import BACKENDS


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="parity matrix (export / Q/DQ / quality; call, loop, frames) with gates",
                       description="Compare every stage of a run folder against PyTorch and write "
                                   "DIR/parity/report.json + report.md. Exit 1 when a gate fails.")
    p.add_argument("--run", required=True, help="run folder build/<model>/<recipe>/ (holds export/, quant/, ...)")
    p.add_argument("--recipe", default=None, help="recipe name (recipes/*.yaml) or path; gates from its parity: "
                   "(default: the recipe recorded in the run folder)")
    p.add_argument("--model", default=None, help="override the model (default: the export manifest's)")
    p.add_argument("--backend", choices=[n for n, b in BACKENDS.items() if b.checked_as == n], default="ort",
                   help="candidate backend (default ort; torch-fp8: FP8 tensor-core GEMMs + Triton kernels on a GPU)")
    p.add_argument("--device", default=None, help="the candidate's device (torch-fp8: default cuda; trt: cuda:N; "
                   "ort: cpu or cuda[:N], default CUDA when onnxruntime-gpu has it)")
    p.add_argument("--text-embeddings", default=None, metavar="FILE",
                   help="precomputed embeddings of the model's held-out prompts (.safetensors, see "
                        "trt_sora.models.text.save_embeddings) for a machine without the text encoder")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from trt_sora.cli.common import run_recipe, stage_line
    from trt_sora.parity import check_artifacts

    recipe, source = run_recipe(args.run, args.recipe)
    if not args.recipe:
        print(f"[check] recipe {recipe.name} from {source}", file=sys.stderr)
    with stage_line("check"):
        rep = check_artifacts(args.run, recipe, model=args.model, backend=args.backend, device=args.device,
                              text_encoder=args.text_embeddings)
    for c in rep["comparisons"]:
        shown = ", ".join(f"{ch['metric']} {ch['value']:.6g} ({ch['op']} {ch['threshold']})" for ch in c["checks"])
        print(f"  {c['level']:8s} {'ok  ' if c['passed'] else 'FAIL'} {shown}")
    for level, loc in rep["localization"].items():
        if level in rep["failed"]:
            print(f"  {level}: error first jumps at {loc['first_jump']} ({loc['block']})")
    ran = rep["candidate"].get("device") or {}
    where = ran.get("gpu") or ran.get("device") or "?"
    sm = f" (SM {ran['sm']})" if ran.get("sm") else ""
    if "fp8_gemms_per_call" in ran:
        print(f"  executed on {where}{sm}: {ran['fp8_gemms_per_call']} FP8 GEMMs, "
              f"{ran['fp8_attention_layers']} 8-bit attention layers per call, {ran['cuda_graphs']} CUDA graph(s)"
              + (("; masked attention keys: " + ("8-bit attention over the valid keys"
                                                    if ran["fp8_attention_layers"] else "attention in BF16"))
                 if ran.get("attention_keys_padded") else ""))
    else:
        print(f"  candidate {rep['candidate']['backend']} executed on {where}{sm}")
    print(f"{'PASSED' if rep['passed'] else 'FAILED'}: {args.run}/parity/report.md")
    return 0 if rep["passed"] else 1
