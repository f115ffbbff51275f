"""The statuses a batch job's record holds, shared by the local output and the bucket output
(:mod:`trt_sora.serve.objstore`): a record with ``DONE`` or ``GATE_FAILED`` is finished and reused on
resume (its outputs re-hashed), ``FAILED`` is retried."""
from __future__ import annotations

__all__ = ["DONE", "FAILED", "GATE_FAILED"]

DONE, FAILED, GATE_FAILED = "done", "failed", "gate_failed"
