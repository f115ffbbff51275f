"""Quantize stage on wan-tiny: ORT vs independent torch fake-quant, PSNR vs unquantized, fused QKV,
structure of the Q/DQ graph, bad inputs, TensorRT-RTX FP8 GEMMs."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from qhelpers import EVAL_POINT, float8_misuses, run_ort, torch_fake_quant_run

from trt_sora.errors import QuantizeError

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def eval_inputs(tiny_adapter):
    return tiny_adapter.example_inputs(EVAL_POINT, seed=7)


@pytest.fixture(scope="module")
def reference(tiny_adapter, tiny_model, eval_inputs):
    import torch

    with torch.no_grad():
        return tiny_adapter.forward(tiny_model, eval_inputs).float().numpy()


@pytest.mark.parametrize("fmt, psnr_floor", [("fp8_e4m3", 50.0), ("int8", 60.0)])
def test_ort_matches_torch_fake_quant(quantized, tiny_adapter, tiny_model, eval_inputs, reference, fmt, psnr_floor,
                                      tiny_stats_path, record_property):
    from trt_sora.export.exporter import compare

    res = quantized(fmt, "fp32")
    got = run_ort(res.onnx_path, eval_inputs)
    fq = torch_fake_quant_run(tiny_adapter, tiny_model, eval_inputs, tiny_stats_path, fmt)
    # the two sides agree on which linears are quantized (the map is only compared, never read for scales)
    in_map = {m for e in res.qdq_map if e["kind"] == "linear" and not e["excluded"] and "fused_into" not in e
              for m in (e.get("members") or [e["site"]])}
    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.config.recipe import QuantConfig, QuantFormat

    assert in_map == set(quantized_sites(tiny_model, QuantConfig(format=QuantFormat(fmt)),
                                           tiny_adapter.quant_excludes))
    vs_fq = compare(fq, got)
    vs_ref = compare(reference, got)
    record_property(f"{fmt}_cosine_vs_fake_quant", vs_fq["cosine"])
    record_property(f"{fmt}_psnr_vs_unquantized", vs_ref["psnr_db"])
    log.warning("%s: ORT vs torch fake-quant cosine %.7f; vs unquantized PSNR %.1f dB (peak %.3f), cosine %.6f",
                fmt, vs_fq["cosine"], vs_ref["psnr_db"], vs_ref["psnr_peak"], vs_ref["cosine"])
    assert vs_fq["cosine"] >= 0.9999
    assert vs_ref["psnr_db"] >= psnr_floor
    # ORT's optimized graph (INT8 -> integer kernels) rounds differently; record it, loose bar
    opt = compare(fq, run_ort(res.onnx_path, eval_inputs, optimize=True))
    log.warning("%s: ORT optimized vs torch fake-quant cosine %.7f", fmt, opt["cosine"])
    assert opt["cosine"] >= 0.999


def test_fp16_graph_runs_in_ort(quantized, eval_inputs, reference):
    """ORT CPU loads and runs the fp16 FP8 graph (it inserts its own fp32 fallbacks for ops without
    fp16 kernels, so this checks validity and types, not fp16 kernel numerics)."""
    from trt_sora.export.exporter import compare

    res = quantized("fp8_e4m3", "fp16")
    io = res.manifest["results"]["graph_io"]
    assert io["inputs"] == {"hidden_states": "float16", "timestep": "float", "encoder_hidden_states": "float16"}
    assert io["outputs"] == {"sample": "float16"}
    m = compare(reference, run_ort(res.onnx_path, eval_inputs, "fp16"))
    assert m["psnr_db"] >= 45.0


@pytest.mark.parametrize("fmt, dtype, cfg", [("fp8_e4m3", "fp16", {}), ("fp8_e4m3", "fp32", {"fp8_attention": True}),
                                              ("int8", "fp32", {})])
def test_onnx_runtime_runs_our_qdq_as_written(quantized, tmp_path, fmt, dtype, cfg):
    """Every float8 tensor feeds only ops that take float8 at the graph's opset, in the Q/DQ graph and in
    the graph ONNX Runtime optimizes from it (ORT_ENABLE_ALL, through the one session factory), and ORT
    fuses none of our Q/DQ nodes away (ONNX Runtime 1.30's fusions made float8 Transpose and
    MatMulIntegerToFloat nodes and refused to load the FP8 graph)."""
    import onnx

    from trt_sora.onnx_tools import ort_session

    res = quantized(fmt, dtype, **cfg)
    ran = tmp_path / "ort_optimized.onnx"
    ort_session(res.onnx_path, providers=["CPUExecutionProvider"], optimized_path=ran)
    ours, theirs = onnx.load(str(res.onnx_path)), onnx.load(str(ran))
    assert float8_misuses(ours) == [] and float8_misuses(theirs) == []

    def qdq(m):
        return {n.name for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}

    assert qdq(ours) and qdq(ours) <= qdq(theirs), sorted(qdq(ours) - qdq(theirs))[:5]


@pytest.mark.parametrize("consumer, opset, misused", [("Transpose", 20, True), ("Transpose", 21, False),
                                                       ("DequantizeLinear", 20, False),
                                                       ("MatMulIntegerToFloat", 20, True)])
def test_float8_misuses_follow_the_schema_at_the_opset(consumer, opset, misused):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    zp = numpy_helper.from_array(np.zeros((), np.float32), "zp")
    zp.data_type, zp.raw_data = onnx.TensorProto.FLOAT8E4M3FN, b"\x00"
    scale = numpy_helper.from_array(np.ones((), np.float32), "s")
    use = helper.make_node(consumer, ["q", "s"][:1 + (consumer != "Transpose")], ["y"], "use",
                           domain="com.microsoft" if consumer == "MatMulIntegerToFloat" else "")
    graph = helper.make_graph([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], "q"), use], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])], [], [zp, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    assert float8_misuses(model) == (["q -> " + f"{consumer} use"] if misused else [])


def test_fused_qkv_matches_unfused(quantized, eval_inputs):
    fused = quantized("none", "fp32", fused_qkv=True)
    plain = quantized("none", "fp32", fused_qkv=False)
    assert fused.counts["fused_groups"] == 4 and plain.counts["fused_groups"] == 0
    a, b = run_ort(plain.onnx_path, eval_inputs), run_ort(fused.onnx_path, eval_inputs)
    rng = float(a.max() - a.min())
    assert np.abs(a - b).max() <= 1e-5 * rng


def _graph(path):
    import onnx

    return onnx.load(str(path))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("fused", [True, False])
def test_structure(quantized, fmt, fused):
    """Each non-excluded linear: exactly one activation Q->DQ on its input and a per-channel weight DQ
    on a quantized initializer; excluded linears: none."""
    import onnx

    res = quantized(fmt, "fp16", fused_qkv=fused)
    m = _graph(res.onnx_path)
    inits = {i.name: i for i in m.graph.initializer}
    prod = {o: n for n in m.graph.node for o in n.output}
    qtype = onnx.TensorProto.FLOAT8E4M3FN if fmt == "fp8_e4m3" else onnx.TensorProto.INT8
    nodes = {n.name: n for n in m.graph.node}
    entries = [e for e in res.qdq_map if e["kind"] == "linear" and "node" in e]
    assert entries
    for e in entries:
        n = nodes[e["node"]]
        x, w = n.input[0], n.input[1]
        if e["excluded"]:
            assert x not in prod or prod[x].op_type != "DequantizeLinear", e["site"]
            assert w in inits and inits[w].data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT), e["site"]
            continue
        dq = prod[x]
        assert dq.op_type == "DequantizeLinear" and prod[dq.input[0]].op_type == "QuantizeLinear", e["site"]
        assert inits[dq.input[1]].dims == [] and inits[dq.input[1]].data_type == onnx.TensorProto.FLOAT16
        wdq = prod[w]
        assert wdq.op_type == "DequantizeLinear", e["site"]
        axis = {a.name: a.i for a in wdq.attribute}["axis"]
        wq = inits[wdq.input[0]]
        assert wq.data_type == qtype
        assert list(inits[wdq.input[1]].dims) == [wq.dims[axis]] and axis == e["weight_axis"] == 1
    n_q = sum(1 for n in m.graph.node if n.op_type == "QuantizeLinear")
    assert n_q == res.counts["activation_quantizers"]
    # every quantized linear's input has exactly one Q (shared by consumers of the same tensor)
    q_inputs = [n.input[0] for n in m.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_inputs) == len(set(q_inputs))
    excluded = {e["site"] for e in res.qdq_map if e["excluded"] and e["kind"] == "linear"}
    assert {"proj_out", "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1"} <= excluded


def test_map_and_manifest(quantized, tiny_export, tiny_stats_path):
    from trt_sora.manifest import read_manifest, sha256_file

    res = quantized("fp8_e4m3", "fp16")
    man = read_manifest(res.onnx_path.parent, stage="quantize")
    assert man["inputs"]["stats"]["sha256"] == sha256_file(tiny_stats_path)
    assert man["inputs"]["onnx"]["sha256"] == sha256_file(tiny_export.onnx_path)
    assert man["results"]["model_hash"] == tiny_export.manifest["results"]["model"]["model_hash"]
    data = json.loads(res.map_path.read_text())
    q = [e for e in data["sites"] if e["kind"] == "linear" and not e["excluded"] and "node" in e]
    assert all(e["scale"] == pytest.approx(e["amax"] / 448, rel=1e-3) for e in q)
    att = [e for e in data["sites"] if e["kind"] == "attention"]
    assert att and all(e["excluded"] and "fp8_attention" in e["reason"] for e in att)


def test_include_overrides_default_exclusion(quantized):
    res = quantized("fp8_e4m3", "fp32", include=("*", "proj_out"))
    e = next(e for e in res.qdq_map if e["site"] == "proj_out")
    assert not e["excluded"]
    res = quantized("fp8_e4m3", "fp32", exclude=("blocks.*.ffn.*",))
    assert all(e["excluded"] for e in res.qdq_map if ".ffn." in e["site"])


def test_fp8_attention(quantized, eval_inputs, reference):
    from trt_sora.export.exporter import compare

    res = quantized("fp8_e4m3", "fp32", fp8_attention=True)
    assert res.counts["attention_quantizers"] == 4 * 4
    sm = [e for e in res.qdq_map if e["site"].endswith(".softmax")]
    assert sm and all(e["amax"] == 1.0 for e in sm)
    assert compare(reference, run_ort(res.onnx_path, eval_inputs))["cosine"] > 0.99


# -- bad inputs -----------------------------------------------------------------------------------

def _cfg(**kw):
    from trt_sora.config.recipe import QuantConfig

    return QuantConfig(**kw)


def _stats(path, **changes):
    from trt_sora.calibrate.stats import CalibStats

    s = CalibStats.load(path)
    for k, v in changes.items():
        if k == "model_hash":
            s.metadata.model_hash = v
        else:
            s.amax[k] = v
    return s


def test_stats_from_another_model(tiny_export, tiny_stats_path, tmp_path):
    from trt_sora.quantize import quantize_onnx

    with pytest.raises(QuantizeError, match="model hash 0123456789abcdef.*calibrate this model"):
        quantize_onnx(tiny_export.onnx_path, _stats(tiny_stats_path, model_hash="0123456789abcdef"), _cfg(),
                      tmp_path / "q")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_bad_amax(tiny_export, tiny_stats_path, tmp_path, bad):
    import torch

    from trt_sora.quantize import quantize_onnx

    stats = _stats(tiny_stats_path, **{"blocks.0.ffn.net.2": torch.tensor(bad)})
    with pytest.raises(QuantizeError, match=r"site 'blocks.0.ffn.net.2'.*(recalibrate|exclude)"):
        quantize_onnx(tiny_export.onnx_path, stats, _cfg(), tmp_path / "q")
    # excluding the site is the documented fix
    quantize_onnx(tiny_export.onnx_path, stats, _cfg(exclude=("blocks.0.ffn.net.2",)), tmp_path / "q")


def test_unmatched_stats_site(tiny_export, tiny_stats_path, tmp_path):
    import torch

    from trt_sora.quantize import quantize_onnx

    stats = _stats(tiny_stats_path, **{"blocks.7.attn1.to_q": torch.tensor(1.0)})
    with pytest.raises(QuantizeError, match="'blocks.7.attn1.to_q' matches no linear"):
        quantize_onnx(tiny_export.onnx_path, stats, _cfg(), tmp_path / "q")


def test_missing_stats_for_quantized_site(tiny_export, tiny_stats_path, tmp_path):
    from trt_sora.quantize import quantize_onnx

    stats = _stats(tiny_stats_path)
    del stats.amax["blocks.1.ffn.net.0.proj"]
    with pytest.raises(QuantizeError, match="'blocks.1.ffn.net.0.proj'.*no statistics"):
        quantize_onnx(tiny_export.onnx_path, stats, _cfg(), tmp_path / "q")


def test_fp8_attention_head_dim_72(tiny_export, tiny_stats_path, tmp_path):
    from trt_sora.quantize import quantize_onnx

    with pytest.raises(QuantizeError, match="head_dim 72.*fp8_attention: false"):
        quantize_onnx(tiny_export.onnx_path, tiny_stats_path, _cfg(fp8_attention=True), tmp_path / "q", head_dim=72)


# -- TensorRT-RTX ---------------------------------------------------------------------------------

def _trt_rtx_layers(onnx_path):
    """Build for SM89 on the CPU; return (built, per-layer lines of the DETAILED verbose log)."""
    import tensorrt_rtx as trt

    lines: list[str] = []

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            lines.append(msg)

    logger = Logger()
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # always strongly typed in TensorRT-RTX
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(onnx_path)), [parser.get_error(i).desc() for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM89, 0)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    prof = builder.create_optimization_profile()
    prof.set_shape("hidden_states", (1, 16, 2, 4, 4), (2, 16, 2, 4, 4), (2, 16, 4, 8, 8))
    prof.set_shape("timestep", (1,), (2,), (2,))
    prof.set_shape("encoder_hidden_states", (1, 4, 64), (2, 8, 64), (2, 16, 64))
    config.add_optimization_profile(prof)
    plan = builder.build_serialized_network(network, config)
    split = [l for msg in lines for l in msg.splitlines()]
    return plan is not None, [l for l in split if l.startswith("Name: ") and "LayerType:" in l]


def _gemm_precisions(layers):
    """``{onnx node name: input datatype}`` of every gemm layer (first input's Datatype)."""
    import re

    out = {}
    for l in layers:
        if "LayerType: gemm" not in l:
            continue
        dt = re.search(r"Inputs: \[ \{ [^}]*?Datatype: (\w+)", l)
        for node in re.findall(r"\[ONNX Layer: ([^\]]+)\]", l):
            out[node] = dt.group(1) if dt else "?"
    return out


@pytest.mark.trt_rtx
def test_trt_rtx_builds_fp8_gemms(quantized, record_property):
    res = quantized("fp8_e4m3", "fp16")
    built, layers = _trt_rtx_layers(res.onnx_path)
    assert built
    prec = _gemm_precisions(layers)
    lin = [e for e in res.qdq_map if e["kind"] == "linear" and not e["excluded"] and "node" in e]
    fp8 = [e["site"] for e in lin if prec.get(e["node"]) == "FP8"]
    log.warning("TensorRT-RTX SM89: %d/%d quantized linears are FP8 GEMMs (%d gemm layers)", len(fp8), len(lin),
                sum("LayerType: gemm" in l for l in layers))
    record_property("trt_rtx_fp8_gemms", f"{len(fp8)}/{len(lin)}")
    assert len(fp8) >= 0.9 * len(lin)


@pytest.mark.trt_rtx
def test_trt_rtx_int8(quantized, record_property):
    """TensorRT-RTX documents INT8 as weight-only: record what the builder does with INT8 Q/DQ."""
    res = quantized("int8", "fp16")
    built, layers = _trt_rtx_layers(res.onnx_path)
    prec = _gemm_precisions(layers)
    lin = [e for e in res.qdq_map if e["kind"] == "linear" and not e["excluded"] and "node" in e]
    kinds = sorted({prec.get(e["node"], "-") for e in lin})
    log.warning("TensorRT-RTX SM89 INT8: built=%s, gemm input types of quantized linears: %s", built, kinds)
    record_property("trt_rtx_int8", f"built={built} types={kinds}")
    assert built


def test_shared_input_takes_the_largest_members_amax(tiny_export, tiny_stats_path, tmp_path):
    """Linears reading one tensor share one Q/DQ: its scale is the largest amax among them (a smaller
    one would clip the others' range). Unfused, Q, K and V read one tensor; their stats are equal
    (the same activations), so K's and V's are raised here to make the members differ: the first
    member's amax (Q) or the last's (V) must not be the one used."""
    import onnx
    from onnx import numpy_helper

    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
    from trt_sora.quantize import quantize_onnx

    stats = CalibStats.load(tiny_stats_path)
    q, k, v = (f"blocks.0.attn1.to_{x}" for x in "qkv")
    base = float(stats.amax[q].max())
    assert {float(stats.amax[s].max()) for s in (q, k, v)} == {base}
    stats.amax[k], stats.amax[v] = stats.amax[k] * 1.5, stats.amax[v] * 1.25
    stats.save(tmp_path / "stats.safetensors")
    cfg = QuantConfig(format=QuantFormat.FP8_E4M3, graph_dtype=DType.FP32, fused_qkv=False)
    res = quantize_onnx(tiny_export.onnx_path, tmp_path / "stats.safetensors", cfg, tmp_path / "quant")
    want = float(np.float32(base) * np.float32(1.5))
    entries = {e["site"]: e for e in res.qdq_map if e["site"] in (q, k, v)}
    for s, e in entries.items():
        assert e["amax"] == pytest.approx(want, rel=1e-6), s
        assert sorted(e["shared_with"]) == sorted({q, k, v} - {s})
    m = onnx.load(str(res.onnx_path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    qs = [n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == entries[q]["tensor"]]
    assert len(qs) == 1
    assert float(inits[qs[0].input[1]]) == pytest.approx(want / 448.0, rel=1e-6)
