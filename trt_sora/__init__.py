"""trt_sora: video diffusion transformers -> calibrated, verified TensorRT engines.

Importing this package is cheap: torch, onnx, onnxruntime, tensorrt and
diffusers load only when a stage that needs them runs.
"""
from __future__ import annotations

import logging

from trt_sora.errors import (
    ArtifactError,
    BackendMissingError,
    BuildError,
    CalibrationError,
    ConfigError,
    ExportError,
    ModelError,
    NumericsError,
    ParityError,
    QuantizeError,
    ShapeError,
    TrtSoraError,
)

__version__ = "0.1.0"

logging.getLogger("trt_sora").addHandler(logging.NullHandler())

__all__ = [
    "__version__", "ArtifactError", "BackendMissingError", "BuildError", "CalibrationError",
    "ConfigError", "ExportError", "ModelError", "NumericsError", "ParityError", "QuantizeError", "ShapeError",
    "TrtSoraError",
]
