"""``trt-sora engine --recipe R [--model M] --out build``: every stage, reusing unchanged ones."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("engine", help="export -> calibrate -> quantize -> build -> check (what `make engine` runs)")
    p.add_argument("--recipe", required=True, help="recipe name (recipes/*.yaml) or path")
    p.add_argument("--model", default=None, help="registry name or diffusers checkpoint folder "
                   "(default: the recipe's model.default)")
    p.add_argument("--out", default="build", help="artifact root; the run lands in OUT/<model>/<recipe>/")
    p.add_argument("--force", action="store_true", help="redo every stage even if its inputs did not change")
    p.add_argument("--stages", default=None, help="comma-separated subset, e.g. export,calibrate")
    p.add_argument("--dry-run", action="store_true", help="say which stages would be reused or rerun, and why "
                   "(re-hashes the artifacts), without running anything")
    p.add_argument("--calib-shards", type=int, default=1, metavar="N",
                   help="calibrate as N shards one after another and merge them (exact: the same stats as one pass)")
    p.set_defaults(func=run)


def run(args) -> int:
    from trt_sora.errors import ArtifactError
    from trt_sora.pipeline import STAGES, EnginePipeline

    def progress(o):
        secs = f" in {o.seconds:.1f} s" if o.status == "ran" else ""
        print(f"[{o.stage:9s}] {o.status}{secs}  {o.detail}", file=sys.stderr, flush=True)

    def on_wait(msg):
        print(f"[engine   ] {msg}", file=sys.stderr, flush=True)

    if not args.out.strip():
        raise ArtifactError("--out '' is not an output folder; pass the artifact root (default: build)")
    pipe = EnginePipeline(args.recipe, args.model, args.out, force=args.force, progress=progress, on_wait=on_wait,
                          calib_shards=args.calib_shards)
    print(f"[engine   ] model {pipe.adapter.name}, recipe {pipe.recipe.name} "
          f"({pipe.recipe.backend.value}, SM {pipe.recipe.compute_capability}), buckets from "
          f"{pipe.bucket_source}: {', '.join(b.name for b in pipe.buckets)} -> {pipe.run_dir}",
          file=sys.stderr, flush=True)
    stages = tuple(s.strip() for s in args.stages.split(",")) if args.stages else STAGES
    if args.dry_run:
        for p in pipe.plan(stages):
            print(f"[{p.stage:9s}] would {p.action}: {p.reason}")
        return 0
    pipe.run(stages)
    print(pipe.run_dir)
    return 0
