"""The layer-dump parser and the GEMM analysis on canned TensorRT-RTX 1.7 log lines (no TensorRT needed)."""
from __future__ import annotations

from trt_sora.build import report as rep
from trt_sora.config import BuildRequirements

FP8_GEMM = ("Name: MatMul_46_myl0_2, LayerType: gemm, Inputs: [ { Name: __mye18731matmul_45.1_39_myl0, "
            "Dimensions: [-1,64], Strides: [64,1], StrideOrder: [1,0], Datatype: FP8, Format: (Linear) Row major "
            "linear format }], Constants: [ { Name: w_myl0, Dimensions: [64,192], Strides: [64,1], StrideOrder: [1,0], "
            "Datatype: FP8, Format: (Linear) Row major linear format }, { Name: alpha_myl0, Dimensions: [1], "
            "Strides: [1], StrideOrder: [0], Datatype: Float, Format: (Linear) Row major linear format }], "
            "Outputs: [ { Name: o_myl0, Dimensions: [-1,192], Strides: [192,1], StrideOrder: [1,0], Datatype: Half, "
            "Format: (Linear) Row major linear format }], TacticName: __myelin_CASK_STUB, StreamId: 0, "
            "Metadata: [ONNX Layer: MatMul_46][ONNX Layer: DequantizeLinear_39]")
MIXED_FC = ("Name: __myl_CastMulFc_myl0_7, LayerType: runtime_fusion, Inputs: [ { Name: a_myl0, Dimensions: [-1,64], "
            "Strides: [64,1], StrideOrder: [1,0], Datatype: FP8, Format: (Linear) Row major linear format }, { Name: "
            "b_myl0, Dimensions: [1,64,64], Strides: [4096,64,1], StrideOrder: [2,1,0], Datatype: Half, Format: "
            "(Linear) Row major linear format }], Constants: [], Outputs: [ { Name: c_myl0, Dimensions: [1,-1,64], "
            "Strides: [-1,64,1], StrideOrder: [2,1,0], Datatype: Half, Format: (Linear) Row major linear format }], "
            "TacticName: , StreamId: 0, Metadata: [ONNX Layer: MatMul_67][ONNX Layer: DequantizeLinear_60]")
MHA = ("Name: _gemm_mha_v2_myl0_11, LayerType: kgen, Inputs: [ { Name: q, Dimensions: [-1,-1,32], Strides: [32,-1,1], "
       "StrideOrder: [1,2,0], Datatype: Half, Format: (Arbitrary) Format with stride order = [1,2,0] }, { Name: k, "
       "Dimensions: [-1,32,-1], Strides: [32,1,-1], StrideOrder: [1,0,2], Datatype: Half, Format: x }, { Name: v, "
       "Dimensions: [-1,-1,32], Strides: [32,-1,1], StrideOrder: [1,2,0], Datatype: Half, Format: x }], Constants: [], "
       "Outputs: [ { Name: o, Dimensions: [-1,-1,32], Strides: [32,-1,1], StrideOrder: [1,2,0], Datatype: FP8, "
       "Format: x }], TacticName: _gemm_mha_v2_0xec4f, StreamId: 0, Metadata: [ONNX Layer: MatMul_101]"
       "[ONNX Layer: Softmax_94][ONNX Layer: MatMul_89]")
KGEN = ("Name: __myl_MulAdd_myl0_28, LayerType: kgen, Inputs: [ { Name: x, Dimensions: [-1,4], Strides: [4,1], "
        "StrideOrder: [1,0], Datatype: Half, Format: x }], Constants: [], Outputs: [], TacticName: t, StreamId: 0, "
        "Metadata: [ONNX Layer: MatMul_272]")
