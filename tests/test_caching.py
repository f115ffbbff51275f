"""Step caching (trt_sora.caching): the schedule rule on hand-worked ratio sequences, per CFG branch and
across a pair's expert switch; the sampler reusing exactly the scheduled outputs (against a loop written
out); the calibrated magnitude ratios against an independent computation from a recorded trajectory."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from caching_helpers import error_table  # noqa: E402

from trt_sora.caching import (  # noqa: E402
    HORIZONS,
    CacheSchedule,
    MagnitudeRecorder,
    StepRatios,
    extrapolate,
    plan_extrapolated,
    plan_schedule,
    schedule_for,
    step_experts,
)
from trt_sora.config import CachingConfig, load_recipe, recipe_from_dict, recipe_to_dict  # noqa: E402
from trt_sora.errors import ArtifactError, ConfigError  # noqa: E402
from trt_sora.sampling import SamplingSettings, gaussian_noise, sample  # noqa: E402

ON = CachingConfig(method="magcache", threshold=0.1, max_skips=2, warmup_steps=2, final_steps=1)


def _scheduler(shift=3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _toy(inputs):
    """A velocity that depends on x, t and the text embedding, per row (so branches differ)."""
    x, t, e = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    return 0.3 * x + (t / 1000.0).view(-1, 1, 1, 1, 1) + e.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)


# -- the rule -----------------------------------------------------------------------------------------
def test_schedule_on_hand_worked_ratios_per_branch():
    """Worked by hand: cond 2: err .02; 3: acc .9506, err .0694; 4: err .1283 > .1 -> compute; 5: .12 ->
    compute; 6: .01; 7: .0299; 8: a third skip -> compute; 9: final. uncond 2: .15 -> compute; 3, 4
    reuse; 5: third skip; 6, 7 reuse; 8: third skip; 9 final."""
    cond = [1.0, 0.5, 0.98, 0.97, 0.99, 0.88, 0.99, 0.99, 0.99, 0.99]
    uncond = [1.0, 1.0, 0.85, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99]
    got = plan_schedule({"cond": cond, "uncond": uncond}, [None] * 10, ON)
    assert got == {"cond": (2, 3, 6, 7), "uncond": (3, 4, 6, 7)}
    # per-branch decisions: a branch the recipe keeps computing never reuses
    only = plan_schedule({"cond": cond, "uncond": uncond}, [None] * 10,
                         CachingConfig(method="magcache", threshold=0.1, branches=("uncond",)))
    assert only == {"cond": (), "uncond": (3, 4, 6, 7)}
    # a larger budget reuses more; a tiny one nothing
    assert plan_schedule({"cond": cond}, [None] * 10, ON, threshold=0.2)["cond"] == (2, 3, 5, 7, 8)
    assert plan_schedule({"cond": cond}, [None] * 10, ON, threshold=0.005)["cond"] == ()


def test_warmup_final_and_max_skips():
    flat = [1.0] * 10
    cfg = CachingConfig(method="magcache", threshold=0.1, max_skips=3, warmup_steps=3, final_steps=2)
    assert plan_schedule({"cond": flat}, [None] * 10, cfg)["cond"] == (3, 4, 5, 7)
    # NaN (the branch did not run there in calibration): that step computes
    assert plan_schedule({"cond": [1.0, 1.0, 1.0, math.nan, 1.0, 1.0]}, [None] * 6, ON)["cond"] == (2, 4)


def test_expert_switch_forces_a_compute():
    """Without a switch steps 2-4 and 6-8 reuse (max_skips 3); the low-noise expert's first step (4)
    computes, because the cached output is the high-noise expert's."""
    flat = [1.0] * 10
    cfg = CachingConfig(method="magcache", threshold=0.1, max_skips=3, warmup_steps=2, final_steps=1)
    assert plan_schedule({"cond": flat}, [None] * 10, cfg)["cond"] == (2, 3, 4, 6, 7, 8)
    pair = ["high"] * 4 + ["low"] * 6
    assert plan_schedule({"cond": flat, "uncond": flat}, pair, cfg) == {"cond": (2, 3, 5, 6, 7),
                                                                        "uncond": (2, 3, 5, 6, 7)}


EXTRA = CachingConfig(method="extrapolate", threshold=0.1, max_skips=3, warmup_steps=2, final_steps=1)


