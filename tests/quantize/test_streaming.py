"""Streaming quantize on the 2-layer, 1.3B-width export (external data): weights read, quantized and written
one at a time give the same file contents as materializing them all, and the FP8 weights equal torch's own
float8 cast of the exported fp32 weights."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch


@pytest.fixture(scope="module")
def wide_stats(tmp_path_factory, wide_adapter):
    """Synthetic activation amax for every linear (the quantize stage only needs numbers > 0 per site)."""
    from trt_sora.calibrate.stats import CalibStats, StatsMetadata

    empty = wide_adapter.load_empty()
    g = torch.Generator().manual_seed(0)
    amax = {n: (torch.rand((), generator=g) * 4 + 0.5) for n, m in empty.named_modules()
            if isinstance(m, torch.nn.Linear)}
    meta = StatsMetadata(method="minmax", model=wide_adapter.spec.ref, model_hash=wide_adapter.spec.model_hash())
    path = tmp_path_factory.mktemp("wide_stats") / "stats.safetensors"
    CalibStats(amax=amax, metadata=meta).save(path)
    return path


def _quantize(wide_export, stats, out, external):
    from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
    from trt_sora.quantize import quantize_onnx

    cfg = QuantConfig(format=QuantFormat.FP8_E4M3, graph_dtype=DType.FP16, external_data=external)
    return quantize_onnx(wide_export.onnx_path, stats, cfg, out)


@pytest.mark.slow
def test_streamed_equals_materialized_and_torch_fp8(tmp_path, wide_export, wide_stats):
    from trt_sora.config.recipe import ExternalData

    streamed = _quantize(wide_export, wide_stats, tmp_path / "s", ExternalData.ALWAYS)
    inline = _quantize(wide_export, wide_stats, tmp_path / "i", ExternalData.NEVER)
    assert streamed.manifest["results"]["external_data"] and (tmp_path / "s" / "model.qdq.onnx.data").is_file()
    a, b = onnx.load(str(streamed.onnx_path)), onnx.load(str(inline.onnx_path))
    assert [n.SerializeToString() for n in a.graph.node] == [n.SerializeToString() for n in b.graph.node]
    ia = {i.name: onnx.numpy_helper.to_array(i) for i in a.graph.initializer}
    ib = {i.name: onnx.numpy_helper.to_array(i) for i in b.graph.initializer}
    assert set(ia) == set(ib)
    for k in ia:
        assert ia[k].dtype == ib[k].dtype, k
        assert np.array_equal(ia[k].reshape(-1).view(np.uint8), ib[k].reshape(-1).view(np.uint8)), k

    # independent check of one fused and one plain FP8 weight: torch's float8 cast of w / scale
    src = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(wide_export.onnx_path)).graph.initializer}
    by_site = {e["site"]: e for e in streamed.qdq_map if e.get("kind") == "linear" and not e["excluded"]
               and "node" in e}
    for site in ("blocks.0.attn1.to_qkv", "blocks.1.ffn.net.2"):
        e = by_site[site]
        mm = next(n for n in a.graph.node if n.name == e["node"])
        dq = next(n for n in a.graph.node if mm.input[1] in n.output)
        wq, scale = ia[dq.input[0]], ia[dq.input[1]].astype(np.float32)
        if "members" in e:
            w = np.concatenate([src[_weight_of(wide_export, m)] for m in e["members"]], axis=1)
        else:
            w = src[_weight_of(wide_export, site)]
        ref = (torch.from_numpy(w) / torch.from_numpy(scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert np.array_equal(wq.view(np.uint8), ref.view(torch.uint8).numpy()), site


def _weight_of(export, site):
    """The exported MatMul weight initializer of ``site`` (module path)."""
    from trt_sora.onnx_tools import module_path, node_scopes

    m = onnx.load(str(export.onnx_path), load_external_data=False)
    scopes = node_scopes(m)
    inits = {i.name for i in m.graph.initializer}
    return next(n.input[1] for n in m.graph.node if n.op_type == "MatMul" and n.input[1] in inits
                and module_path(scopes.get(n.name, [])) == site)


def test_bf16_export_quantizes_in_its_own_dtype(tmp_path, tiny_bf16_export, tiny_stats_path):
    """A model too big for an fp32 file (Wan 14B: 57 GB) is exported in bf16 (the session's bf16 export,
    tests/conftest.py); the quantize stage then keeps the graph in bf16 (the FP8 weights come from the bf16
    ones) and refuses another graph dtype."""
    from trt_sora.config import ExternalData
    from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
    from trt_sora.errors import QuantizeError
    from trt_sora.quantize import quantize_onnx

    exp = tiny_bf16_export
    cfg = QuantConfig(format=QuantFormat.FP8_E4M3, graph_dtype=DType.BF16, external_data=ExternalData.ALWAYS)
    res = quantize_onnx(exp.onnx_path, tiny_stats_path, cfg, tmp_path / "quant")
    assert res.counts["quantized_linears"] == 14 and res.counts["casts"] == 0
    assert res.manifest["results"]["graph_io"]["inputs"]["hidden_states"] == "bfloat16"
    m = onnx.load(str(res.onnx_path))
    types = {i.name: i.data_type for i in m.graph.initializer}
    assert any(t == onnx.TensorProto.FLOAT8E4M3FN for t in types.values())
    with pytest.raises(QuantizeError, match="exported in bf16.*graph_dtype: bf16"):
        quantize_onnx(exp.onnx_path, tiny_stats_path, QuantConfig(graph_dtype=DType.FP16), tmp_path / "q2")
