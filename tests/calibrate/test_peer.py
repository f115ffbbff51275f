"""The ModelOpt peer comparison in the calibration report (wan-tiny, CPU)."""
from __future__ import annotations

import json

import pytest
from run_folders import write_preset

pytest.importorskip("torch")
pytest.importorskip("modelopt")

from trt_sora.calibrate.run import ReportOptions, calibrate  # noqa: E402
from trt_sora.config.recipe import CalibConfig, QuantConfig  # noqa: E402
from trt_sora.errors import ConfigError  # noqa: E402

SHAPE = {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 6, "text_len": 8}


def test_peer_in_report(tmp_path, tiny_adapter, tiny_model):
    """ModelOpt's FP8 recipe, replayed on our calibration trajectories, sits in the report next to ours: the
    replay saw our exact activations (ModelOpt's max = our minmax), every row compares finite numbers against
    the same reference, and ModelOpt on our sites quantizes exactly our linears."""
    write_preset(tmp_path / "small.yaml", SHAPE, negative_prompt="",
                 description="peer test: two prompts, two steps, one shape")
    opts = ReportOptions(eval_prompts=2, eval_steps=1, sensitivity="none", formats=("fp8_e4m3",), peer="modelopt",
                         peer_prompts=2)
    res = calibrate(tiny_adapter, CalibConfig(method="percentile"), tmp_path / "c", model=tiny_model,
                    preset=str(tmp_path / "small.yaml"), report_options=opts, quant_config=QuantConfig())
    peer = res.evaluation["peer"]
    assert peer["setup"]["num_steps"] == tiny_adapter.sampling.num_steps  # what users run
    assert peer["replay_max_rel_diff"] < 1e-6
    rows = {r["name"]: r for r in peer["rows"]}
    # the calibration rounded its weights (GPTQ, the default): the engine row uses them, a nearest row is added
    assert res.manifest["results"]["weight_rounding"]["method"] == "gptq"
    assert set(rows) == {"trt_sora (engine)", "trt_sora (engine, nearest rounding)", "trt_sora (checkpoint)",
                         "ModelOpt FP8 recipe", "ModelOpt max on our sites"}
    assert rows["trt_sora (engine)"]["psnr_db"] != rows["trt_sora (engine, nearest rounding)"]["psnr_db"]
    assert rows["ModelOpt max on our sites"]["sites"] == rows["trt_sora (engine)"]["sites"] == 20
    assert rows["ModelOpt FP8 recipe"]["sites"] == 20  # wan-tiny: its exclusions equal our default ones
    for r in rows.values():
        assert 0.9 < r["cosine"] < 1.0 and 10.0 < r["psnr_db"] < 200.0, r
    text = (tmp_path / "c" / "report.md").read_text()
    assert "## Peer: NVIDIA ModelOpt FP8" in text and "ModelOpt FP8 recipe" in text
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["results"]["peer"]["rows"]


def test_peer_options():
    with pytest.raises(ConfigError, match="peer"):
        ReportOptions(peer="torchao")
