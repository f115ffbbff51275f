"""The build stage's plan: engine files, optimization profiles and flags, decided before a backend loads."""
from __future__ import annotations

import dataclasses

import pytest
from build_buckets import bucket

from trt_sora.build import BuildTarget, build_engine, plan_build
from trt_sora.config import Backend, BuildConfig, QuantFormat, load_recipe
from trt_sora.errors import BackendMissingError

SM89_FP8 = BuildTarget(Backend.TENSORRT_RTX, "8.9", QuantFormat.FP8_E4M3)
TWO = [bucket("small", 1), bucket("large", 2)]


def test_one_engine_with_a_profile_per_bucket(micro_fp8, tmp_path):
    plan = plan_build(micro_fp8, BuildConfig(workspace_gb=1.5), tmp_path / "engine", buckets=TWO, target=SM89_FP8,
                      model_name="micro")
    assert len(plan.engines) == 1 and plan.engines[0].bucket is None
    profiles = dict(plan.engines[0].profiles)
    assert list(profiles) == ["small", "large"]
    # (min, opt, max) per input from the bucket's ranges: batch 1..2 (opt 2), text 1..8, f frames, 2f x 2f
    assert profiles["small"]["hidden_states"] == ((1, 4, 1, 2, 2), (2, 4, 1, 2, 2), (2, 4, 1, 2, 2))
    assert profiles["large"]["hidden_states"] == ((1, 4, 1, 2, 2), (2, 4, 2, 4, 4), (2, 4, 2, 4, 4))
    assert profiles["large"]["encoder_hidden_states"] == ((1, 1, 32), (2, 8, 32), (2, 8, 32))
    assert profiles["large"]["timestep"] == ((1,), (2,), (2,))
    assert plan.workspace_bytes == 3 << 29
    assert plan.timing_cache == tmp_path / "engine" / "timing.cache"
    assert plan.engine_file(plan.engines[0], "1.7.1") == "micro.sm89.trtrtx-1.7.1.plan"
    assert not (tmp_path / "engine").exists()  # planning writes nothing


def test_separate_engines_plan_one_file_per_bucket(micro_fp8, tmp_path):
    cfg = dataclasses.replace(BuildConfig(), separate_engines=True)
    plan = plan_build(micro_fp8, cfg, tmp_path / "engine", buckets=TWO, target=SM89_FP8, model_name="micro")
    assert [(e.bucket, [b for b, _ in e.profiles]) for e in plan.engines] == [("small", ["small"]),
                                                                                ("large", ["large"])]
    assert [plan.engine_file(e, "1.7.1") for e in plan.engines] == ["micro.small.sm89.trtrtx-1.7.1.plan",
                                                                     "micro.large.sm89.trtrtx-1.7.1.plan"]


def test_planning_needs_no_backend(micro_fp8, tmp_path):
    recipe = load_recipe("h100-fp8")  # full TensorRT, not installed here
    plan = plan_build(micro_fp8, recipe, tmp_path / "engine", buckets=TWO)
    assert plan.target.backend is Backend.TENSORRT and plan.target.sm == 90 and plan.name == recipe.name
    assert plan.build == recipe.build and plan.model_name == recipe.model.default
    with pytest.raises(BackendMissingError):
        build_engine(micro_fp8, recipe, tmp_path / "engine", buckets=TWO)
