"""A run folder for `trt-sora check` with step caching at a chosen step count, and a clip's timings.

``prepare`` copies a run folder's export stage into ``--work``/run (unless it is there or ``--run`` has none:
then export into it) and writes a recipe
(``--base`` with a ``caching:`` section, ``calibration.num_steps`` and ``parity.loop_steps`` at ``--steps``)
into ``--work``/recipe.yaml and the run's recipe.yaml; the calibrate stage reads no caching setting, so a
run calibrated once takes the setting a curve picks later. The caching setting is the one of a
``caching_bench.py`` curve (``--curve``, same model and step count) that saved the most calls (at least
one) with its gate passed (ties: the better worst clip; its ``cfg_reuse`` / ``cfg_order`` too; a curve of
``--plan``'s ``caching.plan``), with the
curve's other thresholds at the same ``max_skips``, warm-up and CFG reuse as the check's sweep;
``--setting`` when no curve row passed. The calibrate and quantize stages then run into that run folder
(on the GPU: ``calibrate --device cuda``), and check gates the cached clip. ``show`` prints what a clip's
metadata (``trt-sora generate -o X`` writes ``X.json``) says of its stages' seconds and its caching.
``bash benchmarks/h200.sh ccalib cache50 checkcache gen``::

    python benchmarks/cache_check.py prepare --run build/wan-shapes/rtx4090-fp8 --work /tmp/cc --steps 50 --fresh
    (calibrate and quantize into /tmp/cc/run; caching_bench.py --ratios /tmp/cc/run/calib/step_ratios.safetensors)
    python benchmarks/cache_check.py prepare --run build/wan-shapes/rtx4090-fp8 --work /tmp/cc --steps 50 \\
        --curve cache50.json
    python benchmarks/cache_check.py show clip.mp4.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


#: A curve row's keys that name its caching setting (caching_bench.py's SETTING; older curves lack the last two).
SETTING = ("threshold", "max_skips", "warmup_steps", "cfg_reuse", "cfg_order")


def choose(curve: dict | None, steps: int, model: str, fallback: dict, method: str, plan: str = "runs",
           damping: float = 1.0):
    """``(setting, final, sweep, source)`` from ``curve`` (a caching_bench JSON of the same model, steps,
    method, plan and damping): ``setting`` holds
    CachingConfig's :data:`SETTING` keywords of the best passing row, ``sweep`` the curve's other thresholds
    at that row's other keys; ``fallback`` (the same keys) when no row of this model and step count passed."""
    rows = []
    if curve and curve["model"] == model and curve["sampling"]["num_steps"] == steps \
            and curve["caching"]["method"] == method and curve["caching"].get("plan", "runs") == plan \
            and curve["caching"].get("damping", 1.0) == damping:
        rows = [r for r in curve["curve"] if r["gate_passed"] and r["calls"] < r["calls_uncached"]]
    if not rows:
        return dict(fallback), 1, (), "--setting (no curve row of this model and step count passed)"
    best = max(rows, key=lambda r: (r["saved_fraction"], r["clip_psnr_db"]["worst"], -r["threshold"]))
    setting = {k: best.get(k, 0) for k in SETTING}
    same = [r["threshold"] for r in curve["curve"] if all(r.get(k, 0) == setting[k] for k in SETTING[1:])
            and r["threshold"] != best["threshold"]]
    return (setting, curve["caching"]["final_steps"], tuple(sorted(set(same)))[:4],
            f"the curve's best passing row ({best['saved_fraction']:.1%} saved, worst clip "
            f"{best['clip_psnr_db']['worst']:.2f} dB)")


def prepare(a) -> None:
    from trt_sora.config import CachingConfig, dump_recipe, load_recipe
    from trt_sora.runfolder import RunFolder

    curve = json.loads(Path(a.curve).read_text()) if a.curve and Path(a.curve).is_file() else None
    fallback = {k: t(x) for (k, t), x in zip(zip(SETTING, (float, int, int, float, int)),
                                             [*a.setting.split(":"), "0", "0"][:5])}
    setting, final, sweep, source = choose(curve, a.steps, a.model, fallback, a.method, a.plan, a.damping)
    base = load_recipe(a.base)
    recipe = dataclasses.replace(
        base, name=f"{base.name}-cache{a.steps}",
        caching=CachingConfig(method=a.method, final_steps=final, sweep=sweep, plan=a.plan, damping=a.damping,
                              **setting),
        calibration=dataclasses.replace(base.calibration, num_steps=a.steps),
        parity=dataclasses.replace(base.parity, loop_steps=a.steps))
    work = Path(a.work)
    if a.fresh and work.exists():
        shutil.rmtree(work)
    run = work / "run"
    if not RunFolder(run).export.is_dir() and RunFolder(a.run).export.is_dir():
        shutil.copytree(RunFolder(a.run).export, RunFolder(run).export)
    run.mkdir(parents=True, exist_ok=True)
    text = dump_recipe(recipe)
    (work / "recipe.yaml").write_text(text)
    RunFolder(run).recipe.write_text(text)
    print(f"caching {a.method} plan {a.plan} {setting} final {final} at {a.steps} steps (sweep {list(sweep)}), "
          f"from {source}; run {run}, recipe {work / 'recipe.yaml'}")


def show(a) -> None:
    meta = json.loads(Path(a.metadata).read_text())
    cache = meta.get("caching") or {}
    print("seconds:", json.dumps(meta.get("seconds")))
    print("checked:", meta.get("checked"), "| backend:", meta.get("backend"), "| sampling:", meta.get("sampling"))
    print("caching:", json.dumps({k: cache.get(k) for k in ("applied", "setting", "reused", "calls", "calls_uncached")}
                                 if cache else None))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--run", required=True, help="a run folder whose export stage is reused (when it has one)")
    p.add_argument("--work", required=True, help="folder of run/ and recipe.yaml (run/ is kept: the recipe changes)")
    p.add_argument("--fresh", action="store_true", help="remove --work first")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--model", default="wan-shapes")
    p.add_argument("--base", default="rtx4090-fp8", help="the recipe the caching one starts from")
    p.add_argument("--method", default="extrapolate", choices=("magcache", "extrapolate"))
    p.add_argument("--plan", default="runs", choices=("runs", "global"), help="caching.plan of extrapolate")
    p.add_argument("--damping", type=float, default=1.0, help="caching.damping of extrapolate (1: the line)")
    p.add_argument("--curve", default=None, help="a caching_bench.py JSON (missing file: --setting)")
    p.add_argument("--setting", default="0.1:2:2",
                   help="threshold:max_skips:warmup_steps[:cfg_reuse[:cfg_order]] without a passing row")
    s = sub.add_parser("show")
    s.add_argument("metadata", help="a clip's metadata JSON")
    a = ap.parse_args(argv)
    {"prepare": prepare, "show": show}[a.cmd](a)


if __name__ == "__main__":
    main()
