"""``caching.plan: global`` (trt_sora.caching.plan_global): one error budget for the whole trajectory, the
most reused steps whose least summed error fits it, on hand-worked error tables, both branches, the forced
steps and a pair's switch; against every subset of the steps on random tables; recipe parsing and the
records of recipes without the key."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from trt_sora.caching import HORIZONS, StepRatios, plan_extrapolated, plan_global, schedule_for
from trt_sora.config import CachingConfig, load_recipe, recipe_from_dict, recipe_to_dict
from trt_sora.config.base import to_dict
from trt_sora.errors import ConfigError
from trt_sora.sampling import SamplingSettings

GLOBAL = CachingConfig(method="extrapolate", plan="global", threshold=0.1, max_skips=2, warmup_steps=2,
                       final_steps=1)


def _table(n: int, h1: dict, h2: dict) -> np.ndarray:
    """``[n, HORIZONS]`` errors: ``h1[step]`` at horizon 1, ``h2[step]`` at 2, NaN elsewhere."""
    out = np.full((n, HORIZONS), np.nan)
    for col, at in enumerate((h1, h2)):
        for i, e in at.items():
            out[i, col] = e
    return out


H1 = {1: .03, 2: .01, 3: .02, 4: .015, 5: .05}
H2 = {2: .04, 3: .01, 4: .05, 5: .012}


def test_global_plan_on_hand_worked_errors():
    """cond alone, steps 1-5 free (warm-up 1, final 1), runs of at most 2. The least summed errors per count:
    1: {2} .01; 2: {2, 3} .01 + .01 at horizon 2 = .02 (before {2, 4} .025); 3: {2, 4, 5} .01 + .015 + .012 =
    .037 (before {1, 4, 5} .057); 4: {1, 2, 4, 5} .03 + .04 + .015 + .012 = .097 (the only one). Each budget
    takes the most steps that fit, so the calls saved grow while the steps need not be nested."""
    cond = _table(7, H1, H2)
    cfg = dataclasses.replace(GLOBAL, warmup_steps=1)
    got = {b: plan_global({"cond": cond}, [None] * 7, cfg, threshold=b)["cond"] for b in (.005, .015, .03, .05, .2)}
    assert got == {.005: (), .015: (2,), .03: (2, 3), .05: (2, 4, 5), .2: (1, 2, 4, 5)}
    # the per-run rule on the same table: 1 (.03); 2 at horizon 2 (+.04) computes; 3 (.02); 4 computes; 5 (.05)
    assert plan_extrapolated({"cond": cond}, [None] * 7, cfg, threshold=.05)["cond"] == (1, 3, 5)


def test_global_plan_decides_both_branches_on_the_worse():
    """uncond as cond but .02 at step 3, horizon 2: the worse branch makes {2, 3} cost .03, so two steps are
    {2, 4} (.025, before {4, 5} .027); with only cond deciding, uncond computes every step and cond keeps {2, 3}."""
    errors = {"cond": _table(7, H1, H2), "uncond": _table(7, H1, {**H2, 3: .02})}
    cfg = dataclasses.replace(GLOBAL, warmup_steps=1)
    assert plan_global(errors, [None] * 7, cfg, threshold=.03) == {"cond": (2, 4), "uncond": (2, 4)}
    only = dataclasses.replace(cfg, branches=("cond",))
    assert plan_global(errors, [None] * 7, only, threshold=.03) == {"cond": (2, 3), "uncond": ()}


def test_global_plan_keeps_forced_steps_runs_and_nan():
    flat = _table(10, dict.fromkeys(range(10), .01), dict.fromkeys(range(10), .02))
    cfg = dataclasses.replace(GLOBAL, warmup_steps=3, final_steps=2, threshold=1.0)
    # 3-7 free, runs of 2: four steps at most, one way
    assert plan_global({"cond": flat}, [None] * 10, cfg)["cond"] == (3, 4, 6, 7)
    pair = ["high"] * 4 + ["low"] * 6  # the low expert's first step (4) computes for both branches
    assert plan_global({"cond": flat, "uncond": flat}, pair, cfg) == {"cond": (3, 5, 7), "uncond": (3, 5, 7)}
    with_nan = flat.copy()
    with_nan[6, 0] = np.nan  # no recorded error at 6, horizon 1: {3, 4, 6, 7} is out, three steps fit
    assert plan_global({"cond": with_nan}, [None] * 10, cfg)["cond"] == (3, 5, 7)
    with pytest.raises(ConfigError, match="at most 4"):
        plan_global({"cond": flat}, [None] * 10, dataclasses.replace(GLOBAL, max_skips=HORIZONS + 1))


def _summed_errors(worst: np.ndarray, reused) -> float:
    """A plan's error written out: each reused step at its place in its run (inf past 3 in a row or at NaN)."""
    total, k = 0.0, 0
    for i in range(worst.shape[0]):
        k = k + 1 if i in reused else 0
        total += (worst[i, k - 1] if k <= 3 else math.inf) if k else 0.0
    return total if math.isfinite(total) else math.inf


