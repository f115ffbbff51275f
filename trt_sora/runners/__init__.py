"""Runners: one lifecycle (``activate / infer / deactivate``) for PyTorch, ONNX Runtime and TensorRT.

Shared by :mod:`trt_sora.parity` and :mod:`trt_sora.runtime`. Importing this
package loads no torch, onnx, onnxruntime or tensorrt; each runner imports its
backend in ``activate()``.

* :class:`TorchRunner` - the adapter's PyTorch model (fp32/bf16 reference).
* :class:`TorchFakeQuantRunner` - the same model with simulated Q/DQ at the sites of ``qdq_map.json``.
* :class:`OrtRunner` - ONNX Runtime on a plain or Q/DQ ONNX (CUDA provider when present).
* :class:`TrtRunner` - a TensorRT engine (needs a GPU and TensorRT).
"""
from __future__ import annotations

from trt_sora.errors import lazy_exports
from trt_sora.runners.base import Runner, RunnerStateError, to_numpy

_LAZY = {
    "TorchRunner": "trt_sora.runners.torch_runner",
    "TorchFakeQuantRunner": "trt_sora.runners.torch_runner",
    "OrtRunner": "trt_sora.runners.ort_runner",
    "TrtRunner": "trt_sora.runners.trt_runner",
}

__all__ = ["Runner", "RunnerStateError", "to_numpy", *_LAZY]

__getattr__ = lazy_exports(__name__, _LAZY)