def test_extrapolated_schedule_on_hand_worked_errors():
    """One decision per step for both branches, on the worse branch's error at the run's horizon k.
    Worked by hand (budget .1, max_skips 3): 2: k1, max(.02, .03) -> .03 reuse; 3: k2, +.05 = .08 reuse;
    4: k3, +.04 = .12 -> compute; 5: k1, .09 reuse; 6: k2, +.2 -> compute; 7: k1 .01; 8: k2 .03; 9: k3
    .06 reuse; 10: a fourth in a row -> compute; 11: final."""
    cond = error_table(12, {2: (1, .02), 3: (2, .05), 4: (3, .04), 5: (1, .09), 6: (2, .2), 7: (1, .01),
                        8: (2, .02), 9: (3, .03), 10: (None, 0.0), 11: (None, 0.0)})
    uncond = error_table(12, {2: (1, .03), 3: (2, .04), 4: (3, .01), 5: (1, .01), 6: (2, .01), 7: (1, .01),
                          8: (2, .01), 9: (3, .01), 10: (None, 0.0), 11: (None, 0.0)})
    want = (2, 3, 5, 7, 8, 9)
    assert plan_extrapolated({"cond": cond, "uncond": uncond}, [None] * 12, EXTRA) == {"cond": want, "uncond": want}
    # only uncond may reuse: its errors alone decide, cond always computes. 2-4 reuse (.08); 5: a fourth
    # in a row; 6: k1 is .5; 7-9 reuse; 10: a fourth in a row
    only = dataclasses.replace(EXTRA, branches=("uncond",))
    assert plan_extrapolated({"cond": cond, "uncond": uncond}, [None] * 12, only) == {
        "cond": (), "uncond": (2, 3, 4, 7, 8, 9)}
    # a tight budget: only .01 at k1 (7) and 0 (10) fit
    assert plan_extrapolated({"cond": cond}, [None] * 12, EXTRA, threshold=0.01)["cond"] == (7, 10)
    # NaN (no recorded error there): the step computes, and the next one starts a new run at k1
    cond[8, 1] = np.nan
    assert plan_extrapolated({"cond": cond}, [None] * 12, EXTRA)["cond"] == (2, 3, 5, 7, 10)


def test_extrapolated_schedule_switch_warmup_and_horizons():
    flat = error_table(10, {i: (None, 0.0) for i in range(10)})
    cfg = CachingConfig(method="extrapolate", threshold=0.1, max_skips=2, warmup_steps=3, final_steps=2)
    assert plan_extrapolated({"cond": flat}, [None] * 10, cfg)["cond"] == (3, 4, 6, 7)
    pair = ["high"] * 4 + ["low"] * 6  # the low expert's first step (4) computes for both branches
    assert plan_extrapolated({"cond": flat, "uncond": flat}, pair, cfg) == {"cond": (3, 5, 6), "uncond": (3, 5, 6)}
    with pytest.raises(ConfigError, match="at most 4"):
        plan_extrapolated({"cond": flat}, [None] * 10, CachingConfig(method="extrapolate", max_skips=HORIZONS + 1))


def test_extrapolate_arithmetic():
    """The line through the newest two outputs, in the timestep; one output alone is reused."""
    y0, y1 = torch.tensor([1.0, -2.0]), torch.tensor([2.0, 0.0])
    # through (900, y0), (800, y1) at 650: y1 + (y1 - y0) * (650 - 800) / (800 - 900) = y1 + 1.5 (y1 - y0)
    torch.testing.assert_close(extrapolate([(900.0, y0), (800.0, y1)], 650.0, 1), torch.tensor([3.5, 3.0]))
    assert extrapolate([(900.0, y0), (800.0, y1)], 650.0, 0) is y1
    assert extrapolate([(800.0, y1)], 650.0, 1) is y1


def test_damped_line_arithmetic():
    """``damping`` takes that share of the line's step from the newest output; 1 is the line, bit for bit."""
    y0, y1 = torch.tensor([1.0, -2.0]), torch.tensor([2.0, 0.0])
    hist = [(900.0, y0), (800.0, y1)]
    # y1 + 0.5 * 1.5 (y1 - y0) = [2 + 0.75, 0 + 1.5]
    torch.testing.assert_close(extrapolate(hist, 650.0, 1, 0.5), torch.tensor([2.75, 1.5]))
    assert torch.equal(extrapolate(hist, 650.0, 1, 1.0), extrapolate(hist, 650.0, 1))
    assert extrapolate(hist, 650.0, 0, 0.5) is y1


