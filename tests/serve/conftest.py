"""Reuse the parity run-folder fixtures (built once per session, see tests/parity/conftest.py)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_name = "_trt_sora_parity_fixtures"
if _name not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_name, Path(__file__).parents[1] / "parity" / "conftest.py")
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    sys.modules[_name] = _mod
_m = sys.modules[_name]
base_run = _m.base_run
checked_run = _m.checked_run
corrupt_scale = _m.corrupt_scale
RECIPE = _m.RECIPE


@pytest.fixture(scope="session")
def tiny_runner(checked_run):
    """The checked wan-tiny run folder loaded on ONNX Runtime (one per session)."""
    import trt_sora.runtime as rt

    return rt.load(checked_run, backend="ort")
