"""Step caching: the relative error of a reused step's estimate on uncached trajectories: the line
(order 1), the parabola (order 2), and the line shrunk toward plain reuse (damped).

The model samples ``--captions`` held-out captions uncached (fp32, ``caching_bench.Bench``: the same
captions, noise and sampling settings) and keeps every branch output; per caption, branch, step ``i``
and horizon ``h = 1 .. --horizons`` the relative error ``||est - y_i|| / ||y_i||`` of each estimate of
step ``i``'s output from the computed outputs at steps ``i - h - order .. i - h`` in the timestep
(order 1: the line through two, the calibrate stage's ``MagnitudeRecorder`` definition; order 2: the
parabola through three), from ``i - h - order >= 0`` on. A damped estimate is ``newest + alpha (line -
newest)`` (alpha 0: plain reuse, 1: the line): ``--alphas`` fixed ones, and with ``--fit-captions F`` a
calibrated alpha per branch, step and horizon, the least-squares one over F more captions (sampled after
the scored ones, never scored; ``--cross-fit``: each half of the scored captions fitted on the other):
``alpha_ih = sum <y_i - newest, line - newest> / sum |line - newest|^2`` over the fit captions, clipped
to [0, 1]. The JSON holds the mean over the scored captions per branch, estimate, step and horizon, and
a summary per horizon over ``--steps-from .. --steps-to`` (the steps the global plan reuses) of the worse
branch: each estimate's mean, its ratio to order 1's and how many steps it beats order 1. With
``--curve`` (a ``caching_bench.py`` JSON) and ``--settings``, the same errors as each setting's schedule
would meet them: each reused step estimated from the newest steps its schedule computes (the uncached
outputs there: teacher-forced; the calibrated alpha at the horizon back to the newest), summed over the
reused steps (worse branch). ``--sample``: the scored captions sampled for real with those schedules
(``caching_bench.measure``: clip PSNR vs the uncached clips, probe verdicts, the gate). ``--trajectories``:
a file keeping the uncached outputs and clips (its captions are read back, the missing ones added).

    python benchmarks/caching_orders.py --steps 50 --captions 4 --out o.json \
        --curve benchmarks/results/h100_caching_wan-shapes_50steps_global_2026-12-06.json --settings 0.8:3:10
    python benchmarks/caching_orders.py --steps 50 --captions 8 --cross-fit --alphas 0.5,0.7,0.85 \
        --trajectories t.pt --curve ... --settings 0.8:3:10,0.9:3:10 --sample calibrated --out d.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.caching_bench import Bench, _probe, _write, measure  # noqa: E402
from trt_sora.caching import CacheSchedule, extrapolate  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Estimate:
    """``extrapolate(order, damping=alpha)`` from the newest ``order + 1`` computed outputs (order 1 with
    ``alpha``: ``newest + alpha (line - newest)``); ``alpha`` None: the calibrated alpha of the step and horizon."""

    name: str
    order: int = 1
    alpha: float | None = 1.0


ORDERS = (Estimate("order1", 1), Estimate("order2", 2))
CALIBRATED = Estimate("calibrated", 1, None)


def estimates(alphas: Sequence[float], calibrated: bool) -> tuple[Estimate, ...]:
    """Orders 1 and 2 (order 1 first: the reference of every ratio), the fixed ``alphas``, the calibrated one."""
    return (*ORDERS, *(Estimate(f"alpha{a:g}", 1, float(a)) for a in alphas), *((CALIBRATED,) if calibrated else ()))


def estimate(e: Estimate, history: Sequence[tuple[float, torch.Tensor]], t: float, alpha: float | None = None):
    """``e``'s estimate at timestep ``t`` from ``history`` (``[(timestep, output)]``, oldest first);
    ``alpha``: the calibrated one of this step and horizon, for ``e.alpha`` None."""
    return extrapolate(history, t, e.order, alpha if e.alpha is None else e.alpha)


class Keeper:
    """A step cache that reuses nothing and keeps every output: ``outputs[branch][step] = (t, output)``."""

    def __init__(self):
        self.outputs: dict[str, dict[int, tuple[float, torch.Tensor]]] = {}

    def reuse(self, step: int, branch: str) -> bool:
        return False

    def observe(self, step: int, branch: str, output, timestep: float | None = None) -> None:
        self.outputs.setdefault(branch, {})[step] = (float(timestep), output.detach().double().cpu())


def _relative(est: torch.Tensor, y: torch.Tensor) -> float:
    return float((est - y).norm() / y.norm())


def relative_errors(outputs: dict[int, tuple[float, torch.Tensor]], n: int, horizons: int,
                    ests: Sequence[Estimate] = ORDERS, alphas: np.ndarray | None = None) -> np.ndarray:
    """``[len(ests), n, horizons]``: the relative error of each estimate of step ``i`` from the outputs at
    ``i - h - order .. i - h`` (NaN where those steps do not exist); ``alphas``: ``[n, horizons]`` the
    calibrated alpha of this branch."""
    out = np.full((len(ests), n, horizons), np.nan)
    for k, e in enumerate(ests):
        for i in range(n):
            t, y = outputs[i]
            for h in range(1, horizons + 1):
                if i - h - e.order >= 0:
                    history = [outputs[s] for s in range(i - h - e.order, i - h + 1)]
                    alpha = None if alphas is None else alphas[i, h - 1]
                    out[k, i, h - 1] = _relative(estimate(e, history, t, alpha), y)
    return out


def scheduled_errors(outputs: dict[int, tuple[float, torch.Tensor]], reused: set[int],
                     ests: Sequence[Estimate] = ORDERS, alphas: np.ndarray | None = None) -> np.ndarray:
    """``[len(ests), n]``: the relative error of each estimate of each reused step from the newest
    ``order + 1`` computed steps before it, the calibrated alpha at the horizon back to the newest (NaN at
    computed steps)."""
    n = len(outputs)
    out = np.full((len(ests), n), np.nan)
    for i in sorted(reused):
        t, y = outputs[i]
        computed = [s for s in range(i) if s not in reused]
        h = i - computed[-1]
        if alphas is not None and h > alphas.shape[1]:
            raise SystemExit(f"step {i} is reused {h} steps after a computed one; pass --horizons {h} or more")
        for k, e in enumerate(ests):
            history = [outputs[s] for s in computed[-e.order - 1:]]
            out[k, i] = _relative(estimate(e, history, t, None if alphas is None else alphas[i, h - 1]), y)
    return out


def alpha_sums(outputs: dict[int, tuple[float, torch.Tensor]], n: int, horizons: int) -> np.ndarray:
    """``[2, n, horizons]``: at ``[:, i, h - 1]`` ``<y_i - newest, line - newest>`` and ``|line - newest|^2``,
    newest the output at step ``i - h`` and line the order-1 estimate of step ``i`` from ``i - h - 1, i - h``
    (zero where those steps do not exist); summed over captions, :func:`fit_alphas` fits them."""
    out = np.zeros((2, n, horizons))
    for i in range(n):
        t, y = outputs[i]
        for h in range(1, min(horizons, i - 1) + 1):
            newest = outputs[i - h][1]
            d = extrapolate([outputs[i - h - 1], outputs[i - h]], t, 1) - newest
            out[0, i, h - 1] = float(((y - newest) * d).sum())
            out[1, i, h - 1] = float((d * d).sum())
    return out


def fit_alphas(sums: np.ndarray) -> np.ndarray:
    """``[n, horizons]``: the least-squares alpha of :func:`alpha_sums`' sums, clipped to [0, 1] (NaN where
    the line equals the newest output on every caption, or the steps do not exist)."""
    num, den = sums
    alpha = np.full(num.shape, np.nan)
    np.divide(num, den, out=alpha, where=den > 0)
    return np.clip(alpha, 0.0, 1.0)


def summary(mean: dict[str, np.ndarray], lo: int, hi: int, ests: Sequence[Estimate] = ORDERS) -> list[dict]:
    """Per horizon, over steps ``lo .. hi`` of the worse branch: each estimate's mean error, its ratio to
    order 1's (mean of the per-step ratios), and the steps where it is the smaller."""
    worst = np.max(np.stack(list(mean.values())), axis=0)[:, lo:hi + 1]  # [ests, steps, horizons]
    rows = []
    for h in range(worst.shape[2]):
        o1 = worst[0, :, h]
        row = {"horizon": h + 1, "order1_mean": round(float(o1.mean()), 5)}
        for k, e in enumerate(ests[1:], start=1):
            x = worst[k, :, h]
            row.update({f"{e.name}_mean": round(float(x.mean()), 5),
                        f"{e.name}_over_order1_mean": round(float((x / o1).mean()), 4),
                        f"steps_{e.name}_smaller": int((x < o1).sum())})
        rows.append({**row, "steps": int(o1.size)})
    return rows