def test_extrapolate_order2_is_the_parabola():
    """Order 2 continues the parabola through the newest three: exact on y = t^2 - 1000 t (order 1 is not);
    with two outputs it is the line."""
    ts = (900.0, 850.0, 700.0)
    hist = [(t, torch.tensor([t * t - 1000.0 * t], dtype=torch.float64)) for t in ts]
    # at 600: 360000 - 600000 = -240000; the line through (850, -127500), (700, -210000):
    # -210000 + (-82500 / -150) * (600 - 700) = -265000
    assert extrapolate(hist, 600.0, 2).item() == pytest.approx(-240000.0, rel=1e-12)
    assert extrapolate(hist, 600.0, 1).item() == pytest.approx(-265000.0, rel=1e-12)
    torch.testing.assert_close(extrapolate(hist[1:], 600.0, 2), extrapolate(hist[1:], 600.0, 1))


# -- the sampler -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", ["split", "batched"])
def test_sampler_reuses_exactly_the_scheduled_outputs(cfg):
    noise = gaussian_noise((2, 3, 2, 4, 4), seed=5)
    e_c, e_u = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    settings = SamplingSettings(num_steps=8, guidance_scale=4.0, shift=3.0)
    schedule = CacheSchedule(8, {"cond": (2, 3, 5), "uncond": (3, 4, 6)})
    seen = []
    res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg=cfg, cache=schedule,
                 hook=lambda c: seen.append((c.step, c.branches)))
    calls = {(s, b) for s, bs in seen for b in bs}
    assert calls == {(s, b) for s in range(8) for b in ("cond", "uncond") if not schedule.reuse(s, b)}
    if cfg == "batched":  # both branches computing share one call; a lone branch calls alone
        assert (0, ("cond", "uncond")) in seen and (2, ("uncond",)) in seen and (3, ("cond", "uncond")) not in seen
    assert [r.reused for r in res.steps] == [(), (), ("cond",), ("cond", "uncond"), ("uncond",), ("cond",),
                                             ("uncond",), ()]
    assert schedule.calls([("cond", "uncond")] * 8) == (10, 16)
    # the loop written out: a reused branch's velocity is its last computed one
    s = _scheduler()
    s.set_timesteps(8)
    x, last = noise.double(), {}
    for i, t in enumerate(s.timesteps):
        ts = t.double().expand(2)
        for b, e in (("cond", e_c), ("uncond", e_u)):
            if not schedule.reuse(i, b):
                last[b] = _toy({"hidden_states": x, "timestep": ts, "encoder_hidden_states": e.double()})
        x = x + (float(s.sigmas[i + 1]) - float(s.sigmas[i])) * (last["uncond"] + 4.0 * (last["cond"] - last["uncond"]))
    torch.testing.assert_close(res.latents.double(), x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("damping", [1.0, 0.5])
def test_sampler_extrapolates_reused_outputs(damping):
    """order 1: a skipped branch continues the line through its last two computed outputs in the
    timestep, shrunk by ``damping`` toward the newest (against the loop written out); step 1 after one
    computed step reuses it."""
    noise = gaussian_noise((2, 3, 2, 4, 4), seed=6)
    e_c, e_u = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    settings = SamplingSettings(num_steps=8, guidance_scale=4.0, shift=3.0)
    schedule = CacheSchedule(8, {"cond": (1, 3, 4, 6), "uncond": (1, 3, 4, 6)}, order=1, damping=damping)
    res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg="batched", cache=schedule)
    assert CacheSchedule.from_dict(schedule.to_dict()) == schedule
    assert ("damping" in schedule.to_dict()) is (damping != 1.0)  # records of undamped schedules unchanged
    s = _scheduler()
    s.set_timesteps(8)
    x, done = noise.double(), {"cond": [], "uncond": []}
    for i, t in enumerate(s.timesteps):
        ts, v = t.double().expand(2), {}
        for b, e in (("cond", e_c), ("uncond", e_u)):
            if i in schedule.reused[b]:
                (t0, y0), (t1, y1) = done[b][-2:] if len(done[b]) > 1 else done[b] * 2
                v[b] = y1 if t0 == t1 else y1 + damping * (y1 - y0) * (float(t) - t1) / (t1 - t0)
            else:
                v[b] = _toy({"hidden_states": x, "timestep": ts, "encoder_hidden_states": e.double()})
                done[b].append((float(t), v[b]))
        x = x + (float(s.sigmas[i + 1]) - float(s.sigmas[i])) * (v["uncond"] + 4.0 * (v["cond"] - v["uncond"]))
    torch.testing.assert_close(res.latents.double(), x, rtol=1e-5, atol=1e-6)
    plain = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg="batched",
                   cache=dataclasses.replace(schedule, order=0))
    assert not torch.allclose(plain.latents, res.latents, rtol=1e-3, atol=1e-4)


