"""The Q/DQ site policy, re-exported from :mod:`trt_sora.site_policy` (below every stage, so
calibration can simulate the same sites without importing the quantize stage)."""
from trt_sora.site_policy import site_policy

__all__ = ["site_policy"]
