"""The export stage's plan: dynamic axes, trace and verify points, opset and the external-data decision."""
from __future__ import annotations

import dataclasses

import pytest

from trt_sora.config import DType, ExportConfig, ExternalData
from trt_sora.errors import ExportError
from trt_sora.export.exporter import PROTOBUF_LIMIT, plan_export

DIMS = ("batch", "latent_frames", "latent_height", "latent_width", "text_len")


@pytest.fixture(scope="module")
def tiny():
    from trt_sora.models import get_adapter

    adapter = get_adapter("wan-tiny")
    return adapter, adapter.load_empty("fp32")


def test_wan_tiny_plan(tiny):
    adapter, model = tiny
    cfg = ExportConfig()
    plan = plan_export(adapter, cfg, model, weightless=True)
    assert {d: plan.ranges[d].to_yaml() for d in DIMS} == {d: cfg.dynamic[d].to_yaml() for d in DIMS}
    # traced where every dim is >= 2 (torch.export specialises size 1) and a multiple of the patch (1, 2, 2)
    assert plan.point == {"batch": 2, "latent_frames": 2, "latent_height": 4, "latent_width": 4, "text_len": 2}
    a, b = plan.verify_points
    assert a == {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 7}
    assert all(a[d] != b[d] for d in DIMS)  # two points that differ in every dim, batch included
    n = sum(p.numel() * 4 for p in model.parameters()) + sum(x.numel() * x.element_size() for x in model.buffers())
    assert plan.param_bytes == n and not plan.external  # under protobuf's 2 GB: one file
    assert (plan.opset, plan.dtype, plan.weightless, plan.verify_mode) == (20, DType.FP32, True, "whole-graph")


def test_plan_follows_the_config(tiny):
    adapter, model = tiny
    assert plan_export(adapter, ExportConfig(), model, weightless=True, segmented=True).verify_mode == "segmented"
    assert plan_export(adapter, ExportConfig(verify=False), model, weightless=False).verify_mode is None
    always = dataclasses.replace(ExportConfig(), external_data=ExternalData.ALWAYS)
    assert plan_export(adapter, always, model, weightless=False).external


def test_plan_rejects_what_the_export_cannot_do(tiny, monkeypatch):
    adapter, model = tiny
    outside = dataclasses.replace(ExportConfig(), verify_points=({"batch": 9, "latent_frames": 2, "latent_height": 4,
                                                                   "latent_width": 4, "text_len": 4},))
    with pytest.raises(ExportError, match="outside the exported range"):
        plan_export(adapter, outside, model, weightless=True)
    never = dataclasses.replace(ExportConfig(), external_data=ExternalData.NEVER)
    monkeypatch.setattr("trt_sora.export.exporter._param_bytes", lambda m: PROTOBUF_LIMIT + 1)
    with pytest.raises(ExportError, match="2 GB limit"):
        plan_export(adapter, never, model, weightless=True)
