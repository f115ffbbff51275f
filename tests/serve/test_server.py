"""trt-sora serve over real HTTP on 127.0.0.1: health/readiness, 4xx messages, concurrent clients
batched (formed batch sizes read from /metrics), outputs bit-identical to generate(), 429 under
overload, drain on SIGTERM. Plus the batcher and the memory cap in-process."""
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest


class Http:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def __call__(self, method: str, path: str, body=None, timeout: float = 120):
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, method=method, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers

    def json(self, method, path, body=None):
        status, raw, _ = self(method, path, body)
        return status, json.loads(raw)

    def wait_done(self, job_id: str, timeout: float = 180) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            _, v = self.json("GET", f"/v1/jobs/{job_id}")
            if v["status"] in ("done", "failed"):
                return v
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} not done after {timeout} s")

    def metric(self, name: str, **labels) -> float:
        text = self("GET", "/metrics")[1].decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pat = re.compile(rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? ([0-9.e+-]+)$" if want else
                         rf"^{re.escape(name)} ([0-9.e+-]+)$", re.M)
        m = pat.search(text)
        return float(m.groups()[-1]) if m else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(checked_run, tmp_path_factory):
    """``trt-sora serve`` in a subprocess: queue of 3, 1 s wait budget, results in a folder."""
    port = _free_port()
    results = tmp_path_factory.mktemp("results")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trt_sora", "serve", "--run", str(checked_run), "--backend", "ort",
                             "--port", str(port), "--threads", "1", "--max-queue", "3", "--max-wait-ms", "1000",
                             "--results", str(results), "--drain-grace", "3"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    http = Http(port)
    end = time.monotonic() + 240
    while time.monotonic() < end and proc.poll() is None:
        try:
            if http("GET", "/readyz", timeout=5)[0] == 200:
                break
        except (TimeoutError, urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    yield proc, http, results
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_health_info_and_clear_4xx(server):
    _, http, _ = server
    assert http.json("GET", "/healthz") == (200, {"status": "ok"})
    status, info = http.json("GET", "/v1/info")
    assert status == 200 and info["backend"] == "ort" and info["sampling"]["num_steps"] == 4
    assert info["memory"]["bucket_cap"] == 1 and info["memory"]["per_clip_bytes"] >= 1  # CFG pairs fill batch 2
    for body, fragment in ((b"{oops", "not JSON"), ({"prompt": "x", "sed": 1}, "did you mean 'seed'"),
                           ({"seed": 1}, 'missing "prompt"'), ({"prompt": "x", "num_frames": 10}, "num_frames 10"),
                           ({"prompt": "x", "height": 4096, "width": 4096}, "no bucket"),
                           ({"prompt": "x", "steps": -1}, "steps=-1"),
                           ({"prompt": "x", "steps": 10 ** 6}, "--max-steps"),
                           (b'{"prompt": "x", "guidance": NaN}', "guidance_scale=nan must be a finite"),
                           (b'{"prompt": "x", "shift": 1e999}', "shift=inf must be a finite"),
                           ([{"prompt": "x"}], "expected a JSON object")):
        status, err = http.json("POST", "/v1/jobs", body)
        assert status == 400 and fragment in err["error"], (body, err)
    assert http.json("GET", "/v1/jobs/nope")[0] == 404
    # FastAPI's own refusals speak the same one-line {"error": ...} (400, not 422 with a "detail" list)
    status, err = http.json("GET", "/v1/jobs/nope/result?scale=big")
    assert status == 400 and err["error"].startswith("query parameter scale='big': ") and "integer" in err["error"]
    assert http.json("POST", "/v1/generate?timeout=0", {"prompt": "x"}) == (
        400, {"error": "timeout=0.0 must be a number of seconds > 0"})
    status, err = http.json("GET", "/v2/jobs")
    assert status == 404 and "no route /v2/jobs" in err["error"]
    status, err = http.json("DELETE", "/v1/jobs")
    assert status == 405 and "DELETE is not allowed on /v1/jobs" in err["error"]
    status, job = http.json("POST", "/v1/jobs", {"prompt": "a red kite", "seed": 5})
    assert status == 202 and job["status"] == "queued"
    status, err = http.json("GET", f"/v1/jobs/{job['id']}/result")
    assert status == 409 and "poll" in err["error"]
    assert http.wait_done(job["id"])["status"] == "done"
    assert http.json("GET", f"/v1/jobs/{job['id']}/result?format=avi")[0] == 400


def test_concurrent_clients_are_batched_and_match_generate(server, tiny_runner):
    import trt_sora.runtime as rt

    _, http, _ = server
    before = {n: http.metric("trt_sora_batches_total", clips=str(n)) for n in (1, 2)}
    calls_before = http.metric("trt_sora_transformer_call_seconds_count", call_batch="2")
    jobs = [{"prompt": f"clip {i}", "seed": 100 + i, "guidance": 1.0} for i in range(3)]  # no CFG: 2 clips a call
    jobs += [{"prompt": "a red kite", "seed": 7}]  # CFG: its pair fills the call
    ids = [None] * len(jobs)

    def client(i):  # four jobs, a queue of three: a client retries a 429 as its Retry-After says (well inside 1 s)
        for _ in range(100):
            status, v = http.json("POST", "/v1/jobs", jobs[i])
            if status != 429:
                break
            time.sleep(0.02)
        assert status == 202, v
        ids[i] = v["id"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    views = [http.wait_done(i) for i in ids]
    assert all(v["status"] == "done" for v in views)
    formed = {n: http.metric("trt_sora_batches_total", clips=str(n)) - before[n] for n in (1, 2)}
    assert formed == {1: 2, 2: 1}  # the three compatible jobs: a batch of 2 (the cap) and one left; the CFG job alone
    assert sorted(v["metadata"]["batch"]["clips"] for v in views[:3]) == [1, 2, 2]
    assert views[3]["metadata"]["batch"] == {"clips": 1, "call_batch": 2, "index": 0}
    assert http.metric("trt_sora_transformer_call_seconds_count", call_batch="2") - calls_before == 2 * 4
    for job, v in zip(jobs, views):  # dynamic batching changes no bit of any clip
        status, raw, headers = http("GET", f"/v1/jobs/{v['id']}/result?format=npy")
        assert status == 200 and headers["X-Trt-Sora-Seed"] == str(job["seed"])
        want = rt.generate(tiny_runner, job["prompt"], seed=job["seed"], guidance=job.get("guidance"))[0]
        np.testing.assert_array_equal(np.load(io.BytesIO(raw)), want.frames)
    status, raw, headers = http("GET", f"/v1/jobs/{views[0]['id']}/result?format=mp4&scale=2")
    assert status == 200 and headers["content-type"] == "video/mp4" and raw[4:8] == b"ftyp"
    assert http.metric("trt_sora_queue_depth") == 0 and http.metric("trt_sora_host_rss_bytes") > 1e7


def test_429_when_the_queue_is_full(server):
    _, http, _ = server
    results = []
    lock = threading.Lock()

    def client(i):
        r = http("POST", "/v1/jobs", {"prompt": f"flood {i}", "seed": i})  # CFG jobs: one clip per batch
        with lock:
            results.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    refused = [r for r in results if r[0] == 429]
    accepted = [json.loads(r[1])["id"] for r in results if r[0] == 202]
    assert len(refused) >= 4 and len(accepted) + len(refused) == 10  # a queue of 3 (+ the running ones)
    assert "queue is full" in json.loads(refused[0][1])["error"] and int(refused[0][2]["Retry-After"]) >= 1
    assert all(http.wait_done(i)["status"] == "done" for i in accepted)
    assert http.metric("trt_sora_rejected_total", reason="queue_full") >= len(refused)


def test_sigterm_drains_then_exits_0(server):
    """Last in the module: it ends the server."""
    proc, http, results = server
    ids = [http.json("POST", "/v1/jobs", {"prompt": f"drain {i}", "seed": i})[1]["id"] for i in range(3)]
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, err = http.json("GET", "/readyz")
    assert status == 503 and err["error"] == "draining"
    status, err = http.json("POST", "/v1/jobs", {"prompt": "too late"})
    assert status == 503 and "draining" in err["error"]
    assert [http.wait_done(i)["status"] for i in ids] == ["done"] * 3  # every accepted job finishes
    assert http("GET", f"/v1/jobs/{ids[-1]}/result?format=npy")[0] == 200
    assert proc.wait(timeout=60) == 0
    assert {f"{i}.npy" for i in ids} <= {p.name for p in results.iterdir()}


def test_dynamic_batching_waits_for_compatible_jobs(tiny_runner):
    """In-process: with a wait budget, a job arriving 0.2 s later joins the first one's batch;
    without one (max_wait_s=0), each runs alone."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig

    for wait, want in ((2.0, [2, 2]), (0.0, [1, 1])):
        engine = Engine(tiny_runner, ServeConfig(max_wait_s=wait), metrics=ServerMetrics())
        engine.start(block=True)
        a = engine.submit(ClipRequest("a cat", seed=1, guidance=1.0))
        time.sleep(0.2)
        b = engine.submit(ClipRequest("a dog", seed=2, guidance=1.0))
        sizes = [engine.wait(j.id, 120).metadata["batch"]["clips"] for j in (a, b)]
        assert sizes == want, (wait, sizes)
        assert engine.drain(30)
        engine.close()


def test_memory_cap_from_the_warm_up_peaks():
    from trt_sora.serve.scheduler import memory_cap

    gib = 2 ** 30
    # 1 clip peaks at 3 GiB, 4 clips at 9 GiB: base 1 GiB + 2 GiB a clip; 20 GiB free, 10 % kept
    assert memory_cap(3 * gib, 9 * gib, 4, 20 * gib, 0.1) == (8, gib, 2 * gib)
    assert memory_cap(3 * gib, 9 * gib, 4, 2 * gib, 0.0)[0] == 0  # not even one clip
    assert memory_cap(5 * gib, 5 * gib, 1, 16 * gib, 0.0)[0] == 3  # one measurement: all of it per clip


@pytest.mark.gpu
def test_gpu_memory_sets_the_batch_cap(checked_run):
    """On a GPU the warm-up measures device memory (mem_get_info sampled during the calls)."""
    import trt_sora.runtime as rt
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig

    metrics = ServerMetrics()
    engine = Engine(rt.load(checked_run, backend="torch", device="cuda"), ServeConfig(), metrics=metrics)
    engine.start(block=True)
    m = engine.memory
    assert engine.ready and m["device"] == "gpu" and m["per_clip_bytes"] > 0 and m["cap"] >= 1
    text = metrics.exposition()[0].decode()
    assert re.search(r'^trt_sora_gpu_memory_bytes\{kind="total"\} [1-9]', text, re.M)
    engine.close()
