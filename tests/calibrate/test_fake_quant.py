"""Fake quantization against ONNX Runtime QuantizeLinear -> DequantizeLinear, plus ml_dtypes and numpy."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trt_sora.calibrate.fake_quant import (
    fake_quant,
    fake_quant_fp8_e4m3,
    fake_quant_int8,
    quant_error,
    scale_from_amax,
)
from trt_sora.errors import CalibrationError, ConfigError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402


def _qdq_model(fmt: str, shape: tuple[int, ...], scale: np.ndarray, axis: int | None, opset: int):
    zp_type = TensorProto.INT8 if fmt == "int8" else TensorProto.FLOAT8E4M3FN
    zp_shape = list(scale.shape)
    init = [
        helper.make_tensor("scale", TensorProto.FLOAT, zp_shape, scale.astype(np.float32).ravel().tolist()),
        helper.make_tensor("zp", zp_type, zp_shape, [0] * int(np.prod(zp_shape or [1]))),
    ]
    attrs = {} if axis is None else {"axis": axis}
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run_ort(fmt, x: torch.Tensor, amax, axis, opset) -> np.ndarray:
    scale = scale_from_amax(torch.as_tensor(amax, dtype=torch.float32), fmt).numpy()
    sess = _qdq_model(fmt, tuple(x.shape), scale, axis, opset)
    return sess.run(None, {"x": x.numpy()})[0]


def _adversarial(shape, amax: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * amax / 2
    flat = x.view(-1)
    n = flat.numel()
    flat[: n // 8] *= 5  # saturating values on both sides
    flat[n // 8: n // 4] = torch.randn(n // 4 - n // 8, generator=g) * 1e-6 * amax  # tiny / subnormal
    flat[0], flat[1], flat[2] = amax, -amax, 0.0
    return x


@pytest.mark.parametrize("opset", [19, 21])
@pytest.mark.parametrize("amax", [1.0, 127.0, 3.7e-3, 250.0])
def test_int8_per_tensor_matches_onnxruntime(amax, opset):
    x = _adversarial((64, 33), amax, seed=1)
    # exact half-way points of the quantization grid (round half to even) and beyond -128
    scale = float(scale_from_amax(amax, "int8"))
    x.view(-1)[3:13] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, -128.5, -200.0]) * scale
    ours = fake_quant_int8(x, amax).numpy()
    np.testing.assert_array_equal(ours, _run_ort("int8", x, amax, None, opset))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_int8_per_channel_matches_onnxruntime(axis):
    shape = (6, 5, 4)
    amax = torch.rand(shape[axis], generator=torch.Generator().manual_seed(axis)) * 10 + 0.1
    x = _adversarial(shape, 5.0, seed=2)
    np.testing.assert_array_equal(fake_quant_int8(x, amax, axis=axis).numpy(), _run_ort("int8", x, amax, axis, 19))


@pytest.mark.parametrize("amax", [1.0, 448.0, 0.0123, 3000.0])
def test_fp8_per_tensor_matches_onnxruntime(amax):
    x = _adversarial((50, 40), amax, seed=3)
    np.testing.assert_array_equal(fake_quant_fp8_e4m3(x, amax).numpy(), _run_ort("fp8_e4m3", x, amax, None, 19))


@pytest.mark.parametrize("axis", [0, 1])
def test_fp8_per_channel_matches_onnxruntime(axis):
    shape = (12, 9)
    amax = torch.rand(shape[axis], generator=torch.Generator().manual_seed(9)) * 100 + 0.01
    x = _adversarial(shape, 50.0, seed=4)
    np.testing.assert_array_equal(fake_quant_fp8_e4m3(x, amax, axis=axis).numpy(),
                                  _run_ort("fp8_e4m3", x, amax, axis, 19))


def test_fp8_matches_ml_dtypes_reference():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = _adversarial((4000,), 7.0, seed=5)
    s = np.float32(7.0) / np.float32(448.0)
    ref = np.clip(x.numpy() / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
    np.testing.assert_array_equal(fake_quant_fp8_e4m3(x, 7.0).numpy(), ref)


def test_round_half_to_even_and_saturation_independent_of_onnx():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.4, 127.6, -127.6, -128.4, -128.6, 1e9])
    got = fake_quant_int8(x, 127.0)  # scale exactly 1
    assert got.tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 127.0, 127.0, -128.0, -128.0, -128.0, 127.0]
    assert fake_quant_int8(x, 127.0, narrow_range=True).min() == -127.0
    y = fake_quant_fp8_e4m3(torch.tensor([1e6, -1e6, 448.0, 17.0]), 448.0)  # 17 is a tie between 16 and 18
    assert y.tolist() == [448.0, -448.0, 448.0, 16.0]


def test_dtype_zero_amax_and_bad_amax():
    x = torch.randn(3, 4).to(torch.bfloat16)
    assert fake_quant(x, 2.0, "fp8_e4m3").dtype == torch.bfloat16
    z = torch.zeros(2, 3)
    assert fake_quant_int8(z, torch.tensor([0.0, 0.0]), axis=0).abs().sum() == 0  # no NaN from 0/0
    assert not torch.isnan(fake_quant_fp8_e4m3(z, 0.0)).any()
    with pytest.raises(CalibrationError):
        fake_quant_int8(x.float(), float("nan"))
    with pytest.raises(CalibrationError):
        fake_quant_fp8_e4m3(x.float(), -1.0)
    with pytest.raises(ConfigError, match="did you mean 'int8'"):
        fake_quant(x, 1.0, "int9")
    with pytest.raises(ConfigError, match="per-channel"):
        fake_quant_int8(x.float(), torch.ones(3), axis=1)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quant_error_metrics_match_numpy(fmt):
    x = _adversarial((300,), 4.0, seed=6)
    amax = 2.5
    e = quant_error(x, amax, fmt)
    xn = x.double().numpy()
    fq = _run_ort(fmt, x, amax, None, 19).astype(np.float64)
    mse = np.mean((xn - fq) ** 2)
    assert e.clipped_fraction == pytest.approx(np.mean(np.abs(xn) > amax))
    assert e.mse == pytest.approx(mse, rel=1e-9)
    assert e.rel_mse == pytest.approx(mse / np.mean(xn ** 2), rel=1e-9)
    assert e.sqnr_db == pytest.approx(10 * np.log10(np.mean(xn ** 2) / mse), rel=1e-9)
    assert e.max_abs_err == pytest.approx(np.abs(xn - fq).max(), rel=1e-6)
    lossless = quant_error(torch.arange(-5.0, 6.0), 127.0, "int8")
    assert lossless.mse == 0 and math.isinf(lossless.sqnr_db) and lossless.clipped_fraction == 0
