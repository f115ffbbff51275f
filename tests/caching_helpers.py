"""Shared inputs of the step-caching tests (test_caching.py, test_cfg_reuse.py)."""
from __future__ import annotations

import numpy as np

from trt_sora.caching import HORIZONS


def error_table(n: int, at: dict) -> np.ndarray:
    """``[n, HORIZONS]`` calibrated errors: ``at[step] = (horizon, error)`` sets one horizon (the others 0.5,
    more than any budget the tests use), ``(None, error)`` every horizon; steps not listed are NaN."""
    out = np.full((n, HORIZONS), np.nan)
    for i, (h, e) in at.items():
        out[i] = e if h is None else 0.5
        if h is not None:
            out[i, h - 1] = e
    return out
