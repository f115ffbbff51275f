"""Fixtures over the session's checked wan-tiny run folder (tests/run_folders.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_runner(checked_run):
    """The checked wan-tiny run folder loaded on ONNX Runtime (one per session)."""
    import trt_sora.runtime as rt

    return rt.load(checked_run, backend="ort")


@pytest.fixture
def resolves(monkeypatch):
    """A Counter of ``Generator.resolve`` calls by prompt, from now on (every Generator of the process)."""
    import collections

    from trt_sora.runtime.generate import Generator

    calls = collections.Counter()
    resolve = Generator.resolve
    monkeypatch.setattr(Generator, "resolve", lambda self, req: (calls.update([req.prompt]), resolve(self, req))[1])
    return calls
