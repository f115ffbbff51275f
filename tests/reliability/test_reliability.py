"""Every hostile case of ``cases.py`` on a wan-tiny run folder: the outcome it must have now.

One case per row of the issue's table (corrupt / truncated / missing / tampered files for every
stage, kill -9 in every stage then a rerun, two runs on one folder, unwritable and full output
folders, bad runtime inputs followed by an exact good call, 8 threads x 100 calls). The run folder
is the session's ``trt-sora engine`` run (``engine_run``); every case works on its own copy.
Stage-reuse decisions are checked with ``EnginePipeline.plan``; one damage per cheap stage reruns
for real (``real=True`` in cases.py).
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_trt_sora_reliability_cases", Path(__file__).with_name("cases.py"))
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.trt_rtx  # the run folder holds a real TensorRT-RTX engine


@pytest.fixture(scope="module")
def env(engine_run, tmp_path_factory):
    _, _, pristine = engine_run
    return cases.Env(pristine, tmp_path_factory.mktemp("reliability"), quick=True)


@pytest.mark.parametrize("case", cases.CASES, ids=[c.id for c in cases.CASES])
def test_case(case, env):
    out = cases.run_case(case, env)
    if out.kind == "n/a":
        pytest.skip(out.detail)
    assert out.kind == case.want, f"{case.what}: {out.kind}: {out.detail}"
    if case.match:
        assert re.search(case.match, out.detail), out.detail
