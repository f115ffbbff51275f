"""CFG-branch reuse (``caching.cfg_reuse``): which steps call cond alone and estimate uncond as cond plus the
branch difference, on hand-worked errors, composed with the step plan and across a pair's expert switch; the
sampler's estimate against loops written out; the recorded errors against an independent computation; old
step-ratio files and bad settings."""
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
    plan_cfg_reuse,
    schedule_for,
    step_experts,
)
from trt_sora.config import CachingConfig, recipe_from_dict, recipe_to_dict  # noqa: E402
from trt_sora.config.base import to_dict  # noqa: E402
from trt_sora.errors import ArtifactError, ConfigError  # noqa: E402
from trt_sora.sampling import CFG_DELTA, SamplingSettings, gaussian_noise, sample  # noqa: E402

CFG = CachingConfig(method="extrapolate", threshold=0.1, max_skips=2, warmup_steps=2, final_steps=1, cfg_reuse=0.1)
PAIR = SamplingSettings(num_steps=6, guidance_scale=4.0, shift=12.0, boundary_ratio=0.875, guidance_scale_2=3.0)


def _scheduler(shift=3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _toy(inputs):
    """A velocity whose branch difference changes with x and t (so the estimate's order matters)."""
    x, t, e = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    m, s = e.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1), (t / 1000.0).view(-1, 1, 1, 1, 1)
    return x * (0.3 + 0.2 * m) + torch.sin(3.0 * s) * m + s


# -- the plan -----------------------------------------------------------------------------------------
def test_cond_only_steps_on_hand_worked_errors():
    """Budget .1, warm-up 2, final 1. 2: h1 .04 reuse; 3: h2 +.05 = .09 reuse; 4: h3 +.03 = .12 -> both
    compute (anchor); 5: NaN -> anchor; 6-8: .02 each at h1-3 reuse; 9: final."""
    e = error_table(10, {2: (1, .04), 3: (2, .05), 4: (3, .03), 6: (1, .02), 7: (2, .02), 8: (3, .02), 9: (4, 0.0)})
    assert plan_cfg_reuse(e, [None] * 10, CFG, {}) == (2, 3, 6, 7, 8)
    # a step the step plan skips whole (3) after the cond-alone step 2 takes the difference too (h2: .09)
    # and anchors nothing: 4 is h3 from 1, .12 -> anchor; without step 2 before it, 3 keeps uncond's own
    assert plan_cfg_reuse(e, [None] * 10, CFG, {"cond": (3,), "uncond": (3,)}) == (2, 3, 6, 7, 8)
    assert plan_cfg_reuse(e, [None] * 10, dataclasses.replace(CFG, warmup_steps=3), {"cond": (3,), "uncond": (3,)}) \
        == (6, 7, 8)
    # a tighter budget; a step where one branch is reused (2) is skipped here too: 3 and 4 are h2 and h3
    assert plan_cfg_reuse(e, [None] * 10, CFG, {}, budget=0.03) == (6,)
    assert plan_cfg_reuse(e, [None] * 10, CFG, {"cond": (2,), "uncond": ()}) == (3, 4, 6, 7, 8)
    with pytest.raises(ConfigError, match="cover 10 steps"):
        plan_cfg_reuse(e, [None] * 11, CFG, {})


def test_horizon_limit_and_the_pair_switch():
    """At most HORIZONS (4) steps from the last step computing both; the low expert's first step computes
    both (the difference is the expert's own)."""
    flat = error_table(12, {i: (None, 0.0) for i in range(12)})
    cfg = dataclasses.replace(CFG, warmup_steps=1, final_steps=0)
    assert plan_cfg_reuse(flat, [None] * 12, cfg, {}) == (1, 2, 3, 4, 6, 7, 8, 9, 11)
    pair = ["high"] * 4 + ["low"] * 6
    assert plan_cfg_reuse(flat[:10], pair, cfg, {}) == (1, 2, 3, 5, 6, 7, 8)


