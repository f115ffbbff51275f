"""stats.safetensors: round trip, header metadata, atomic writes, validation errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trt_sora.calibrate import stats as stats_mod
from trt_sora.calibrate.observers import SiteStats
from trt_sora.calibrate.stats import STATS_FORMAT, CalibStats, StatsMetadata, read_metadata
from trt_sora.errors import CalibrationError


def _sites() -> dict[str, SiteStats]:
    g = torch.Generator().manual_seed(0)
    sites = {
        "blocks.0.attn1.to_q": SiteStats("blocks.0.attn1.to_q", ["percentile", "minmax", "ema"]),
        "blocks.0.ffn.net.0.proj": SiteStats("blocks.0.ffn.net.0.proj", ["percentile", "mse"]),
        "proj_out": SiteStats("proj_out", ["percentile"], branches=("cond",)),
    }
    for step in range(4):
        for branch in ("cond", "uncond"):
            for s in sites.values():
                if branch in s.branches:
                    s.collect(torch.randn(2, 8, 16, generator=g) * (step + 1), step=step, branch=branch)
    return sites


def _meta(**kw) -> StatsMetadata:
    kw.setdefault("num_samples", 3)
    return StatsMetadata(method="percentile", num_steps=4, timesteps=[999.0, 750.5, 500.0, 1.0],
                         shapes=[{"batch": 1, "latent_frames": 2, "latent_height": 8, "latent_width": 8,
                                  "text_len": 16}], model="wan-tiny", model_hash="ab" * 32, preset="tiny",
                         prompt_set="video_prompts_v1", seed=0, guidance_scale=5.0, shift=3.0, **kw)


def test_round_trip(tmp_path):
    sites = _sites()
    stats = CalibStats.from_sites(sites, _meta())
    path = stats.save(tmp_path / "calib" / "stats.safetensors")
    back = CalibStats.load(path)
    assert back.sites == sorted(sites)
    for name, site in sites.items():
        torch.testing.assert_close(back.amax[name], site.compute_amax("percentile"), rtol=0, atol=0)
        assert back.amax[name].dtype == torch.float32
    grid = back.amax_per_step["blocks.0.attn1.to_q"]
    assert grid.shape == (4, 2)
    torch.testing.assert_close(grid, sites["blocks.0.attn1.to_q"].amax_per_step)
    assert back.amax_per_step["proj_out"].shape == (4,)  # one branch: [steps]
    assert back.count_per_step["proj_out"].tolist() == [1, 1, 1, 1]
    assert set(back.method_amax["blocks.0.attn1.to_q"]) == {"minmax", "ema"}
    torch.testing.assert_close(back.method_amax["blocks.0.ffn.net.0.proj"]["mse"],
                               sites["blocks.0.ffn.net.0.proj"].compute_amax("mse"))
    h, r = back.histograms["proj_out"]
    h_ref, r_ref = sites["proj_out"].observers["percentile"].histogram()
    assert torch.equal(h, h_ref) and r == pytest.approx(r_ref, rel=1e-7)
    assert back.metadata == stats.metadata
    assert back.metadata.observers["percentile"]["percentile"] == 99.99


def test_metadata_readable_from_header_alone(tmp_path):
    path = CalibStats.from_sites(_sites(), _meta()).save(tmp_path / "stats.safetensors")
    with safe_open(str(path), framework="pt") as fh:  # independent reader: raw safetensors header
        header = fh.metadata()
        keys = set(fh.keys())
    assert header["format"] == STATS_FORMAT and header["format_version"] == "1"
    raw = json.loads(header["trt_sora.calib"])
    assert raw["timesteps"] == [999.0, 750.5, 500.0, 1.0] and raw["model_hash"] == "ab" * 32
    assert raw["shapes"][0]["latent_height"] == 8 and raw["method"] == "percentile"
    assert read_metadata(path).to_dict() == raw
    assert {"blocks.0.attn1.to_q.amax", "blocks.0.attn1.to_q.amax_per_step", "proj_out.amax"} <= keys


def test_per_channel_amax_round_trip(tmp_path):
    w = SiteStats("blocks.0.attn1.to_q.weight", ["minmax"], branches=("cond",),
                  observer_kwargs={"minmax": {"axis": 0}})
    weight = torch.randn(16, 8)
    w.collect(weight)
    stats = CalibStats.from_sites({w.name: w}, StatsMetadata(method="minmax"))
    back = CalibStats.load(stats.save(tmp_path / "s.safetensors"))
    torch.testing.assert_close(back.amax[w.name], weight.abs().amax(dim=1), rtol=0, atol=0)
    assert w.name not in back.amax_per_step  # never collected per step


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "stats.safetensors"
    CalibStats.from_sites(_sites(), _meta()).save(path)
    before = path.read_bytes()

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"half-written")
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        CalibStats.from_sites(_sites(), _meta(num_samples=99)).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["stats.safetensors"]  # no temp file left behind


def _write_raw(path, tensors, meta_override=None, header=None):
    meta = {"format": STATS_FORMAT, "format_version": "1",
            "trt_sora.calib": json.dumps(StatsMetadata(method="minmax").to_dict())}
    if meta_override:
        meta.update(meta_override)
    save_file(tensors, str(path), metadata=header if header is not None else meta)


@pytest.mark.parametrize("value,match", [(float("nan"), "non-finite"), (float("inf"), "non-finite"),
                                         (0.0, "<= 0"), (-1.0, "<= 0")])
def test_load_rejects_bad_amax_naming_the_site(tmp_path, value, match):
    p = tmp_path / "bad.safetensors"
    _write_raw(p, {"blocks.7.ffn.amax": torch.tensor(value), "ok.amax": torch.tensor(1.0)})
    with pytest.raises(CalibrationError, match=match) as ei:
        CalibStats.load(p)
    assert "blocks.7.ffn" in str(ei.value) and "calibrat" in str(ei.value)
    assert CalibStats.load(p, validate=False).amax["ok"] == 1.0


def test_save_refuses_invalid_stats(tmp_path):
    bad = CalibStats(amax={"a.b": torch.tensor(0.0)}, metadata=StatsMetadata(method="minmax"))
    with pytest.raises(CalibrationError, match="'a.b'"):
        bad.save(tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def test_load_errors(tmp_path):
    with pytest.raises(CalibrationError, match="do not exist"):
        CalibStats.load(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 5)
    with pytest.raises(CalibrationError, match="not a readable safetensors"):
        CalibStats.load(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.ones(2)}, str(foreign))
    with pytest.raises(CalibrationError, match="not a trt_sora calibration stats file"):
        CalibStats.load(foreign)
    future = tmp_path / "future.safetensors"
    _write_raw(future, {"a.amax": torch.tensor(1.0)}, {"format_version": "2"})
    with pytest.raises(CalibrationError, match="format_version '2' is not supported"):
        CalibStats.load(future)
    odd = tmp_path / "odd.safetensors"
    _write_raw(odd, {"a.amax": torch.tensor(1.0), "a.weird": torch.tensor(1.0)})
    with pytest.raises(CalibrationError, match="unexpected tensor 'a.weird'"):
        CalibStats.load(odd)
    orphan = tmp_path / "orphan.safetensors"
    _write_raw(orphan, {"a.amax": torch.tensor(1.0), "b.amax_per_step": torch.ones(3)})
    with pytest.raises(CalibrationError, match="'b'"):
        CalibStats.load(orphan)
    nan_step = tmp_path / "nanstep.safetensors"
    _write_raw(nan_step, {"a.amax": torch.tensor(1.0), "a.amax_per_step": torch.tensor([1.0, float("nan")])})
    with pytest.raises(CalibrationError, match="amax_per_step"):
        CalibStats.load(nan_step)


def test_metadata_unknown_key_is_an_error(tmp_path):
    p = tmp_path / "m.safetensors"
    meta = StatsMetadata(method="minmax").to_dict() | {"new_field": 1}
    _write_raw(p, {"a.amax": torch.tensor(1.0)}, {"trt_sora.calib": json.dumps(meta)})
    with pytest.raises(CalibrationError, match="new_field"):
        read_metadata(p)


def test_raw_tensors_match_documented_layout(tmp_path):
    path = CalibStats.from_sites(_sites(), _meta()).save(tmp_path / "s.safetensors")
    raw = load_file(str(path))
    assert raw["blocks.0.attn1.to_q.amax"].shape == () and raw["blocks.0.attn1.to_q.amax"].dtype == torch.float32
    assert raw["blocks.0.attn1.to_q.amax_per_step"].shape == (4, 2)
    assert raw["blocks.0.attn1.to_q.count_per_step"].dtype == torch.int64
    assert raw["proj_out.hist"].shape == (2048,) and raw["proj_out.hist_range"].shape == ()
    assert stats_mod.STATS_FORMAT_VERSION == 1
