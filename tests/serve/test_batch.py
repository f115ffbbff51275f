"""trt-sora batch: per-clip outputs + manifest, failures recorded, retries, quality gate, resume after kill -9."""
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trt_sora.errors import ConfigError


def _write_jobs(path: Path, lines) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_outputs_manifest_and_recorded_failures(tiny_runner, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "kite", "prompt": "a red kite", "seed": 1},
        {"id": "cat", "prompt": "a cat walks", "seed": 2, "guidance": 1.0},
        {"id": "dog", "prompt": "a dog runs", "seed": 3, "guidance": 1.0},
        "# a comment, then a blank line",
        "",
        {"id": "typo", "prompt": "x", "sed": 1},
        {"id": "size", "prompt": "x", "num_frames": 10},
        "{not json",
    ])
    s = run_batch(tiny_runner, jobs, tmp_path / "out", BatchConfig(formats=("npy", "mp4")))
    d = s.data
    assert (d["total"], d["finished"], d["generated"], d["failed"]) == (6, 3, 3, 3) and not s.ok
    assert d["formed_batches"] == {"1": 1, "2": 1}  # kite alone (CFG pair), cat + dog together (no CFG)
    errors = {f["id"]: f["error"] for f in d["failures"]}
    assert "did you mean 'seed'" in errors["typo"] and "num_frames 10" in errors["size"]
    assert "not JSON" in errors["line-8"]
    out = tmp_path / "out"
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "batch"
    assert sorted(man["results"]["clips"]) == ["cat", "dog", "kite", "line-8", "size", "typo"]
    want = rt.generate(tiny_runner, ["a cat walks"], seed=2, guidance=1.0)[0].frames
    rec = json.loads((out / "clips" / "cat.json").read_text())
    assert rec["status"] == "done" and rec["metadata"]["sampling"]["guidance_scale"] == 1.0
    assert rec["frames"]["sha256"] == hashlib.sha256(want.tobytes()).hexdigest()
    np.testing.assert_array_equal(np.load(out / "clips" / "cat.npy"), want)
    for o in rec["outputs"].values():
        assert hashlib.sha256((out / o["path"]).read_bytes()).hexdigest() == o["sha256"]
    assert "| 6 | 3 | 3 | 0 | 3 |" in (out / "summary.md").read_text()
    with pytest.raises(ConfigError, match="lines 1 and 2"):
        run_batch(tiny_runner, _write_jobs(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}] * 2), out)


class _Flaky:
    """The runner, failing its first ``fail`` calls with a simulated out-of-memory error."""

    def __init__(self, runner, fail: int):
        self._runner, self.fail, self.calls = runner, fail, 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def infer(self, feeds):
        self.calls += 1
        if self.calls <= self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self._runner.infer(feeds)


def test_transient_errors_are_retried_then_recorded(tiny_runner, tmp_path):
    from trt_sora.serve.batch import BatchConfig, is_transient, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": "a cat", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    waits = []
    s = run_batch(_Flaky(tiny_runner, 1), jobs, tmp_path / "a", BatchConfig(formats=("npy",), retries=2),
                  sleep=waits.append)
    assert s.ok and s.data["retries"] == 2 and waits == [1.0]
    recs = [json.loads((tmp_path / "a" / "clips" / f"c{i}.json").read_text()) for i in range(2)]
    assert [r["attempts"] for r in recs] == [2, 2]
    assert [r["metadata"]["batch"]["clips"] for r in recs] == [1, 1]  # out of memory: the pair was split
    s = run_batch(_Flaky(tiny_runner, 99), jobs, tmp_path / "b", BatchConfig(formats=("npy",), retries=1),
                  sleep=waits.append)
    assert s.data["failed"] == 2 and "out of memory" in s.data["failures"][0]["error"]
    rec = json.loads((tmp_path / "b" / "clips" / "c0.json").read_text())
    assert rec["status"] == "failed" and rec["error"]["transient"] and rec["attempts"] == 2
    assert is_transient(TimeoutError()) and not is_transient(ConfigError("bad"))


def _npy(out: Path, jid: str) -> Path:
    return out / "clips" / f"{jid}.npy"


