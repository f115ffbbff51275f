"""Calibration shards: observer states merge exactly (bit for bit) for every method, a 2-shard run of
wan-tiny equals the one-pass run tensor for tensor, and incomplete or mismatched shard sets are refused."""
from __future__ import annotations

import pytest
from run_folders import write_preset

torch = pytest.importorskip("torch")

from trt_sora.calibrate.observers import SiteStats  # noqa: E402
from trt_sora.calibrate.run import calibrate  # noqa: E402
from trt_sora.calibrate.shards import merge_stats, parse_shard, shard_range  # noqa: E402
from trt_sora.calibrate.stats import CalibStats  # noqa: E402
from trt_sora.config.recipe import CalibConfig  # noqa: E402
from trt_sora.errors import CalibrationError, ConfigError  # noqa: E402

METHODS = ("percentile", "minmax", "ema", "mse")
KW = {"percentile": {"percentile": 99.9, "num_bins": 256}, "mse": {"num_bins": 256}}


def _batches(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    # growing and shrinking ranges, zeros, outliers, fp16 and bf16 inputs: every histogram path
    out = [torch.zeros(40)]
    for i in range(n):
        x = torch.randn(300, generator=g) * (0.01 * 7 ** (i % 5))
        if i % 4 == 3:
            x[5] = 900.0
        out.append(x.half() if i % 3 == 1 else x.bfloat16() if i % 3 == 2 else x)
    return out


def test_merged_sites_equal_one_pass_bit_for_bit():
    batches = [(step, b, x) for step, x in enumerate(_batches(0, 11)) for b in ("cond", "uncond")]
    one = SiteStats("s", METHODS, observer_kwargs=KW)
    parts = [SiteStats("s", METHODS, observer_kwargs=KW) for _ in range(3)]
    for k, (step, b, x) in enumerate(batches):
        one.collect(x, step=step, branch=b)
        parts[k * 3 // len(batches)].collect(x, step=step, branch=b)  # contiguous slices, like shards
    merged = parts[0]
    for p in parts[1:]:
        merged.merge(p)
    a, b = one.compute_all(), merged.compute_all()
    assert all(torch.equal(a[m], b[m]) for m in METHODS), (a, b)
    h1, r1 = one.observers["percentile"].histogram()
    h2, r2 = merged.observers["percentile"].histogram()
    assert r1 == r2 and torch.equal(h1, h2)
    assert torch.equal(one.amax_per_step, merged.amax_per_step)
    assert torch.equal(one.count_per_step, merged.count_per_step)
    # EMA depends on the order: merging the same shards in another order gives another average
    other = parts_copy = [SiteStats("s", ["ema"]) for _ in range(2)]
    for k, (step, b, x) in enumerate(batches):
        parts_copy[k * 2 // len(batches)].collect(x, step=step, branch=b)
    other[1].merge(other[0])
    assert not torch.equal(other[1].compute_amax(), a["ema"])


def test_parse_and_slices():
    assert parse_shard("1/4") == (1, 4)
    with pytest.raises(ConfigError, match="0 <= i < n"):
        parse_shard("4/4")
    assert [list(shard_range(10, i, 3)) for i in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return write_preset(tmp_path_factory.mktemp("preset") / "three.yaml",
                        {"batch": 1, "latent_frames": 2, "latent_height": 4, "latent_width": 4, "text_len": 8},
                        num_prompts=3)


def test_two_shard_calibration_equals_one_pass(tmp_path, tiny_adapter, tiny_model, preset):
    cfg = CalibConfig(method="mse")
    kw = dict(model=tiny_model, preset=str(preset), report=False)
    one = calibrate(tiny_adapter, cfg, tmp_path / "one", **kw)
    shards = [calibrate(tiny_adapter, cfg, tmp_path / f"s{i}", shard=(i, 2), **kw) for i in (1, 0)]
    assert shards[0].manifest["results"]["shard"] == [1, 2] and shards[1].stats.metadata.num_samples == 1
    merged = calibrate(tiny_adapter, cfg, tmp_path / "merged", from_shards=[tmp_path / "s1", tmp_path / "s0"], **kw)
    a = one.stats.to_tensors()
    b = CalibStats.load(merged.stats_path).to_tensors()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert merged.manifest["results"]["from_shards"] == 2 and len(merged.manifest["inputs"]["shards"]) == 2
    # step caching's ratios: the shards' rows in shard order are the one pass's rows
    import numpy as np

    from trt_sora.caching import RATIOS_FILE, StepRatios

    r1, r2 = (StepRatios.load(tmp_path / d / RATIOS_FILE) for d in ("one", "merged"))
    assert r1.steps == r2.steps and all(np.array_equal(r1.ratios[b], r2.ratios[b]) for b in ("cond", "uncond"))
    with pytest.raises(CalibrationError, match="not one complete set"):
        merge_stats([CalibStats.load(tmp_path / "s0" / "stats.safetensors")])
    with pytest.raises(CalibrationError, match="num_steps"):
        calibrate(tiny_adapter, CalibConfig(method="mse", num_steps=3), tmp_path / "bad",
                  from_shards=[tmp_path / "s0", tmp_path / "s1"], **kw)


@pytest.mark.slow
def test_torchrun_workers_on_cpu_resume_and_match_one_pass(tmp_path, tiny_adapter, preset):
    """`trt-sora calibrate --workers 2` (torchrun, gloo): the merged stats equal a one-pass run; after a shard
    is lost, rerunning redoes that shard alone."""
    import json
    import os
    import subprocess
    import sys

    from trt_sora.config import load_recipe

    recipe = load_recipe("rtx4090-fp8")
    out = tmp_path / "calib"
    cmd = [sys.executable, "-m", "trt_sora", "calibrate", "--model", "wan-tiny", "--recipe", "rtx4090-fp8",
           "--preset", str(preset), "--out", str(out), "--no-report", "--workers", "2", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
    one = calibrate(tiny_adapter, recipe.calibration, tmp_path / "one", preset=str(preset), report=False,
                    quant_format=recipe.quantization.format, quant_config=recipe.quantization,
                    dtype=recipe.model.dtype.value)
    a, b = one.stats.to_tensors(), CalibStats.load(out / "stats.safetensors").to_tensors()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    created = {i: json.loads((tmp_path / "calib.shards" / f"shard-{i}-of-2" / "manifest.json").read_text())["created"]
               for i in (0, 1)}
    import shutil

    shutil.rmtree(tmp_path / "calib.shards" / "shard-1-of-2")  # a killed shard leaves no folder (written atomically)
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
    again = {i: json.loads((tmp_path / "calib.shards" / f"shard-{i}-of-2" / "manifest.json").read_text())["created"]
             for i in (0, 1)}
    assert again[0] == created[0]  # skipped: already complete
    assert (tmp_path / "calib.shards" / "shard-1-of-2" / "stats.safetensors").is_file()
    b2 = CalibStats.load(out / "stats.safetensors").to_tensors()
    assert all(torch.equal(a[k], b2[k]) for k in a)


@pytest.mark.gpu
def test_site_updates_never_sync_with_the_host_on_cuda():
    """The calibration hot path (SiteStats.collect / collect_cfg_batch for every method) issues no
    device->host sync: torch raises on any sync in 'error' debug mode. Only check_finite syncs, once."""
    from trt_sora.calibrate.observers import check_finite

    site = SiteStats("blocks.0.attn1.to_q", METHODS, observer_kwargs=KW)
    xs = [torch.randn(2, 4096, 512, device="cuda", dtype=torch.bfloat16) * s for s in (0.1, 3.0, 0.5)]
    site.collect(xs[0], step=0, branch="cond")  # first call allocates; the steady state is what counts
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        site.collect(xs[1], step=1, branch="uncond")
        site.collect_cfg_batch(xs[2], step=2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_finite([site])
    cpu = SiteStats("blocks.0.attn1.to_q", METHODS, observer_kwargs=KW)
    cpu.collect(xs[0].cpu(), step=0, branch="cond")
    cpu.collect(xs[1].cpu(), step=1, branch="uncond")
    cpu.collect_cfg_batch(xs[2].cpu(), step=2)
    a, b = site.compute_all(), cpu.compute_all()
    for m in ("minmax", "percentile", "ema"):  # same bins, same maxima on either device
        assert torch.equal(a[m].cpu(), b[m]), m


@pytest.mark.gpu
def test_observers_on_a_side_stream_give_the_same_statistics(tiny_adapter):
    """CollectionHooks(overlap=True) runs the observers on a side stream (ordered after each producing
    kernel, joined before the host sync): every site's statistics equal the forward-stream run's, bit for
    bit, over split and CFG-batched forwards, and the forward's own output is untouched."""
    from trt_sora.calibrate.hooks import CollectionHooks

    model = tiny_adapter.load("fp32", "cuda")
    pt = {"batch": 2, "latent_frames": 3, "latent_height": 8, "latent_width": 8, "text_len": 16}
    x = tiny_adapter.example_inputs(pt, device="cuda")
    stats, outs = [], []
    for overlap in (False, True):
        with CollectionHooks(model, methods=METHODS, observer_kwargs=KW, overlap=overlap) as hooks:
            for step in range(3):
                with hooks.at(step=step, branch="cond+uncond"), torch.inference_mode():
                    outs.append(tiny_adapter.forward(model, x))
                with hooks.at(step=step, branch="cond"), torch.inference_mode():
                    tiny_adapter.forward(model, x)
        stats.append({n: s.compute_all() for n, s in hooks.used_sites().items()})
    assert stats[0].keys() == stats[1].keys() and len(stats[0]) > 10
    for name in stats[0]:
        for m in METHODS:
            assert torch.equal(stats[0][name][m], stats[1][name][m]), (name, m)
    assert torch.equal(outs[0], outs[3])


def test_hooks_summarize_a_shared_input_once(tiny_adapter, tiny_model, monkeypatch):
    """Q, K and V of self-attention read one tensor: one batch summary serves all three sites."""
    from trt_sora.calibrate.hooks import CollectionHooks

    calls = []
    real = SiteStats.summarize
    monkeypatch.setattr(SiteStats, "summarize", lambda self, x, order=None: calls.append(self.name) or
                        real(self, x, order))
    x = tiny_adapter.example_inputs({"batch": 1, "latent_frames": 2, "latent_height": 4, "latent_width": 4,
                                     "text_len": 8})
    with CollectionHooks(tiny_model, methods=METHODS, observer_kwargs=KW) as hooks:
        with hooks.at(step=0, branch="cond"), torch.inference_mode():
            tiny_adapter.forward(tiny_model, x)
    sites = hooks.used_sites()
    assert "blocks.0.attn1.to_q" in calls and "blocks.0.attn1.to_k" not in calls and len(calls) < len(sites)
    q, k = sites["blocks.0.attn1.to_q"].compute_all(), sites["blocks.0.attn1.to_k"].compute_all()
    assert all(torch.equal(q[m], k[m]) for m in METHODS)


def _tensors(folder):
    from safetensors.torch import load_file

    out = {f"stats:{k}": v for k, v in CalibStats.load(folder / "stats.safetensors").to_tensors().items()}
    if (folder / "weights.safetensors").is_file():  # the GPTQ-rounded weights, rounded once from the merged Hessians
        out.update({f"weights:{k}": v for k, v in load_file(str(folder / "weights.safetensors")).items()})
    return out


def test_sharded_calibration_of_an_expert_pair_equals_one_pass(tmp_path, preset):
    """Wan 2.2 A14B's pair: shards of the shared trajectories (each still switching at the boundary; a shard
    folder holds one folder per expert), merged by `trt-sora calibrate --from-shards`, give both experts the
    one-pass statistics and GPTQ weights tensor for tensor."""
    import json

    from trt_sora.calibrate.run import calibrate_experts
    from trt_sora.cli import main
    from trt_sora.config import load_recipe
    from trt_sora.models import get_adapter

    pair = get_adapter("wan-a14b-tiny")
    recipe = load_recipe("rtx4090-fp8")
    two = tmp_path / "two.yaml"  # the module's preset with 2 prompts: one trajectory per shard
    two.write_text(preset.read_text().replace("num_prompts: 3", "num_prompts: 2"))
    kw = dict(preset=str(two), report=False, quant_format=recipe.quantization.format, quant_config=recipe.quantization,
              models={e: pair.expert(e).load() for e in pair.experts})
    one = calibrate_experts(pair, recipe.calibration, {e: tmp_path / "one" / e for e in pair.experts}, **kw)
    served = {e: r.manifest["results"]["expert"]["steps_served"] for e, r in one.items()}
    assert served == {"high": [0], "low": [1]}  # 2 steps at shift 3: t = 1000, then below the boundary
    for i in (1, 0):
        calibrate_experts(pair, recipe.calibration, {e: tmp_path / f"s{i}" / e for e in pair.experts},
                          shard=(i, 2), **kw)
    assert json.loads((tmp_path / "s1" / "low" / "manifest.json").read_text())["results"]["shard"] == [1, 2]
    merge = ["calibrate", "--model", "wan-a14b-tiny", "--recipe", "rtx4090-fp8", "--preset", str(two), "--no-report",
             "--from-shards", str(tmp_path / "s1"), str(tmp_path / "s0"), "--out", str(tmp_path / "m")]
    assert main(merge) == 0
    assert main(merge) == 0  # again into the same OUT (it holds high/ and low/): replaced, as a rerun does
    for e in pair.experts:
        a, b = _tensors(tmp_path / "one" / e), _tensors(tmp_path / "m" / e)
        assert set(a) == set(b) and any(k.startswith("weights:") for k in a)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (e, k)
        m = json.loads((tmp_path / "m" / e / "manifest.json").read_text())["results"]
        assert m["from_shards"] == 2 and m["expert"]["steps_served"] == served[e]
    import dataclasses

    with pytest.raises(CalibrationError, match="num_bins=2048"):  # observer settings of the shards, not others
        calibrate_experts(pair, dataclasses.replace(recipe.calibration, num_bins=256),
                          {e: tmp_path / "x" / e for e in pair.experts},
                          from_shards={e: [tmp_path / "s0" / e, tmp_path / "s1" / e] for e in pair.experts}, **kw)
    with pytest.raises(ConfigError, match="missing"):  # each expert needs its own shards
        calibrate_experts(pair, recipe.calibration, {e: tmp_path / "x" / e for e in pair.experts},
                          from_shards={"high": [tmp_path / "s0" / "high", tmp_path / "s1" / "high"]}, **kw)
