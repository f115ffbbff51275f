"""The stage commands' shared pieces: ``--recipe``/``--out``, the ``--out`` check before any work, and
flags that override a recipe section."""
from __future__ import annotations

import dataclasses

import pytest

from trt_sora.cli import build_parser
from trt_sora.cli.common import overridden
from trt_sora.config import load_recipe
from trt_sora.config.recipe import CalibMethod, DType, ExternalData, QuantFormat
from trt_sora.errors import ArtifactError, ConfigError

RECIPE = "rtx4090-fp8"  # fp8_e4m3 in an fp16 graph, fused QKV, external data auto, mse calibration


def test_flags_override_only_what_they_set_read_as_the_recipe_yaml():
    recipe = load_recipe(RECIPE)
    q = recipe.quantization
    assert overridden(q, format=None, graph_dtype=None, fused_qkv=None) is q
    got = overridden(q, format="int8", graph_dtype="fp32", fused_qkv=None)
    assert got == dataclasses.replace(q, format=QuantFormat.INT8, graph_dtype=DType.FP32)
    assert got.format is QuantFormat.INT8 and got.fused_qkv is True
    assert overridden(q, fused_qkv=False) == dataclasses.replace(q, fused_qkv=False)
    assert overridden(recipe.export, external_data="never", verify=False) == dataclasses.replace(
        recipe.export, external_data=ExternalData.NEVER, verify=False)
    assert overridden(recipe.calibration, method="ema").method is CalibMethod.EMA
    with pytest.raises(ConfigError, match="did you mean 'int8'"):
        overridden(q, format="int9")


@pytest.mark.parametrize("argv", [["export"], ["calibrate"], ["quantize", "--onnx", "m.onnx"],
                                  ["build", "--onnx", "m.onnx"]])
def test_stage_commands_take_recipe_and_out(argv):
    parser = build_parser()
    args = parser.parse_args([*argv, "--recipe", RECIPE, "--out", "o"])
    assert (args.recipe, args.out) == (RECIPE, "o")
    with pytest.raises(SystemExit):  # --out is required
        parser.parse_args([*argv, "--recipe", RECIPE])


@pytest.mark.parametrize("argv", [["export"], ["quantize", "--onnx", "m.onnx"], ["build", "--onnx", "m.onnx"]])
def test_stage_commands_refuse_a_foreign_out_folder_before_reading_the_recipe(tmp_path, argv):
    (tmp_path / "notes.txt").write_text("not an artifact")
    args = build_parser().parse_args([*argv, "--recipe", "no-such-recipe", "--out", str(tmp_path)])
    with pytest.raises(ArtifactError, match="not a trt_sora artifact"):
        args.func(args)


@pytest.mark.parametrize("argv", [["generate", "a caption", "-o", "c.mp4"],
                                  ["batch", "--prompts", "j.jsonl", "--out", "o"], ["serve"]])
def test_run_folder_commands_share_the_runtime_and_cfg_arguments(argv):
    parser = build_parser()
    args = parser.parse_args([*argv, "--run", "r", "--backend", "ort", "--threads", "1", "--cfg", "split"])
    assert (args.run, args.backend, args.threads, args.force, args.cfg) == ("r", "ort", 1, False, "split")
    assert parser.parse_args([*argv, "--run", "r"]).cfg == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--run", "r", "--cfg", "sometimes"])
