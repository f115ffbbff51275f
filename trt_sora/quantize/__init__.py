"""Stage 3: calibrated FP8 / INT8 Q/DQ insertion into an exported ONNX graph.

Light on purpose: importing ``trt_sora.quantize`` loads no torch, onnx or
graphsurgeon. The public names resolve lazily:

* :func:`quantize_onnx` (``model.onnx`` + ``stats.safetensors`` -> ``model.qdq.onnx``,
  ``qdq_map.json``, ``manifest.json``) and :class:`QuantResult` - :mod:`trt_sora.quantize.api`.
* :func:`site_plan` -> :class:`SitePlan`: which sites get Q/DQ, at which amax and why, before
  anything is written - :mod:`trt_sora.quantize.plan`.
* :func:`site_policy` - :mod:`trt_sora.site_policy` (shared with calibration; the exclusions are the
  model family's, ``ModelAdapter.quant_excludes``).
* graph passes: :mod:`~trt_sora.quantize.sites` (site -> node resolution),
  :mod:`~trt_sora.quantize.dtype` (graph float type), :mod:`~trt_sora.quantize.fuse_qkv`,
  :mod:`~trt_sora.quantize.qdq`.
"""
from __future__ import annotations

from trt_sora.errors import lazy_exports

_LAZY = {
    "quantize_onnx": "trt_sora.quantize.api",
    "QuantResult": "trt_sora.quantize.api",
    "QDQ_NAME": "trt_sora.quantize.api",
    "site_plan": "trt_sora.quantize.api",
    "SitePlan": "trt_sora.quantize.plan",
    "site_policy": "trt_sora.site_policy",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