IO = (" Name: hidden_states, IOMode: Input, DataType: Float, Dimensions: [-1,4,-1,-1,-1], Location: Device, "
      "IsShapeInferenceIO: false, ProfileInfo: [ { MinShape: [1,4,1,1,1], OptShape: [2,4,2,2,2], "
      "MaxShape: [2,4,2,2,2], "
      "Format: x }, { MinShape: [1,4,2,2,2], OptShape: [2,4,4,4,4], MaxShape: [2,4,4,4,4], Format: x }]")


def _log(*lines):
    return "Layers:\n" + "\n".join(lines) + "\n\nI/O Tensors:\n" + IO


def test_parse_fp8_gemm_line():
    li = rep.parse_layer_line(FP8_GEMM)
    assert li.name == "MatMul_46_myl0_2" and li.type == "gemm" and li.profile == 0
    assert [t.precision for t in li.inputs] == ["fp8"]
    assert li.constants[0].dims == (64, 192)
    assert li.onnx_nodes == ("MatMul_46", "DequantizeLinear_39")


def test_profile_index_from_name():
    li = rep.parse_layer_line(FP8_GEMM.replace("MatMul_46_myl0_2", "MatMul_46 [profile 1]_myl1_2"))
    assert li.profile == 1
    assert rep.parse_layer_line(KGEN.replace("_myl0_", "_myl3_")).profile == 3


def test_analysis_counts_precisions_attention_and_qkv():
    layers = rep.parse_layer_dump(_log(FP8_GEMM, MIXED_FC, MHA, KGEN,
                                       FP8_GEMM.replace("_myl0_", "_myl1_")))
    a = rep.analyze(layers)
    assert a["gemm_total"] == 2
    assert a["gemm_counts"]["fp8"] == 1 and a["gemm_counts"]["fp16"] == 1
    assert a["mixed_gemms"] == ["__myl_CastMulFc_myl0_7"]
    assert a["attention"]["fused"] and a["attention"]["precisions"] == ["fp16"]
    assert a["fused_qkv"]["engine"] == 1 and a["fused_qkv"]["precisions"] == ["fp8"]
    assert rep.parse_profile_count(_log(FP8_GEMM)) == 2


def test_requirements():
    a = rep.analyze(rep.parse_layer_dump(_log(FP8_GEMM, MIXED_FC, KGEN)))
    fails = rep.check_requirements({"analysis": a}, BuildRequirements(min_fp8_gemm_fraction=0.9,
                                                                      require_fused_attention=True))
    assert len(fails) == 2
    assert "0.500" in fails[0] and "__myl_CastMulFc_myl0_7" in fails[0]
    assert rep.check_requirements({"analysis": a}, BuildRequirements(min_fp8_gemm_fraction=0.5)) == []


def test_fraction_counts_only_gemms_the_graph_quantized():
    """Excluded layers (embedders, proj_out) stay fp16 on purpose: they must not lower the fraction."""
    layers = rep.parse_layer_dump(_log(FP8_GEMM, MIXED_FC, KGEN))
    fp8_node = next(n for n in layers[0].onnx_nodes if n.startswith("MatMul"))
    mixed = next(li for li in layers if li.name == "__myl_CastMulFc_myl0_7")
    facts = rep.OnnxFacts(linear={fp8_node, *mixed.onnx_nodes}, bmm=set(), qkv={}, q_formats={"fp8"}, num_qdq=2,
                          quantized={fp8_node})
    a = rep.analyze(layers, facts)
    assert a["quantized_gemm_total"] == 1 and a["fp8_gemm_fraction"] == 1.0
    assert a["fp8_gemm_fraction_all"] == 0.5
    assert rep.check_requirements({"analysis": a}, BuildRequirements(min_fp8_gemm_fraction=0.9)) == []
    # once the same fp16 GEMM is one the graph asked for, it fails the requirement
    facts.quantized.update(mixed.onnx_nodes)
    a = rep.analyze(layers, facts)
    assert a["fp8_gemm_fraction"] == 0.5
    assert rep.check_requirements({"analysis": a}, BuildRequirements(min_fp8_gemm_fraction=0.9))
