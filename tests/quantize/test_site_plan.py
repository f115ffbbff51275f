"""The quantize stage's site plan, inspected before anything is written."""
from __future__ import annotations

import pytest

from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
from trt_sora.manifest import sha256_file

BLOCKS = ("blocks.0", "blocks.1")
# wan-tiny's linears that FP8 quantizes with the default recipe: every block projection, the
# self-attention's q/k/v and the cross-attention's k/v each as one fused GEMM
QUANTIZED = tuple(f"{b}.{s}" for b in BLOCKS for s in ("attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
                                                       "ffn.net.0.proj", "ffn.net.2")) + \
    tuple(f"{b}.{s}" for b in BLOCKS for s in ("attn1.to_qkv", "attn2.to_kv"))
EXCLUDED = {
    "condition_embedder.time_embedder.linear_1": "timestep embedder",
    "condition_embedder.time_embedder.linear_2": "timestep embedder",
    "condition_embedder.time_proj": "AdaLN modulation projection",
    "condition_embedder.text_embedder.linear_1": "text embedder",
    "condition_embedder.text_embedder.linear_2": "text embedder",
    "proj_out": "final projection",
}


def _plan(export, stats, **kw):
    from trt_sora.quantize import site_plan

    cfg = QuantConfig(format=QuantFormat(kw.pop("fmt", "fp8_e4m3")), graph_dtype=DType.FP16, **kw)
    return site_plan(export.onnx_path, stats, cfg)


def test_plan_lists_the_sites_wan_tiny_quantizes(tiny_export, tiny_stats_path, quantized):
    plan = _plan(tiny_export, tiny_stats_path)
    assert sorted(plan.quantized) == sorted(QUANTIZED)
    for site, why in EXCLUDED.items():
        q, reason = plan.decisions[site]
        assert not q and why in reason, (site, reason)
    assert set(plan.sites) == set(QUANTIZED) | set(EXCLUDED)
    assert dict(plan.fused) == {f"{b}.attn1.to_qkv": tuple(f"{b}.attn1.to_{w}" for w in "qkv") for b in BLOCKS} | {
        f"{b}.attn2.to_kv": (f"{b}.attn2.to_k", f"{b}.attn2.to_v") for b in BLOCKS}
    attention_sites = {f"{b}.attn{i}.{w}" for b in BLOCKS for i in (1, 2) for w in "qkv"}
    assert {e["site"] for e in plan.stats_entries} == attention_sites  # recorded as excluded: fp8_attention off
    # the stage writes what the plan says
    res = quantized("fp8_e4m3", "fp16")
    written = {e["site"]: e for e in res.qdq_map if e["kind"] == "linear" and "node" in e}
    assert sorted(s for s, e in written.items() if not e["excluded"]) == sorted(plan.quantized)
    assert all(written[s]["site_amax"] == plan.act_amax[s] for s in plan.quantized)


def test_plan_follows_the_recipe(tiny_export, tiny_stats_path):
    unfused = _plan(tiny_export, tiny_stats_path, fused_qkv=False)
    assert not unfused.fused and "blocks.0.attn1.to_k" in unfused.quantized
    assert not any(s.endswith(("to_qkv", "to_kv")) for s in unfused.sites)
    ffn_off = _plan(tiny_export, tiny_stats_path, exclude=("blocks.*.ffn.*",))
    assert set(QUANTIZED) - set(ffn_off.quantized) == {f"{b}.ffn.net.{i}" for b in BLOCKS for i in ("0.proj", "2")}
    none = _plan(tiny_export, tiny_stats_path, fmt="none")
    assert none.quantized == () and not any(q for q, _ in none.decisions.values())
    assert none.decisions["blocks.0.ffn.net.2"] == (False, "quantization.format is none")


def test_planning_writes_nothing(tiny_export, tiny_stats_path):
    folder = tiny_export.onnx_path.parent
    before = {p.name: sha256_file(p, cached=False) for p in folder.iterdir()}
    plan = _plan(tiny_export, tiny_stats_path)
    assert {p.name: sha256_file(p, cached=False) for p in folder.iterdir()} == before
    with pytest.raises(TypeError):
        plan.act_amax["proj_out"] = 1.0  # frozen: applying it cannot change what was decided