def test_schedule_composes_step_and_cfg_plans_and_round_trips():
    n, ts = 8, tuple(float(t) for t in np.linspace(999, 100, 8))
    errors = {b: np.full((2, n, HORIZONS), 0.03) for b in ("cond", "uncond")}
    cfg_err = {o: np.full((2, n, HORIZONS), 0.02) for o in (0, 1)}
    ratios = StepRatios(tuple(range(n)), ts, {b: np.ones((2, n)) for b in errors}, errors, cfg_err)
    settings = SamplingSettings(n, 4.0, 3.0)
    cfg = CachingConfig(method="extrapolate", threshold=0.05, max_skips=1, warmup_steps=2, final_steps=1,
                        cfg_reuse=0.05, cfg_order=1)
    s = schedule_for(cfg, ratios, settings, ts)
    # step plan: 2, 4 and 6 estimated whole; cfg: 3 calls cond alone (h2 from 1, .02), so 4 (whole) takes the
    # difference too (h3, .04); 5: h4, .06 > .05 -> both compute; 6 keeps uncond's own line; 7 final
    assert s.reused == {"cond": (2, 4, 6), "uncond": (2, 3, 4, 6)} and s.cfg_delta == (3, 4) and s.cfg_order == 1
    assert s.calls([("cond", "uncond")] * n) == (9, 16)
    assert schedule_for(dataclasses.replace(cfg, cfg_reuse=0.01), ratios, settings, ts).cfg_delta == ()
    d = s.to_dict()
    assert d["cfg_delta"] == [3, 4] and d["cfg_order"] == 1 and CacheSchedule.from_dict(d) == s
    # off: the schedule and its record are what they were before CFG reuse existed
    off = schedule_for(dataclasses.replace(cfg, cfg_reuse=0.0), ratios, settings, ts)
    assert off.cfg_delta == () and set(off.to_dict()) == {"num_steps", "reused", "order"}
    with pytest.raises(ArtifactError, match="do not reuse uncond"):
        CacheSchedule.from_dict({**d, "cfg_delta": [5]})
    with pytest.raises(ArtifactError, match="cfg_order 2"):
        CacheSchedule.from_dict({**d, "cfg_order": 2})


def test_old_step_ratio_files_load_and_name_the_fix(tmp_path):
    n, ts = 6, tuple(float(t) for t in np.linspace(999, 100, 6))
    old = StepRatios(tuple(range(n)), ts, {b: np.ones((1, n)) for b in ("cond", "uncond")},
                     {b: np.full((1, n, HORIZONS), 0.01) for b in ("cond", "uncond")})
    old.save(tmp_path / "r.safetensors")
    back = StepRatios.load(tmp_path / "r.safetensors")
    assert back.cfg_errors == {} and "cfg_errors_mean" not in back.summary()
    settings = SamplingSettings(n, 4.0, 3.0)
    assert schedule_for(dataclasses.replace(CFG, cfg_reuse=0.0), back, settings, ts).cfg_delta == ()
    with pytest.raises(ArtifactError, match="re-run `trt-sora calibrate`"):
        schedule_for(CFG, back, settings, ts)
    # a calibration without CFG (no uncond branch) has nothing to estimate: the step plan alone
    cond_only = StepRatios(back.steps, ts, {"cond": back.ratios["cond"]}, {"cond": back.errors["cond"]})
    assert schedule_for(CFG, cond_only, settings, ts).cfg_delta == ()


# -- the sampler --------------------------------------------------------------------------------------
def test_estimate_is_cond_plus_the_continued_difference():
    """By hand: cond (1, 2) + the line through d = (0, 1) at 900 and (1, 3) at 800, at 650:
    (1, 3) + 1.5 (1, 2) = (2.5, 6) -> (3.5, 8); order 0: (1, 2) + (1, 3) = (2, 5)."""
    hist = {CFG_DELTA: [(900.0, torch.tensor([0.0, 1.0])), (800.0, torch.tensor([1.0, 3.0]))],
            "uncond": [(800.0, torch.tensor([9.0, 9.0]))]}
    s = CacheSchedule(4, {"uncond": (2,)}, order=1, cfg_delta=(2,), cfg_order=1)
    got = s.estimate(2, "uncond", hist, 650.0, {"cond": torch.tensor([1.0, 2.0])})
    torch.testing.assert_close(got, torch.tensor([3.5, 8.0]))
    got0 = dataclasses.replace(s, cfg_order=0).estimate(2, "uncond", hist, 650.0, {"cond": torch.tensor([1.0, 2.0])})
    torch.testing.assert_close(got0, torch.tensor([2.0, 5.0]))
    with pytest.raises(ConfigError, match="computed both branches"):
        s.estimate(2, "uncond", {"uncond": hist["uncond"]}, 650.0, {"cond": torch.tensor([1.0, 2.0])})


