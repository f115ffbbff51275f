"""``manifest.staged_dir``: a signal (KeyboardInterrupt / the CLI's SIGTERM) landing anywhere in a stage's
write - between creating the temp folder and handing it out, inside the stage, or between the two renames
of the swap - leaves no temp folder behind and the previous artifact intact."""
from __future__ import annotations

import json
import os

import pytest

from trt_sora import manifest


def _old_artifact(out):
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"stage": "export"}))
    return (out / "manifest.json").read_bytes()


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("where", ["lock", "stage", "swap"])
def test_interrupt_anywhere_leaves_nothing(tmp_path, monkeypatch, where):
    out = tmp_path / "export"
    before = _old_artifact(out)
    if where == "lock":  # the window between mkdtemp and the yield (the folder already exists)
        monkeypatch.setattr(manifest, "_try_lock_dir", lambda p: (_ for _ in ()).throw(KeyboardInterrupt()))
    if where == "swap":  # after the old artifact moved aside, before the new one moved in
        real = os.replace

        def replace(src, dst):
            real(src, dst)
            if str(dst).endswith(f".old-{os.getpid()}"):
                raise KeyboardInterrupt()
        monkeypatch.setattr(manifest.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with manifest.staged_dir(out) as tmp:
            (tmp / "manifest.json").write_text(json.dumps({"stage": "export", "new": True}))
            if where == "stage":
                raise KeyboardInterrupt()
    assert _leftovers(tmp_path) == [], "temp folders left behind"
    assert (out / "manifest.json").read_bytes() == before, "the previous artifact was not kept"


def test_success_swaps_in_and_cleans_up(tmp_path):
    out = tmp_path / "export"
    _old_artifact(out)
    with manifest.staged_dir(out) as tmp:
        (tmp / "manifest.json").write_text(json.dumps({"stage": "export", "new": True}))
    assert json.loads((out / "manifest.json").read_text())["new"] is True
    assert _leftovers(tmp_path) == []
