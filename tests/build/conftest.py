"""Fixtures for build tests: micro DiT ONNX graphs (their buckets: ``build_buckets.bucket``)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def micro_fp8(tmp_path_factory):
    """FP8 micro block with separate Q/K/V linears (the builder fuses them into one FP8 GEMM)."""
    from micro_dit import make_micro_onnx

    return make_micro_onnx(tmp_path_factory.mktemp("micro_fp8") / "model.qdq.onnx", quant="fp8", fused_qkv=False)


@pytest.fixture(scope="session")
def micro_fp8_fused_qkv(tmp_path_factory):
    """FP8 micro block with one fused QKV linear ([d, 3d] weight) followed by Split."""
    from micro_dit import make_micro_onnx

    return make_micro_onnx(tmp_path_factory.mktemp("micro_fp8_qkv") / "model.qdq.onnx", quant="fp8",
                           fused_qkv=True)


@pytest.fixture(scope="session")
def micro_plain(tmp_path_factory):
    """The same block without Q/DQ (fp16 graph)."""
    from micro_dit import make_micro_onnx

    return make_micro_onnx(tmp_path_factory.mktemp("micro_plain") / "model.onnx", quant=None)
