"""``trt-sora ls [ROOT]``: the run folders under ROOT with their gates, backends, target GPU and sizes."""
from __future__ import annotations

import json
from pathlib import Path

from trt_sora.runfolder import RunFolder


def add_parser(sub) -> None:
    p = sub.add_parser("ls", help="list artifacts (run folders): parity gates, backends, target GPU, sizes",
                       description="Find run folders (folders with export/manifest.json) under ROOT and show for "
                                   "each: model, recipe, the parity verdict and its failed levels, the backends it "
                                   "can serve on, the engine's target GPU, sizes, and the sampling it records.")
    p.add_argument("root", nargs="?", default="build", help="where to look (default build/)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _bytes(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def _experts(run: Path) -> list[str]:
    """The expert folders of a pair's run folder (``experts/experts.json``), else ``[]``."""
    return list(_json(RunFolder(run).experts_json).get("experts") or [])


def describe_run(run: Path) -> dict:
    """What one run folder holds, from its files (loads no model). A pair of experts (Wan 2.2 A14B) is
    one run: its experts' folders are summed, the parity report is the pair's."""
    from trt_sora.cli.common import run_recipe
    from trt_sora.errors import TrtSoraError

    experts = _experts(run)
    rf = RunFolder(run)
    parts = [rf.expert(e) for e in experts] or [rf]
    exp = _json(parts[0].manifest("export"))
    model = exp.get("results", {}).get("model", {})
    rep = _json(rf.parity_report)
    eng = _json(parts[0].manifest("engine")).get("results", {})
    plans = sorted(p for part in parts if part.engine.is_dir() for p in part.engine.glob("*.plan"))
    qdqs = [part.qdq_model for part in parts]
    qdq = qdqs[0]
    try:
        recipe, source = run_recipe(run)
        recipe_name, target = recipe.name, f"SM {recipe.compute_capability} ({recipe.backend.value})"
    except TrtSoraError:
        recipe_name, source, target = None, None, None
    gate = "unchecked" if not rep else ("passed" if rep.get("passed") else "FAILED " + ",".join(rep.get("failed", [])))
    backends = ["torch"] + (["ort (Q/DQ)" if qdq.is_file() else "ort"] if parts[0].onnx_model.is_file()
                            else [])
    if plans:
        backends.append(f"trt ({eng.get('backend', '?')}, SM{eng.get('sm', '?')})")
    if rep.get("backend") == "torch-fp8" and rep.get("passed"):
        backends.append("torch-fp8")
    onnx = [part.onnx_model for part in parts]
    return {
        "run": str(run), "model": model.get("ref"), "experts": experts, "recipe": recipe_name, "recipe_source": source,
        "parity": gate, "checked_backend": rep.get("backend"), "backends": backends,
        "target": f"SM{eng['sm']} ({eng.get('backend')})" if eng.get("sm") else target,
        "sampling": model.get("sampling"), "text_encoder": model.get("text_encoder"),
        "buckets": [b.get("name") for b in rep.get("buckets", [])],
        "bytes": {"export": _bytes(*onnx, *(o.with_name(o.name + ".data") for o in onnx)),
                  "quant": _bytes(*qdqs, *(q.with_name(q.name + ".data") for q in qdqs)), "engine": _bytes(*plans)},
    }


def find_runs(root: Path) -> list[Path]:
    """Folders with ``export/manifest.json``; an expert's folder counts as its pair's run folder."""
    runs = set()
    for rf in RunFolder.under(root):
        run = rf.path
        if any(part.startswith(".") for part in run.relative_to(root).parts):
            continue
        runs.add(run.parent if run.name in _experts(run.parent) else run)
    return sorted(runs)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n else "-"


def run(args) -> int:
    from trt_sora.errors import ConfigError

    root = Path(args.root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder; pass the artifact root (default build/)")
    runs = [describe_run(r) for r in find_runs(root)]
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no run folders under {root} (make one with `trt-sora engine --recipe R`)")
        return 0
    for r in runs:
        s = r["sampling"]
        samp = f"{s['num_steps']} steps, CFG {s['guidance_scale']:g}, shift {s['shift']:g}" if s else "not recorded"
        pair = f" (experts {', '.join(r['experts'])})" if r["experts"] else ""
        print(f"{r['run']}\n  model {r['model']}{pair}, recipe {r['recipe'] or '?'}; parity {r['parity']}"
              f"{' (' + r['checked_backend'] + ')' if r['checked_backend'] else ''}; target {r['target'] or '?'}\n"
              f"  backends: {', '.join(r['backends'])}; buckets: {', '.join(r['buckets']) or '?'}\n"
              f"  sizes: export {_mb(r['bytes']['export'])}, quant {_mb(r['bytes']['quant'])}, engine "
              f"{_mb(r['bytes']['engine'])}; sampling {samp}; text encoder {r['text_encoder'] or '?'}")
    return 0