def curve_schedules(path: str, settings: str) -> dict[str, dict[str, list[int]]]:
    """``{threshold:max_skips:warmup: {branch: reused steps}}`` of ``settings``' rows of a caching_bench JSON."""
    rows = json.loads(Path(path).read_text())["curve"]
    out = {}
    for spec in settings.split(","):
        key = [float(x) for x in spec.split(":")]
        row = next((r for r in rows if [r["threshold"], r["max_skips"], r["warmup_steps"]] == key
                    and not r.get("cfg_reuse")), None)
        if row is None:
            raise SystemExit(f"{path} has no row {spec} without cfg_reuse")
        out[spec] = row["reused"]
    return out


def scheduled_summary(reused: dict[str, list[int]], errors: np.ndarray, ests: Sequence[Estimate] = ORDERS) -> dict:
    """``errors``: ``[captions, ests, steps]`` at one schedule's reused steps (the worse branch)."""
    steps = sorted({s for st in reused.values() for s in st})
    per_caption = np.nansum(errors, axis=2)  # [captions, ests]
    return {"reused": steps, **{e.name: {
        "summed_error_mean": round(float(per_caption[:, k].mean()), 5),
        "summed_error_worst_caption": round(float(per_caption[:, k].max()), 5),
        **({"steps_smaller_than_order1": int((np.nanmean(errors[:, k, steps], axis=0)
                                              < np.nanmean(errors[:, 0, steps], axis=0)).sum())} if k else {})}
        for k, e in enumerate(ests)}, "steps": len(steps)}


