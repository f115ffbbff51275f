"""Real TensorRT-RTX builds (SM89, CPU-only) of micro DiT blocks; assertions on the build report."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from build_buckets import bucket

from trt_sora.build import BuildTarget, build_engine
from trt_sora.config import Backend, BuildConfig, BuildRequirements, QuantFormat, load_recipe
from trt_sora.errors import BuildError

pytestmark = pytest.mark.trt_rtx
SM89_FP8 = BuildTarget(Backend.TENSORRT_RTX, "8.9", QuantFormat.FP8_E4M3)
FAST = BuildConfig(optimization_level=0, workspace_gb=1)


@pytest.fixture(scope="module")
def two_bucket_build(micro_fp8, tmp_path_factory):
    out = tmp_path_factory.mktemp("eng") / "engine"
    cfg = dataclasses.replace(FAST, requirements=BuildRequirements(min_fp8_gemm_fraction=0.9,
                                                                   require_fused_attention=True,
                                                                   require_fused_qkv=True))
    return build_engine(micro_fp8, cfg, out, buckets=[bucket("small", 1), bucket("large", 2)], target=SM89_FP8,
                        model_name="micro")


def test_engine_file_and_manifest(two_bucket_build):
    r = two_bucket_build
    assert [p.name for p in r.engine_paths] == ["micro.sm89.trtrtx-1.7.1.plan"]
    assert r.engine_path.stat().st_size == r.report["engine_bytes"] > 0
    m = json.loads((r.out_dir / "manifest.json").read_text())
    assert m["stage"] == "build" and m["outputs"]["engines"] == ["micro.sm89.trtrtx-1.7.1.plan"]
    assert (r.out_dir / "build_report.json").is_file() and (r.out_dir / "build_report.md").is_file()


def test_two_buckets_two_profiles(two_bucket_build):
    prof = two_bucket_build.report["profiles"]
    assert prof["built"] == 2 and prof["in_engine"] == 2


def test_all_linears_fp8_attention_fused_fp16(two_bucket_build):
    a = two_bucket_build.report["analysis"]
    # 10 linears: patch-in, time, QKV (3 fused into 1 by the builder), out, cross q, cross k+v (fused),
    # cross out, ffn up, ffn down, proj out -> 10 GEMM layers, all FP8
    assert a["gemm_counts"]["fp8"] == a["gemm_total"] == 10
    assert a["fp8_gemm_fraction"] == 1.0
    assert a["attention"]["fused"] and a["attention"]["fused_count"] == 2
    assert a["attention"]["precisions"] == ["fp16"]
    assert a["fused_qkv"]["engine"] == 1 and a["fused_qkv"]["precisions"] == ["fp8"]


def test_fused_qkv_dequantized_weight_fails_fp8_requirement(micro_fp8_fused_qkv, tmp_path):
    """A [d, 3d] FP8 QKV linear followed by Split runs with an fp16 weight: the report must say so."""
    cfg = dataclasses.replace(FAST, requirements=BuildRequirements(min_fp8_gemm_fraction=0.95))
    out = tmp_path / "engine"
    with pytest.raises(BuildError, match="FP8 GEMM fraction 0.900") as ei:
        build_engine(micro_fp8_fused_qkv, cfg, out, buckets=[bucket("a", 1)], target=SM89_FP8)
    assert "__myl_CastMulFc" in str(ei.value)
    failed = json.loads((out / "build_report.failed.json").read_text())
    assert failed["status"] == "failed" and failed["analysis"]["gemm_counts"] == {
        "fp8": 9, "int8": 0, "fp16": 1, "bf16": 0, "fp32": 0}
    assert failed["analysis"]["fused_qkv"] == {"onnx": 1, "engine": 1, "survived": True, "precisions": ["fp16"],
                                               "layers": ["__myl_CastMulFc_myl0_7"]}
    assert not (out / "manifest.json").exists()  # no artifact that a later stage could pick up


def test_corrupt_timing_cache_warns_and_builds_separate_engines(micro_fp8, tmp_path, caplog):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "timing.cache").write_bytes(b"\x00garbage" * 64)
    (out / "timing.cache.json").write_text(json.dumps({"sha256": "0" * 64}))
    cfg = dataclasses.replace(FAST, separate_engines=True)
    with caplog.at_level(logging.WARNING, logger="trt_sora"):
        r = build_engine(micro_fp8, cfg, out, buckets=[bucket("small", 1), bucket("large", 2)], target=SM89_FP8,
                         model_name="micro")
    assert any("timing cache" in rec.message and "unusable" in rec.message for rec in caplog.records)
    assert r.report["timing_cache"].startswith("corrupt_ignored")
    assert sorted(p.name for p in r.engine_paths) == ["micro.large.sm89.trtrtx-1.7.1.plan",
                                                     "micro.small.sm89.trtrtx-1.7.1.plan"]
    assert [e["profiles"] for e in r.report["engines"]] == [1, 1]
    meta = json.loads((out / "timing.cache.json").read_text())  # a fresh, sound cache replaced it
    assert meta["sha256"] != "0" * 64


def test_cli_builds_rtx4090_recipe(micro_fp8, tmp_path, capsys):
    from trt_sora.cli import main

    out = tmp_path / "engine"
    rc = main(["build", "--onnx", str(micro_fp8), "--recipe", "rtx4090-fp8", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "build_report.json").read_text())
    assert report["name"] == "rtx4090-fp8" and report["profiles"]["in_engine"] == 2  # 480p + 720p buckets
    bar = load_recipe("rtx4090-fp8").build.requirements.min_fp8_gemm_fraction
    assert report["analysis"]["fp8_gemm_fraction"] >= bar
    assert "fp8 fraction 1.000" in capsys.readouterr().out
