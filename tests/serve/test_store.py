"""The durable job store: rows and result files as a crash leaves them, read back by an independent
sqlite3 connection and hashlib; the engine resuming what a dead process left queued or running;
retention by age and count."""
import hashlib
import io
import sqlite3

import numpy as np
import pytest
from http_helpers import HANG

from trt_sora.errors import ConfigError
from trt_sora.serve.store import JobStore


def _rows(folder):
    """Rows as another process sees them (a fresh connection, not the store's)."""
    with sqlite3.connect(folder / "jobs.sqlite") as db:
        return {r[0]: r[1:] for r in db.execute("SELECT id, status, attempts, result, key_id FROM jobs")}


def _npy_sha(frames) -> str:
    buf = io.BytesIO()
    np.save(buf, frames)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def test_every_write_is_committed_when_it_returns(tmp_path):
    store = JobStore(tmp_path)
    store.add("a", {"prompt": "x", "seed": 1}, 10.0, key_id="alice")
    store.add("b", {"prompt": "y"}, 11.0)
    assert _rows(tmp_path) == {"a": ("queued", 0, None, "alice"), "b": ("queued", 0, None, None)}
    store.started(["a"], 12.0)
    frames = np.arange(24, dtype=np.uint8).reshape(1, 2, 4, 3)
    sha, path = store.put_result(frames)
    assert sha == _npy_sha(frames) == hashlib.sha256(path.read_bytes()).hexdigest() and path.name == f"{sha}.npy"
    store.finished("a", 13.0, metadata={"fps": 16}, result=sha)
    assert _rows(tmp_path)["a"] == ("done", 0, sha, "alice")
    assert [r.id for r in store.unfinished()] == ["b"]
    row = store.get("a")
    assert row.request == {"prompt": "x", "seed": 1} and row.metadata == {"fps": 16} and store.result_path(row) == path
    assert store.put_result(frames)[1] == path and len(list(store.results.iterdir())) == 1  # one file per clip


def test_requeue_counts_attempts_and_leaves_finished_jobs(tmp_path):
    store = JobStore(tmp_path)
    for i, t in (("late", 5.0), ("early", 1.0), ("done", 0.5)):
        store.add(i, {"prompt": i}, t)
    store.started(["early", "done"], 6.0)
    store.finished("done", 7.0, error="boom")
    store.requeue(["early", "done"])
    assert [(r.id, r.status, r.attempts) for r in store.unfinished()] == [("early", "queued", 1), ("late", "queued", 0)]
    assert _rows(tmp_path)["done"][:2] == ("failed", 0)


def test_retention_by_age_and_count_and_unreferenced_files(tmp_path):
    store = JobStore(tmp_path)
    shas = []
    for i in range(4):
        store.add(f"j{i}", {"prompt": "x"}, float(i))
        sha, _ = store.put_result(np.full((1, 1, 1, 3), i, np.uint8))
        store.finished(f"j{i}", 100.0 + i, result=sha)
        shas.append(sha)
        (store.results / f"j{i}.x2.mp4").write_bytes(b"encoded")  # a fetch's encoding
    store.add("q", {"prompt": "x"}, 0.0)  # queued: never swept
    pending, _ = store.put_result(np.zeros((2, 1, 1, 3), np.uint8))  # written, its row not yet committed
    assert store.sweep(103.5, max_age_s=2.0) == ["j0", "j1"]  # finished at 100, 101: older than 2 s
    assert store.sweep(103.5, keep=1) == ["j2"]
    assert set(_rows(tmp_path)) == {"j3", "q"}
    names = {p.name for p in store.results.iterdir()}
    assert names == {f"{shas[3]}.npy", f"{pending}.npy", "j3.x2.mp4"}, names


def test_a_file_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "jobs.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(ConfigError, match="is not a job store"):
        JobStore(tmp_path)
    other = tmp_path / "newer"
    other.mkdir()
    with sqlite3.connect(other / "jobs.sqlite") as db:
        db.execute("PRAGMA user_version=7")
    with pytest.raises(ConfigError, match="schema 7"):
        JobStore(other)


