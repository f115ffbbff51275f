"""Build stage: Q/DQ ONNX -> TensorRT / TensorRT-RTX engines with a build report that proves precision.

``build_engine`` is the stage function (``plan_build`` gives its :class:`BuildPlan`: engine files,
optimization profiles and flags, before any backend loads); ``load_backend`` picks ``tensorrt`` or
``tensorrt_rtx`` lazily. Importing this package does not import TensorRT.
"""
from trt_sora.build.backend import INSTALL, RTX_SUPPORTED_SM, check_target, load_backend
from trt_sora.build.builder import (
    BuildPlan,
    BuildResult,
    BuildTarget,
    EnginePlan,
    build_engine,
    engine_file_name,
    plan_build,
)
from trt_sora.build.report import REPORT_JSON, load_report

__all__ = ["INSTALL", "RTX_SUPPORTED_SM", "BuildPlan", "BuildResult", "BuildTarget", "EnginePlan", "REPORT_JSON",
           "build_engine", "check_target", "engine_file_name", "load_backend", "load_report", "plan_build"]
