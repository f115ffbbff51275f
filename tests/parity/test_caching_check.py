"""Step caching through check and the runtime on wan-tiny (ONNX Runtime candidate): the check gates the
cached clip against the uncached reference and records the curve; a too-aggressive threshold fails
`trt-sora check`; the runtime serves only the caching setting its check passed."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from run_folders import RECIPE

torch = pytest.importorskip("torch")

from trt_sora.caching import RATIOS_FILE, MagnitudeRecorder, StepRatios, plan_schedule, step_experts  # noqa: E402
from trt_sora.config import CachingConfig, dump_recipe, load_recipe  # noqa: E402
from trt_sora.errors import ArtifactError  # noqa: E402

#: wan-tiny samples 4 steps: steps 1 and 2 may reuse.
MILD = dict(method="magcache", threshold=0.3, max_skips=1, warmup_steps=1, final_steps=1, branches=("uncond",),
            sweep=(0.001, 10.0))
AGGRESSIVE = dict(method="magcache", threshold=10.0, max_skips=2, warmup_steps=1, final_steps=1)


def _recipe(**caching):
    r = load_recipe(RECIPE)
    return dataclasses.replace(r, caching=CachingConfig(**caching))


def _record_ratios(run, steps: int | None = None) -> None:
    """calib/step_ratios.safetensors as the calibrate stage records it: two held-out-style trajectories of
    the fp32 model at its sampling settings (``steps``: at that many steps), the recorder as the sampler's
    step cache."""
    from trt_sora.models import get_adapter
    from trt_sora.parity.loop import loop_inputs
    from trt_sora.sampling import adapter_call, sample

    adapter = get_adapter("wan-tiny")
    model, settings = adapter.load("fp32", "cpu"), adapter.sampling.override(num_steps=steps)
    rec = MagnitudeRecorder(settings.num_steps)
    point = {"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 16}
    for seed in (7, 8):
        noise, cond, uncond = loop_inputs(adapter, point, seed=seed, prompts=("a cat walks", "a dog runs"))
        sample(adapter_call(adapter, model), noise, cond, uncond, scheduler=adapter.scheduler(settings.shift),
               settings=settings, conditioner=adapter, cache=rec)
    rec.ratios().save(run / "calib" / RATIOS_FILE)


@pytest.fixture(scope="module")
def cached_run(base_run, tmp_path_factory):
    """A copy of base_run with step ratios, checked with MILD caching."""
    from trt_sora.parity import check_artifacts

    run = tmp_path_factory.mktemp("cached") / "run"
    shutil.copytree(base_run, run)
    _record_ratios(run)
    rep = check_artifacts(run, _recipe(**MILD))
    return run, rep


def _level(rep, name):
    return next(c for c in rep["comparisons"] if c["level"] == name)


def test_check_gates_the_cached_clip_and_records_the_curve(cached_run):
    run, rep = cached_run
    assert rep["passed"], rep["failed"]
    cache = rep["caching"]
    ratios = StepRatios.load(run / "calib" / RATIOS_FILE)
    from trt_sora.models import get_adapter

    a = get_adapter("wan-tiny")
    sched = a.scheduler(a.sampling.shift)
    sched.set_timesteps(a.sampling.num_steps)
    cfg = CachingConfig(**MILD)
    means = {b: list(ratios.mean(b)) for b in ratios.ratios}
    want = plan_schedule(means, step_experts(a.sampling, sched.timesteps), cfg)
    assert cache["schedule"]["reused"] == {b: list(s) for b, s in want.items()}
    assert cache["schedule"]["reused"]["cond"] == [] and cache["schedule"]["reused"]["uncond"]  # per-branch
    assert cache["calls_uncached"] == 8 and cache["calls"] == 8 - len(want["uncond"])
    curve = {p["threshold"]: p for p in cache["curve"]}
    assert sorted(curve) == [0.001, 0.3, 10.0] and curve[0.3]["chosen"] and not curve[10.0]["chosen"]
    assert curve[0.001]["calls"] >= curve[0.3]["calls"] >= curve[10.0]["calls"]
    # a threshold that reuses nothing is the uncached candidate loop: the loop level's PSNR, to the bit
    assert curve[0.001]["calls"] == 8 and curve[0.001]["psnr_db"] == _level(rep, "loop")["metrics"]["psnr_db"]
    lvl = _level(rep, "caching")
    assert lvl["metrics"]["psnr_db"] == curve[0.3]["psnr_db"] < curve[0.001]["psnr_db"]
    assert {c["metric"] for c in lvl["checks"]} == {"psnr_db", "frames worst_frame_psnr_db"}
    md = (run / "parity" / "report.md").read_text()
    assert "## Step caching" in md and "| 0.3 (chosen) |" in md
    man = json.loads((run / "parity" / "manifest.json").read_text())
    assert man["inputs"]["step_ratios"]["path"] == "calib/step_ratios.safetensors"


def test_too_aggressive_threshold_fails_check(cached_run, tmp_path, capsys):
    from trt_sora.cli import main

    run = tmp_path / "run"
    shutil.copytree(cached_run[0], run)
    path = tmp_path / "aggressive.yaml"
    r = _recipe(**AGGRESSIVE)
    path.write_text(dump_recipe(dataclasses.replace(r, parity=dataclasses.replace(
        r.parity, loop=dataclasses.replace(r.parity.loop, min_psnr_db=_strict_gate(cached_run[1]))))))
    assert main(["check", "--run", str(run), "--recipe", str(path)]) == 1
    rep = json.loads((run / "parity" / "report.json").read_text())
    assert rep["failed"] == ["caching"] and not rep["caching"]["passed"]
    assert rep["caching"]["calls"] == 4  # steps 1 and 2 of both branches reused


def _strict_gate(rep) -> float:
    """A loop gate 1 dB under the uncached candidate's PSNR: the uncached loop passes it, and a setting
    reusing half the calls must meet it on its own error (it misses it on wan-tiny)."""
    return round(_level(rep, "loop")["metrics"]["psnr_db"] - 1.0, 2)


def _with_recipe(src, dst, recipe):
    shutil.copytree(src, dst)
    (dst / "recipe.yaml").write_text(dump_recipe(recipe))
    return dst


def test_runtime_serves_the_checked_setting(cached_run, tmp_path):
    import trt_sora.runtime as rt

    run = _with_recipe(cached_run[0], tmp_path / "run", _recipe(**MILD))
    sr = rt.load(run, backend="ort", warmup=False)
    assert sr.caching is not None and sr.caching.schedule.to_dict() == cached_run[1]["caching"]["schedule"]
    calls = []
    clip = rt.generate(sr, "a cat walks", cfg="split", hook=lambda c: calls.append((c.step, c.branch)))[0]
    reused = cached_run[1]["caching"]["schedule"]["reused"]
    assert sorted(calls) == sorted((s, b) for s in range(4) for b in ("cond", "uncond") if s not in reused[b])
    meta = clip.metadata["caching"]
    assert meta["applied"] and meta["reused"] == reused
    assert meta["calls"] == len(calls) == cached_run[1]["caching"]["calls"]
    # other sampling settings than the checked ones: every step computes
    calls.clear()
    other = rt.generate(sr, "a cat walks", steps=5, cfg="split", hook=lambda c: calls.append(c.step))[0]
    assert len(calls) == 10 and not other.metadata["caching"]["applied"]
    assert rt.load(run, backend="ort", warmup=False, caching=False).caching is None


def test_extrapolating_setting_is_checked_and_served(cached_run, tmp_path):
    """method: extrapolate through check and the runtime: the report's schedule carries order 1, planned
    from the calibrated errors, and the runtime replays exactly the checked calls."""
    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    setting = dict(method="extrapolate", threshold=10.0, max_skips=2, warmup_steps=1, final_steps=1)
    run = _with_recipe(cached_run[0], tmp_path / "run", _recipe(**setting))
    rep = check_artifacts(run, _recipe(**setting))
    cache = rep["caching"]
    assert cache["schedule"] == {"num_steps": 4, "reused": {"cond": [1, 2], "uncond": [1, 2]}, "order": 1}
    assert cache["setting"]["method"] == "extrapolate" and cache["calls"] == 4
    assert rep["passed"], rep["failed"]
    sr = rt.load(run, backend="ort", warmup=False)
    assert sr.caching.schedule.order == 1
    calls = []
    clip = rt.generate(sr, "a cat walks", cfg="split", hook=lambda c: calls.append((c.step, c.branch)))[0]
    assert sorted(calls) == [(0, "cond"), (0, "uncond"), (3, "cond"), (3, "uncond")]
    assert clip.metadata["caching"]["applied"]


def test_cfg_reuse_setting_is_checked_and_served(cached_run, tmp_path):
    """caching.cfg_reuse through check and the runtime: steps 1 and 2 call cond alone (uncond estimated from
    step 0's branch difference), the report records that schedule and the runtime replays exactly its calls."""
    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    setting = dict(method="extrapolate", threshold=1e-6, max_skips=1, warmup_steps=1, final_steps=1, cfg_reuse=10.0)
    run = _with_recipe(cached_run[0], tmp_path / "run", _recipe(**setting))
    rep = check_artifacts(run, _recipe(**setting))
    cache = rep["caching"]
    assert cache["schedule"] == {"num_steps": 4, "reused": {"cond": [], "uncond": [1, 2]}, "order": 1,
                                 "cfg_delta": [1, 2], "cfg_order": 0}
    assert cache["setting"]["cfg_reuse"] == 10.0 and (cache["calls"], cache["calls_uncached"]) == (6, 8)
    assert rep["passed"], rep["failed"]
    assert _level(rep, "caching")["metrics"]["psnr_db"] < _level(rep, "loop")["metrics"]["psnr_db"]
    assert "uncond estimated from cond at steps [1, 2]" in (run / "parity" / "report.md").read_text()
    sr = rt.load(run, backend="ort", warmup=False)
    assert sr.caching.schedule.cfg_delta == (1, 2)
    calls = []
    clip = rt.generate(sr, "a cat walks", cfg="batched", hook=lambda c: calls.append((c.step, c.branch)))[0]
    assert calls == [(0, "cond+uncond"), (1, "cond"), (2, "cond"), (3, "cond+uncond")]
    assert clip.metadata["caching"]["applied"] and clip.metadata["caching"]["calls"] == 6
    # the same recipe with CFG reuse off is another setting: refused
    off = _with_recipe(cached_run[0], tmp_path / "off", _recipe(**{**setting, "cfg_reuse": 0.0}))
    shutil.copytree(run / "parity", off / "parity", dirs_exist_ok=True)
    with pytest.raises(ArtifactError, match="cfg_reuse: checked 10.0, asked None"):
        rt.load(off, backend="ort", warmup=False)


def test_runtime_refuses_an_unchecked_caching_setting(cached_run, checked_run, tmp_path, caplog):
    import trt_sora.runtime as rt

    other = _with_recipe(cached_run[0], tmp_path / "other", _recipe(**{**MILD, "threshold": 0.5}))
    with pytest.raises(ArtifactError, match=r"another setting \(threshold: checked 0.3, asked 0.5\)"):
        rt.load(other, backend="ort", warmup=False)
    never = _with_recipe(checked_run, tmp_path / "never", _recipe(**MILD))
    with pytest.raises(ArtifactError, match="never ran.*trt-sora check"):
        rt.load(never, backend="ort", warmup=False)
    sr = rt.load(never, backend="ort", warmup=False, force=True)
    assert sr.caching is None and "LOADING UNVERIFIED ARTIFACT" in caplog.text
    # the run folder's own setting off: the checked caching is not served
    off = _with_recipe(cached_run[0], tmp_path / "off", load_recipe(RECIPE))
    assert rt.load(off, backend="ort", warmup=False).caching is None


def test_check_at_more_steps_than_the_model_card_serves_those_steps(base_run, tmp_path):
    """The 50-step path in small: step ratios calibrated at 7 steps (wan-tiny's card samples 4), a recipe
    whose loop runs 7 steps with caching; `trt-sora check` gates the 7-step cached clip, the runtime
    replays its schedule at 7 steps and computes every call at the card's 4."""
    import trt_sora.runtime as rt
    from trt_sora.cli import main

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    _record_ratios(run, steps=7)
    r = _recipe(method="extrapolate", threshold=10.0, max_skips=2, warmup_steps=1, final_steps=1, sweep=(0.001,))
    recipe = dataclasses.replace(r, parity=dataclasses.replace(r.parity, loop_steps=7))
    (run / "recipe.yaml").write_text(dump_recipe(recipe))
    assert main(["check", "--run", str(run), "--recipe", str(run / "recipe.yaml")]) == 0
    cache = json.loads((run / "parity" / "report.json").read_text())["caching"]
    reused = [1, 2, 4, 5]  # warm-up 0 and final 6 compute; a run of at most 2 reuses after each compute
    assert cache["schedule"] == {"num_steps": 7, "reused": {"cond": reused, "uncond": reused}, "order": 1}
    assert cache["sampling"]["num_steps"] == 7 and (cache["calls"], cache["calls_uncached"]) == (6, 14)
    assert {p["threshold"]: p["calls"] for p in cache["curve"]}[0.001] == 14
    sr = rt.load(run, backend="ort", warmup=False)
    calls = []
    clip = rt.generate(sr, "a cat walks", steps=7, cfg="split", hook=lambda c: calls.append(c.step))[0]
    assert sorted(calls) == sorted(2 * [0, 3, 6]) and clip.metadata["caching"]["applied"]
    calls.clear()
    card = rt.generate(sr, "a cat walks", cfg="split", hook=lambda c: calls.append(c.step))[0]
    assert len(calls) == 8 and not card.metadata["caching"]["applied"]
