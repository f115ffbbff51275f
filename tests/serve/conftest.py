"""Fixtures over the session's checked wan-tiny run folder (tests/run_folders.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_runner(checked_run):
    """The checked wan-tiny run folder loaded on ONNX Runtime (one per session)."""
    import trt_sora.runtime as rt

    return rt.load(checked_run, backend="ort")
