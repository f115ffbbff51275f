"""Calibration: observers, statistics files, prompt sets and presets.

Light on purpose: importing ``trt_sora.calibrate`` loads no torch. Import the
submodules that need it directly:

* :mod:`trt_sora.calibrate.observers` - ``MinMaxObserver``, ``EmaObserver``,
  ``PercentileObserver``, ``MseObserver``, ``SiteStats``, ``make_observer``.
* :mod:`trt_sora.calibrate.fake_quant` - FP8 E4M3 / INT8 fake quantization
  (ONNX Q/DQ semantics) and ``quant_error`` metrics.
* :mod:`trt_sora.calibrate.stats` - ``CalibStats`` (``stats.safetensors``) save/load.
* :mod:`trt_sora.calibrate.data` - prompt sets (``calib/prompts``, or a user's .parquet/.csv/datasets
  folder) and presets (``calib/presets``): ``load_prompts``, ``load_preset``.
* :mod:`trt_sora.calibrate.peer` - NVIDIA ModelOpt's FP8 recipe on the same trajectories, compared
  with ours in the report (``calibrate --peer modelopt``).
"""
from __future__ import annotations

__all__: list[str] = []
