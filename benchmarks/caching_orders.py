"""Step caching: the relative error of the order-1 vs order-2 estimate of a step's output, uncached trajectories.

The model samples ``--captions`` held-out captions uncached (fp32, ``caching_bench.Bench``: the same
captions, noise and sampling settings) and keeps every branch output; per caption, branch, step ``i``
and horizon ``h = 1 .. --horizons`` the relative error ``||est - y_i|| / ||y_i||`` of the estimate of
step ``i``'s output from the computed outputs at steps ``i - h - order .. i - h`` in the timestep
(order 1: the line through two, the calibrate stage's ``MagnitudeRecorder`` definition; order 2: the
parabola through three), from ``i - h - order >= 0`` on. The JSON holds the mean over captions per
branch, step and horizon, and a summary per horizon over ``--steps-from .. --steps-to`` (the steps the
global plan reuses) of the worse branch: the mean of each order, and how many steps order 2 beats order 1.
With ``--curve`` (a ``caching_bench.py`` JSON) and ``--settings``, the same errors as each setting's
schedule would meet them: each reused step estimated from the newest ``order + 1`` steps its schedule
computes (the uncached outputs there: teacher-forced), summed over the reused steps (worse branch).

    python benchmarks/caching_orders.py --steps 50 --captions 4 --out o.json \
        --curve benchmarks/results/h100_caching_wan-shapes_50steps_global_2026-12-06.json --settings 0.8:3:10
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.caching_bench import Bench, _write  # noqa: E402

ORDERS = (1, 2)


class Keeper:
    """A step cache that reuses nothing and keeps every output: ``outputs[branch][step] = (t, output)``."""

    def __init__(self):
        self.outputs: dict[str, dict[int, tuple[float, torch.Tensor]]] = {}

    def reuse(self, step: int, branch: str) -> bool:
        return False

    def observe(self, step: int, branch: str, output, timestep: float | None = None) -> None:
        self.outputs.setdefault(branch, {})[step] = (float(timestep), output.detach().double().cpu())


def relative_errors(outputs: dict[int, tuple[float, torch.Tensor]], n: int, horizons: int) -> np.ndarray:
    """``[len(ORDERS), n, horizons]``: the relative error of each order's estimate of step ``i`` from the
    outputs at ``i - h - order .. i - h`` (NaN where those steps do not exist)."""
    from trt_sora.caching import extrapolate

    out = np.full((len(ORDERS), n, horizons), np.nan)
    for k, order in enumerate(ORDERS):
        for i in range(n):
            t, y = outputs[i]
            for h in range(1, horizons + 1):
                if i - h - order >= 0:
                    est = extrapolate([outputs[s] for s in range(i - h - order, i - h + 1)], t, order)
                    out[k, i, h - 1] = float((est - y).norm() / y.norm())
    return out


def scheduled_errors(outputs: dict[int, tuple[float, torch.Tensor]], reused: set[int]) -> np.ndarray:
    """``[len(ORDERS), n]``: the relative error of each order's estimate of each reused step from the newest
    ``order + 1`` computed steps before it (NaN at computed steps)."""
    from trt_sora.caching import extrapolate

    n = len(outputs)
    out = np.full((len(ORDERS), n), np.nan)
    for i in sorted(reused):
        t, y = outputs[i]
        computed = [outputs[s] for s in range(i) if s not in reused]
        for k, order in enumerate(ORDERS):
            out[k, i] = float((extrapolate(computed[-order - 1:], t, order) - y).norm() / y.norm())
    return out


def summary(mean: dict[str, np.ndarray], lo: int, hi: int) -> list[dict]:
    """Per horizon, over steps ``lo .. hi`` of the worse branch: each order's mean error, order 2 / order 1
    (mean of the per-step ratios), and the steps where order 2 is the smaller."""
    worst = np.max(np.stack(list(mean.values())), axis=0)[:, lo:hi + 1]  # [orders, steps, horizons]
    rows = []
    for h in range(worst.shape[2]):
        o1, o2 = worst[0, :, h], worst[1, :, h]
        rows.append({"horizon": h + 1, "order1_mean": round(float(o1.mean()), 5),
                     "order2_mean": round(float(o2.mean()), 5),
                     "order2_over_order1_mean": round(float((o2 / o1).mean()), 4),
                     "steps_order2_smaller": int((o2 < o1).sum()), "steps": int(o1.size)})
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


def scheduled_summary(reused: dict[str, list[int]], errors: np.ndarray) -> dict:
    """``errors``: ``[captions, orders, steps]`` at one schedule's reused steps (the worse branch)."""
    steps = sorted({s for st in reused.values() for s in st})
    per_caption = np.nansum(errors, axis=2)  # [captions, orders]
    return {"reused": steps, **{f"order{o}": {
        "summed_error_mean": round(float(per_caption[:, k].mean()), 5),
        "summed_error_worst_caption": round(float(per_caption[:, k].max()), 5),
        **({"steps_smaller_than_order1": int((np.nanmean(errors[:, k, steps], axis=0)
                                              < np.nanmean(errors[:, 0, steps], axis=0)).sum())} if o != 1 else {})}
        for k, o in enumerate(ORDERS)}, "steps": len(steps)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--captions", type=int, default=4)
    ap.add_argument("--horizons", type=int, default=3)
    ap.add_argument("--steps-from", type=int, default=10)
    ap.add_argument("--steps-to", type=int, default=48)
    ap.add_argument("--curve", default=None, help="a caching_bench.py JSON whose schedules --settings names")
    ap.add_argument("--settings", default="", help="threshold:max_skips:warmup rows of --curve, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    b = Bench(argparse.Namespace(model=a.model, steps=a.steps, captions=a.captions, device=a.device,
                                 calib_prompts=None, text_embeddings=None, seed=a.seed))
    schedules = curve_schedules(a.curve, a.settings) if a.curve else {}
    keeper = Keeper()
    per_caption: dict[str, list[np.ndarray]] = {}
    scheduled: dict[str, list[np.ndarray]] = {s: [] for s in schedules}
    for clip in b.clips:  # one caption at a time: the keeper holds one trajectory
        b.clips, saved = [clip], b.clips
        keeper.outputs = {}
        b.sampled(cache=keeper)
        b.clips = saved
        for branch, outs in keeper.outputs.items():
            per_caption.setdefault(branch, []).append(relative_errors(outs, b.settings.num_steps, a.horizons))
        for spec, reused in schedules.items():  # [orders, steps]: the worse branch
            scheduled[spec].append(np.max(np.stack([scheduled_errors(keeper.outputs[br], set(steps))
                                                    for br, steps in reused.items() if steps]), axis=0))
    mean = {br: np.mean(np.stack(e), axis=0) for br, e in per_caption.items()}
    out = {"model": a.model, "sampling": b.settings.to_dict(), "captions": b.captions, "seed": a.seed,
           "error": "per caption ||estimate - output|| / ||output|| over the whole latent, estimate of step i "
                    "from the computed outputs at steps i-h-order .. i-h in the timestep; mean over captions",
           "summary_steps": [a.steps_from, a.steps_to],
           "summary_worse_branch": summary(mean, a.steps_from, a.steps_to),
           "summary_per_branch": {br: summary({br: m}, a.steps_from, a.steps_to) for br, m in mean.items()},
           "scheduled": {spec: scheduled_summary(schedules[spec], np.stack(e)) for spec, e in scheduled.items()},
           "mean_errors": {br: {f"order{o}": [[None if np.isnan(x) else round(float(x), 6) for x in row]
                                              for row in m[k]] for k, o in enumerate(ORDERS)}
                           for br, m in mean.items()},
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    _write(a.out, out)
    print(json.dumps({k: out[k] for k in ("summary_worse_branch", "scheduled")}, indent=1))


if __name__ == "__main__":
    main()
