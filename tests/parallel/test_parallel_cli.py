"""``--parallel`` on the CLI: ``torchrun ... -m trt_sora -- generate --parallel cfg=2`` writes the clip one
process writes (within one uint8 level: the CFG halves run as two batch-1 calls), and without torchrun
the command says how to launch it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

CAPTION = "a red circle moves left"


def test_generate_under_torchrun_equals_one_process(checked_run, tmp_path):
    import trt_sora.runtime as rt

    out = tmp_path / "clip.npy"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trt_sora", "--",
           "generate", "--run", str(checked_run), "--backend", "torch", "--device", "cpu", "--steps", "2",
           "--parallel", "cfg=2", CAPTION, "-o", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(out)
    with rt.load(checked_run, backend="torch", device="cpu") as runner:
        want = rt.generate(runner, [CAPTION], seed=0, steps=2)[0].frames
    assert got.shape == want.shape and got.dtype == np.uint8
    assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= 1
    assert (got != want).mean() < 0.01


def test_parallel_without_torchrun_names_the_launch_command(checked_run, tmp_path, capsys, monkeypatch):
    from trt_sora.cli import main

    monkeypatch.delenv("RANK", raising=False)
    rc = main(["generate", "--run", str(checked_run), "--backend", "torch", "--device", "cpu",
               "--parallel", "cfg=2,ulysses=2", CAPTION, "-o", str(tmp_path / "x.npy")])
    err = capsys.readouterr().err
    assert rc != 0 and "torchrun --nproc-per-node 4" in err, err
    assert not (tmp_path / "x.npy").exists()
