"""Session-scoped run folders and helpers that damage them; the fixtures are registered once, in
tests/conftest.py, for every test folder:

* ``base_run`` / ``checked_run``: wan-tiny (export (~25-80 s) -> stats -> Q/DQ, and a checked copy);
* ``pair_run``, ``i2v_run``, ``ti2v_run``, ``hunyuan_run``: ``make engine`` (every stage, a real
  TensorRT-RTX FP8 build included) on the tiny Wan 2.2 A14B pair, Wan 2.1 I2V, Wan 2.2 TI2V and
  HunyuanVideo 1.5 configs with :func:`ci_recipe`, as ``(EnginePipeline, outcomes)``. Tests read them;
  a test that damages one works on a copy;
* :func:`quantized_run`: a family's export -> calibrate -> quantize, from its engine run where there is one;
* :func:`write_preset`: a small calibration preset for the tests that calibrate.

The costly session fixtures (exports, engine runs) are built once per test run, not once per xdist worker:
:func:`once_per_run`."""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest

RECIPE = "rtx4090-fp8"

#: Three export-parity points that differ in every dynamic dim (batch, frames, height, width, text length).
WAN_POINTS = (
    {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 7},
    {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 4, "text_len": 12},
    {"batch": 3, "latent_frames": 4, "latent_height": 8, "latent_width": 2, "text_len": 3},
)
#: The same for HunyuanVideo 1.5, whose own text_len_2 differs too.
HUNYUAN_POINTS = tuple({**p, "text_len_2": n} for p, n in zip(WAN_POINTS, (2, 5, 8)))


def ci_recipe(points=WAN_POINTS, **calibration):
    """rtx4090-fp8 with export parity at ``points`` and the calibration report's evaluation sized for CI
    (no sensitivity sweep, 2 evaluation steps; ``calibration`` overrides more)."""
    import dataclasses

    from trt_sora.config import load_recipe

    r = load_recipe(RECIPE)
    calib = dataclasses.replace(r.calibration, **{"sensitivity": "none", "eval_steps": 2, **calibration})
    return dataclasses.replace(r, export=dataclasses.replace(r.export, verify_points=points), calibration=calib)


def _recipe(model: str):
    """The CI recipe of each tiny family's run folder (HunyuanVideo: its own points, one evaluation prompt)."""
    return ci_recipe(HUNYUAN_POINTS, eval_prompts=1) if model == "hunyuan-tiny" else ci_recipe()


