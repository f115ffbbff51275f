"""`make engine` end to end on the CPU: every stage for wan-tiny + rtx4090-fp8, with a real
TensorRT-RTX build, stage reuse by fingerprint, and the fail-fast path of a TensorRT recipe."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from trt_sora.config import load_recipe
from trt_sora.errors import BackendMissingError
from trt_sora.pipeline import STAGES, EnginePipeline
from trt_sora.sm import parse_sm

pytestmark = pytest.mark.trt_rtx


@pytest.fixture(scope="module")
def first_run(engine_run):
    pipe, seen, _ = engine_run  # the session's run (tests/conftest.py), shared with tests/reliability
    return pipe, seen


def test_every_stage_ran_and_wrote_its_manifest(first_run):
    pipe, seen = first_run
    assert [o.stage for o in seen] == list(STAGES)
    assert all(o.status == "ran" for o in seen)
    for stage in STAGES:
        m = json.loads((pipe.folder(stage) / "manifest.json").read_text())
        assert m["inputs"], stage
    assert (pipe.folder("calibrate") / "report.md").is_file()
    assert (pipe.folder("quantize") / "qdq_map.json").is_file()
    from trt_sora.cli.common import run_recipe  # the recipe as run, for `trt-sora check --run DIR`

    recipe, source = run_recipe(pipe.run_dir)
    assert recipe == pipe.recipe and source.endswith("recipe.yaml")


def test_build_report_proves_fp8_and_profiles(first_run):
    pipe, _ = first_run
    report = json.loads((pipe.folder("build") / "build_report.json").read_text())
    a = report["analysis"]
    assert report["backend"] == "tensorrt_rtx" and parse_sm(report["sm"]) == (8, 9)
    assert a["quantized_gemm_total"] >= 10
    assert a["fp8_gemm_fraction"] >= 0.9, a["gemm_counts"]
    assert a["attention"]["fused"]
    assert report["profiles"]["built"] == len(pipe.buckets) == 2
    assert report["profiles"]["in_engine"] == 2
    plans = list(pipe.folder("build").glob("*.plan"))
    assert len(plans) == 1 and "sm89" in plans[0].name and plans[0].stat().st_size > 0


def test_parity_passed_and_says_engine_not_executed(first_run):
    pipe, _ = first_run
    rep = json.loads((pipe.folder("check") / "report.json").read_text())
    assert rep["passed"], rep["failed"]
    assert {c["level"] for c in rep["comparisons"]} >= {"export", "qdq", "quality", "loop", "frames"}
    assert rep["engine"]["executed"] is False and rep["engine"]["path"].endswith(".plan")


def test_unchanged_stages_are_reused_and_a_changed_one_reruns(first_run):
    pipe, _ = first_run
    seen = []
    again = EnginePipeline(pipe.recipe, "wan-tiny", pipe.run_dir.parent.parent, progress=seen.append)
    again.run(("export", "calibrate", "quantize", "build"))
    assert [o.status for o in seen] == ["reused"] * 4
    # a builder setting changed: only the build reruns
    seen.clear()
    recipe = dataclasses.replace(pipe.recipe, build=dataclasses.replace(pipe.recipe.build, optimization_level=1))
    EnginePipeline(recipe, "wan-tiny", pipe.run_dir.parent.parent, progress=seen.append).run(
        ("export", "calibrate", "quantize", "build"))
    assert [o.status for o in seen] == ["reused", "reused", "reused", "ran"]


def test_caching_recipe_reruns_the_check_and_the_runtime_serves_it(first_run, tmp_path):
    """Switching step caching on reuses every stage but the check (the calibration recorded the step
    ratios); the check's schedule is what the runtime serves. A calibration that predates the step
    ratios reruns when caching is on, saying why."""
    import trt_sora.runtime as rt
    from trt_sora.config import CachingConfig
    from trt_sora.manifest import folder_files, read_manifest, write_json

    pipe, _ = first_run
    run = tmp_path / "out" / "wan-tiny" / pipe.recipe.name
    shutil.copytree(pipe.run_dir, run)
    # the copy's build matches this recipe whatever an earlier test left in the shared run folder
    EnginePipeline(pipe.recipe, "wan-tiny", tmp_path / "out").run(("export", "calibrate", "quantize", "build"))
    recipe = dataclasses.replace(pipe.recipe, caching=CachingConfig(method="magcache", threshold=0.3, max_skips=1,
                                                                    warmup_steps=1, final_steps=1))
    seen = []
    EnginePipeline(recipe, "wan-tiny", tmp_path / "out", progress=seen.append).run()
    assert [o.status for o in seen] == ["reused"] * 4 + ["ran"]
    rep = json.loads((run / "parity" / "report.json").read_text())
    assert rep["passed"] and rep["caching"]["calls"] < rep["caching"]["calls_uncached"] == 8
    assert rt.load(run, backend="ort", warmup=False).caching.schedule.to_dict() == rep["caching"]["schedule"]
    man = read_manifest(run / "calib")
    (run / "calib" / man["outputs"].pop("step_ratios")).unlink()
    man["files"] = folder_files(run / "calib")
    write_json(run / "calib" / "manifest.json", man)
    plan = EnginePipeline(recipe, "wan-tiny", tmp_path / "out").plan(("calibrate",))
    assert plan[0].action == "run" and "predates its step ratios" in plan[0].reason
    assert EnginePipeline(pipe.recipe, "wan-tiny", tmp_path / "out").plan(("calibrate",))[0].action == "reuse"


def test_tensorrt_recipe_fails_fast_after_earlier_stages(first_run, tmp_path):
    """h100-fp8 needs full TensorRT (not installable here): the earlier stages' artifacts stay,
    and the error names the install command."""
    pytest.importorskip("tensorrt_rtx")
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("full TensorRT is installed here")
    pipe, _ = first_run
    # same export/calibration/quantization sections as the first run, so those stages are reused
    h100 = dataclasses.replace(load_recipe("h100-fp8"), export=pipe.recipe.export,
                               calibration=pipe.recipe.calibration, quantization=pipe.recipe.quantization)
    run_dir = tmp_path / "wan-tiny" / "h100-fp8"
    run_dir.mkdir(parents=True)
    for stage in ("export", "calibrate", "quantize"):
        shutil.copytree(pipe.folder(stage), run_dir / pipe.folder(stage).name)
    shutil.copy(pipe.run_dir / "pipeline.json", run_dir / "pipeline.json")
    seen = []
    with pytest.raises(BackendMissingError, match="pip install .*tensorrt"):
        EnginePipeline(h100, "wan-tiny", tmp_path, progress=seen.append).run()
    assert [o.status for o in seen] == ["reused"] * 3
    assert (run_dir / "quant" / "model.qdq.onnx").is_file()
    assert not (run_dir / "engine").exists()


def test_unquantized_recipe_skips_calibration_and_casts_the_graph(first_run, tmp_path):
    """h100-bf16: no calibration, the quantize stage only casts the exported graph to bf16."""
    import onnx

    pipe, _ = first_run
    bf16 = load_recipe("h100-bf16")
    assert bf16.export == pipe.recipe.export
    run_dir = tmp_path / "wan-tiny" / "h100-bf16"
    run_dir.mkdir(parents=True)
    shutil.copytree(pipe.folder("export"), run_dir / "export")
    shutil.copy(pipe.run_dir / "pipeline.json", run_dir / "pipeline.json")
    seen = []
    EnginePipeline(bf16, "wan-tiny", tmp_path, progress=seen.append).run(("export", "calibrate", "quantize"))
    assert [o.status for o in seen] == ["reused", "skipped", "ran"]
    model = onnx.load(str(run_dir / "quant" / "model.qdq.onnx"), load_external_data=False)
    assert not [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["hidden_states"] == onnx.TensorProto.BFLOAT16 and types["timestep"] == onnx.TensorProto.FLOAT


@pytest.mark.slow
def test_two_calibration_shards_give_the_same_quantized_graph(first_run, tmp_path):
    """`trt-sora engine --calib-shards 2`: two shards merged exactly -> the same stats, so the same Q/DQ
    graph, byte for byte, as the one-pass run."""
    pipe, _ = first_run
    run_dir = tmp_path / "wan-tiny" / pipe.recipe.name  # the first run's export, reused: the claim is calibrate's
    run_dir.mkdir(parents=True)
    shutil.copytree(pipe.folder("export"), run_dir / pipe.folder("export").name)
    shutil.copy(pipe.run_dir / "pipeline.json", run_dir / "pipeline.json")
    seen = []
    two = EnginePipeline(pipe.recipe, "wan-tiny", tmp_path, progress=seen.append, calib_shards=2)
    two.run(("export", "calibrate", "quantize"))
    assert [o.status for o in seen] == ["reused", "ran", "ran"] and "2 shards merged" in seen[1].detail
    for name in ("model.qdq.onnx", "model.qdq.onnx.data"):
        a, b = pipe.folder("quantize") / name, two.folder("quantize") / name
        assert a.exists() == b.exists()
        if a.exists():
            assert a.read_bytes() == b.read_bytes(), name
    assert (two.folder("calibrate").parent / "calib.shards" / "shard-1-of-2" / "stats.safetensors").is_file()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_engine_passes_shards_to_the_engine_command():
    """`make engine SHARDS=2` runs the command the test above runs (`trt-sora engine --calib-shards 2`)."""
    import shlex
    import subprocess

    from trt_sora.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-n", "-C", str(root), "engine", "SHARDS=2", "MODEL=wan-tiny", "VENV=/v"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("/v/bin/trt-sora engine"))
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert (args.calib_shards, args.model) == (2, "wan-tiny")