@pytest.mark.parametrize("seed", range(4))
def test_global_plan_is_the_least_error_plan_of_every_subset(seed):
    """Random tables (some NaN) against every subset of the free steps: at each budget the plan reuses the
    most steps any subset within the budget reuses, at the least summed error of that many; the count never
    falls as the budget grows."""
    rng = np.random.default_rng(seed)
    n = 14
    errors = {b: rng.uniform(0.0, 0.1, (n, HORIZONS)) * np.arange(1, HORIZONS + 1) for b in ("cond", "uncond")}
    errors["uncond"][rng.integers(2, n - 1, 2), rng.integers(0, 3, 2)] = np.nan
    cfg = dataclasses.replace(GLOBAL, max_skips=3, warmup_steps=2, final_steps=1)
    worst = np.maximum(errors["cond"], errors["uncond"])
    least: dict[int, float] = {}
    for bits in range(1 << (n - 3)):
        steps = [2 + j for j in range(n - 3) if bits >> j & 1]
        least[len(steps)] = min(least.get(len(steps), math.inf), _summed_errors(worst, steps))
    sizes = []
    for budget in np.linspace(0.0, 3.0, 31):
        plan = plan_global(errors, [None] * n, cfg, threshold=float(budget))
        steps = plan["cond"]
        assert plan["uncond"] == steps
        assert len(steps) == max(k for k, e in least.items() if e <= budget)
        assert math.isclose(_summed_errors(worst, steps), least[len(steps)], abs_tol=1e-12)
        sizes.append(len(steps))
    assert sizes == sorted(sizes) and sizes[0] == 0 and sizes[-1] == max(k for k, e in least.items() if e < math.inf)


def test_schedule_for_plans_global_when_asked():
    settings = SamplingSettings(num_steps=7, guidance_scale=4.0, shift=3.0)
    cond = _table(7, H1, H2)
    ratios = StepRatios(tuple(range(7)), tuple(float(1000 - 100 * i) for i in range(7)),
                        {b: np.ones((1, 7)) for b in ("cond", "uncond")}, {b: cond[None] for b in ("cond", "uncond")})
    ts = ratios.timesteps
    cfg = dataclasses.replace(GLOBAL, warmup_steps=1)
    assert schedule_for(cfg, ratios, settings, ts, threshold=.05).reused == {"cond": (2, 4, 5), "uncond": (2, 4, 5)}
    runs = dataclasses.replace(cfg, plan="runs")
    assert schedule_for(runs, ratios, settings, ts, threshold=.05).reused["cond"] == (1, 3, 5)


# -- the recipe key -----------------------------------------------------------------------------------
@pytest.mark.parametrize("section,match", [
    ({"method": "extrapolate", "plan": "globl"}, r"caching.plan: 'globl' is not one of .*did you mean 'global'"),
    ({"method": "magcache", "plan": "global"}, "plan=global budgets the extrapolation errors .* plan: runs"),
])
def test_bad_plan_is_a_typed_error(section, match):
    raw = recipe_to_dict(load_recipe("rtx4090-fp8"))
    raw["caching"] = {**raw["caching"], **section}
    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(raw)


def test_recipes_and_records_without_plan_are_unchanged():
    from trt_sora.runtime.served_caching import caching_mismatch

    runs = CachingConfig(method="extrapolate", threshold=0.05)
    assert runs.setting() == {k: v for k, v in to_dict(runs).items() if k not in ("cfg_reuse", "cfg_order", "plan",
                                                                                          "damping")}
    on = dataclasses.replace(runs, plan="global")
    assert on.setting()["plan"] == "global" and math.isclose(on.setting()["threshold"], 0.05)
    r = dataclasses.replace(load_recipe("rtx4090-fp8"), caching=on)
    assert recipe_from_dict(recipe_to_dict(r)).caching == on
    rep = {"caching": {"setting": runs.setting(), "passed": True}, "candidate": {"backend": "ort"}}
    assert caching_mismatch(runs.setting(), rep, "ort") is None  # a report written before the key existed
    assert "plan: checked None, asked 'global'" in caching_mismatch(on.setting(), rep, "ort")