def once_per_run(tmp_path_factory, name: str, build):
    """``build(folder)``'s value, built once per test run. Under pytest-xdist the first worker that asks builds
    it in the run's temp root (the parent of every worker's basetemp) holding a lock, and pickles the value;
    a worker that asks later waits for the lock and loads it. Without xdist, the session's basetemp. A build
    that raised leaves no value: the next worker to ask builds again. ``folder`` is new and empty; the value
    must pickle (paths, dataclasses, recipes) and the tests must only read what ``folder`` holds (as the
    session fixtures always required: a test that damages a run works on a copy)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once"
    root.mkdir(exist_ok=True)
    value_file = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if value_file.exists():
            return pickle.loads(value_file.read_bytes())
        folder = root / name
        shutil.rmtree(folder, ignore_errors=True)  # a build that raised part-way
        folder.mkdir()
        value = build(folder)
        tmp = value_file.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(value_file)
        return value


def _engine(tmp_path_factory, model: str):
    """``(EnginePipeline, outcomes)`` of ``make engine`` on ``model``, once per test run."""
    pytest.importorskip("tensorrt_rtx")
    from trt_sora.pipeline import EnginePipeline

    def build(out: Path):
        pipe = EnginePipeline(_recipe(model), model, out)
        return out, pipe.run()

    out, outcomes = once_per_run(tmp_path_factory, f"engine-{model}", build)
    return EnginePipeline(_recipe(model), model, out), outcomes


@pytest.fixture(scope="session")
def pair_run(tmp_path_factory):
    """wan-a14b-tiny: two experts, two engines, one parity report."""
    return _engine(tmp_path_factory, "wan-a14b-tiny")


@pytest.fixture(scope="session")
def i2v_run(tmp_path_factory):
    return _engine(tmp_path_factory, "wan-i2v-tiny")


@pytest.fixture(scope="session")
def ti2v_run(tmp_path_factory):
    return _engine(tmp_path_factory, "wan-ti2v-tiny")


@pytest.fixture(scope="session")
def hunyuan_run(tmp_path_factory):
    return _engine(tmp_path_factory, "hunyuan-tiny")


#: The session fixture of each tiny family's ``make engine`` run.
ENGINE_RUNS = {"wan-a14b-tiny": "pair_run", "wan-i2v-tiny": "i2v_run", "wan-ti2v-tiny": "ti2v_run",
               "hunyuan-tiny": "hunyuan_run"}
_QUANTIZED: dict = {}


def quantized_run(request, model: str):
    """``EnginePipeline`` of ``model`` (a key of ENGINE_RUNS) whose export, calibrate and quantize stages
    ran with its engine fixture's recipe, for tests that read calib/ and quant/ (a test that writes works
    on a copy). On a CPU machine with TensorRT-RTX (CI) this is the session's engine run (the same three
    stages, then build and check): one export per family per session instead of two. Elsewhere the three
    stages alone, once per session: on a GPU machine (``pytest -m gpu``) no test needs the engine runs,
    and their check would run an SM 8.9 engine on that GPU."""
    import importlib.util

    import torch

    if importlib.util.find_spec("tensorrt_rtx") is not None and not torch.cuda.is_available():
        return request.getfixturevalue(ENGINE_RUNS[model])[0]
    if model not in _QUANTIZED:
        from trt_sora.pipeline import EnginePipeline

        pipe = EnginePipeline(_recipe(model), model, request.getfixturevalue("tmp_path_factory").mktemp(model))
        assert [o.status for o in pipe.run(("export", "calibrate", "quantize"))] == ["ran"] * 3
        _QUANTIZED[model] = pipe
    return _QUANTIZED[model]


def write_preset(path: Path, *shapes: dict, prompt_set: str = "video_prompts_v1", num_prompts: int = 2,
                 num_steps: int = 2, guidance_scale: float = 5.0, shift: float = 3.0, seed: int = 0,
                 negative_prompt: str = "blurry, low quality", **more) -> Path:
    """A calibration preset YAML at ``path``: ``num_prompts`` prompts of ``prompt_set``, ``num_steps``
    steps, at each of ``shapes`` (``{batch, latent_frames, ...}``); ``more``: further preset keys."""
    import yaml

    path.write_text(yaml.safe_dump({"prompt_set": prompt_set, "num_prompts": num_prompts, "num_steps": num_steps,
                                    "guidance_scale": guidance_scale, "shift": shift, "seed": seed,
                                    "negative_prompt": negative_prompt, **more, "shapes": [dict(s) for s in shapes]},
                                   sort_keys=False))
    return path


def assert_every_stage_passed(run, points, *, attentions: int) -> dict:
    """What every tiny family's ``make engine`` run must show: five stages ran, export parity at
    ``points`` (cosine >= 0.99999, max-abs < 1e-4) with the adapter's inputs, every quantized GEMM in FP8
    and ``attentions`` fused attentions in the TensorRT-RTX build, parity passed at all six levels.
    Returns the export manifest's results for the family's own checks."""
    import json

    pipe, outcomes = run
    assert [o.status for o in outcomes] == ["ran"] * 5
    exp = json.loads((pipe.folder("export") / "manifest.json").read_text())["results"]
    assert [p["point"] for p in exp["parity"]] == list(points)
    assert all(p["cosine"] >= 0.99999 and p["max_abs"] < 1e-4 for p in exp["parity"])
    assert exp["input_names"] == list(pipe.adapter.input_names)
    report = json.loads((pipe.folder("build") / "build_report.json").read_text())["analysis"]
    assert report["fp8_gemm_fraction"] == 1.0 and report["gemm_counts"]["fp8"] >= 13
    assert report["attention"]["fused"] and report["attention"]["fused_count"] == attentions
    rep = json.loads((pipe.folder("check") / "report.json").read_text())
    assert rep["passed"], rep["failed"]
    assert {c["level"] for c in rep["comparisons"]} == {"export", "qdq", "quality", "trajectory", "loop", "frames"}
    return exp


def make_stats(adapter, model, path: Path) -> None:
    """Min-max input amax of every nn.Linear over a short CFG sampling loop (calibration stand-in)."""
    import torch

    from trt_sora.calibrate.stats import CalibStats, StatsMetadata
    from trt_sora.parity.loop import loop_inputs, sample_loop

    amax: dict = {}

    def hook(name):
        def h(_m, args):
            v = args[0].detach().abs().max().float()
            amax[name] = torch.maximum(amax.get(name, v), v)
        return h

    hs = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    fwd = adapter.export_module(model)
    point = {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 16}
    noise, cond, unc = loop_inputs(adapter, point, seed=99, prompts=("a cat walks", "a dog runs"))
    sample_loop(lambda f: {"sample": fwd(*[f[n] for n in adapter.input_names])}, noise, cond, unc,
                adapter.scheduler(), steps=4, guidance=5.0, batched=True)
    for h in hs:
        h.remove()
    CalibStats(amax={k: v.reshape(()) for k, v in amax.items()},
               metadata=StatsMetadata(method="minmax", model=adapter.name, model_hash=adapter.spec.model_hash())
               ).save(path)


def _shared(tmp_path_factory, name: str, build) -> Path:
    """A run folder ``build(folder)`` fills, once per test run (:func:`once_per_run`); every such folder is
    ``<run's temp root>/once/runs/<name>`` (``trt-sora ls`` of their parent lists them all)."""

    def made(folder: Path) -> Path:
        run = folder.parent / "runs" / name
        shutil.rmtree(run, ignore_errors=True)  # a build that raised part-way
        build(run)
        return run

    return once_per_run(tmp_path_factory, name, made)