def test_a_schedule_reusing_before_any_compute_is_refused():
    with pytest.raises(ConfigError, match="no computed output yet"):
        sample(_toy, gaussian_noise((1, 3, 2, 4, 4), 0), torch.ones(1, 5, 8), torch.zeros(1, 5, 8),
               scheduler=_scheduler(), settings=SamplingSettings(4, 4.0, 3.0), cache=CacheSchedule(4, {"cond": (0,)}))
    with pytest.raises(ArtifactError, match="outside"):
        CacheSchedule.from_dict({"num_steps": 4, "reused": {"cond": [0]}})
    with pytest.raises(ArtifactError, match="order 2"):
        CacheSchedule.from_dict({"num_steps": 4, "reused": {"cond": [1]}, "order": 2})
    with pytest.raises(ArtifactError, match="damps its line by 0.0"):
        CacheSchedule.from_dict({"num_steps": 4, "reused": {"cond": [1]}, "order": 1, "damping": 0.0})


def test_pair_switch_computes_the_low_expert_first_step():
    """wan-a14b-style pair: the boundary step calls the low-noise expert for both branches even where
    the ratios would let it reuse, and the clip matches the loop written out with that schedule."""
    pair = SamplingSettings(num_steps=6, guidance_scale=4.0, shift=12.0, boundary_ratio=0.875, guidance_scale_2=3.0)
    sched = _scheduler(12.0)
    sched.set_timesteps(6)
    experts = step_experts(pair, sched.timesteps)
    boundary = experts.index("low")
    assert 1 < boundary < 5
    cfg = CachingConfig(method="magcache", threshold=1.0, max_skips=5, warmup_steps=1, final_steps=0)
    ratios = StepRatios(tuple(range(6)), tuple(float(t) for t in sched.timesteps),
                        {"cond": np.ones((2, 6)), "uncond": np.ones((2, 6))})
    schedule = schedule_for(cfg, ratios, pair, sched.timesteps)
    assert schedule.reused == {b: tuple(i for i in range(1, 6) if i != boundary) for b in ("cond", "uncond")}
    high, low = (lambda inp: 0.5 * _toy(inp)), (lambda inp: -0.25 * _toy(inp))
    seen = []
    noise, e_c, e_u = gaussian_noise((1, 2, 2, 2, 2), seed=0), torch.ones(1, 3, 4), -torch.ones(1, 3, 4)
    res = sample({"high": high, "low": low}, noise, e_c, e_u, scheduler=_scheduler(12.0), settings=pair,
                 cache=schedule, hook=lambda c: seen.append((c.step, c.expert, c.branch)))
    assert seen == [(0, "high", "cond"), (0, "high", "uncond"), (boundary, "low", "cond"), (boundary, "low", "uncond")]
    x, last = noise.double(), {}
    for i, t in enumerate(sched.timesteps):
        f, g = (high, 4.0) if experts[i] == "high" else (low, 3.0)
        if i in (0, boundary):
            ts = t.double().expand(1)
            last = {b: f({"hidden_states": x, "timestep": ts, "encoder_hidden_states": e.double()})
                    for b, e in (("cond", e_c), ("uncond", e_u))}
        v = last["uncond"] + g * (last["cond"] - last["uncond"])
        x = x + (float(sched.sigmas[i + 1]) - float(sched.sigmas[i])) * v
    torch.testing.assert_close(res.latents.double(), x, rtol=1e-5, atol=1e-6)


