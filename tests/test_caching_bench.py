"""benchmarks/caching_bench.py on wan-tiny: every setting of a grid in one process against one set of
uncached clips, each caption its own clip, the JSON rewritten after each setting (a failing setting keeps
the rows before it), the numbers against a loop written out here; on a GPU, the same uncached clips."""
from __future__ import annotations

import json
import math

import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")

from trt_sora.caching import CacheSchedule  # noqa: E402
from trt_sora.errors import ConfigError  # noqa: E402
from trt_sora.models import get_adapter  # noqa: E402
from trt_sora.parity.loop import loop_inputs  # noqa: E402
from trt_sora.sampling import adapter_call, gaussian_noise, sample  # noqa: E402

#: wan-tiny samples 4 steps; the first two settings plan one schedule.
GRID = "1:2:1,2:2:1,0.01:1:1"
#: wan-tiny's calibration preset's shape (the bench samples its captions at it).
TINY = {"latent_frames": 2, "latent_height": 8, "latent_width": 8, "text_len": 16}


def _bench():
    return load_script("benchmarks/caching_bench.py")


def _args(tmp_path, *more):
    return ["--model", "wan-tiny", "--captions", "2", "--method", "extrapolate", "--threads", "1",
            "--reference", str(tmp_path / "ref.pt"), "--ratios", str(tmp_path / "ratios.safetensors"), *more]


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cb")
    _bench().main(_args(tmp, "--configs", GRID, "--out", str(tmp / "c.json")))
    return tmp, json.loads((tmp / "c.json").read_text())


def _clip(adapter, model, caption: str, seed: int, cache):
    """One caption's final latents, with the text encoded here and the sampler called directly."""
    point = adapter.with_family_dims({"batch": 1, **TINY})
    cond, uncond = adapter.conditioning(adapter.text_encoder(), [caption], point, seed=seed)
    noise = gaussian_noise((1, adapter.latent_channels, TINY["latent_frames"], TINY["latent_height"],
                            TINY["latent_width"]), seed)
    s = adapter.sampling
    return sample(adapter_call(adapter, model), noise, cond, uncond, scheduler=adapter.scheduler(s.shift), settings=s,
                  cfg="batched", conditioner=adapter, cache=cache).latents


def test_rows_match_a_loop_written_out(curve):
    tmp, out = curve
    a = get_adapter("wan-tiny")
    shape = _bench().calibration_preset(a, None).shapes[0].as_dict()
    assert {k: shape[k] for k in TINY} == TINY
    model = a.load("fp32", "cpu")
    row = out["curve"][0]
    sched = CacheSchedule(4, {b: tuple(s) for b, s in row["reused"].items()}, order=1)
    assert row["reused"]["cond"] and row["reused"]["cond"] == row["reused"]["uncond"]
    assert row["calls_uncached"] == 8 and row["calls"] == 8 - 2 * len(row["reused"]["cond"])
    psnr = []
    for i, caption in enumerate(out["captions"]):
        ref = _clip(a, model, caption, out["seed"] + i, None).double()
        got = _clip(a, model, caption, out["seed"] + i, sched).double()
        mse = float((ref - got).square().mean())
        psnr.append(10 * math.log10(float(ref.max() - ref.min()) ** 2 / mse))
    assert out["captions"][0] != out["captions"][1]
    assert row["latents_psnr_db"]["worst"] == pytest.approx(min(psnr), abs=1e-6)
    assert row["latents_psnr_db"]["mean"] == pytest.approx(sum(psnr) / 2, abs=1e-6)


def test_each_caption_gets_its_own_conditioning(tmp_path):
    a = get_adapter("wan-tiny")
    point = a.with_family_dims({"batch": 1, **TINY})
    enc = a.text_encoder()  # the bench's clips come from loop_inputs, one caption each
    c0 = loop_inputs(a, point, seed=1, prompts=("a red boat",))[1]["encoder_hidden_states"]
    c1 = loop_inputs(a, point, seed=1, prompts=("a snowy forest",))[1]["encoder_hidden_states"]
    want = a.conditioning(enc, ["a snowy forest"], point, seed=1)[0]["encoder_hidden_states"]
    assert not torch.equal(c0, c1) and torch.equal(c1, want)


def test_one_schedule_is_sampled_once_and_the_json_keeps_finished_rows(curve, tmp_path):
    tmp, out = curve
    first, second = out["curve"][:2]
    assert second["same_schedule_as"] == 0 and second["threshold"] == 2.0 and first["threshold"] == 1.0
    assert {k: v for k, v in second.items() if k not in ("threshold", "same_schedule_as")} == \
        {k: v for k, v in first.items() if k != "threshold"}
    # a setting the plan refuses stops the run; the rows before it are on disk, whole
    with pytest.raises(ConfigError, match="max_skips"):
        _bench().main(_args(tmp, "--configs", "1:2:1,1:9:1", "--out", str(tmp_path / "x.json")))
    kept = json.loads((tmp_path / "x.json").read_text())
    assert [r["threshold"] for r in kept["curve"]] == [1.0] and kept["curve"][0]["reused"] == first["reused"]
    assert not (tmp_path / "x.json.tmp").exists()