@pytest.fixture(scope="session")
def base_run(tmp_path_factory, tiny_export):
    """``build/wan-tiny/rtx4090-fp8``-like folder: export/ (the session's tiny export), calib/, quant/."""

    def build(run: Path):
        from trt_sora.config import load_recipe
        from trt_sora.models import get_adapter
        from trt_sora.quantize import quantize_onnx

        recipe = load_recipe(RECIPE)
        adapter = get_adapter("wan-tiny")
        shutil.copytree(tiny_export.onnx_path.parent, run / "export")
        make_stats(adapter, adapter.load("fp32", "cpu"), run / "calib" / "stats.safetensors")
        quantize_onnx(run / "export" / "model.onnx", run / "calib" / "stats.safetensors", recipe.quantization,
                      run / "quant")

    return _shared(tmp_path_factory, "base_run", build)


@pytest.fixture(scope="session")
def checked_run(base_run, tmp_path_factory):
    """A copy of ``base_run`` with a passing parity report (ORT backend)."""

    def build(run: Path):
        from trt_sora.parity import check_artifacts

        shutil.copytree(base_run, run)
        check_artifacts(run, RECIPE)

    return _shared(tmp_path_factory, "checked_run", build)


def restamp(folder: Path) -> None:
    """Record ``folder``'s current files in its manifest, as a stage that wrote them would have."""
    from trt_sora.manifest import folder_files, read_manifest, write_json

    m = read_manifest(folder)
    m["files"] = folder_files(folder)
    write_json(folder / "manifest.json", m)


def corrupt_scale(run: Path, site: str, factor: float) -> str:
    """Multiply the activation Q/DQ scale of ``site`` in quant/model.qdq.onnx by ``factor`` as a buggy quantize
    stage would have written it (the manifest records the changed file); returns the tensor."""
    import json

    import onnx
    from onnx import numpy_helper

    qmap = json.loads((run / "quant" / "qdq_map.json").read_text())
    tensor = next(e["tensor"] for e in qmap["sites"] if e["site"] == site)
    path = run / "quant" / "model.qdq.onnx"
    m = onnx.load(str(path))
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    scale_names = {q.input[1]}
    for n in m.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]:
            scale_names.add(n.input[1])
    for init in m.graph.initializer:
        if init.name in scale_names:
            a = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((a * factor).astype(a.dtype), init.name))
    onnx.save(m, str(path))
    restamp(run / "quant")
    return tensor
