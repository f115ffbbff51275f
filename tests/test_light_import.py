"""`import trt_sora` (and the CLI's --help) must not load heavy libraries."""
import importlib
import subprocess
import sys

import pytest

HEAVY = ("torch", "onnx", "onnxruntime", "tensorrt", "tensorrt_rtx", "diffusers", "transformers",
         "onnx_graphsurgeon", "safetensors")


def _loaded_after(stmt: str) -> list[str]:
    code = f"import sys; {stmt}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_import_trt_sora_is_light():
    assert _loaded_after("import trt_sora, trt_sora.config, trt_sora.errors, trt_sora.manifest") == []


LAZY_PACKAGES = ("trt_sora.checkpoint", "trt_sora.quantize", "trt_sora.runners", "trt_sora.parity")


def test_lazy_packages_import_light_and_resolve_each_public_name():
    """The stage packages' names come from their modules on first use (errors.lazy_exports): importing
    the packages loads no heavy library, each name is its module's object, an unknown one is an
    AttributeError naming the package."""
    assert _loaded_after("import " + ", ".join(LAZY_PACKAGES)) == []
    for name in LAZY_PACKAGES:
        pkg = importlib.import_module(name)
        for attr, module in pkg._LAZY.items():
            assert getattr(pkg, attr) is getattr(importlib.import_module(module), attr)
        with pytest.raises(AttributeError, match=f"module '{name}' has no attribute 'no_such_name'"):
            pkg.no_such_name  # noqa: B018


def test_cli_parser_is_light():
    assert _loaded_after("from trt_sora.cli import build_parser; build_parser()") == []


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "trt_sora", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "export" in out.stdout