def test_extrapolated_pair_schedule_from_calibrated_errors():
    """schedule_for plans ``extrapolate`` from the calibrated mean errors: order 1, the low expert's first
    step computes for both branches, and a calibration without errors names the fix."""
    pair = SamplingSettings(num_steps=6, guidance_scale=4.0, shift=12.0, boundary_ratio=0.875, guidance_scale_2=3.0)
    sched = _scheduler(12.0)
    sched.set_timesteps(6)
    boundary = step_experts(pair, sched.timesteps).index("low")
    cfg = CachingConfig(method="extrapolate", threshold=1.0, max_skips=4, warmup_steps=1, final_steps=0)
    ts = tuple(float(t) for t in sched.timesteps)
    errors = {b: np.full((2, 6, HORIZONS), 0.01) for b in ("cond", "uncond")}
    ratios = StepRatios(tuple(range(6)), ts, {b: np.ones((2, 6)) for b in errors}, errors)
    schedule = schedule_for(cfg, ratios, pair, sched.timesteps)
    assert schedule.order == 1 and schedule.damping == 1.0
    damped = schedule_for(dataclasses.replace(cfg, damping=0.5), ratios, pair, sched.timesteps)
    assert damped == dataclasses.replace(schedule, damping=0.5)
    assert schedule.reused == {b: tuple(i for i in range(1, 6) if i != boundary) for b in ("cond", "uncond")}
    seen = []
    sample({"high": _toy, "low": lambda inp: -_toy(inp)}, gaussian_noise((1, 2, 2, 2, 2), seed=0), torch.ones(1, 3, 4),
           -torch.ones(1, 3, 4), scheduler=_scheduler(12.0), settings=pair, cache=schedule,
           hook=lambda c: seen.append((c.step, c.expert, c.branch)))
    assert seen == [(0, "high", "cond"), (0, "high", "uncond"), (boundary, "low", "cond"), (boundary, "low", "uncond")]
    with pytest.raises(ArtifactError, match="re-run `trt-sora calibrate`"):
        schedule_for(cfg, dataclasses.replace(ratios, errors={}), pair, sched.timesteps)


