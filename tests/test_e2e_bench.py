"""benchmarks/e2e_bench.py --measure clips on wan-tiny (CPU): whole clips through our torch-fp8 runner, the cached
one replaying its step schedule. The transformer calls are counted at the runner (not by the sampler's hook the
bench reports from): a schedule the clip ignored would call it at every step."""
from __future__ import annotations

import json

import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")

from trt_sora.errors import ConfigError  # noqa: E402
from trt_sora.runners.fp8_runner import TorchFp8Runner  # noqa: E402

#: the warm-up's 2-step trajectory (batched CFG: one batch-2 call a step).
WARMUP = [2, 2]


def _bench():
    return load_script("benchmarks/e2e_bench.py")


def _run(tmp_path, monkeypatch, *schedule, device: str = "cpu") -> tuple[dict, list[int]]:
    """The bench's JSON and the batch of every call the runner served, in order."""
    rows: list[int] = []
    infer = TorchFp8Runner._infer_impl

    def counted(self, feeds):
        rows.append(int(feeds["hidden_states"].shape[0]))
        return infer(self, feeds)

    monkeypatch.setattr(TorchFp8Runner, "_infer_impl", counted)
    out = tmp_path / "clips.json"
    _bench().main(["--measure", "clips", "--model", "wan-tiny", "--size", "tiny", "--device", device,
                   "--clip-steps", "4", "--tmp", str(tmp_path), "--out", str(out), *schedule])
    return json.loads(out.read_text()), rows


def test_cached_clip_calls_the_transformer_as_its_schedule_says(tmp_path, monkeypatch):
    res, rows = _run(tmp_path, monkeypatch, "--cache-reuse", "2")
    # 2 warm-up steps, the cached clip's steps 0, 1, 3, then the uncached clip's 4: both branches in one call
    assert rows == WARMUP + [2] * 3 + [2] * 4
    cached, uncached = res["clips"]["cached"], res["clips"]["uncached"]
    assert list(res["clips"]) == ["cached", "uncached"]  # the cached clip first
    assert (cached["transformer_calls"], cached["branch_calls"]) == (3, 6)
    assert (uncached["transformer_calls"], uncached["branch_calls"]) == (4, 8)
    assert cached["reused"] == {"cond": [2], "uncond": [2]} and uncached["reused"] == {"cond": [], "uncond": []}
    assert res["schedule"]["checked"] is None and "explicit" in res["schedule"]["source"]
    assert "frame_decoder" in res["tail"]["ran"] and "serially" in res["tail"]["before"]  # what the stages mean
    for c in (cached, uncached):
        stages = c["text_encode_s"] + c["denoise_s"] + c["decode_and_encode_s"] + c["encode_finish_s"]
        assert 0 < stages <= c["clip_s"] and c["frames"] == 9 and c["mp4_bytes"] > 0
    assert res["setup"]["ours_report"]["fp8_gemms_per_call"] > 0
    assert res["cached_speedup"] == pytest.approx(uncached["clip_s"] / cached["clip_s"], rel=1e-12)


def test_eager_clip_runs_whole_with_split_cfg_before_the_runner(tmp_path, monkeypatch):
    """The baseline clip measured whole: two calls a step on the model itself (the runner serves none of them),
    the fp32 VAE and the MP4 timed as stages, and each of our clips' speed-up against it."""
    res, rows = _run(tmp_path, monkeypatch, "--clips", "eager,uncached")
    assert rows == WARMUP + [2] * 4  # the runner's warm-up and the uncached clip only
    eager = res["clips"]["eager"]
    assert (eager["transformer_calls"], eager["branch_calls"], eager["cfg"]) == (8, 8, "split")
    stages = eager["text_encode_s"] + eager["denoise_s"] + eager["vae_decode_fp32_s"] + eager["mp4_s"]
    assert 0 < stages <= eager["clip_s"] and eager["frames"] == 9 and eager["mp4_bytes"] > 0
    assert res["speedup_vs_eager"] == {"uncached": pytest.approx(eager["clip_s"] / res["clips"]["uncached"]["clip_s"],
                                                                 rel=1e-12)}


