"""`import trt_sora` (and the CLI's --help) must not load heavy libraries."""
import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime", "tensorrt", "tensorrt_rtx", "diffusers", "transformers",
         "onnx_graphsurgeon", "safetensors")


def _loaded_after(stmt: str) -> list[str]:
    code = f"import sys; {stmt}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_import_trt_sora_is_light():
    assert _loaded_after("import trt_sora, trt_sora.config, trt_sora.errors, trt_sora.manifest") == []


def test_cli_parser_is_light():
    assert _loaded_after("from trt_sora.cli import build_parser; build_parser()") == []


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "trt_sora", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "export" in out.stdout