def trajectories(b: Bench, path: str | None) -> list[dict]:
    """Per caption of ``b``: ``{"outputs": {branch: {step: (t, output)}}, "latents", "frames"}`` sampled
    uncached, one caption at a time; ``path`` keeps them: the captions it holds (``b``'s first ones, at the
    same seed and sampling settings) are read back, the rest sampled and added (temp file, rename)."""
    key = {"seed": b.a.seed, "sampling": b.settings.to_dict()}
    kept = torch.load(path) if path and Path(path).is_file() else {**key, "captions": [], "clips": []}
    held = kept.get("captions") or []
    if {k: kept.get(k) for k in key} != key or held[:len(b.captions)] != b.captions[:len(held)]:
        raise SystemExit(f"{path} holds other captions, seeds or sampling settings; pass another --trajectories")
    keeper, clips, saved = Keeper(), list(kept["clips"][:len(b.captions)]), b.clips
    for clip in saved[len(clips):]:
        b.clips, keeper.outputs = [clip], {}
        res, frames, _ = b.sampled(cache=keeper)
        clips.append({"outputs": keeper.outputs, "latents": res[0].latents.cpu(), "frames": frames[0].cpu()})
    b.clips = saved
    if path and len(clips) > len(held):
        torch.save({**key, "captions": b.captions, "clips": clips}, f"{path}.tmp")
        Path(f"{path}.tmp").replace(path)
    return clips


class Damped:
    """A schedule's step cache whose reused steps take the damped line (this script's sampling hook): the
    calibrated alpha of the trajectory's caption (``alphas[row]``, rows in sampling order; a new row starts
    when a branch computes a step at or before its newest), branch, step and horizon back to the branch's
    newest computed output."""

    def __init__(self, schedule: CacheSchedule, alphas: Sequence[dict[str, np.ndarray]]):
        self.schedule, self.alphas, self.newest, self.row = schedule, alphas, {}, {}

    def reuse(self, step: int, branch: str) -> bool:
        return self.schedule.reuse(step, branch)

    def estimate(self, step: int, branch: str, history, timestep: float, computed):
        alpha = float(self.alphas[self.row[branch]][branch][step, step - self.newest[branch] - 1])
        if np.isnan(alpha):
            raise SystemExit(f"no calibrated alpha for {branch} at step {step}; fit on longer trajectories")
        return estimate(CALIBRATED, history[branch], timestep, alpha)

    def observe(self, step: int, branch: str, output, timestep: float | None = None) -> None:
        if step <= self.newest.get(branch, -1) or branch not in self.newest:
            self.row[branch] = self.row.get(branch, -1) + 1
        self.newest[branch] = step

    def calls(self, branches_per_step):
        return self.schedule.calls(branches_per_step)

    def to_dict(self) -> dict:
        return {**self.schedule.to_dict(), "alpha": "calibrated per caption fold, branch, step and horizon"}