def test_eager_clip_alone_builds_no_runner(tmp_path, monkeypatch):
    res, rows = _run(tmp_path, monkeypatch, "--clips", "eager")
    assert rows == [] and list(res["clips"]) == ["eager"] and "ours_report" not in res["setup"]
    assert res["clips"]["eager"]["transformer_calls"] == 8


def test_a_lone_branch_is_called_at_batch_one_after_its_own_warm_up(tmp_path, monkeypatch):
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"num_steps": 4, "reused": {"uncond": [2]}, "order": 0}))
    res, rows = _run(tmp_path, monkeypatch, "--cache-schedule", str(sched))
    # warm-ups: 2 steps, then 2 steps whose second calls cond alone; the cached clip's step 2 calls cond alone
    assert rows == WARMUP + [2, 1] + [2, 2, 1, 2] + [2] * 4
    assert res["clips"]["cached"]["branch_calls"] == res["schedule"]["branch_calls"] == 7
    assert "CacheSchedule JSON" in res["schedule"]["source"]


@pytest.mark.gpu
def test_cuda_clips_replay_one_graph_and_the_schedule(tmp_path, monkeypatch):
    res, rows = _run(tmp_path, monkeypatch, "--cache-reuse", "2", device="cuda")
    assert rows == WARMUP + [2] * 3 + [2] * 4  # the runner is asked once per call; graphs replay inside it
    assert res["setup"]["ours_report"]["cuda_graphs"] == 1 and res["clips"]["cached"]["peak_gib"] > 0
    assert res["clips"]["cached"]["branch_calls"] == 6 and res["device"] != "cpu"


def _report(tmp_path, **caching) -> str:
    rec = {"setting": {"method": "extrapolate"}, "sampling": {"num_steps": 4}, "passed": True,
           "schedule": {"num_steps": 4, "reused": {"cond": [2], "uncond": [2]}, "order": 1}, **caching}
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"what": "a results JSON", "check_report": {"model": "wan-tiny", "caching": rec}}))
    return str(path)


def test_schedule_from_a_checked_report(tmp_path):
    sched, rec = _bench().cache_schedule(_report(tmp_path), None, 1, 4)
    assert sched.reused == {"cond": (2,), "uncond": (2,)} and sched.order == 1
    assert rec["checked"]["model"] == "wan-tiny" and rec["checked"]["passed"] is True


@pytest.mark.parametrize("caching, steps, why", [({}, 5, "--clip-steps 4"), ({"passed": False}, 4, "failed")])
def test_schedule_refused(tmp_path, caching, steps, why):
    with pytest.raises(ConfigError, match=why):
        _bench().cache_schedule(_report(tmp_path, **caching), None, 1, steps)


@pytest.mark.parametrize("clips", ["cache", "cached,cached", "", "eager,eager"])
def test_unknown_or_repeated_clips_refused_before_anything_loads(tmp_path, clips, capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--measure", "clips", "--clips", clips, "--out", str(tmp_path / "x.json")])
    assert "each once" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_the_tail_decodes_with_the_benchs_vae_or_fails_loudly(monkeypatch):
    """The family's frame decoder takes the bench's VAE (its description names it); a decoder that ignores
    it stops the bench instead of timing the small random one."""
    from trt_sora.models import get_adapter

    bench, adapter = _bench(), get_adapter("wan-tiny")
    vae = bench.vae_for("wan-tiny", "cpu", torch.float32)
    bench.frame_decoder(adapter, vae, "cpu", torch.float32)
    assert adapter.vae_on("cpu", torch.float32)[0] is vae
    monkeypatch.setattr(type(adapter), "vae_on", lambda self, device=None, dtype=None: self.vae())
    with pytest.raises(RuntimeError, match="did not take the bench's VAE"):
        bench.frame_decoder(get_adapter("wan-tiny"), vae, "cpu", torch.float32)
