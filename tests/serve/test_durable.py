"""A server you can trust with jobs, over real processes on 127.0.0.1: ``trt-sora serve --state-dir S
--api-keys-file K``. Jobs accepted with 202 survive kill -9, a second SIGTERM and a drain that times
out (each exits 0, never an abort), and finish exactly once with the clip ``generate()`` makes; keys
are checked (401), a key sees only its own jobs, the store never holds a key, SIGHUP reloads them.

No clock decides anything: the servers that must die with a job inside the model run through
gated_serve.py, whose runner blocks on a named pipe once armed and says so on stdout."""
import hashlib
import io
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import prefork
import pytest
from http_helpers import HANG, Http, Lines

HERE = Path(__file__).resolve().parent
ALICE, BOB, CAROL = "a" * 20 + "-alice", "b" * 20 + "-bob", "c" * 20 + "-carol"
JOBS = [{"prompt": "a red kite", "seed": 11}, {"prompt": "a cat walks", "seed": 12, "guidance": 1.0},
        {"prompt": "a dog runs", "seed": 13, "steps": 2}]


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


class Server:
    """One ``trt-sora serve`` process (through gated_serve.py) on port 0."""

    def __init__(self, run, tmp, *extra, state="state"):
        env = {**os.environ, "PYTHONPATH": f"{HERE.parents[1]}{os.pathsep}{HERE.parent}", "OMP_NUM_THREADS": "1"}
        args = ["serve", "--run", str(run), "--backend", "ort", "--port", "0", "--threads", "1",
                "--max-wait-ms", "0", "--drain-grace", "0", "--state-dir", str(tmp / state),
                "--api-keys-file", str(tmp / "keys"), *extra]
        self.proc = prefork.popen([sys.executable, str(HERE / "gated_serve.py"), str(tmp / "arm"),
                                   str(tmp / "fifo"), *args], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.out, self.err = Lines(self.proc.stdout), Lines(self.proc.stderr)
        try:
            self.http = Http(int(self.out.wait_for(r"on http://127\.0\.0\.1:(\d+) ").group(1)))
            self.out.wait_for(r"^ready: ort backend")
        except AssertionError as exc:
            self.proc.kill()
            raise AssertionError(f"{exc}\nstderr:\n{self.err.text()[-3000:]}") from None

    def signal(self, sig, log_line: str, start: int = 0):
        self.proc.send_signal(sig)
        self.err.wait_for(log_line, start)

    def exit_code(self) -> int:
        return self.proc.wait(timeout=HANG)


def _rows(tmp):
    with sqlite3.connect(tmp / "state" / "jobs.sqlite") as db:
        return {r[0]: r[1:] for r in db.execute("SELECT id, status, key_id, attempts FROM jobs")}


@pytest.fixture(scope="module")
def durable(checked_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("durable")
    (tmp / "keys").write_text(f"# the server's keys\nalice {ALICE}\n\nbob {BOB}\n")
    os.mkfifo(tmp / "fifo")
    (tmp / "arm").write_text("")
    return checked_run, tmp


def test_kill_9_loses_no_accepted_job(durable):
    run, tmp = durable
    s = Server(run, tmp)
    ids = []
    for job in JOBS:
        status, view = s.http.json("POST", "/v1/jobs", job, headers=bearer(ALICE))
        assert status == 202, view
        ids.append(view["id"])
    s.out.wait_for("^gate: entered")  # the first job is inside the model, the others queued
    rows = _rows(tmp)
    assert [rows[i][:2] for i in ids] == [("running", "alice"), ("queued", "alice"), ("queued", "alice")]
    s.proc.kill()
    assert s.exit_code() == -signal.SIGKILL
    (tmp / "ids").write_text("\n".join(ids))


def test_a_second_sigterm_leaves_the_jobs_queued_and_exits_0(durable):
    run, tmp = durable
    s = Server(run, tmp)
    s.err.wait_for(r"3 job\(s\) from .*jobs\.sqlite resume once warm \(1 were running\)")
    s.out.wait_for("^gate: entered")
    s.signal(signal.SIGTERM, "signal SIGTERM: draining")
    s.proc.send_signal(signal.SIGTERM)
    assert s.exit_code() == 0, s.err.text()[-2000:]
    assert "second SIGTERM: 2 queued job(s) stay in" in s.err.text() and "terminate called" not in s.err.text()


def test_a_drain_that_times_out_exits_0_and_keeps_the_rest(durable):
    run, tmp = durable
    s = Server(run, tmp, "--drain-timeout", "0.1")
    s.out.wait_for("^gate: entered")
    s.signal(signal.SIGTERM, "signal SIGTERM: draining")
    assert s.exit_code() == 0, s.err.text()[-2000:]
    assert "drain timed out after 0.1 s: 2 queued job(s) stay in" in s.err.text()
    assert {v[0] for v in _rows(tmp).values()} == {"running", "queued"}


def test_exiting_with_a_clip_inside_the_model_is_no_abort(durable):
    """The drain times out while a 1000-step job runs inside ONNX Runtime: the process must exit 0
    with the job left for the next start, not abort in the runtime's thread pool (exit 134)."""
    run, tmp = durable
    s = Server(run, tmp, "--drain-timeout", "0.1", "--max-steps", "1000", state="state2")
    status, job = s.http.json("POST", "/v1/jobs", {"prompt": "a long one", "steps": 1000}, headers=bearer(BOB))
    assert status == 202
    s.out.wait_for("^gate: entered")
    with open(tmp / "fifo", "w"):  # open the gate: the job goes into the model
        pass
    s.signal(signal.SIGTERM, "signal SIGTERM: draining")
    assert s.exit_code() == 0, s.err.text()[-2000:]
    assert "terminate called" not in s.err.text()
    with sqlite3.connect(tmp / "state2" / "jobs.sqlite") as db:
        assert db.execute("SELECT status FROM jobs WHERE id=?", (job["id"],)).fetchone() == ("running",)


def test_after_restarts_every_job_finishes_once_for_its_key_only(durable, tiny_runner):
    import trt_sora.runtime as rt

    run, tmp = durable
    ids = (tmp / "ids").read_text().split("\n")
    (tmp / "arm").unlink()  # no gate: the jobs run
    s = Server(run, tmp)
    http = s.http
    assert http.json("GET", f"/v1/jobs/{ids[0]}")[0] == 401
    assert http("GET", "/metrics")[0] == 401 and http("GET", "/healthz")[0] == 200
    assert http.json("GET", f"/v1/jobs/{ids[0]}", headers=bearer(BOB))[0] == 404  # another key's job
    views = []
    for i in ids:
        _, v = http.json("GET", f"/v1/jobs/{i}?wait=60", headers=bearer(ALICE))
        while v["status"] not in ("done", "failed"):
            _, v = http.json("GET", f"/v1/jobs/{i}?wait=60", headers=bearer(ALICE))
        views.append(v)
    assert [v["status"] for v in views] == ["done"] * 3
    assert [v.get("attempts", 1) for v in views] == [4, 1, 1]  # the first began in all four processes
    for job, v in zip(JOBS, views):
        want = rt.generate(tiny_runner, job["prompt"], seed=job["seed"], guidance=job.get("guidance"),
                           steps=job.get("steps"))[0].frames
        status, raw, _ = http("GET", f"/v1/jobs/{v['id']}/result?format=npy", headers=bearer(ALICE))
        assert status == 200 and np.array_equal(np.load(io.BytesIO(raw)), want)
        assert v["result_sha256"] == hashlib.sha256(raw).hexdigest()
    rows = _rows(tmp)
    assert {i: rows[i][:2] for i in ids} == {i: ("done", "alice") for i in ids} and len(rows) == 3
    stored = b"".join(p.read_bytes() for p in (tmp / "state").glob("jobs.sqlite*"))
    for key in (ALICE, BOB):
        assert key.encode() not in stored and key not in s.err.text()
    # SIGHUP reloads the keys: carol is let in
    assert http("GET", "/v1/info", headers=bearer(CAROL))[0] == 401
    (tmp / "keys").write_text(f"alice {ALICE}\nbob {BOB}\ncarol {CAROL}\n")
    s.signal(signal.SIGHUP, r"SIGHUP: 3 API key\(s\) loaded")
    assert http("GET", "/v1/info", headers=bearer(CAROL))[0] == 200
    mark = len(s.err.lines)
    s.signal(signal.SIGTERM, "signal SIGTERM: draining", mark)
    assert s.exit_code() == 0
