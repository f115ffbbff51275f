"""Shared fixtures: one wan-tiny export per test session (export costs ~20 s on 2 cores)."""
from __future__ import annotations

import importlib.util

import pytest
from run_folders import (  # noqa: F401  (session fixtures
    base_run,
    checked_run,
    hunyuan_run,
    i2v_run,
    once_per_run,
    pair_run,
    ti2v_run,  # for every test folder)
)

# The points where export parity is checked: non-square, odd latent frames, batch 1 and 2,
# different text lengths; every dim differs between consecutive points.
TINY_POINTS = (
    {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 7},
    {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 4, "text_len": 12},
    {"batch": 3, "latent_frames": 5, "latent_height": 8, "latent_width": 2, "text_len": 3},
)


def pytest_configure(config):
    """sha256 cache of this session in a temp folder (subprocesses and xdist workers inherit it; the process that
    made it removes it at the end), not in ~/.cache. On an xdist worker of several, one torch thread (and one for
    the processes tests start): two processes with two threads each on two cores stall on the suite's small
    tensors."""
    import atexit
    import os
    import shutil
    import tempfile

    if "TRT_SORA_CACHE_DIR" not in os.environ:
        made = tempfile.mkdtemp(prefix="trt_sora-hash-cache-")
        os.environ["TRT_SORA_CACHE_DIR"] = made
        # at exit, after the cache's own save (an atexit hook registered later, so run earlier) rewrote it
        atexit.register(shutil.rmtree, made, ignore_errors=True)
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    missing = {
        "trt_rtx": importlib.util.find_spec("tensorrt_rtx") is None,
        "trt": importlib.util.find_spec("tensorrt") is None,
    }
    try:
        import torch

        missing["gpu"] = not torch.cuda.is_available()
    except ImportError:
        missing["gpu"] = True
    reasons = {"trt_rtx": "tensorrt-rtx-cu13 is not installed", "trt": "full TensorRT is not installed",
               "gpu": "needs an NVIDIA GPU"}
    for item in items:
        for mark, is_missing in missing.items():
            if is_missing and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reasons[mark]))


@pytest.fixture(scope="session")
def tiny_points():
    """TINY_POINTS as a fixture: `from conftest import ...` is ambiguous once sub-folders have
    their own conftest.py."""
    return TINY_POINTS


@pytest.fixture(scope="session")
def tiny_adapter():
    from trt_sora.models import get_adapter

    return get_adapter("wan-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_adapter):
    return tiny_adapter.load("fp32", "cpu")


@pytest.fixture(scope="session")
def tiny_traces():
    """One ``traces`` dict for the wan-tiny exports of this process whose subject is not the trace itself
    (``export_onnx(traces=...)``: the fp32 graph of ``tiny_model`` traced once, each export gets a copy, byte for
    byte the export traced alone: tests/test_experts.py)."""
    return {}


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, tiny_adapter, tiny_traces, request):
    """``ExportResult`` of wan-tiny (fp32, opset 20), verified at the three TINY_POINTS (once per test run)."""
    from trt_sora.config import ExportConfig
    from trt_sora.export import export_onnx

    def build(out):
        model = request.getfixturevalue("tiny_model")
        return export_onnx(tiny_adapter, ExportConfig(verify_points=TINY_POINTS), out / "export", model=model,
                           traces=tiny_traces)

    return once_per_run(tmp_path_factory, "tiny_export", build)


@pytest.fixture(scope="session")
def tiny_bf16_export(tmp_path_factory, tiny_adapter):
    """``ExportResult`` of wan-tiny in bf16 with external data, unverified (bf16 refuses verification)."""
    from trt_sora.config import ExportConfig, ExternalData
    from trt_sora.config.recipe import DType
    from trt_sora.export import export_onnx

    cfg = ExportConfig(dtype=DType.BF16, external_data=ExternalData.ALWAYS, verify=False)
    return once_per_run(tmp_path_factory, "tiny_bf16_export",
                        lambda out: export_onnx(tiny_adapter, cfg, out / "export"))


@pytest.fixture(scope="session")
def engine_run(tmp_path_factory):
    """``trt-sora engine --model wan-tiny --recipe rtx4090-fp8`` once per session (every stage, a real
    TensorRT-RTX build): ``(pipeline, outcomes, pristine)``. ``pristine`` is a copy of the out root
    taken right after the run, for tests that must start from an untouched run folder."""
    import shutil

    pytest.importorskip("tensorrt_rtx")
    from trt_sora.pipeline import EnginePipeline

    def build(root):
        out, seen = root / "engine", []
        EnginePipeline("rtx4090-fp8", "wan-tiny", out, progress=seen.append).run()
        shutil.copytree(out, root / "pristine", symlinks=True)
        return out, seen, root / "pristine"

    out, seen, pristine = once_per_run(tmp_path_factory, "engine_run", build)
    return EnginePipeline("rtx4090-fp8", "wan-tiny", out), seen, pristine


@pytest.fixture(scope="session")
def wide_adapter():
    """A 2-layer Wan at 1.3B width (dim 1536, ffn 8960, text 4096; 119 M parameters, 0.48 GB fp32): big enough
    that weights take the streaming paths (placeholders, external data), small enough for CI."""
    from trt_sora.models import get_adapter, wan
    from trt_sora.models.base import ModelSpec

    cfg = dict(wan.CONFIGS["wan2.1-t2v-1.3b"], num_layers=2)
    return get_adapter(ModelSpec(ref="wan-1.3b-width-2l", family="wan", source="random-init", config=cfg, seed=0,
                                 text_encoder="hash"))


@pytest.fixture(scope="session")
def wide_export(tmp_path_factory, wide_adapter, tiny_points):
    """Weightless export of ``wide_adapter`` (external data, ORT parity segment by segment at two points), once
    per test run."""
    from trt_sora.config import ExportConfig, ExternalData
    from trt_sora.export import export_onnx

    cfg = ExportConfig(external_data=ExternalData.ALWAYS, verify_points=tiny_points[:2])
    return once_per_run(tmp_path_factory, "wide_export",
                        lambda out: export_onnx(wide_adapter, cfg, out / "export", segmented=True))
