"""The checkpoint stage: calibration -> a quantized diffusers checkpoint in NVIDIA ModelOpt's format.

What TensorRT-LLM VisualGen, vLLM-Omni and SGLang-Diffusion load as a pre-quantized
transformer (FP8 weights with their scales, static input scales, the exclusions,
``quantization_config`` in ``config.json``). Light on purpose: importing
``trt_sora.checkpoint`` loads no torch. The public names resolve lazily:

* :func:`export_checkpoint`, :class:`CheckpointResult` - :mod:`trt_sora.checkpoint.writer`.
* the format itself (which sites, their scales, packing, ``ignore`` summary; :func:`checkpoint_plan`) -
  :mod:`trt_sora.checkpoint.modelopt_format`.
* ModelOpt as the reference (its own export with our amax; loading a checkpoint into its
  fake-quant quantizers) - :mod:`trt_sora.checkpoint.modelopt_interop` (needs ``nvidia-modelopt``).
"""
from __future__ import annotations

from trt_sora.errors import lazy_exports

_LAZY = {
    "export_checkpoint": "trt_sora.checkpoint.writer",
    "CheckpointResult": "trt_sora.checkpoint.writer",
    "checkpoint_plan": "trt_sora.checkpoint.modelopt_format",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