def _written_out(schedule, noise, e_c, e_u, settings, shift=3.0, calls=None, reset=True):
    """The cached loop written out: cond-only steps add the branch difference of the expert's last two
    steps computing both (continued in t at cfg_order 1), whole skipped steps extrapolate each branch."""
    s = _scheduler(shift)
    s.set_timesteps(settings.num_steps)
    x, done, deltas, prev = noise.double(), {"cond": [], "uncond": []}, [], None
    for i, t in enumerate(s.timesteps):
        t, v = float(t), {}
        expert, g = settings.expert_at(t), settings.guidance_at(t)
        if reset and expert != prev:
            deltas = []
        prev = expert
        f = calls[expert] if calls else _toy
        for b, e in (("cond", e_c), ("uncond", e_u)):
            if b == "uncond" and g <= 1.0:
                continue
            if i in schedule.cfg_delta and b == "uncond":
                v[b] = v["cond"] + _line(deltas, t, schedule.cfg_order)
            elif schedule.reuse(i, b):
                v[b] = _line(done[b], t, schedule.order)
            else:
                v[b] = f({"hidden_states": x, "timestep": torch.full((x.shape[0],), t, dtype=torch.float64),
                          "encoder_hidden_states": e.double()})
                done[b].append((t, v[b]))
        if "uncond" in v and not schedule.reuse(i, "cond") and not schedule.reuse(i, "uncond"):
            deltas.append((t, v["uncond"] - v["cond"]))
        vel = v["cond"] if g <= 1.0 else v["uncond"] + g * (v["cond"] - v["uncond"])
        x = x + (float(s.sigmas[i + 1]) - float(s.sigmas[i])) * vel
    return x


def _line(hist, t, order):
    (t1, y1) = hist[-1]
    if order == 0 or len(hist) < 2:
        return y1
    t0, y0 = hist[-2]
    return y1 + (y1 - y0) * (t - t1) / (t1 - t0)


@pytest.mark.parametrize("cfg", ["split", "batched"])
@pytest.mark.parametrize("order, whole", [(0, ()), (1, ()), (1, (4,))])
def test_sampler_calls_cond_alone_and_matches_the_loop_written_out(cfg, order, whole):
    noise = gaussian_noise((2, 3, 2, 4, 4), seed=5)
    g = torch.Generator().manual_seed(3)
    e_c, e_u = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g) + 1.0
    settings = SamplingSettings(num_steps=8, guidance_scale=4.0, shift=3.0)
    schedule = CacheSchedule(8, {"cond": (4,), "uncond": (2, 3, 4, 6)}, order=1,
                             cfg_delta=tuple(sorted((2, 3, 6) + whole)), cfg_order=order)
    seen = []
    res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg=cfg, cache=schedule,
                 hook=lambda c: seen.append((c.step, c.branches)))
    calls = sorted((s, b) for s, bs in seen for b in bs)
    assert calls == sorted((s, b) for s in range(8) for b in ("cond", "uncond") if not schedule.reuse(s, b))
    if cfg == "batched":
        assert (2, ("cond",)) in seen and (5, ("cond", "uncond")) in seen
    assert [r.reused for r in res.steps][2:5] == [("uncond",), ("uncond",), ("cond", "uncond")]
    want = _written_out(schedule, noise, e_c, e_u, settings)
    torch.testing.assert_close(res.latents.double(), want, rtol=1e-5, atol=1e-5)  # fp32 loop vs float64
    # the estimate matters: uncond's own line at those steps gives another clip
    other = dataclasses.replace(schedule, cfg_delta=(2, 3, 6) if whole else ())
    plain = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg=cfg, cache=other)
    assert not torch.allclose(plain.latents, res.latents, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_cuda_loop_with_cfg_reuse_matches_the_cpu_one():
    """The estimate on the GPU: the same schedule, batched CFG, on CUDA vs the CPU (fp32 both)."""
    noise = gaussian_noise((2, 3, 2, 4, 4), seed=9)
    g = torch.Generator().manual_seed(4)
    e_c, e_u = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    settings = SamplingSettings(num_steps=8, guidance_scale=4.0, shift=3.0)
    schedule = CacheSchedule(8, {"cond": (4,), "uncond": (2, 3, 4, 6)}, order=1, cfg_delta=(2, 3, 6))
    out = [sample(_toy, noise.to(d), e_c.to(d), e_u.to(d), scheduler=_scheduler(), settings=settings, cfg="batched",
                  cache=schedule).latents.cpu() for d in ("cpu", "cuda")]
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-5)