@pytest.mark.parametrize("damage", ["same-size-flip", "truncate", "delete"])
def test_resume_rechecks_finished_clips(tiny_runner, tmp_path, damage):
    """A rerun skips a finished clip only while its outputs still have the recorded size and sha256:
    a clip changed in place (same size), cut short or deleted is generated again; the intact one
    is left untouched."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    out, cfg = tmp_path / "out", BatchConfig(formats=("npy",))
    assert run_batch(tiny_runner, jobs, out, cfg).ok
    kept = (_npy(out, "c1").read_bytes(), _npy(out, "c1").stat().st_mtime_ns)
    p = _npy(out, "c0")
    if damage == "same-size-flip":
        data = bytearray(p.read_bytes())
        data[-1] ^= 0x01  # the last pixel's lowest bit: same size, other sha256
        p.write_bytes(bytes(data))
    elif damage == "truncate":
        p.write_bytes(p.read_bytes()[:-7])
    else:
        p.unlink()
    s = run_batch(tiny_runner, jobs, out, cfg)
    assert s.ok and (s.data["skipped"], s.data["generated"], s.data["finished"]) == (1, 1, 2)
    want = rt.generate(tiny_runner, ["clip 0"], seed=0, guidance=1.0)[0].frames
    np.testing.assert_array_equal(np.load(p), want)
    rec = json.loads((out / "clips" / "c0.json").read_text())
    assert rec["outputs"]["npy"]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert (_npy(out, "c1").read_bytes(), _npy(out, "c1").stat().st_mtime_ns) == kept


def test_resume_retries_failed_jobs(tiny_runner, tmp_path):
    """A job recorded as failed is not finished: a rerun generates it, and the summary counts it as
    done, not failed or skipped."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    out, cfg = tmp_path / "out", BatchConfig(formats=("npy",), retries=0)
    s = run_batch(_Flaky(tiny_runner, 99), jobs, out, cfg, sleep=lambda _: None)
    assert s.data["failed"] == 2 and not _npy(out, "c0").exists()
    assert json.loads((out / "clips" / "c0.json").read_text())["status"] == "failed"
    s = run_batch(tiny_runner, jobs, out, cfg)
    assert s.ok and (s.data["failed"], s.data["skipped"], s.data["generated"], s.data["finished"]) == (0, 0, 2, 2)
    for i in range(2):
        want = rt.generate(tiny_runner, [f"clip {i}"], seed=i, guidance=1.0)[0].frames
        np.testing.assert_array_equal(np.load(_npy(out, f"c{i}")), want)
        assert json.loads((out / "clips" / f"c{i}.json").read_text())["status"] == "done"


def test_quality_gate_against_the_pytorch_model(tiny_runner, checked_run, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, GateConfig, run_batch

    ref = rt.load(checked_run, backend="torch", warmup=False)
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "kite", "prompt": "a red kite", "seed": 1}])
    s = run_batch(tiny_runner, jobs, tmp_path / "a", BatchConfig(formats=("npy",), gate=GateConfig(vmaf=True)),
                  reference_runner=ref)
    g = json.loads((tmp_path / "a" / "clips" / "kite.json").read_text())["gate"]
    assert s.ok and g["passed"] and g["min_psnr_db"] == 25.0 and "parity" in g["min_psnr_source"]
    assert 25.0 <= g["worst_psnr_db"] < 100 and 0 < g["mean_ssim"] <= 1 and not g["identical"]
    assert isinstance(g["vmaf"], float) or "without libvmaf" in g["vmaf_note"]
    s = run_batch(tiny_runner, jobs, tmp_path / "b", BatchConfig(formats=("npy",), gate=GateConfig(min_psnr_db=99)),
                  reference_runner=ref)
    assert not s.ok and s.data["gate_failed"] == 1 and s.data["gate_failures"][0]["id"] == "kite"


def _cli(*args):
    # one thread each: the clips are tiny, and on a shared 2-core machine thread pools only contend
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "trt_sora", *args], env


@pytest.mark.slow
def test_resume_after_kill_9(checked_run, tiny_runner, tmp_path):
    """kill -9 mid-batch, leave a partial clip behind, rerun: the exact set of outputs, finished
    clips untouched, the partial one redone, nothing twice."""
    import trt_sora.runtime as rt

    n = 6
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "prompt": f"clip number {i}", "seed": i}
                                                 for i in range(n)])
    out = tmp_path / "out"
    cmd, env = _cli("-v", "batch", "--run", str(checked_run), "--backend", "ort", "--prompts", str(jobs), "--out",
                    str(out), "--formats", "npy,png", "--threads", "1", "--no-progress")
    # the kill lands after the batch logs its second finished clip (each log line follows the clip's commit):
    # the test reads the log as it is written, with no polling
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, lines = 0, []
    for line in proc.stderr:
        lines.append(line)
        seen += " done (" in line and line.split()[0] == "INFO"
        if seen == 2:
            break
    assert seen == 2 and proc.poll() is None, f"the batch ended before it could be killed: {''.join(lines)[-800:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    finished = {p.stem: (p.read_text(), (out / "clips" / f"{p.stem}.npy").stat().st_mtime_ns)
                for p in (out / "clips").glob("j*.json") if json.loads(p.read_text())["status"] == "done"}
    assert 2 <= len(finished) < n
    todo = sorted(f"j{i}" for i in range(n) if f"j{i}" not in finished)
    (out / "clips" / f"{todo[0]}.npy").write_bytes(b"partial")          # a clip cut off mid-write
    (out / "clips" / f".{todo[-1]}.tmp999.png").write_bytes(b"partial")  # a temp file of a killed writer
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["skipped"], summary["generated"], summary["finished"]) == (len(finished), n - len(finished), n)
    names = sorted(p.name for p in (out / "clips").iterdir())
    assert names == sorted(f"j{i}.{ext}" for i in range(n) for ext in ("json", "npy", "png"))  # no temp, no dup
    for jid, (text, mtime) in finished.items():  # finished clips were not regenerated
        assert (out / "clips" / f"{jid}.json").read_text() == text
        assert (out / "clips" / f"{jid}.npy").stat().st_mtime_ns == mtime
    man = json.loads((out / "manifest.json").read_text())["results"]["clips"]
    assert sorted(man) == sorted(f"j{i}" for i in range(n)) and {c["status"] for c in man.values()} == {"done"}
    want = rt.generate(tiny_runner, [f"clip number {todo[0][1:]}"], seed=int(todo[0][1:]))[0].frames
    np.testing.assert_array_equal(np.load(out / "clips" / f"{todo[0]}.npy"), want)  # the partial one, redone