def test_the_engine_resumes_what_a_dead_process_left(tiny_runner, tmp_path):
    """The store as a process killed mid-batch leaves it: one job running, two queued, one done. A new
    engine on it runs the three in their order, each once, with the clip generate() makes; the done
    one is served from the store; a stored request this artifact cannot make fails with the reason."""
    import trt_sora.runtime as rt
    from trt_sora.serve.scheduler import Engine, ServeConfig

    store = JobStore(tmp_path)
    jobs = {"r": {"prompt": "a red kite", "seed": 3, "guidance": 1.0}, "q1": {"prompt": "a cat", "seed": 4},
            "q2": {"prompt": "a dog", "seed": 5, "steps": 2}, "bad": {"prompt": "x", "num_frames": 10}}
    for t, (i, req) in enumerate(jobs.items()):
        store.add(i, {**req}, float(t), key_id="alice")
    store.started(["r"], 9.0)
    old = np.zeros((1, 1, 1, 3), np.uint8)
    store.add("old", {"prompt": "old"}, -1.0)
    sha, _ = store.put_result(old)
    store.finished("old", 8.0, result=sha, metadata={"fps": 16})
    store.close()

    engine = Engine(tiny_runner, ServeConfig(state_dir=str(tmp_path), max_wait_s=0.0))
    assert engine.get("r").status == "queued" and engine.get("r").attempts == 1  # known while warming up
    engine.start(block=True)
    try:
        views = {i: engine.wait(i, HANG).view() for i in jobs}
        assert views["bad"]["status"] == "failed" and "could not be resumed" in views["bad"]["error"]
        for i in ("r", "q1", "q2"):
            req = jobs[i]
            want = rt.generate(tiny_runner, req["prompt"], seed=req["seed"], guidance=req.get("guidance"),
                               steps=req.get("steps"))[0]
            assert views[i]["status"] == "done" and views[i]["result_sha256"] == _npy_sha(want.frames), i
            assert views[i]["key_id"] == "alice"
        assert views["r"]["attempts"] == 2 and "attempts" not in views["q1"]
        assert views["r"]["started"] < views["q1"]["started"] <= views["q2"]["started"]  # oldest first
        rows = _rows(tmp_path)
        assert {i: rows[i][0] for i in rows} == {"r": "done", "q1": "done", "q2": "done", "bad": "failed",
                                                 "old": "done"}
        served = engine.get("old")
        assert served.status == "done" and np.array_equal(np.load(served.result_path), old)
    finally:
        engine.close()


def test_an_accepted_job_is_in_the_store_before_submit_returns(tiny_runner, tmp_path):
    """Committed before the 202: a runner held at its gate keeps the job from running, and another
    connection already reads it."""
    from http_helpers import Gated

    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.scheduler import Engine, ServeConfig

    gated = Gated(tiny_runner)
    engine = Engine(gated, ServeConfig(state_dir=str(tmp_path), max_wait_s=0.0))
    engine.start(block=True)
    gated.arm()
    try:
        a = engine.submit(ClipRequest("a cat", seed=1), key_id="bob")
        assert gated.entered.wait(HANG)
        b = engine.submit(ClipRequest("a dog", seed=2))
        rows = _rows(tmp_path)
        assert rows[a.id][0] == "running" and rows[a.id][3] == "bob" and rows[b.id][0] == "queued"
    finally:
        gated.release.set()
        engine.wait(b.id, HANG)
        engine.close()


def test_a_closed_engine_stops_its_retention_sweeper(tiny_runner, tmp_path):
    """close() ends the sweeper at once, not after its interval (when it would sweep a closed store)."""
    from trt_sora.serve.scheduler import Engine, ServeConfig

    engine = Engine(tiny_runner, ServeConfig(state_dir=str(tmp_path), sweep_interval_s=10 * HANG))
    engine.start(block=True)
    (sweeper,) = [t for t in engine._threads if t.name == "trt-sora-sweep"]
    engine.close()
    sweeper.join(HANG)
    assert not sweeper.is_alive(), "the sweeper sleeps out its interval after close()"