def sampled_rows(b: Bench, clips: list[dict], schedules: dict[str, dict[str, list[int]]], names: Sequence[str],
                 alphas: Sequence[dict[str, np.ndarray]], write) -> dict:
    """``{setting: {estimate: caching_bench.measure's row}}``: ``b``'s captions sampled for real with each
    schedule at each of ``names`` (order1, calibrated), against their uncached ``clips``; ``write(rows)``
    after each row (a time limit keeps what finished)."""
    rows: dict[str, dict] = {}
    ref = ([c["latents"] for c in clips], [c["frames"] for c in clips])
    probe = _probe(b.a.model, b.captions)
    for spec, reused in schedules.items():
        schedule = CacheSchedule(b.settings.num_steps, {br: tuple(st) for br, st in reused.items()}, order=1)
        for name in names:
            cache = Damped(schedule, alphas) if name == CALIBRATED.name else schedule
            rows.setdefault(spec, {})[name] = row = measure(b, cache, ref, probe)
            write(rows)
            print(f"{spec} {name}: {row['saved_fraction']:.0%} saved, clip PSNR worst "
                  f"{row['clip_psnr_db']['worst']:.2f} mean {row['clip_psnr_db']['mean']:.2f} dB, gate "
                  f"{'pass' if row['gate_passed'] else 'FAIL'}", flush=True)
    return rows


