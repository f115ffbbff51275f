"""Fixtures for build tests: micro DiT ONNX graphs and shape buckets small enough for ~5 s builds."""
from __future__ import annotations

import pytest

from trt_sora.config import DimRange, ShapeProfile


def bucket(name: str, f: int, *, batch=(1, 2, 2), text=(1, 8, 8)) -> ShapeProfile:
    """A latent bucket ``f`` frames, ``2f x 2f`` latent pixels."""
    return ShapeProfile(name, DimRange(*batch), DimRange(1, f, f), DimRange(2, 2 * f, 2 * f),
                        DimRange(2, 2 * f, 2 * f), DimRange(*text))


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