def test_pair_switch_resets_the_branch_difference():
    """The low expert's first step computes both; the next step's uncond (order 1) takes that step's
    difference alone, never a line through the high expert's."""
    sched = _scheduler(12.0)
    sched.set_timesteps(6)
    b = step_experts(PAIR, sched.timesteps).index("low")
    assert 1 < b < 5
    schedule = CacheSchedule(6, {"uncond": (1, b + 1)}, order=1, cfg_delta=(1, b + 1), cfg_order=1)
    calls = {"high": lambda inp: 0.5 * _toy(inp), "low": lambda inp: -0.25 * _toy(inp) + 0.1}
    noise, e_c, e_u = gaussian_noise((1, 2, 2, 2, 2), seed=0), torch.ones(1, 3, 4), -torch.ones(1, 3, 4)
    res = sample(calls, noise, e_c, e_u, scheduler=_scheduler(12.0), settings=PAIR, cache=schedule)
    want = _written_out(schedule, noise, e_c, e_u, PAIR, shift=12.0, calls=calls)
    torch.testing.assert_close(res.latents.double(), want, rtol=1e-5, atol=1e-5)  # fp32 loop vs float64
    across = _written_out(schedule, noise, e_c, e_u, PAIR, shift=12.0, calls=calls, reset=False)
    assert not torch.allclose(across, want, rtol=1e-3, atol=1e-4)  # the reset is what the test sees


def test_a_step_without_guidance_runs_cond_alone():
    """guidance_scale_2 = 1: the low expert's steps run cond alone; a schedule estimating uncond in the
    high expert still works and the calls count only the branches that run."""
    pair = dataclasses.replace(PAIR, guidance_scale_2=1.0)
    sched = _scheduler(12.0)
    sched.set_timesteps(6)
    b = step_experts(pair, sched.timesteps).index("low")
    schedule = CacheSchedule(6, {"uncond": (1,)}, order=1, cfg_delta=(1,))
    seen = []
    noise, e_c, e_u = gaussian_noise((1, 2, 2, 2, 2), seed=1), torch.ones(1, 3, 4), -torch.ones(1, 3, 4)
    res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(12.0), settings=pair, cache=schedule,
                 hook=lambda c: seen.append((c.step, c.branch)))
    assert [s for s, br in seen if br == "uncond"] == [i for i in range(b) if i != 1]
    torch.testing.assert_close(res.latents.double(), _written_out(schedule, noise, e_c, e_u, pair, shift=12.0),
                               rtol=1e-5, atol=1e-5)  # fp32 loop vs float64
    branches = [("cond", "uncond") if pair.guidance_at(float(t)) > 1.0 else ("cond",) for t in sched.timesteps]
    assert schedule.calls(branches) == (len(seen), 6 + b)