# -- the statistics ---------------------------------------------------------------------------------
def test_recorded_ratios_match_an_independent_computation(tmp_path):
    """The recorder's ratios vs numpy on the outputs recomputed from a recorded trajectory's latents."""
    settings = SamplingSettings(num_steps=5, guidance_scale=4.0, shift=3.0)
    rec = MagnitudeRecorder(5)
    rows = []
    for seed in (1, 2):  # two trajectories of two prompts each: four rows
        noise = gaussian_noise((2, 3, 2, 4, 4), seed=seed)
        e_c, e_u = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed)), torch.zeros(2, 5, 8)
        res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg="batched",
                     keep=("latents",), cache=rec)
        plain = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg="batched")
        torch.testing.assert_close(res.latents, plain.latents, rtol=0, atol=0)  # recording changes nothing
        entering = [noise] + [r.latents for r in res.steps[:-1]]
        ts = [r.timestep for r in res.steps]
        for b, e in (("cond", e_c), ("uncond", e_u)):
            vs = [_toy({"hidden_states": x, "timestep": torch.full((2,), r.timestep),
                        "encoder_hidden_states": e}).numpy().astype(np.float64) for x, r in zip(entering, res.steps)]
            mags = [np.sqrt((v ** 2).sum(axis=1)).reshape(2, -1).mean(axis=1) for v in vs]
            rows.append((b, np.stack([np.ones(2)] + [mags[i] / mags[i - 1] for i in range(1, 5)], axis=1),
                         _line_errors(vs, ts)))
    got = rec.ratios()
    for b in ("cond", "uncond"):
        want = np.concatenate([r for bb, r, _ in rows if bb == b])
        np.testing.assert_allclose(got.ratios[b], want, rtol=1e-5)
        want_err = np.concatenate([e for bb, _, e in rows if bb == b])
        assert np.array_equal(np.isnan(got.errors[b]), np.isnan(want_err))
        np.testing.assert_allclose(got.errors[b], want_err, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(got.mean_errors(b), want_err.mean(axis=0), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(got.mean(b), want.mean(axis=0), rtol=1e-5)
        np.testing.assert_allclose(got.std(b), want.std(axis=0), rtol=1e-4, atol=1e-7)
    got.save(tmp_path / "r.safetensors")
    back = StepRatios.load(tmp_path / "r.safetensors")
    assert back.steps == tuple(range(5)) and np.array_equal(back.ratios["cond"], got.ratios["cond"])
    assert np.array_equal(back.errors["uncond"], got.errors["uncond"], equal_nan=True)
    both = StepRatios.merged([back, back])
    assert both.ratios["uncond"].shape == (8, 5) and both.errors["cond"].shape == (8, 5, HORIZONS)
    np.testing.assert_allclose(both.mean("uncond"), got.mean("uncond"))


def _line_errors(vs, ts):
    """``[rows, steps, HORIZONS]``: per row, |pred - v_i| / |v_i| with pred the line through the outputs
    h + 1 and h steps back evaluated at t_i (the output h steps back alone at the start)."""
    out = np.full((vs[0].shape[0], len(vs), HORIZONS), np.nan)
    for i in range(len(vs)):
        for h in range(1, min(i, HORIZONS) + 1):
            a = i - h
            pred = vs[a] if a == 0 else vs[a] + (vs[a] - vs[a - 1]) * (ts[i] - ts[a]) / (ts[a] - ts[a - 1])
            diff, ref = (pred - vs[i]).reshape(len(pred), -1), vs[i].reshape(len(pred), -1)
            out[:, i, h - 1] = np.linalg.norm(diff, axis=1) / np.linalg.norm(ref, axis=1)
    return out


def test_experts_files_join_into_one_trajectory():
    high = StepRatios((0, 1), (999.0, 950.0), {"cond": np.array([[1.0, 0.9]])})
    low = StepRatios((2, 3, 4), (800.0, 500.0, 100.0), {"cond": np.array([[1.1, 0.95, 0.8]])})
    j = StepRatios.joined([low, high])
    assert j.steps == (0, 1, 2, 3, 4) and j.timesteps == (999.0, 950.0, 800.0, 500.0, 100.0)
    np.testing.assert_array_equal(j.ratios["cond"], [[1.0, 0.9, 1.1, 0.95, 0.8]])
    with pytest.raises(ConfigError, match="runs 4 steps"):
        schedule_for(ON, high, SamplingSettings(4, 4.0, 3.0), [999.0, 800.0, 500.0, 100.0])


def test_missing_ratios_file_names_the_fix(tmp_path):
    with pytest.raises(ArtifactError, match="trt-sora calibrate"):
        StepRatios.load(tmp_path / "step_ratios.safetensors")


def test_an_attention_mass_file_is_not_read_as_step_ratios(tmp_path):
    from trt_sora.sparse import AttentionMass

    AttentionMass(("blocks.0",), (0,), ((1, 1, 1),), (1, 8, 16), 0, np.zeros((1, 1, 1))).save(tmp_path / "m.st")
    with pytest.raises(ArtifactError, match=r"not a step-ratios file .*'trt_sora\.attention_mass/1'.*calibrate"):
        StepRatios.load(tmp_path / "m.st")


# -- the recipe section -----------------------------------------------------------------------------
def test_caching_is_off_by_default_in_every_recipe():
    from trt_sora.config import list_recipes

    for name in list_recipes():
        assert not load_recipe(name).caching.enabled


@pytest.mark.parametrize("section,match", [
    ({"method": "magcash"}, "did you mean 'magcache'"),
    ({"treshold": 0.1}, "did you mean 'threshold'"),
    ({"threshold": 0.0}, r"caching.threshold=0.0 is outside \(0, 10\]"),
    ({"max_skips": 0}, "max_skips=0 must be >= 1"),
    ({"warmup_steps": 0}, "warmup_steps=0 must be >= 1"),
    ({"branches": ["cnd"]}, "did you mean 'cond'"),
    ({"branches": ["cond", "cond"]}, "once"),
    ({"sweep": [0.1, -1]}, "caching.sweep"),
    ({"method": "extrapolate", "damping": 1.5}, r"caching.damping=1.5 is outside \(0, 1\]"),
    ({"method": "magcache", "damping": 0.5}, "damping shrinks the line of method: extrapolate"),
])
def test_bad_caching_section_is_a_typed_error(section, match):
    raw = recipe_to_dict(load_recipe("rtx4090-fp8"))
    raw["caching"] = {**raw["caching"], **section}
    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(raw)


def test_caching_setting_names_damping_only_when_it_damps():
    """A recipe without the key keeps its setting (records, fingerprints) as before the key existed."""
    plain = CachingConfig(method="extrapolate", threshold=0.8, max_skips=3, warmup_steps=10, plan="global")
    assert "damping" not in plain.setting()
    assert dataclasses.replace(plain, damping=0.5).setting() == {**plain.setting(), "damping": 0.5}


def test_caching_section_round_trips():
    raw = recipe_to_dict(load_recipe("rtx4090-fp8"))
    raw["caching"] = {"method": "magcache", "threshold": 0.2, "branches": ["uncond"], "sweep": [0.05, 0.4]}
    r = recipe_from_dict(raw)
    assert r.caching.enabled and r.caching.branches == ("uncond",) and r.caching.sweep == (0.05, 0.4)
    assert recipe_from_dict(recipe_to_dict(r)) == r
