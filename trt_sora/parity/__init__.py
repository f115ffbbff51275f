"""Parity checker: the comparison matrix (export fidelity, Q/DQ correctness, quality; single call,
sampling loop, decoded frames), gates from the recipe, ``report.json`` + ``report.md``.

Importing this package loads no torch/onnx: :func:`check_artifacts` imports them when it runs.
"""
from __future__ import annotations

from trt_sora.errors import lazy_exports

_LAZY = {
    **dict.fromkeys(("CheckPlan", "check_artifacts", "check_plan", "localize", "find_artifacts", "effective_buckets"),
                    "trt_sora.parity.check"),
    **dict.fromkeys(("compare", "frame_metrics", "ssim"), "trt_sora.parity.metrics"),
}

__all__ = ["CheckPlan", "check_artifacts", "check_plan", "compare", "frame_metrics", "localize", "ssim"]

__getattr__ = lazy_exports(__name__, _LAZY)