# -- the statistics -----------------------------------------------------------------------------------
def test_recorded_cfg_errors_match_an_independent_computation(tmp_path):
    settings = SamplingSettings(num_steps=5, guidance_scale=4.0, shift=3.0)
    rec, want = MagnitudeRecorder(5), {0: [], 1: []}
    for seed in (1, 2):
        noise = gaussian_noise((2, 3, 2, 4, 4), seed=seed)
        e_c = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed))
        e_u = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed + 10))
        res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=settings, cfg="batched",
                     keep=("latents",), cache=rec)
        entering = [noise] + [r.latents for r in res.steps[:-1]]
        ts = [r.timestep for r in res.steps]
        out = {b: [_toy({"hidden_states": x.double(), "timestep": torch.full((2,), t, dtype=torch.float64),
                         "encoder_hidden_states": e.double()}).numpy() for x, t in zip(entering, ts)]
               for b, e in (("cond", e_c), ("uncond", e_u))}
        d = [u - c for c, u in zip(out["cond"], out["uncond"])]
        for o in (0, 1):
            err = np.full((2, 5, HORIZONS), np.nan)
            for i in range(5):
                for h in range(1, min(i, HORIZONS) + 1):
                    a = i - h
                    est = d[a] if o == 0 or a == 0 else d[a] + (d[a] - d[a - 1]) * (ts[i] - ts[a]) / (ts[a] - ts[a - 1])
                    err[:, i, h - 1] = (np.linalg.norm((est - d[i]).reshape(2, -1), axis=1)
                                        / np.linalg.norm(out["uncond"][i].reshape(2, -1), axis=1))
            want[o].append(err)
    got = rec.ratios()
    for o in (0, 1):
        w = np.concatenate(want[o])
        assert np.array_equal(np.isnan(got.cfg_errors[o]), np.isnan(w))
        np.testing.assert_allclose(got.cfg_errors[o], w, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(got.mean_cfg_errors(o), w.mean(axis=0), rtol=1e-4, atol=1e-7)
    assert not np.allclose(got.cfg_errors[0][:, 2:], got.cfg_errors[1][:, 2:])
    got.save(tmp_path / "r.safetensors")
    back = StepRatios.load(tmp_path / "r.safetensors")
    assert all(np.array_equal(back.cfg_errors[o], got.cfg_errors[o], equal_nan=True) for o in (0, 1))
    assert StepRatios.merged([back, back]).cfg_errors[1].shape == (8, 5, HORIZONS)
    high = dataclasses.replace(back, steps=(0, 1), timesteps=back.timesteps[:2],
                               ratios={b: r[:, :2] for b, r in back.ratios.items()},
                               errors={b: e[:, :2] for b, e in back.errors.items()},
                               cfg_errors={o: e[:, :2] for o, e in back.cfg_errors.items()})
    low = dataclasses.replace(back, steps=(2, 3, 4), timesteps=back.timesteps[2:],
                              ratios={b: r[:, 2:] for b, r in back.ratios.items()},
                              errors={b: e[:, 2:] for b, e in back.errors.items()},
                              cfg_errors={o: e[:, 2:] for o, e in back.cfg_errors.items()})
    joined = StepRatios.joined([low, high])
    assert np.array_equal(joined.cfg_errors[1], back.cfg_errors[1], equal_nan=True)


# -- the setting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (dict(cfg_reuse=-0.1), "cfg_reuse=-0.1 is outside"),
    (dict(cfg_reuse=math.nan), "cfg_reuse=nan is outside"),
    (dict(cfg_reuse=11.0), "cfg_reuse=11.0 is outside"),
    (dict(cfg_order=2), "cfg_order=2 must be 0"),
    (dict(cfg_order=True), "cfg_order=True must be 0"),
    (dict(method="none"), "needs a step method"),
    (dict(branches=("cond",)), "add uncond or set cfg_reuse: 0"),
])
def test_bad_settings_name_the_fix(bad, match):
    with pytest.raises(ConfigError, match=match):
        CachingConfig(**{**dict(method="extrapolate", cfg_reuse=0.2), **bad})


def test_recipes_and_records_without_cfg_reuse_are_unchanged():
    from run_folders import RECIPE

    from trt_sora.config import load_recipe
    from trt_sora.runtime.served_caching import caching_mismatch

    off = CachingConfig(method="extrapolate", threshold=0.05)
    assert off.setting() == {k: v for k, v in to_dict(off).items()
                             if k not in ("cfg_reuse", "cfg_order", "plan", "damping")}
    on = dataclasses.replace(off, cfg_reuse=0.3, cfg_order=1)
    assert on.setting() == {k: v for k, v in to_dict(on).items() if k not in ("plan", "damping")}
    assert on.setting()["cfg_reuse"] == 0.3
    r = dataclasses.replace(load_recipe(RECIPE), caching=on)
    assert recipe_from_dict(recipe_to_dict(r)).caching == on
    rep = {"caching": {"setting": off.setting(), "passed": True}, "candidate": {"backend": "ort"}}
    assert caching_mismatch(off.setting(), rep, "ort") is None  # a report written before the keys existed
    assert "cfg_reuse: checked None, asked 0.3" in caching_mismatch(on.setting(), rep, "ort")
