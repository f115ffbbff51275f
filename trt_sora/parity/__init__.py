"""Parity checker: the comparison matrix (export fidelity, Q/DQ correctness, quality; single call,
sampling loop, decoded frames), gates from the recipe, ``report.json`` + ``report.md``.

Importing this package loads no torch/onnx: :func:`check_artifacts` imports them when it runs.
"""
from __future__ import annotations

__all__ = ["CheckPlan", "check_artifacts", "check_plan", "compare", "frame_metrics", "localize", "ssim"]


def __getattr__(name: str):
    import importlib

    if name in ("CheckPlan", "check_artifacts", "check_plan", "localize", "find_artifacts", "effective_buckets"):
        return getattr(importlib.import_module("trt_sora.parity.check"), name)
    if name in ("compare", "frame_metrics", "ssim"):
        return getattr(importlib.import_module("trt_sora.parity.metrics"), name)
    raise AttributeError(f"module 'trt_sora.parity' has no attribute {name!r}")
