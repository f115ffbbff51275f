"""Backend selection and target checks: no engine is built here (fast)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import time

import pytest
from build_buckets import bucket

from trt_sora.build import INSTALL, build_engine, check_target, load_backend
from trt_sora.config import Backend, BuildConfig, QuantFormat, load_recipe
from trt_sora.errors import BackendMissingError, BuildError, ConfigError


def _hide(monkeypatch, prefixes):
    real = importlib.import_module

    def fake(name, *a, **k):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)


@pytest.mark.parametrize("backend", list(Backend))
def test_missing_backend_names_install_command(monkeypatch, backend):
    _hide(monkeypatch, ["tensorrt", "tensorrt_bindings", "tensorrt_rtx", "tensorrt_rtx_bindings"])
    with pytest.raises(BackendMissingError) as ei:
        load_backend(backend)
    assert INSTALL[backend] in str(ei.value)


def test_install_commands_match_the_declared_extras():
    """The hints name exactly what pyproject's extras install (NVIDIA's PyPI packages: ``tensorrt`` = CUDA 13,
    ``tensorrt-cu12``; TensorRT-RTX's range), and no extra index: TensorRT 10.x/11.x wheels are on PyPI."""
    import re
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = lambda reqs: {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in reqs}  # noqa: E731
    trt = INSTALL[Backend.TENSORRT]
    assert "extra-index-url" not in trt
    assert {w.strip("()") for w in trt.split() if w.startswith("tensorrt")} == names(extras["tensorrt"]) | names(
        extras["tensorrt-cu12"])
    assert "'" + extras["tensorrt-rtx"][0] + "'" in INSTALL[Backend.TENSORRT_RTX]


@pytest.mark.trt_rtx
def test_rtx_module_loads():
    trt = load_backend(Backend.TENSORRT_RTX)
    assert hasattr(trt, "Builder") and hasattr(trt, "ComputeCapability")


@pytest.mark.parametrize("sm", [90, 80, 70, 100])
def test_rtx_rejects_datacenter_and_old_sm(sm):
    with pytest.raises(ConfigError, match="backend: tensorrt|supports"):
        check_target(Backend.TENSORRT_RTX, sm)


def test_rtx_sm90_message_names_hopper_and_fix():
    with pytest.raises(ConfigError) as ei:
        check_target(Backend.TENSORRT_RTX, 90, QuantFormat.FP8_E4M3)
    assert "Hopper" in str(ei.value) and "backend: tensorrt" in str(ei.value)


@pytest.mark.parametrize("sm", [75, 86, 89, 120])
def test_rtx_accepts_rtx_parts(sm):
    check_target(Backend.TENSORRT_RTX, sm)


def test_fp8_needs_ada_or_newer():
    with pytest.raises(ConfigError, match="int8"):
        check_target(Backend.TENSORRT, 80, QuantFormat.FP8_E4M3)
    check_target(Backend.TENSORRT, 80, QuantFormat.INT8)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="full TensorRT is installed here")
def test_tensorrt_recipe_fails_fast_with_install_command(micro_fp8, tmp_path):
    recipe = load_recipe("h100-fp8")
    t0 = time.perf_counter()
    with pytest.raises(BackendMissingError) as ei:
        build_engine(micro_fp8, recipe, tmp_path / "engine", buckets=[bucket("a", 1)])
    assert time.perf_counter() - t0 < 10
    assert INSTALL[Backend.TENSORRT] in str(ei.value)
    assert not (tmp_path / "engine").exists()
    assert micro_fp8.exists()  # the earlier stage's artifact is untouched


def test_rtx_with_plugins_is_a_clear_error(micro_fp8, tmp_path):
    from trt_sora.build import BuildTarget

    with pytest.raises(BuildError, match="cannot build plugins"):
        build_engine(micro_fp8, BuildConfig(plugins=("attn_plugin",)), tmp_path / "e", buckets=[bucket("a", 1)],
                     target=BuildTarget(Backend.TENSORRT_RTX, "8.9", QuantFormat.FP8_E4M3))


def test_fp8_recipe_without_qdq_names_quantize(micro_plain, tmp_path):
    with pytest.raises(BuildError, match="run the quantize stage"):
        build_engine(micro_plain, load_recipe("rtx4090-fp8"), tmp_path / "e", buckets=[bucket("a", 1)])


def test_int8_onnx_for_fp8_recipe(tmp_path):
    from micro_dit import make_micro_onnx

    p = make_micro_onnx(tmp_path / "m.onnx", quant="int8")
    with pytest.raises(BuildError, match="int8 Q/DQ"):
        build_engine(p, load_recipe("rtx4090-fp8"), tmp_path / "e", buckets=[bucket("a", 1)])


def test_bucket_outside_exported_range(micro_fp8, tmp_path):
    from trt_sora.errors import ShapeError

    export = {"stage": "export", "results": {"dynamic": {"batch": [1, 2, 2], "latent_frames": [1, 2, 4],
                                                         "latent_height": [2, 4, 8], "latent_width": [2, 4, 8],
                                                         "text_len": [1, 8, 16]}}}
    with pytest.raises(ShapeError, match="outside the exported range"):
        build_engine(micro_fp8, load_recipe("rtx4090-fp8"), tmp_path / "e", export_manifest=export)


def test_import_build_package_is_light():
    code = ("import sys, trt_sora.build, trt_sora.cli.build; "
            "print([m for m in ('tensorrt', 'tensorrt_rtx', 'onnx', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