@pytest.mark.gpu
def test_cuda_uncached_clips_match_the_cpu_ones(curve, tmp_path):
    tmp, out = curve
    _bench().main(_args(tmp_path, "--device", "cuda", "--configs", "1:2:1", "--out", str(tmp_path / "g.json")))
    cpu, gpu = torch.load(tmp / "ref.pt"), torch.load(tmp_path / "ref.pt")
    assert gpu["captions"] == cpu["captions"]
    for r, g in zip(cpu["latents"], gpu["latents"]):
        assert g.device.type == "cpu"
        mse = float((r.double() - g.double()).square().mean())
        assert 10 * math.log10(float(r.max() - r.min()) ** 2 / max(mse, 1e-30)) > 50.0
    assert json.loads((tmp_path / "g.json").read_text())["backend"] != "torch fp32, CPU"


def test_damped_rows_replay_their_damping(curve, tmp_path):
    """--damping reaches every row's schedule and the JSON; the same plan damped gives another clip."""
    tmp, _ = curve
    runs = {}
    for d in ("1", "0.5"):  # warm-up 2: step 2 is reused with two computed outputs behind it, a line to damp
        _bench().main(_args(tmp, "--configs", "1:1:2", "--damping", d, "--out", str(tmp_path / f"{d}.json")))
        runs[d] = json.loads((tmp_path / f"{d}.json").read_text())
    (line,), (damped,) = runs["1"]["curve"], runs["0.5"]["curve"]
    assert runs["0.5"]["caching"]["damping"] == 0.5 and "damping" not in runs["1"]["caching"]
    assert 2 in line["reused"]["cond"] and damped["schedule"] == {**line["schedule"], "damping": 0.5}
    assert damped["latents_psnr_db"]["worst"] != line["latents_psnr_db"]["worst"]


def test_check_setting_is_the_curves_best_passing_row():
    cc = load_script("benchmarks/cache_check.py")

    def row(thr, skips, calls, worst, passed):
        return {"threshold": thr, "max_skips": skips, "warmup_steps": 2, "calls": calls, "calls_uncached": 100,
                "saved_fraction": 1 - calls / 100, "clip_psnr_db": {"worst": worst}, "gate_passed": passed}

    curve = {"model": "wan-shapes", "sampling": {"num_steps": 50},
             "caching": {"method": "extrapolate", "final_steps": 1},
             "curve": [row(0.01, 2, 100, math.inf, True), row(0.1, 2, 50, 31.0, True), row(0.2, 2, 50, 32.0, True),
                       row(0.5, 2, 40, 25.0, False), row(0.3, 3, 55, 35.0, True)]}
    def setting(thr, skips, warm, cfg=0.0, order=0):
        return {"threshold": thr, "max_skips": skips, "warmup_steps": warm, "cfg_reuse": cfg, "cfg_order": order}

    assert cc.choose(curve, 50, "wan-shapes", setting(0.1, 2, 2), "extrapolate")[:3] == \
        (setting(0.2, 2, 2), 1, (0.01, 0.1, 0.5))
    for other in ((20, "wan-shapes", "extrapolate"), (50, "wan-tiny", "extrapolate"), (50, "wan-shapes", "magcache")):
        assert cc.choose(curve, *other[:2], setting(0.7, 1, 3), other[2])[:3] == (setting(0.7, 1, 3), 1, ())
    # a damped curve's rows are chosen only for the same damping (a row passed with its own estimate)
    damped = {**curve, "caching": {**curve["caching"], "damping": 0.5}}
    assert cc.choose(damped, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate")[:3] == (setting(0.7, 1, 3), 1, ())
    assert cc.choose(damped, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate", "runs", 0.5)[0] == \
        setting(0.2, 2, 2)
    nothing_saved = {**curve, "curve": [row(0.01, 2, 100, math.inf, True), row(0.5, 2, 40, 25.0, False)]}
    assert cc.choose(nothing_saved, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate")[0] == setting(0.7, 1, 3)
    # CFG reuse: the best row's cfg_reuse / cfg_order go with it; the sweep keeps its cfg setting's rows
    cfg = {**curve, "curve": curve["curve"] + [{**row(0.1, 2, 35, 30.5, True), "cfg_reuse": 0.3, "cfg_order": 1},
                                               {**row(0.05, 2, 45, 33.0, True), "cfg_reuse": 0.3, "cfg_order": 1},
                                               {**row(0.1, 2, 30, 29.0, False), "cfg_reuse": 0.6, "cfg_order": 1}]}
    assert cc.choose(cfg, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate")[:3] == \
        (setting(0.1, 2, 2, 0.3, 1), 1, (0.05,))
    # caching.plan: a curve of the other plan is not read (a curve before the key: plan runs)
    assert cc.choose(curve, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate", "global")[0] == setting(0.7, 1, 3)
    planned = {**curve, "caching": {**curve["caching"], "plan": "global"}}
    assert cc.choose(planned, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate", "global")[0] == setting(0.2, 2, 2)
    assert cc.choose(planned, 50, "wan-shapes", setting(0.7, 1, 3), "extrapolate")[0] == setting(0.7, 1, 3)
