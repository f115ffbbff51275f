"""trt-sora batch --out s3://...: against moto's S3 server started on 127.0.0.1 by each test (a real HTTP
endpoint; its request log is the independent count of uploads), including the server killed mid-upload
and restarted from its own request recording (moto's recorder: the state a durable server keeps)."""
import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import prefork
import pytest
from http_helpers import kill_batch_after_clips, trt_sora_cli

from trt_sora.errors import BackendMissingError, ConfigError, StorageError

pytest.importorskip("s3fs")
pytest.importorskip("moto.server", reason="moto's S3 server is not installed (pip install 'moto[server]')")
boto3 = pytest.importorskip("boto3")


class Moto:
    """moto's server (``python -m moto.server -p0``) on 127.0.0.1: the port read from its own 'Running on'
    line; every request line kept (a thread drains its stderr; :meth:`stop` reads it to the end)."""

    def __init__(self, tmp_path: Path, *, recording: Path | None = None, env: dict | None = None):
        import moto.server

        env = {**os.environ, **(env or {})}
        if recording is not None:
            env.update(MOTO_ENABLE_RECORDING="True", MOTO_RECORDER_FILEPATH=str(recording))
        self.proc = subprocess.Popen([sys.executable, "-m", moto.server.__name__, "-H", "127.0.0.1", "-p0"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        self.lines: list[str] = []
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"Running on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.url = f"http://127.0.0.1:{m.group(1)}"
                break
        else:
            raise AssertionError(f"moto_server did not start: {''.join(self.lines)[-500:]}")
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def client(self, **kw):
        return boto3.session.Session().client("s3", endpoint_url=self.url, region_name="us-east-1",
                            **({"aws_access_key_id": "test", "aws_secret_access_key": "test"} | kw))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._drain.join()

    def stop(self) -> list[str]:
        """Stop the server; its whole request log (method, path)."""
        if self.proc.poll() is None:
            self.kill()
        return _requests(self.lines)


def _requests(lines) -> list[tuple[str, str]]:
    """(method, path) of each request line of a werkzeug log (ANSI colours of non-200 codes removed)."""
    found = (re.search(r'"([A-Z]+) (\S+) HTTP', re.sub(r"\x1b\[[0-9;]*m", "", x)) for x in lines)
    return [(m.group(1), m.group(2)) for m in found if m]


def _use(monkeypatch, server: Moto, tmp_path: Path) -> None:
    """Point botocore at ``server`` through the standard AWS variables only (no profile, one attempt)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def s3(tmp_path, monkeypatch):
    server = Moto(tmp_path)
    server.client().create_bucket(Bucket="clips")
    _use(monkeypatch, server, tmp_path)
    yield server
    server.stop()


def _jobs(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}) + "\n"
                            for i in range(n)))
    return path


def _keys(client, prefix="run1/") -> dict[str, bytes]:
    objs = client.list_objects_v2(Bucket="clips", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket="clips", Key=o["Key"])["Body"].read() for o in objs}


def _uploads(log, name: str, token: str = "") -> int:
    """PUTs of a clip's bytes (to its temporary keys) in the server's log; ``token``: of one run."""
    return sum(m == "PUT" and f"/clips/.{name}.tmp-{token}" in p for m, p in log)


def test_objects_sha256_and_one_upload_per_file(tiny_runner, s3, tmp_path):
    """Every object under the prefix is the clip, record, manifest or summary (no temporary key, no
    lock left); the sha256 of each clip object as the server returns it equals its record's, the
    manifest's and its own metadata; the npy is the clip generate() makes; each file went up once,
    under a temporary key the server then deleted."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _jobs(tmp_path / "jobs.jsonl", 2)
    s = run_batch(tiny_runner, jobs, "s3://clips/run1", BatchConfig(formats=("npy", "mp4")))
    assert s.ok and s.data["out"] == "s3://clips/run1" and s.data["generated"] == 2
    client = s3.client()
    objs = _keys(client)
    assert sorted(objs) == sorted(["manifest.json", "summary.json", "summary.md"] +
                                  [f"clips/c{i}.{x}" for i in range(2) for x in ("json", "npy", "mp4")])
    files = json.loads(objs["manifest.json"])["files"]
    for i in range(2):
        rec = json.loads(objs[f"clips/c{i}.json"])
        assert rec["status"] == "done"
        for fmt in ("npy", "mp4"):
            name = f"clips/c{i}.{fmt}"
            sha = hashlib.sha256(objs[name]).hexdigest()
            assert rec["outputs"][fmt] == {"path": name, "sha256": sha, "bytes": len(objs[name])}
            assert files[name]["sha256"] == sha
            assert client.head_object(Bucket="clips", Key=f"run1/{name}")["Metadata"]["sha256"] == sha
        want = rt.generate(tiny_runner, [f"clip {i}"], seed=i, guidance=1.0)[0].frames
        np.testing.assert_array_equal(np.load(io.BytesIO(objs[f"clips/c{i}.npy"])), want)
    log = s3.stop()
    for i in range(2):
        for fmt in ("npy", "mp4"):
            assert _uploads(log, f"c{i}.{fmt}") == 1
            assert sum(m == "DELETE" and f"/clips/.c{i}.{fmt}.tmp-" in p for m, p in log) == 1
            assert sum(m == "PUT" and p.endswith(f"/run1/clips/c{i}.{fmt}") for m, p in log) == 1  # the copy


@pytest.mark.parametrize("damage", ["same-size-flip", "record-points-outside"])
def test_resume_rehashes_the_objects_in_the_bucket(tiny_runner, s3, tmp_path, damage):
    """A rerun reads each record from the bucket and re-hashes its objects there: a clip object changed
    in place (same size), or whose record names an intact copy outside the prefix, is made and
    uploaded again; the intact one is not uploaded again."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch
    from trt_sora.serve.objstore import S3Out

    jobs, cfg, client = _jobs(tmp_path / "jobs.jsonl", 2), BatchConfig(formats=("npy",)), s3.client()
    assert run_batch(tiny_runner, jobs, "s3://clips/run1", cfg).ok
    data = client.get_object(Bucket="clips", Key="run1/clips/c0.npy")["Body"].read()
    if damage == "same-size-flip":
        client.put_object(Bucket="clips", Key="run1/clips/c0.npy", Body=data[:-1] + bytes([data[-1] ^ 1]))
    else:  # the object copied out of the prefix, the record edited to follow it: same bytes, size and sha256
        # (S3 keeps 'run1/../elsewhere/c0.npy' as a literal key; tools that map keys to paths resolve it
        # to elsewhere/c0.npy: an intact copy sits at both)
        for key in ("elsewhere/c0.npy", "run1/../elsewhere/c0.npy"):
            client.put_object(Bucket="clips", Key=key, Body=data)
        client.delete_object(Bucket="clips", Key="run1/clips/c0.npy")
        rec = json.loads(client.get_object(Bucket="clips", Key="run1/clips/c0.json")["Body"].read())
        rec["outputs"]["npy"]["path"] = "../elsewhere/c0.npy"
        client.put_object(Bucket="clips", Key="run1/clips/c0.json", Body=json.dumps(rec).encode())
    out = S3Out("s3://clips/run1")
    s = run_batch(tiny_runner, jobs, out, cfg)
    assert s.ok and (s.data["skipped"], s.data["generated"]) == (1, 1)
    objs = _keys(client)
    want = rt.generate(tiny_runner, ["clip 0"], seed=0, guidance=1.0)[0].frames
    np.testing.assert_array_equal(np.load(io.BytesIO(objs["clips/c0.npy"])), want)
    rec = json.loads(objs["clips/c0.json"])
    assert rec["outputs"]["npy"]["sha256"] == hashlib.sha256(objs["clips/c0.npy"]).hexdigest()
    log = s3.stop()
    assert (_uploads(log, "c0.npy", out.token), _uploads(log, "c1.npy", out.token)) == (1, 0)
    assert _uploads(log, "c1.npy") == 1


def test_server_killed_mid_upload_then_rerun_uploads_only_unfinished(tiny_runner, tmp_path, monkeypatch):
    """The server is killed (SIGKILL) right after the second clip's bytes reached its temporary key:
    the batch stops with a StorageError, the final key of that clip never appears. The server comes
    back with what it had stored (replaying its request recording); the rerun deletes the orphaned
    temporary key, skips the finished clip without uploading it, and uploads only the other two."""
    from trt_sora.serve.batch import BatchConfig, run_batch
    from trt_sora.serve.objstore import S3Out

    recording = tmp_path / "moto-recording.jsonl"
    first = Moto(tmp_path, recording=recording)
    first.client().create_bucket(Bucket="clips")
    _use(monkeypatch, first, tmp_path)
    jobs, cfg = _jobs(tmp_path / "jobs.jsonl", 3), BatchConfig(formats=("npy",), max_batch=1)
    out = S3Out("s3://clips/run1")
    put, puts = out.fs.put_file, []

    def put_then_kill(local, key, **kw):
        put(local, key, **kw)
        puts.append(key)
        if len(puts) == 2:  # the second clip's bytes are on the server; its copy to the final key is not
            first.kill()

    out.fs.put_file = put_then_kill
    with pytest.raises(StorageError, match="lost the connection to .*rerun the same command to resume"):
        run_batch(tiny_runner, jobs, out, cfg)
    assert len(puts) == 2

    server = Moto(tmp_path, recording=recording)
    _use(monkeypatch, server, tmp_path)
    replay = urllib.request.Request(f"{server.url}/moto-api/recorder/replay-recording", method="POST")
    with urllib.request.urlopen(replay, timeout=60) as reply:  # returns once every recorded request is replayed
        assert reply.status == 200
    client = server.client()
    before = _keys(client)
    done = [k for k in before if re.fullmatch(r"clips/c\d\.json", k)]
    assert len(done) == 1 and f"clips/{done[0][6:8]}.npy" in before  # the first clip, committed
    cut = Path(puts[1]).name
    assert cut.startswith(".c") and any(k == f"clips/{cut}" for k in before)  # the orphaned temporary key
    assert f"clips/{cut.split('.')[1]}.npy" not in before  # its final key never appeared
    replayed = len(server.lines)

    rerun = S3Out("s3://clips/run1")
    s = run_batch(tiny_runner, jobs, rerun, cfg)
    assert s.ok and (s.data["skipped"], s.data["generated"], s.data["finished"]) == (1, 2, 3)
    assert sorted(_keys(client)) == sorted(["manifest.json", "summary.json", "summary.md"] +
                                           [f"clips/c{i}.{x}" for i in range(3) for x in ("json", "npy")])
    log = server.stop()
    finished = done[0][6:8]
    assert _uploads(log, f"{finished}.npy", rerun.token) == 0
    assert sorted(j for j in ("c0", "c1", "c2") if _uploads(log, f"{j}.npy", rerun.token) == 1) == \
        sorted({"c0", "c1", "c2"} - {finished})
    assert not any(m == "PUT" and p.endswith(f"/clips/{finished}.npy") for m, p in _requests(server.lines[replayed:]))


def test_errors_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A missing s3fs, a malformed URL, another scheme, a missing bucket, refused or absent credentials
    are one-line errors naming the fix, before any model loads and with nothing written; a profile
    with the right key works; a second batch on a locked prefix is refused."""
    import json as _json

    import trt_sora.cli.generate as gen_cli
    from trt_sora.cli import main
    from trt_sora.serve.objstore import S3Out

    def never(*a, **k):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(gen_cli, "load_runner", never)
    # moto checks signatures against its IAM users once its first 4 (setup) requests are done
    server = Moto(tmp_path, env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        setup = {"endpoint_url": server.url, "region_name": "us-east-1", "aws_access_key_id": "x",
                 "aws_secret_access_key": "y"}
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="batch")
        iam.put_user_policy(UserName="batch", PolicyName="s3", PolicyDocument=_json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="batch")["AccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket="clips")
        _use(monkeypatch, server, tmp_path)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        jobs = _jobs(tmp_path / "jobs.jsonl", 1)
        run = ["batch", "--run", str(tmp_path / "no-run-folder"), "--prompts", str(jobs), "--out"]

        def refused(out: str, pattern: str) -> None:
            assert main([*run, out]) == 2
            assert re.search(pattern, capsys.readouterr().err), pattern

        refused("s3://nobucket/run1", r"bucket 'nobucket' does not exist at http://127\.0\.0\.1:\d+; create it")
        refused("s3://Clips_/run1", r"'Clips_' is not a bucket name")
        refused("s3://clips/a/../b", r"'a/\.\./b' is not a plain key under the prefix")
        refused("gs://clips/run1", r"gs:// is not supported; use s3://bucket/prefix")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        refused("s3://clips/run1", r"refused the credentials .*set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        refused("s3://clips/run1", r"no AWS credentials were found")
        monkeypatch.setenv("AWS_PROFILE", "nobody")
        refused("s3://clips/run1", r"AWS profile 'nobody' is not in the AWS config or credentials files")
        creds = tmp_path / "credentials"
        creds.write_text(f"[batch]\naws_access_key_id = {key['AccessKeyId']}\n"
                         f"aws_secret_access_key = {key['SecretAccessKey']}\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
        monkeypatch.setenv("AWS_PROFILE", "batch")
        monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
        refused("s3://clips/run1", r"'s3fs' is not installed .*pip install 'trt_sora\[s3\]'")
        with pytest.raises(BackendMissingError):
            S3Out("s3://clips/run1")
        monkeypatch.delitem(sys.modules, "s3fs")
        held = S3Out("s3://clips/run1")  # the profile's key
        held.lock()
        with pytest.raises(ConfigError, match=rf"another trt-sora batch .* pid {os.getpid()}.* holds "
                           r"s3://clips/run1/\.batch\.lock"):
            S3Out("s3://clips/run1").lock()
        held.unlock()
        listed = server.client(aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
        assert listed.list_objects_v2(Bucket="clips")["KeyCount"] == 0  # nothing written, the lock removed
    finally:
        server.stop()


@pytest.mark.slow
def test_cli_kill_9_then_rerun_skips_finished_uploads(checked_run, s3, tmp_path):
    """``trt-sora batch --out s3://clips/run1`` killed with SIGKILL after its second finished clip: the
    rerun takes over the dead batch's lock, skips the finished clips (each clip object PUT exactly once
    over both runs, by the server's log) and finishes the rest."""
    n = 4
    jobs = _jobs(tmp_path / "jobs.jsonl", n)
    cmd, env = trt_sora_cli("-v", "batch", "--run", str(checked_run), "--backend", "ort", "--prompts", str(jobs),
                            "--out", "s3://clips/run1", "--formats", "npy", "--threads", "1", "--no-progress",
                            "--max-batch", "1")
    kill_batch_after_clips(cmd, env, clips=2)
    client = s3.client()
    finished = {k[6:8] for k, v in _keys(client).items() if re.fullmatch(r"clips/c\d\.json", k)}
    assert 2 <= len(finished) < n and "run1/.batch.lock" in [o["Key"] for o in client.list_objects_v2(
        Bucket="clips", Prefix="run1/").get("Contents", [])]
    res = prefork.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    assert "which is gone; taking it over" in res.stderr
    summary = json.loads(_keys(client)["summary.json"])
    assert (summary["skipped"], summary["generated"], summary["finished"]) == (len(finished), n - len(finished), n)
    log = s3.stop()
    assert all(_uploads(log, f"c{i}.npy") == 1 for i in range(n))


# -- trt-sora serve --results s3://bucket/prefix ---------------------------------------------------------


def _serving(runner, tmp_path, **kw):
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig

    metrics = ServerMetrics()
    engine = Engine(runner, ServeConfig(state_dir=str(tmp_path / "state"), results_dir="s3://clips/serve",
                                        max_wait_s=0.0, **kw), metrics=metrics)
    engine.start(block=True)
    return engine, metrics


def _npy(frames) -> bytes:
    buf = io.BytesIO()
    np.save(buf, frames)
    return buf.getvalue()


def test_serve_results_live_in_the_bucket_across_restarts_until_swept(tiny_runner, s3, tmp_path):
    """A finished job's frames are one object ``<sha256>.npy`` (the sha256 of its bytes as the server
    returns them = the job store row's = its metadata), nothing local; a second server process on the
    same store fetches it back over HTTP from the bucket (the server's log shows the GET) with the
    frames generate() makes; the retention sweep deletes the object of the job it drops."""
    import sqlite3

    from http_helpers import HANG, http_server

    import trt_sora.runtime as rt
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.server import make_app

    client = s3.client()
    engine, _ = _serving(tiny_runner, tmp_path)
    try:
        job = engine.wait(engine.submit(ClipRequest("a red kite", seed=3, guidance=1.0)).id, HANG)
    finally:
        engine.close()
    assert job.status == "done", job.error
    objs = _keys(client, "serve/")
    sha = hashlib.sha256(objs[f"{job.result_sha256}.npy"]).hexdigest()
    with sqlite3.connect(tmp_path / "state" / "jobs.sqlite") as db:
        assert db.execute("SELECT result FROM jobs WHERE id=?", (job.id,)).fetchone()[0] == sha
    assert list(objs) == [f"{sha}.npy"] and job.result_sha256 == sha
    head = client.head_object(Bucket="clips", Key=f"serve/{sha}.npy")
    assert head["Metadata"]["sha256"] == sha
    assert not list((tmp_path / "state" / "results").glob("*.npy"))  # the bucket holds it, not the disk
    want = rt.generate(tiny_runner, "a red kite", seed=3, guidance=1.0)[0].frames
    assert objs[f"{sha}.npy"] == _npy(want)

    seen = len(s3.lines)
    engine, metrics = _serving(tiny_runner, tmp_path, keep_results=1)
    try:
        with http_server(make_app(engine, metrics)) as http:
            status, raw, _ = http("GET", f"/v1/jobs/{job.id}/result?format=npy")
            assert status == 200 and raw == _npy(want)
            assert ("GET", f"/clips/serve/{sha}.npy") in _requests(s3.lines[seen:])
            status, raw, _ = http("GET", f"/v1/jobs/{job.id}/result?format=mp4")
            assert status == 200 and raw[4:8] == b"ftyp"
            newer = engine.wait(engine.submit(ClipRequest("a cat walks", seed=4, guidance=1.0)).id, HANG)
            assert newer.status == "done" and engine.sweep() == [job.id]  # keep 1: the older job goes
            assert list(_keys(client, "serve/")) == [f"{newer.result_sha256}.npy"]
            key = f"serve/{newer.result_sha256}.npy"
            client.put_object(Bucket="clips", Key=key, Body=_npy(want))  # another clip's bytes under its name
            status, raw, _ = http("GET", f"/v1/jobs/{newer.id}/result?format=npy")
            assert status == 502 and "changed outside the server" in json.loads(raw)["error"]
            client.delete_object(Bucket="clips", Key=key)
            status, raw, _ = http("GET", f"/v1/jobs/{newer.id}/result?format=npy")
            assert status == 502 and re.search(r"s3://clips/serve/\w+\.npy is gone", json.loads(raw)["error"])
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's SystemExit
@pytest.mark.parametrize("dies", ["s3", "server"])
def test_serve_upload_cut_off_leaves_no_visible_object(tiny_runner, tmp_path, monkeypatch, dies):
    """The upload of a finished clip is cut off once its bytes reached the temporary key. ``s3``: the
    S3 server is killed (SIGKILL); the job fails with a StorageError naming the lost connection, and
    the restarted S3 server (replaying its recording) holds only the temporary key. ``server``: the
    trt-sora process dies there (its worker thread ends, the row stays running); the next process on
    the store retries the job and commits it. Either way no final key appears for the cut upload, and
    the next sweep deletes the orphaned temporary key."""
    from http_helpers import HANG

    from trt_sora.runtime import ClipRequest

    recording = tmp_path / "moto-recording.jsonl"
    first = Moto(tmp_path, recording=recording)
    first.client().create_bucket(Bucket="clips")
    _use(monkeypatch, first, tmp_path)
    engine, _ = _serving(tiny_runner, tmp_path)
    put, cut = engine.remote.out.fs.put_file, []

    def put_then_die(local, key, **kw):
        put(local, key, **kw)
        cut.append(key.rsplit("/", 1)[-1])
        if dies == "s3":
            first.kill()
        else:
            raise SystemExit  # ends the worker thread here, as a killed process would stop
    engine.remote.out.fs.put_file = put_then_die
    try:
        job = engine.submit(ClipRequest("a red kite", seed=3, guidance=1.0))
        if dies == "s3":
            assert engine.wait(job.id, HANG).status == "failed"
            assert re.fullmatch(r"StorageError: uploading \w+\.npy to s3://clips/serve/\w+\.npy: lost the connection "
                                r"to http://127\.0\.0\.1:\d+ .*the job failed; submit it again.*", job.error), job.error
        else:
            for t in engine._threads:
                if t.name.startswith("trt-sora-worker"):
                    t.join(HANG)
            assert job.status == "running" and not job.done_event.is_set()
    finally:
        engine.close()
    assert len(cut) == 1 and cut[0].startswith(".") and ".npy.tmp-" in cut[0]

    if dies == "s3":
        server = Moto(tmp_path, recording=recording)
        _use(monkeypatch, server, tmp_path)
        replay = urllib.request.Request(f"{server.url}/moto-api/recorder/replay-recording", method="POST")
        with urllib.request.urlopen(replay, timeout=60) as reply:
            assert reply.status == 200
    else:
        server = first
    try:
        client = server.client()
        assert list(_keys(client, "serve/")) == [cut[0]]  # only the hidden temporary key
        engine, _ = _serving(tiny_runner, tmp_path)
        try:
            again = engine.wait(job.id, HANG)
            if dies == "s3":
                assert again.status == "failed" and again.error == job.error
                again = engine.wait(engine.submit(ClipRequest("a red kite", seed=3, guidance=1.0)).id, HANG)
            assert again.status == "done" and again.attempts == (dies == "server")
            engine.sweep()
            assert list(_keys(client, "serve/")) == [f"{again.result_sha256}.npy"]
        finally:
            engine.close()
    finally:
        server.stop()


def test_serve_results_errors_before_the_model_loads(tmp_path, s3):
    """A missing bucket or a malformed URL is refused when the engine is made (before any load), naming
    --results; --state-dir goes with an s3:// --results but not with a local one."""
    from trt_sora.serve.scheduler import Engine, ServeConfig

    def never():
        raise AssertionError("the model was loaded before --results was checked")

    with pytest.raises(StorageError, match=r"bucket 'nobucket' does not exist .*fix --results"):
        Engine(never, ServeConfig(results_dir="s3://nobucket/x"))
    with pytest.raises(ConfigError, match=r"--results 's3://Clips_/x': 'Clips_' is not a bucket name"):
        Engine(never, ServeConfig(results_dir="s3://Clips_/x"))
    with pytest.raises(ConfigError, match="give --state-dir or a local --results, not both"):
        ServeConfig(state_dir=str(tmp_path), results_dir=str(tmp_path / "r"))
    ServeConfig(state_dir=str(tmp_path), results_dir="s3://clips/x")


@pytest.mark.slow
def test_cli_serve_kill_9_mid_run_reruns_the_job_without_reuploading_finished_clips(checked_run, s3, tmp_path):
    """``trt-sora serve --state-dir S --results s3://clips/serve``: a first process finishes job A (its
    clip uploaded) and is killed; a second is killed with SIGKILL while job B is inside the model; the
    third reruns B from the store. By the S3 server's log each clip's bytes are PUT exactly once, and
    both objects hold their job's sha256."""
    from http_helpers import HANG
    from test_durable import ALICE, Server, bearer

    (tmp_path / "keys").write_text(f"alice {ALICE}\n")
    os.mkfifo(tmp_path / "fifo")
    results = ("--results", "s3://clips/serve")

    def done(server, job_id):
        for _ in range(int(HANG // 60) + 1):
            _, view = server.http.json("GET", f"/v1/jobs/{job_id}?wait=60", headers=bearer(ALICE))
            if view["status"] in ("done", "failed"):
                return view
        raise AssertionError(f"job {job_id} did not finish: {view}")

    def submit(server, prompt):
        status, view = server.http.json("POST", "/v1/jobs", {"prompt": prompt, "seed": 5, "guidance": 1.0},
                                        headers=bearer(ALICE))
        assert status == 202, view
        return view["id"]

    s = Server(checked_run, tmp_path, *results)
    a = done(s, submit(s, "a red kite"))
    assert a["status"] == "done", a
    s.proc.kill()
    assert s.exit_code() == -signal.SIGKILL
    (tmp_path / "arm").write_text("")  # the next process stops at its first transformer call
    s = Server(checked_run, tmp_path, *results)
    b_id = submit(s, "a cat walks")
    s.out.wait_for("^gate: entered")
    s.proc.kill()
    assert s.exit_code() == -signal.SIGKILL
    (tmp_path / "arm").unlink()
    s = Server(checked_run, tmp_path, *results)
    try:
        b = done(s, b_id)
    finally:
        s.proc.kill()
        s.exit_code()
    assert b["status"] == "done" and b["attempts"] == 2, b
    objs = _keys(s3.client(), "serve/")
    assert sorted(objs) == sorted(f"{v['result_sha256']}.npy" for v in (a, b))
    assert all(hashlib.sha256(data).hexdigest() == name[:-4] for name, data in objs.items())
    log = s3.stop()
    puts = [p for m, p in log if m == "PUT" and ".npy.tmp-" in p]
    assert sorted(p.split("/")[-1].split(".npy")[0].lstrip(".") for p in puts) == sorted(
        v["result_sha256"] for v in (a, b)), puts