def _floats(a: np.ndarray) -> list:
    return [None if np.isnan(x) else round(float(x), 6) for x in a]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--captions", type=int, default=4, help="held-out captions scored")
    ap.add_argument("--fit-captions", type=int, default=0,
                    help="captions after the scored ones that fit the calibrated alpha (0: no calibrated alpha)")
    ap.add_argument("--cross-fit", action="store_true",
                    help="fit each half of the scored captions' calibrated alpha on the other half")
    ap.add_argument("--alphas", default="", help="fixed alphas of the damped line, comma-separated, in [0, 1]")
    ap.add_argument("--horizons", type=int, default=3)
    ap.add_argument("--steps-from", type=int, default=10)
    ap.add_argument("--steps-to", type=int, default=48)
    ap.add_argument("--curve", default=None, help="a caching_bench.py JSON whose schedules --settings names")
    ap.add_argument("--settings", default="", help="threshold:max_skips:warmup rows of --curve, comma-separated")
    ap.add_argument("--trajectories", default=None, help="a .pt file keeping the uncached outputs and clips")
    ap.add_argument("--sample", default="", help="sample the scored captions with each --settings schedule at "
                    "these estimates (order1, calibrated; comma-separated) and compare with the uncached clips")
    ap.add_argument("--gate-db", type=float, default=30.0, help="--sample's gate: clip PSNR on every caption")
    ap.add_argument("--text-embeddings", default=None, help="the captions' embeddings (caching_bench.py's), for a "
                    "machine without the text encoder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    fixed = [float(x) for x in a.alphas.split(",") if x]
    if any(not 0.0 <= x <= 1.0 for x in fixed):
        raise SystemExit(f"--alphas {a.alphas}: each alpha lies in [0, 1] (0: plain reuse, 1: the line)")
    torch.set_num_threads(a.threads)
    b = Bench(argparse.Namespace(model=a.model, steps=a.steps, captions=a.captions + a.fit_captions, device=a.device,
                                 calib_prompts=None, text_embeddings=a.text_embeddings, seed=a.seed,
                                 gate_db=a.gate_db))
    schedules = curve_schedules(a.curve, a.settings) if a.curve else {}
    clips, n = trajectories(b, a.trajectories), b.settings.num_steps
    folds = fit_folds(a.captions, a.fit_captions, a.cross_fit)
    fitted = [{br: fit_alphas(sum(alpha_sums(clips[c]["outputs"][br], n, a.horizons) for c in fit))
               for br in clips[0]["outputs"]} for _, fit in folds]
    alphas = [next((al for (sc, _), al in zip(folds, fitted) if c in sc), {}) for c in range(a.captions)]
    ests = estimates(fixed, bool(folds))
    per_caption: dict[str, list[np.ndarray]] = {}
    scheduled: dict[str, list[np.ndarray]] = {s: [] for s in schedules}
    for clip, al in zip(clips[:a.captions], alphas):
        outputs = clip["outputs"]
        for branch, outs in outputs.items():
            per_caption.setdefault(branch, []).append(relative_errors(outs, n, a.horizons, ests, al.get(branch)))
        for spec, reused in schedules.items():  # [ests, steps]: the worse branch
            scheduled[spec].append(np.max(np.stack([scheduled_errors(outputs[br], set(steps), ests, al.get(br))
                                                    for br, steps in reused.items() if steps]), axis=0))
    mean = {br: np.mean(np.stack(e), axis=0) for br, e in per_caption.items()}
    out = {"model": a.model, "sampling": b.settings.to_dict(), "captions": b.captions[:a.captions], "seed": a.seed,
           "error": "per caption ||estimate - output|| / ||output|| over the whole latent, estimate of step i "
                    "from the computed outputs at steps i-h-order .. i-h in the timestep; mean over captions",
           "estimates": [dataclasses.asdict(e) for e in ests],
           "summary_steps": [a.steps_from, a.steps_to],
           "summary_worse_branch": summary(mean, a.steps_from, a.steps_to, ests),
           "summary_per_branch": {br: summary({br: m}, a.steps_from, a.steps_to, ests) for br, m in mean.items()},
           "scheduled": {spec: scheduled_summary(schedules[spec], np.stack(e), ests) for spec, e in scheduled.items()},
           "mean_errors": {br: {e.name: [_floats(row) for row in m[k]] for k, e in enumerate(ests)}
                           for br, m in mean.items()},
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if folds:
        out["calibrated_alpha"] = alpha_record(b.captions, folds, fitted, a.steps_from, a.steps_to)
    _write(a.out, out)
    print(json.dumps({k: out[k] for k in ("summary_worse_branch", "scheduled")}, indent=1), flush=True)
    if a.sample:
        b.clips, b.captions = b.clips[:a.captions], b.captions[:a.captions]
        sampled_rows(b, clips[:a.captions], schedules, a.sample.split(","), alphas,
                     lambda rows: _write(a.out, {**out, "gate_db": a.gate_db, "sampled": rows}))


def fit_folds(captions: int, fit_captions: int, cross_fit: bool) -> list[tuple[range, range]]:
    """``[(scored captions, the captions their alpha is fitted on)]``: the ``fit_captions`` after the scored
    ones, or (``cross_fit``) each half of the scored ones fitted on the other half; never a caption in both."""
    if cross_fit:
        if fit_captions or captions < 2:
            raise SystemExit("--cross-fit fits each half of --captions (2 or more) on the other; drop --fit-captions")
        half = captions // 2
        return [(range(half), range(half, captions)), (range(half, captions), range(half))]
    return [(range(captions), range(captions, captions + fit_captions))] if fit_captions else []


def alpha_record(captions: Sequence[str], folds, fitted, lo: int, hi: int) -> dict:
    """The JSON record of each fold's calibrated alphas: its fit captions, the mean over steps ``lo .. hi``
    per branch and horizon, and every step's."""
    return {"definition": "per branch, step i and horizon h: the sum over the fit captions of <y_i - newest, "
                          "line - newest> over the sum of |line - newest|^2, clipped to [0, 1]",
            "folds": [{"scored_captions": list(sc), "fit_captions": [captions[c] for c in fit],
                       "mean_over_summary_steps": {br: [round(float(np.nanmean(al[lo:hi + 1, h])), 4)
                                                        for h in range(al.shape[1])] for br, al in fa.items()},
                       "per_step": {br: [_floats(row) for row in al] for br, al in fa.items()}}
                      for (sc, fit), fa in zip(folds, fitted)]}

if __name__ == "__main__":
    main()
