"""Step caching: which denoising steps skip a CFG branch's transformer call, what stands in for the
output, and the calibrated statistics that decide it. The one sampler (:func:`trt_sora.sampling.sample`)
asks a *step cache* three things per call, through its ``cache=`` argument::

    cache.reuse(step, branch) -> bool                                  # True: skip the call
    cache.estimate(step, branch, history, timestep, computed) -> out   # the skipped output, from computed ones
    cache.observe(step, branch, output, timestep)                      # every output computed ([B, C, F, H, W] fp32)

Two step caches live here:

* :class:`MagnitudeRecorder` (calibration): never reuses; records, per trajectory row, step and
  branch, the magnitude ratio ``r_i = m_i / m_{i-1}`` of the transformer output, with ``m`` the
  mean over latent positions of the output's L2 norm over channels (``r_0 = 1``), and the relative
  error of :func:`extrapolate` (order 1) of step ``i`` from steps ``i - h - 1, i - h`` for
  ``h = 1 .. HORIZONS``, and the relative error of uncond estimated as its step's cond plus the branch
  difference ``uncond - cond`` extrapolated (orders 0 and 1) from the same steps. The calibrate stage
  saves them as :class:`StepRatios` (``calib/step_ratios.safetensors``).
* :class:`CacheSchedule` (check, runtime): a fixed set of reused steps per branch and the order of
  the estimate, planned from the calibrated means, so a schedule is a fact of the model and its
  sampling settings that ``check`` verifies and the runtime replays.

``method: magcache`` (:func:`plan_schedule`, order 0: the last output reused), per branch over steps
``i = 0 .. n-1``: a step computes when it is one of the first ``warmup_steps`` or the last
``final_steps``, the first step of an expert (a pair switching at its boundary: the cached output is the
other expert's), or the branch may not reuse; every other step multiplies ``acc *= r_i``, adds
``err += |1 - acc|``, counts ``k += 1`` and reuses while ``err <= threshold`` and ``k <= max_skips``; a
computing step resets ``acc = 1, err = 0, k = 0``.

``method: extrapolate`` (:func:`plan_extrapolated`, order 1): the same forced steps, one decision per
step for every branch that may reuse, on the summed errors of the worse branch at each step's horizon.

``caching.cfg_reuse`` (:func:`plan_cfg_reuse`), on top of either: among the steps where the step plan
computes both branches, the uncond call is replaced by cond plus the branch difference of the expert's
last steps computing both, while the summed calibrated errors of that estimate stay under the budget; a
step skipped whole after such a step takes its uncond the same way from its cond estimate.

No heavy imports at module load: numpy here, torch and safetensors inside the functions.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trt_sora.config.recipe import CACHE_BRANCHES, CacheMethod, CachePlan, CachingConfig
from trt_sora.errors import ArtifactError, ConfigError
from trt_sora.manifest import read_safetensors
from trt_sora.sampling import CFG_DELTA

__all__ = ["CFG_ORDERS", "HORIZONS", "RATIOS_FILE", "CacheSchedule", "MagnitudeRecorder", "StepRatios",
           "caching_record", "extrapolate", "plan_cfg_reuse", "plan_extrapolated", "plan_global", "plan_schedule",
           "schedule_for"]

#: The calibrate stage's file of per-step magnitude ratios (beside ``stats.safetensors``).
RATIOS_FILE = "step_ratios.safetensors"
_FORMAT = "trt_sora.step_ratios/1"
MAGNITUDE = "mean over latent positions of the transformer output's L2 norm over channels"
#: How many steps ahead the extrapolation errors are recorded (``caching.max_skips`` of ``extrapolate``).
HORIZONS = 4
EXTRAPOLATION_ERROR = ("per row, ||extrapolate(order 1) - output|| / ||output|| over the whole latent; "
                       "[step, horizon - 1]")
#: The orders of the CFG-difference estimate the calibrate stage records (``caching.cfg_order``).
CFG_ORDERS = (0, 1)
CFG_ERROR = ("per row, ||extrapolate(uncond - cond, order) - (uncond - cond)|| / ||uncond|| over the whole latent: "
             "the relative error of uncond estimated as this step's cond plus the difference h steps back; "
             "[step, horizon - 1]")


# -- the statistics ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepRatios:
    """Magnitude ratios of the transformer output, step over previous step, per CFG branch.

    Attributes:
        steps: the schedule indices covered (a pair's expert covers the steps it served).
        timesteps: each covered step's timestep.
        ratios: ``{branch: [rows, len(steps)] float64}``, one row per trajectory row (prompt);
            NaN where a row's branch did not run at that step (no CFG there).
        errors: ``{branch: [rows, len(steps), HORIZONS] float64}``: at ``[r, i, h - 1]`` the relative
            error of :func:`extrapolate` (order 1) of step ``i``'s output from the branch's outputs at
            steps ``i - h - 1`` and ``i - h`` (see :class:`MagnitudeRecorder`); empty in files recorded
            before ``method: extrapolate`` existed.
        cfg_errors: ``{order: [rows, len(steps), HORIZONS] float64}``: at ``[r, i, h - 1]`` the relative
            error of the unconditional output of step ``i`` estimated as its cond output plus
            :func:`extrapolate` (``order``) of the branch difference ``uncond - cond`` at steps
            ``i - h - 1, i - h`` (``caching.cfg_reuse``); empty in files recorded before it existed.
    """

    steps: tuple[int, ...]
    timesteps: tuple[float, ...]
    ratios: Mapping[str, np.ndarray]
    errors: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    cfg_errors: Mapping[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def mean(self, branch: str) -> np.ndarray:
        """``[len(steps)]`` mean over rows (NaN where no row ran)."""
        return _nan_stat(self.ratios[branch], np.nanmean)

    def std(self, branch: str) -> np.ndarray:
        """``[len(steps)]`` population standard deviation over rows."""
        return _nan_stat(self.ratios[branch], np.nanstd)

    def mean_errors(self, branch: str) -> np.ndarray:
        """``[len(steps), HORIZONS]`` mean extrapolation error over rows (NaN where no row has one)."""
        return _mean_by_horizon(self.errors[branch])

    def mean_cfg_errors(self, order: int) -> np.ndarray:
        """``[len(steps), HORIZONS]`` mean error of the CFG-difference estimate at ``order`` over rows."""
        return _mean_by_horizon(self.cfg_errors[order])

    def mean_by_step(self, branch: str) -> dict[int, float]:
        return dict(zip(self.steps, (float(x) for x in self.mean(branch))))

    def summary(self) -> dict[str, Any]:
        """JSON-safe per-branch mean and std per step (the calibration manifest's record)."""
        return {"steps": list(self.steps), "magnitude": MAGNITUDE,
                "rows": {b: int(r.shape[0]) for b, r in self.ratios.items()},
                **{b: {"mean": _floats(self.mean(b)), "std": _floats(self.std(b))} for b in self.ratios},
                **({"extrapolation_error": EXTRAPOLATION_ERROR, "errors_mean": {
                    b: [_floats(row) for row in self.mean_errors(b)] for b in self.errors}} if self.errors else {}),
                **({"cfg_error": CFG_ERROR, "cfg_errors_mean": {
                    str(o): [_floats(row) for row in self.mean_cfg_errors(o)] for o in self.cfg_errors}}
                   if self.cfg_errors else {})}

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        tensors = {"steps": np.asarray(self.steps, np.int64), "timesteps": np.asarray(self.timesteps, np.float64)}
        for b, r in self.ratios.items():
            tensors[f"{b}.ratios"] = np.ascontiguousarray(r, dtype=np.float64)
            tensors[f"{b}.mean"], tensors[f"{b}.std"] = self.mean(b), self.std(b)
        for b, e in self.errors.items():
            tensors[f"{b}.errors"] = np.ascontiguousarray(e, dtype=np.float64)
        for o, e in self.cfg_errors.items():
            tensors[f"cfg_delta.errors{o}"] = np.ascontiguousarray(e, dtype=np.float64)
        save_file(tensors, str(path), metadata={"format": _FORMAT, "magnitude": MAGNITUDE,
                                                "branches": json.dumps(list(self.ratios))})

    @classmethod
    def load(cls, path: str | Path) -> StepRatios:
        meta, t = read_safetensors(path, fmt=_FORMAT, what="a step-ratios file",
                                   missing="the calibration predates step caching",
                                   fix="re-run `trt-sora calibrate` (it records the step ratios step caching needs)")
        branches = json.loads(meta["branches"])
        return cls(steps=tuple(int(s) for s in t["steps"]), timesteps=tuple(float(x) for x in t["timesteps"]),
                   ratios={b: t[f"{b}.ratios"] for b in branches},
                   errors={b: t[f"{b}.errors"] for b in branches if f"{b}.errors" in t},
                   cfg_errors={o: t[f"cfg_delta.errors{o}"] for o in CFG_ORDERS if f"cfg_delta.errors{o}" in t})

    @classmethod
    def merged(cls, parts: Sequence[StepRatios]) -> StepRatios:
        """One file's rows after another's (shards, in shard order): the same steps, rows concatenated."""
        first = parts[0]
        if any(p.steps != first.steps or set(p.ratios) != set(first.ratios) for p in parts):
            raise ArtifactError("step-ratio shards cover different steps or branches; merge the shards of one "
                                "calibration")
        rows = {b: np.concatenate([p.ratios[b] for p in parts]) for b in first.ratios}
        errors = {b: np.concatenate([p.errors[b] for p in parts]) for b in first.errors
                  if all(b in p.errors for p in parts)}
        cfg = {o: np.concatenate([p.cfg_errors[o] for p in parts]) for o in first.cfg_errors
               if all(o in p.cfg_errors for p in parts)}
        return cls(first.steps, first.timesteps, rows, errors, cfg)

    @classmethod
    def joined(cls, parts: Sequence[StepRatios]) -> StepRatios:
        """The experts' files of a pair as one trajectory: their steps side by side, in step order."""
        if len(parts) == 1:
            return parts[0]
        order = sorted((s, i, j) for i, p in enumerate(parts) for j, s in enumerate(p.steps))
        rows = {p.ratios[b].shape[0] for p in parts for b in p.ratios}
        if len(rows) != 1 or len({s for s, _, _ in order}) != len(order):
            raise ArtifactError("the experts' step ratios do not come from one calibration pass (their rows or "
                                "steps differ); re-run `trt-sora calibrate` for the pair")
        branches = [b for b in parts[0].ratios if all(b in p.ratios for p in parts)]
        with_errors = [b for b in branches if all(b in p.errors for p in parts)]
        orders = [o for o in CFG_ORDERS if all(o in p.cfg_errors for p in parts)]
        return cls(tuple(s for s, _, _ in order), tuple(parts[i].timesteps[j] for _, i, j in order),
                   {b: np.stack([parts[i].ratios[b][:, j] for _, i, j in order], axis=1) for b in branches},
                   {b: np.stack([parts[i].errors[b][:, j] for _, i, j in order], axis=1) for b in with_errors},
                   {o: np.stack([parts[i].cfg_errors[o][:, j] for _, i, j in order], axis=1) for o in orders})


def _nan_stat(a: np.ndarray, fn) -> np.ndarray:
    out = np.full(a.shape[1], np.nan)
    seen = ~np.isnan(a).all(axis=0)
    out[seen] = fn(a[:, seen], axis=0)
    return out


def _mean_by_horizon(e: np.ndarray) -> np.ndarray:
    return np.stack([_nan_stat(e[:, :, h], np.nanmean) for h in range(e.shape[2])], axis=1)


def _floats(a: np.ndarray) -> list:
    return [None if math.isnan(x) else round(float(x), 6) for x in a]


class MagnitudeRecorder:
    """The sampler's step cache during calibration: computes every call and records, per trajectory
    row, step and branch, the magnitude ratio of the output to the previous step's and the relative
    error of :func:`extrapolate` (order 1) from the outputs ``h`` and ``h + 1`` steps back, for
    ``h = 1 .. HORIZONS`` (see the module docstring). One recorder follows any number of
    trajectories of ``num_steps`` steps; :meth:`ratios` returns them."""

    def __init__(self, num_steps: int):
        self.num_steps = int(num_steps)
        self._rows: dict[str, list[np.ndarray]] = {}
        self._errors: dict[str, list[np.ndarray]] = {}
        self._prev: dict[str, list[tuple[int, float, Any, Any]]] = {}  # this trajectory's (step, t, output, m)
        self._timesteps: dict[int, float] = {}
        self._cfg: dict[int, list[np.ndarray]] = {o: [] for o in CFG_ORDERS}
        self._deltas: list[tuple[int, float, Any]] = []  # this trajectory's (step, t, uncond - cond)

    def reuse(self, step: int, branch: str) -> bool:
        return False

    def observe(self, step: int, branch: str, output, timestep: float | None = None) -> None:
        y = output.detach().float()
        mag = y.norm(dim=1).flatten(1).mean(dim=1).double().cpu().numpy()
        rows = self._rows.setdefault(branch, [])
        prev = self._prev.get(branch) or []
        if not prev or step <= prev[-1][0] or not rows or rows[-1].shape[0] != mag.shape[0]:
            rows.append(np.full((mag.shape[0], self.num_steps), np.nan))  # a new trajectory
            self._errors.setdefault(branch, []).append(np.full((mag.shape[0], self.num_steps, HORIZONS), np.nan))
            prev = []
            if branch == "uncond":
                for o in CFG_ORDERS:
                    self._cfg[o].append(np.full((mag.shape[0], self.num_steps, HORIZONS), np.nan))
                self._deltas = []
        if prev and prev[-1][0] == step - 1:
            rows[-1][:, step] = mag / prev[-1][3]
        elif step == 0:
            rows[-1][:, step] = 1.0
        t = math.nan if timestep is None else float(timestep)
        self._record_errors(self._errors[branch][-1], prev, step, t, y)
        self._prev[branch] = [*prev[-HORIZONS:], (step, t, y, mag)]
        cond = (self._prev.get("cond") or [(None,)])[-1]
        if branch == "uncond" and cond[0] == step and cond[2].shape == y.shape:
            self._record_cfg_errors(step, t, y, y - cond[2])
        if timestep is not None:
            self._timesteps.setdefault(step, float(timestep))

    @staticmethod
    def _record_errors(errors: np.ndarray, prev, step: int, t: float, y) -> None:
        """``errors[:, step, h - 1]``: each row's relative error of the extrapolation from the outputs at
        steps ``step - h - 1`` and ``step - h`` (the one at ``step - h`` alone at the trajectory's start)."""
        by_step = {s: (ts, out) for s, ts, out, _ in prev}
        norm = y.flatten(1).norm(dim=1).double()
        for h, history in _histories(by_step, step):
            diff = (extrapolate(history, t, 1) - y).flatten(1).norm(dim=1).double()
            errors[:, step, h - 1] = (diff / norm.clamp_min(1e-30)).cpu().numpy()

    def _record_cfg_errors(self, step: int, t: float, uncond, delta) -> None:
        """``cfg[order][:, step, h - 1]``: each row's relative error of ``uncond`` estimated as this step's
        cond plus the branch difference extrapolated (``order``) from steps ``step - h - 1, step - h``."""
        by_step = {s: (ts, d) for s, ts, d in self._deltas}
        norm = uncond.flatten(1).norm(dim=1).double().clamp_min(1e-30)
        for h, history in _histories(by_step, step):
            for o in CFG_ORDERS:
                diff = (extrapolate(history, t, o) - delta).flatten(1).norm(dim=1).double()
                self._cfg[o][-1][:, step, h - 1] = (diff / norm).cpu().numpy()
        self._deltas = [*self._deltas[-HORIZONS:], (step, t, delta)]

    def ratios(self, steps: Sequence[int] | None = None) -> StepRatios:
        """The recorded ratios and errors over ``steps`` (default: every step), one row per trajectory row."""
        steps = tuple(range(self.num_steps)) if steps is None else tuple(int(s) for s in steps)
        return StepRatios(steps=steps, timesteps=tuple(self._timesteps.get(s, math.nan) for s in steps),
                          ratios={b: np.concatenate(r)[:, list(steps)] for b, r in self._rows.items()},
                          errors={b: np.concatenate(e)[:, list(steps)] for b, e in self._errors.items()},
                          cfg_errors={o: np.concatenate(e)[:, list(steps)] for o, e in self._cfg.items() if e})


def _histories(by_step: Mapping[int, tuple[float, Any]], step: int):
    """``(h, history)`` for ``h = 1 .. HORIZONS``: the recorded ``(timestep, output)`` at steps ``step - h - 1``
    and ``step - h`` (the latter alone at a trajectory's start), where step ``step - h`` was recorded."""
    for h in range(1, HORIZONS + 1):
        if step - h in by_step:
            yield h, [by_step[s] for s in (step - h - 1, step - h) if s in by_step]


# -- the policy ---------------------------------------------------------------------------------------
def plan_schedule(ratios: Mapping[str, Sequence[float]], experts: Sequence[str | None], config: CachingConfig,
                  threshold: float | None = None) -> dict[str, tuple[int, ...]]:
    """``{branch: reused steps}`` by the rule of the module docstring.

    Args:
        ratios: ``{branch: [r_0 .. r_{n-1}]}`` (the calibrated mean per step; NaN: the step computes).
        experts: the expert serving each step (``None`` for one model): a change forces a compute.
        config: warm-up / final steps, ``max_skips``, the branches that may reuse.
        threshold: the accumulated-error budget (default ``config.threshold``).
    """
    budget = config.threshold if threshold is None else float(threshold)
    n = len(experts)
    out = {}
    for branch, r in ratios.items():
        if len(r) != n:
            raise ConfigError(f"caching: {len(r)} ratios for branch {branch!r} but the schedule has {n} steps")
        acc, err, k, reused = 1.0, 0.0, 0, []
        for i in range(n):
            forced = (i < config.warmup_steps or i >= n - config.final_steps or experts[i] != experts[i - 1]
                      or branch not in config.branches or not math.isfinite(r[i]))
            if not forced:
                acc *= float(r[i])
                err += abs(1.0 - acc)
                k += 1
                if err <= budget and k <= config.max_skips:
                    reused.append(i)
                    continue
            acc, err, k = 1.0, 0.0, 0
        out[branch] = tuple(reused)
    return out


def extrapolate(history: Sequence[tuple[float, Any]], timestep: float, order: int, damping: float = 1.0):
    """A skipped step's output estimated from a branch's computed ``history`` (``[(timestep, output)]``,
    oldest first): ``order`` 0 reuses the newest output; 1 continues the line through the newest two in
    the timestep, ``y2 + (y2 - y1) (t - t2) / (t2 - t1)``; 2 adds the parabola's term through the newest
    three, ``(d21 - d10) (t - t2) (t - t1) / (t2 - t0)`` with ``dab = (ya - yb) / (ta - tb)`` (Newton's form);
    an order falls to what the history holds (the newest alone while only one exists). Schedules use
    orders 0 and 1; order 2 is ``benchmarks/caching_orders.py``'s comparison. ``damping`` shrinks the line
    toward plain reuse, ``y2 + damping (line - y2)`` (``caching.damping``; 1: the line itself, bit for bit)."""
    t2, y2 = history[-1]
    if order == 0 or len(history) < 2:
        return y2
    t1, y1 = history[-2]
    line = y2 + (y2 - y1) * (damping * ((timestep - t2) / (t2 - t1)))
    if order == 1 or len(history) < 3:
        return line
    t0, y0 = history[-3]
    curvature = (y2 - y1) * (1.0 / (t2 - t1)) - (y1 - y0) * (1.0 / (t1 - t0))
    return line + curvature * ((timestep - t2) * (timestep - t1) / (t2 - t0))


def plan_extrapolated(errors: Mapping[str, np.ndarray], experts: Sequence[str | None], config: CachingConfig,
                      threshold: float | None = None) -> dict[str, tuple[int, ...]]:
    """``{branch: reused steps}`` of ``method: extrapolate``: one decision per step for every branch that
    may reuse (a step mixing a fresh and an estimated branch puts the guidance scale on their mismatch).

    Args:
        errors: ``{branch: [n, HORIZONS]}`` calibrated mean extrapolation errors (NaN: the step computes).
        experts: the expert serving each step (``None`` for one model): a change forces a compute.
        config: warm-up / final steps, ``max_skips`` (at most the recorded horizons), the branches that may
            reuse.
        threshold: the budget of the summed errors of a run of reused steps (default ``config.threshold``).

    A step computes when forced (warm-up, final, an expert's first step); otherwise, as the ``k``-th step
    in a row after a computed one, it adds the worst branch's error at horizon ``k`` to ``err`` and reuses
    while ``err <= threshold`` and ``k <= max_skips``; a computing step resets ``err = 0, k = 0``.
    """
    budget = config.threshold if threshold is None else float(threshold)
    n, deciding = len(experts), _deciding(errors, len(experts), config)
    err, k, reused = 0.0, 0, []
    for i in range(n):
        if i >= config.warmup_steps and i < n - config.final_steps and experts[i] == experts[i - 1] and deciding:
            k += 1
            err += max(float(errors[b][i, k - 1]) if k <= errors[b].shape[1] else math.inf for b in deciding)
            if err <= budget and k <= config.max_skips:  # NaN compares False: the step computes
                reused.append(i)
                continue
        err, k = 0.0, 0
    return {b: tuple(reused) if b in deciding else () for b in errors}


def _deciding(errors: Mapping[str, np.ndarray], n: int, config: CachingConfig) -> list[str]:
    """The branches whose errors decide a step; ConfigError when the errors do not cover ``n`` steps x
    ``caching.max_skips`` horizons."""
    for b, e in errors.items():
        if e.shape[0] != n or e.shape[1] < config.max_skips:
            raise ConfigError(f"caching: the extrapolation errors of branch {b!r} cover {e.shape[0]} steps x "
                              f"{e.shape[1]} horizons; this schedule needs {n} steps x caching.max_skips="
                              f"{config.max_skips} (at most {e.shape[1]})")
    return [b for b in config.branches if b in errors]


def plan_global(errors: Mapping[str, np.ndarray], experts: Sequence[str | None], config: CachingConfig,
                threshold: float | None = None) -> dict[str, tuple[int, ...]]:
    """``{branch: reused steps}`` of ``caching.plan: global``: one budget for the whole trajectory.

    Args:
        errors: ``{branch: [n, HORIZONS]}`` calibrated mean extrapolation errors (NaN: the step computes).
        experts: the expert serving each step (``None`` for one model): a change forces a compute.
        config: warm-up / final steps, ``max_skips``, the branches that may reuse (one decision for all).
        threshold: the budget of the summed errors of every reused step (default ``config.threshold``).

    A plan's error is the sum over its reused steps of the worse branch's error at the step's horizon (its
    place in its run of reused steps; runs of at most ``max_skips``, no forced step: warm-up, final, an
    expert's first step). The schedule reuses the most steps whose least-error plan stays within the
    budget, and that plan: the calls saved never fall as the budget grows.
    """
    budget = config.threshold if threshold is None else float(threshold)
    n, deciding = len(experts), _deciding(errors, len(experts), config)
    if not deciding:
        return {b: () for b in errors}
    worst = np.max(np.stack([np.asarray(errors[b], np.float64) for b in deciding]), axis=0)  # NaN propagates
    forced = {i for i in range(n) if i < config.warmup_steps or i >= n - config.final_steps}
    forced |= {i for i in range(1, n) if experts[i] != experts[i - 1]}
    plans = _least_error_plans(worst, [i not in forced for i in range(n)], config.max_skips)
    steps = max((p for cost, p in plans.values() if cost <= budget), key=len, default=())
    return {b: steps if b in deciding else () for b in errors}


def _least_error_plans(worst: np.ndarray, free: Sequence[bool], max_skips: int) -> dict[int, tuple[float, tuple]]:
    """``{count: (error, steps)}``: per number of reused steps, the ``free`` steps with the least summed
    ``worst[i, h - 1]`` (``h``: the step's place in its run, at most ``max_skips``), by dynamic programming
    over the steps with the state (length of the run so far, steps reused)."""
    plans: dict[tuple[int, int], tuple[float, tuple]] = {(0, 0): (0.0, ())}
    for i, can in enumerate(free):
        nxt: dict[tuple[int, int], tuple[float, tuple]] = {}
        for (run, count), (cost, steps) in plans.items():
            options = [((0, count), (cost, steps))]
            if can and run < max_skips and math.isfinite(worst[i, run]):
                options.append(((run + 1, count + 1), (cost + float(worst[i, run]), (*steps, i))))
            for key, plan in options:
                if key not in nxt or plan[0] < nxt[key][0]:
                    nxt[key] = plan
        plans = nxt
    best: dict[int, tuple[float, tuple]] = {}
    for (_, count), plan in plans.items():
        if count not in best or plan[0] < best[count][0]:
            best[count] = plan
    return best


def plan_cfg_reuse(errors: np.ndarray, experts: Sequence[str | None], config: CachingConfig,
                   reused: Mapping[str, Sequence[int]], budget: float | None = None) -> tuple[int, ...]:
    """The steps whose uncond output is this step's cond (computed, or the step plan's estimate) plus the
    branch difference (``caching.cfg_reuse``): steps where the step plan computes both branches and that
    now call cond alone, and the steps the step plan skips whole after such a step (uncond's own outputs
    are then older than cond's).

    Args:
        errors: ``[n, HORIZONS]`` calibrated mean errors of that estimate at ``caching.cfg_order``
            (``[i, h - 1]``: the difference taken ``h`` steps back; NaN: the step computes both).
        experts: the expert serving each step (``None`` for one model).
        config: warm-up / final steps; ``cfg_reuse`` is the default ``budget``.
        reused: ``{branch: reused steps}`` of the step plan.
        budget: the summed errors a run of estimates since the last step computing both may reach.

    A step the plan computes whole computes both branches (and anchors the difference) when forced
    (warm-up, final, an expert's first step: the difference is the expert's own; the step plans never
    skip those for uncond), or when ``h`` (steps since the anchor) passes the recorded horizons or adding
    its error at ``h`` brings ``err`` over the budget; otherwise it calls cond alone and ``err`` grows. A
    step skipped whole after a cond-alone step since the anchor takes the difference too (within the
    horizons; its error adds to ``err``).
    """
    budget = config.cfg_reuse if budget is None else float(budget)
    n, width = len(experts), errors.shape[1]
    if errors.shape[0] != n:
        raise ConfigError(f"caching: the CFG-difference errors cover {errors.shape[0]} steps but the schedule has "
                          f"{n}; calibrate at the sampling settings the check runs")
    skipped = {int(s) for steps in reused.values() for s in steps}
    whole = set(reused.get("cond", ())) & set(reused.get("uncond", ()))
    anchor, err, out, alone = None, 0.0, [], False  # alone: a cond-alone step since the anchor
    for i in range(n):
        h = i - anchor if anchor is not None else width + 1
        if i in skipped:
            if i in whole and alone and h <= width:
                err += float(errors[i, h - 1])
                out.append(i)
            continue
        forced = i < config.warmup_steps or i >= n - config.final_steps or experts[i - 1] != experts[i]
        if not forced and h <= width and err + float(errors[i, h - 1]) <= budget:  # NaN: False
            err += float(errors[i, h - 1])
            out.append(i)
            alone = True
            continue
        anchor, err, alone = i, 0.0, False
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CacheSchedule:
    """The sampler's step cache when serving: ``reused[branch]`` lists the steps that skip that
    branch's call and take :func:`extrapolate` of its computed outputs at ``order`` (0: plain reuse),
    except the steps of ``cfg_delta`` (all in ``reused["uncond"]``): there uncond is this step's cond
    (computed, or estimated as above) plus :func:`extrapolate` (``cfg_order``) of the branch difference
    at the expert's last steps computing both. ``damping`` shrinks the order-1 line of the branch outputs
    toward plain reuse (:func:`extrapolate`). It holds only for ``num_steps``-step trajectories."""

    num_steps: int
    reused: Mapping[str, tuple[int, ...]]
    order: int = 0
    cfg_delta: tuple[int, ...] = ()
    cfg_order: int = 0
    damping: float = 1.0

    def reuse(self, step: int, branch: str) -> bool:
        return step in self.reused.get(branch, ())

    def estimate(self, step: int, branch: str, history: Mapping[str, Sequence[tuple[float, Any]]], timestep: float,
                 computed: Mapping[str, Any]):
        """``branch``'s output at ``step`` from ``history`` (per branch and :data:`~trt_sora.sampling.CFG_DELTA`:
        the last two computed ``(timestep, output)``, oldest first) and this step's ``computed`` outputs."""
        if branch != "uncond" or step not in self.cfg_delta:
            return extrapolate(history[branch], timestep, self.order, self.damping)
        if CFG_DELTA not in history or not ("cond" in computed or "cond" in history):
            raise ConfigError(f"the step cache estimates uncond at step {step} from cond and the branch difference, "
                              "but no earlier step of this expert computed both branches; re-plan the schedule "
                              "with `trt-sora check`")
        cond = computed["cond"] if "cond" in computed else extrapolate(history["cond"], timestep, self.order,
                                                                      self.damping)
        return cond + extrapolate(history[CFG_DELTA], timestep, self.cfg_order)

    def observe(self, step: int, branch: str, output, timestep: float | None = None) -> None:
        return None

    def calls(self, branches_per_step: Sequence[Sequence[str]]) -> tuple[int, int]:
        """``(computed, uncached)`` branch evaluations over steps running ``branches_per_step[i]``."""
        total = sum(len(bs) for bs in branches_per_step)
        return total - sum(1 for i, bs in enumerate(branches_per_step) for b in bs if self.reuse(i, b)), total

    def to_dict(self) -> dict[str, Any]:
        cfg = {"cfg_delta": list(self.cfg_delta), "cfg_order": self.cfg_order} if self.cfg_delta else {}
        damped = {"damping": self.damping} if self.damping != 1.0 else {}  # left out at 1: old records unchanged
        return {"num_steps": self.num_steps, "reused": {b: list(s) for b, s in self.reused.items()},
                "order": self.order, **cfg, **damped}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "caching schedule") -> CacheSchedule:
        try:
            reused = {str(b): tuple(int(s) for s in steps) for b, steps in d["reused"].items()}
            num_steps, order = int(d["num_steps"]), int(d.get("order", 0))
            cfg_delta, cfg_order = tuple(int(s) for s in d.get("cfg_delta", ())), int(d.get("cfg_order", 0))
            damping = float(d.get("damping", 1.0))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ArtifactError(f"{where} is not a step schedule of this trt_sora; re-run `trt-sora check`") from None
        if not 0.0 < damping <= 1.0:
            raise ArtifactError(f"{where} damps its line by {damping} (this trt_sora takes 0 < damping <= 1); "
                                "re-run `trt-sora check`")
        if order not in (0, 1) or cfg_order not in CFG_ORDERS:
            raise ArtifactError(f"{where} extrapolates at order {order} / cfg_order {cfg_order} (this trt_sora knows "
                                "0 and 1); re-run `trt-sora check`")
        if any(b not in CACHE_BRANCHES or any(not 0 < s < num_steps for s in st) for b, st in reused.items()):
            raise ArtifactError(f"{where} names an unknown branch or a step outside 1..{num_steps - 1}; re-run "
                                "`trt-sora check`")
        if not set(cfg_delta) <= set(reused.get("uncond", ())):
            raise ArtifactError(f"{where} estimates uncond from cond at steps {list(cfg_delta)} that do not reuse "
                                "uncond; re-run `trt-sora check`")
        return cls(num_steps, reused, order, cfg_delta, cfg_order, damping)


def step_experts(settings, timesteps: Sequence[float]) -> list[str | None]:
    """The expert serving each timestep (``None`` for one model)."""
    return [settings.expert_at(float(t)) for t in timesteps]


def schedule_for(config: CachingConfig, ratios: StepRatios, settings, timesteps: Sequence[float],
                 threshold: float | None = None) -> CacheSchedule:
    """The schedule of ``settings``' trajectory (``timesteps``: the scheduler's) from calibrated ratios.

    ConfigError when the ratios were calibrated over another step count: a schedule is planned from
    this model's statistics at the steps users run, never extrapolated."""
    n = settings.num_steps
    if ratios.steps != tuple(range(n)):
        raise ConfigError(f"caching: the calibrated step ratios cover steps {list(ratios.steps)[:3]}.. of a "
                          f"{len(ratios.steps)}-step trajectory but this loop runs {n} steps; calibrate at the "
                          "sampling settings the check runs (calibration.num_steps / parity.loop_steps)")
    experts = step_experts(settings, timesteps)
    if config.method is CacheMethod.EXTRAPOLATE:
        if not ratios.errors:
            raise ArtifactError("caching.method=extrapolate needs the extrapolation errors the calibrate stage "
                                "records; this calibration predates them: re-run `trt-sora calibrate`")
        errors = {b: ratios.mean_errors(b) for b in ratios.errors}
        plan = plan_global if config.plan is CachePlan.GLOBAL else plan_extrapolated
        return _with_cfg_reuse(CacheSchedule(n, plan(errors, experts, config, threshold), order=1,
                                             damping=config.damping), config, ratios, experts)
    means = {b: list(ratios.mean(b)) for b in ratios.ratios}
    return _with_cfg_reuse(CacheSchedule(n, plan_schedule(means, experts, config, threshold)), config, ratios, experts)


def _with_cfg_reuse(schedule: CacheSchedule, config: CachingConfig, ratios: StepRatios,
                    experts: Sequence[str | None]) -> CacheSchedule:
    """``schedule`` with the uncond estimates of ``caching.cfg_reuse`` added (unchanged when it is off or the
    calibration ran no uncond branch)."""
    if not config.cfg_reuse or "uncond" not in ratios.ratios:
        return schedule
    if config.cfg_order not in ratios.cfg_errors:
        raise ArtifactError("caching.cfg_reuse needs the CFG-difference errors the calibrate stage records; this "
                            "calibration predates them: re-run `trt-sora calibrate`")
    cfg = plan_cfg_reuse(ratios.mean_cfg_errors(config.cfg_order), experts, config, schedule.reused)
    reused = {**schedule.reused, "uncond": tuple(sorted({*schedule.reused.get("uncond", ()), *cfg}))}
    return dataclasses.replace(schedule, reused=reused, cfg_delta=cfg, cfg_order=config.cfg_order)


def caching_record(config: CachingConfig, schedule: CacheSchedule, settings, computed: int, total: int) -> dict:
    """What a report or a clip's metadata says of a cached trajectory."""
    return {"setting": config.setting(), "sampling": settings.to_dict(), "schedule": schedule.to_dict(),
            "calls": computed, "calls_uncached": total, "saved_fraction": round(1.0 - computed / max(total, 1), 6)}
