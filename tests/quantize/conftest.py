"""Quantize-stage fixtures: stats for wan-tiny without the calibration loop, Q/DQ models, a torch fake-quant run."""
from __future__ import annotations

import pytest
from qhelpers import CALIB_POINTS, collect_stats


@pytest.fixture(scope="session")
def tiny_stats_path(tmp_path_factory, tiny_adapter, tiny_model):
    path = tmp_path_factory.mktemp("tiny_stats") / "stats.safetensors"
    collect_stats(tiny_adapter, tiny_model, CALIB_POINTS, path)
    return path


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, tiny_export, tiny_stats_path):
    """``quantized(format, graph_dtype, fused_qkv=True, **cfg) -> QuantResult``, cached per config."""
    from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
    from trt_sora.quantize import quantize_onnx

    cache = {}

    def get(fmt="fp8_e4m3", dtype="fp32", fused_qkv=True, **kw):
        key = (fmt, dtype, fused_qkv, tuple(sorted(kw.items())))
        if key not in cache:
            cfg = QuantConfig(format=QuantFormat(fmt), graph_dtype=DType(dtype), fused_qkv=fused_qkv, **kw)
            out = tmp_path_factory.mktemp("quant") / "quant"
            cache[key] = quantize_onnx(tiny_export.onnx_path, tiny_stats_path, cfg, out)
        return cache[key]

    return get
