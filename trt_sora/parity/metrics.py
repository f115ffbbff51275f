"""Parity gates over the shared metrics (:mod:`trt_sora.metrics`, re-exported here)."""
from __future__ import annotations

import math

from trt_sora.metrics import PEAK_PIXEL_RANGE, PEAK_REF_RANGE, compare, frame_metrics, psnr_from_mse, ssim  # noqa: F401 (re-exports)

__all__ = ["PEAK_PIXEL_RANGE", "PEAK_REF_RANGE", "compare", "frame_metrics", "gate_check", "psnr_from_mse", "ssim"]


def gate_check(metrics: dict, gate, *, psnr_key: str = "psnr_db", ssim_key: str | None = None) -> list[dict]:
    """Each enabled threshold of ``gate`` (a ParityGate) against ``metrics``:
    ``[{"metric", "value", "threshold", "op", "passed"}]``."""
    checks = []

    def add(metric, value, thr, op):
        if thr is None or value is None:
            return
        ok = value >= thr if op == ">=" else value <= thr
        checks.append({"metric": metric, "value": value, "threshold": thr, "op": op,
                       "passed": bool(ok and not (isinstance(value, float) and math.isnan(value)))})

    add("cosine", metrics.get("cosine"), gate.min_cosine, ">=")
    add(psnr_key, metrics.get(psnr_key), gate.min_psnr_db, ">=")
    add("max_abs", metrics.get("max_abs"), gate.max_abs, "<=")
    add("rel_l2", metrics.get("rel_l2"), gate.max_rel_l2, "<=")
    if ssim_key:
        add(ssim_key, metrics.get(ssim_key), getattr(gate, "min_ssim", None), ">=")
    return checks
