"""Wan 2.2 A14B-style pairs of experts: the one sampler switches at the boundary (the boundary step
runs the low-noise expert with its own guidance), `make engine` calibrates both over shared
trajectories and builds two engines with one parity report, and the runtime serves the pair,
switching by timestep - only what passed."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trt_sora.errors import ConfigError, ShapeError  # noqa: E402
from trt_sora.sampling import SamplingSettings, gaussian_noise, sample  # noqa: E402

PAIR = SamplingSettings(num_steps=6, guidance_scale=4.0, shift=12.0, boundary_ratio=0.875, guidance_scale_2=3.0)


def _scheduler(shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _expert(scale):
    """A toy velocity per expert (different per expert and per branch)."""
    return lambda inp: scale * inp["hidden_states"] + inp["encoder_hidden_states"].mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)


def test_boundary_step_runs_the_low_noise_expert_with_its_guidance():
    noise = gaussian_noise((1, 2, 2, 2, 2), seed=0)
    e_c, e_u = torch.ones(1, 3, 4), -torch.ones(1, 3, 4)
    seen = []
    res = sample({"high": _expert(0.5), "low": _expert(-0.25)}, noise, e_c, e_u, scheduler=_scheduler(12.0),
                 settings=PAIR, hook=lambda c: seen.append((c.step, c.expert, c.timestep, c.branch)), keep=("latents",))
    s = _scheduler(12.0)
    s.set_timesteps(6)
    ts = [float(t) for t in s.timesteps]
    boundary = next(i for i, t in enumerate(ts) if t < 875.0)
    assert 0 < boundary < 6 and ts[boundary - 1] >= 875.0
    assert [(st, e) for st, e, _, b in seen if b == "cond"] == [(i, "high" if i < boundary else "low")
                                                               for i in range(6)]
    # the same loop written out: expert and guidance by timestep, diffusers' WanPipeline rule
    x = noise.double()
    for i, t in enumerate(ts):
        f, g = (_expert(0.5), 4.0) if t >= 875.0 else (_expert(-0.25), 3.0)
        v_c = f({"hidden_states": x, "encoder_hidden_states": e_c.double()})
        v_u = f({"hidden_states": x, "encoder_hidden_states": e_u.double()})
        x = x + (float(s.sigmas[i + 1]) - float(s.sigmas[i])) * (v_u + g * (v_c - v_u))
    torch.testing.assert_close(res.latents.double(), x, rtol=1e-5, atol=1e-6)


def test_pair_settings_and_errors():
    assert PAIR.expert_at(875.0) == "high" and PAIR.expert_at(874.99) == "low"
    assert PAIR.guidance_at(900.0) == 4.0 and PAIR.guidance_at(100.0) == 3.0
    assert PAIR.override(guidance_scale=2.0).guidance_scale_2 == 2.0
    with pytest.raises(ConfigError, match="missing"):
        sample({"high": _expert(1.0)}, torch.zeros(1, 2, 2, 2, 2), torch.ones(1, 3, 4), torch.ones(1, 3, 4),
               scheduler=_scheduler(12.0), settings=PAIR)
    with pytest.raises(ConfigError, match="boundary_ratio"):
        SamplingSettings(num_steps=4, guidance_scale=4.0, shift=3.0, guidance_scale_2=3.0)


# -- make engine on a tiny pair (pair_run: tests/run_folders.py) ---------------------------------------
@pytest.mark.trt_rtx
def test_make_engine_builds_both_experts_and_one_report(pair_run):
    pipe, outcomes = pair_run
    assert [o.status for o in outcomes] == ["ran"] * 5
    run = pipe.run_dir
    pair = json.loads((run / "experts" / "experts.json").read_text())
    assert pair["boundary_timestep"] == 875.0 and set(pair["experts"]) == {"high", "low"}
    plans = {e: list((run / e / "engine").glob("*.plan")) for e in ("high", "low")}
    assert all(len(p) == 1 and f"-{e}.sm89" in p[0].name for e, p in plans.items())
    steps = {}
    for e in ("high", "low"):
        calib = json.loads((run / e / "calib" / "manifest.json").read_text())["results"]
        steps[e] = calib["expert"]["steps_served"]
        build = json.loads((run / e / "engine" / "build_report.json").read_text())["analysis"]
        assert build["fp8_gemm_fraction"] == 1.0 and build["attention"]["fused"]
    assert steps == {"high": [0, 1, 2, 3], "low": [4, 5]}  # one pass, each expert on the steps it serves
    rep = json.loads((run / "parity" / "report.json").read_text())
    assert rep["passed"], rep["failed"]
    levels = [c["level"] for c in rep["comparisons"]]
    assert levels == ["export[high]", "qdq[high]", "quality[high]", "export[low]", "qdq[low]", "quality[low]",
                      "trajectory", "loop", "frames"]
    traj = next(c for c in rep["comparisons"] if c["level"] == "trajectory")
    assert {(c["step"], c["expert"]) for c in traj["calls"]} == {(s, e) for e, ss in steps.items() for s in ss}
    assert set(rep["candidate"]["experts"]) == {"high", "low"}
    assert {"high/quant/model.qdq.onnx", "low/quant/model.qdq.onnx"} <= set(rep["candidate"]["files"])


@pytest.mark.trt_rtx
def test_a_second_run_reuses_every_stage(pair_run):
    from trt_sora.pipeline import EnginePipeline

    pipe, _ = pair_run
    seen = []
    EnginePipeline(pipe.recipe, "wan-a14b-tiny", pipe.run_dir.parent.parent, progress=seen.append).run()
    assert [o.status for o in seen] == ["reused"] * 5


@pytest.mark.trt_rtx
def test_runtime_switches_experts_at_the_boundary(pair_run):
    import numpy as np

    import trt_sora.runtime as rt
    from trt_sora.runners import OrtRunner

    pipe, _ = pair_run
    r = rt.load(pipe.run_dir, backend="ort", warmup=False)
    feeds = r.example_feeds(r.buckets[0].point("opt"))
    own = {e: OrtRunner(pipe.run_dir / e / "quant" / "model.qdq.onnx").activate() for e in ("high", "low")}
    for t, e in ((875.0, "high"), (874.9, "low"), (999.0, "high"), (1.0, "low")):
        f = {**feeds, "timestep": np.full_like(feeds["timestep"], t)}
        np.testing.assert_array_equal(r.infer(f)["sample"], own[e].infer(f)["sample"])
    assert feeds["timestep"].shape == (2,)
    with pytest.raises(ShapeError, match="both sides"):  # one call is one step: one expert
        r.infer({**feeds, "timestep": np.array([900.0, 100.0], np.float32)})


@pytest.mark.trt_rtx
def test_runtime_refuses_a_changed_expert(pair_run, tmp_path):
    import shutil

    import trt_sora.runtime as rt
    from trt_sora.errors import ArtifactError

    pipe, _ = pair_run
    copy = tmp_path / "run"
    shutil.copytree(pipe.run_dir, copy)
    q = copy / "low" / "quant" / "model.qdq.onnx"
    data = bytearray(q.read_bytes())
    data[-10] ^= 0xFF
    q.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="low/quant/model.qdq.onnx"):
        rt.load(copy, backend="ort", warmup=False)


@pytest.mark.trt_rtx
def test_check_caches_the_pair_across_its_switch_and_the_runtime_serves_it(pair_run, tmp_path):
    """Step caching on the pair: each expert's calibration recorded the ratios of the steps it served;
    check joins them, plans one schedule whose low-noise expert's first step computes (its cached
    output would be the other expert's), and the runtime replays that schedule through both experts."""
    import dataclasses
    import shutil

    import numpy as np

    import trt_sora.runtime as rt
    from trt_sora.caching import RATIOS_FILE, StepRatios, plan_schedule
    from trt_sora.config import CachingConfig, dump_recipe
    from trt_sora.parity import check_artifacts

    pipe, _ = pair_run
    run = tmp_path / "pair"
    shutil.copytree(pipe.run_dir, run)
    caching = CachingConfig(method="magcache", threshold=10.0, max_skips=5, warmup_steps=1, final_steps=0)
    recipe = dataclasses.replace(pipe.recipe, caching=caching)
    rep = check_artifacts(run, recipe)
    parts = {e: StepRatios.load(run / e / "calib" / RATIOS_FILE) for e in ("high", "low")}
    assert parts["high"].steps == (0, 1, 2, 3) and parts["low"].steps == (4, 5)
    means = {b: [float(np.nanmean(parts["high" if s < 4 else "low"].ratios[b][:, s if s < 4 else s - 4]))
                 for s in range(6)] for b in ("cond", "uncond")}
    want = plan_schedule(means, ["high"] * 4 + ["low"] * 2, caching)
    reused = rep["caching"]["schedule"]["reused"]
    assert reused == {b: list(s) for b, s in want.items()}
    assert all(4 not in s and 0 not in s for s in reused.values()) and any(reused.values())
    assert {"high/step_ratios", "low/step_ratios"} <= set(rep["artifacts"])
    if not rep["passed"]:
        pytest.skip(f"the cached pair misses its gates ({rep['failed']}): nothing to serve")
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    r = rt.load(run, backend="ort", warmup=False)
    calls = []
    clip = rt.generate(r, "a cat walks", cfg="split", hook=lambda c: calls.append((c.step, c.expert, c.branch)))[0]
    assert sorted(calls) == sorted((s, "high" if s < 4 else "low", b) for s in range(6) for b in ("cond", "uncond")
                                   if s not in reused[b])
    assert clip.metadata["caching"]["applied"] and clip.metadata["experts"]["steps"]["low"][0] == 4


def test_the_pair_is_traced_once_and_each_expert_gets_its_own_bytes(pair_run, tmp_path):
    """The export stage traces the experts' one graph once: the high-noise expert's export traced it, the
    low-noise expert's copied it, and the low expert's files from that copy are byte for byte its export traced
    on its own (the first export's weights and optimization never reach the copy)."""
    from trt_sora.export import export_onnx

    pipe, _ = pair_run
    graph = {e: json.loads((pipe.folder("export", e) / "manifest.json").read_text())["results"]["graph"]
             for e in pipe.experts}
    assert graph == {"high": "traced", "low": "copied from an earlier trace of the same graph"}
    alone = export_onnx(pipe.sides["low"], pipe.recipe.export, tmp_path / "low")
    assert alone.manifest["results"]["graph"] == "traced"
    files = sorted(p.name for p in (tmp_path / "low").iterdir() if p.name.startswith("model.onnx"))
    assert files and files == sorted(p.name for p in pipe.folder("export", "low").iterdir()
                                     if p.name.startswith("model.onnx"))
    for name in files:
        assert (tmp_path / "low" / name).read_bytes() == (pipe.folder("export", "low") / name).read_bytes(), name
