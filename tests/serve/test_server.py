"""trt-sora serve over real HTTP on 127.0.0.1: health/readiness, 4xx messages, concurrent clients
batched (formed batch sizes read from /metrics), outputs bit-identical to generate(), 429 under
overload, drain on SIGTERM. Plus the batcher and the memory cap in-process.

Nothing here waits on the clock: the server binds port 0 and prints the port it got, readiness and
draining are read from its output as it is written, jobs are awaited with the server's long-poll,
overload is made exact with a runner held at a gate, and the batcher runs on a test clock."""
import concurrent.futures
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import prefork
import pytest
from http_helpers import HANG, Gated, Http, Lines, http_server


@pytest.fixture(scope="module")
def server(checked_run, tmp_path_factory):
    """``trt-sora serve --port 0`` in a subprocess (through gated_serve.py): a queue of 8, a 1 s wait
    budget, results in a folder; ``(proc, http, results, stderr lines, (arm, fifo, stdout lines))``,
    the last the gate: once ``arm`` exists the next transformer call prints ``gate: entered`` and
    waits until ``fifo`` is opened for writing."""
    results = tmp_path_factory.mktemp("results")
    arm, fifo = results.parent / f"{results.name}.arm", results.parent / f"{results.name}.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    proc = prefork.popen([sys.executable, str(Path(__file__).with_name("gated_serve.py")), str(arm), str(fifo),
                          "serve", "--run", str(checked_run), "--backend", "ort",
                          "--port", "0", "--threads", "1", "--max-queue", "8", "--max-wait-ms", "1000",
                          "--results", str(results), "--drain-grace", "3"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        port = int(out.wait_for(r"on http://127\.0\.0\.1:(\d+) ").group(1))
        out.wait_for(r"^ready: ort backend")
    except AssertionError as exc:
        proc.kill()
        raise AssertionError(f"{exc}\nstderr:\n{err.text()[-2000:]}") from None
    yield proc, Http(port), results, err, (arm, fifo, out)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_health_info_and_clear_4xx(server):
    _, http, _, _, _ = server
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
    """Four clients at once: the three jobs without CFG share calls (batches of at most 2, the cap), the
    CFG job runs alone with both branches in one call, and no bit of any clip depends on its batch.
    Which of the three share a batch depends on arrival order; the in-process batcher test below pins
    the formation exactly."""
    import trt_sora.runtime as rt

    _, http, _, _, _ = server
    before = {n: http.metric("trt_sora_batches_total", clips=str(n)) for n in (1, 2)}
    calls_before = http.metric("trt_sora_transformer_call_seconds_count", call_batch="2")
    jobs = [{"prompt": f"clip {i}", "seed": 100 + i, "guidance": 1.0} for i in range(3)]  # no CFG: 2 clips a call
    jobs += [{"prompt": "a red kite", "seed": 7}]  # CFG: its pair fills the call
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        posted = list(pool.map(lambda j: http.json("POST", "/v1/jobs", j), jobs))
    assert [p[0] for p in posted] == [202] * 4, posted
    views = [http.wait_done(p[1]["id"]) for p in posted]
    assert all(v["status"] == "done" for v in views)
    formed = {n: http.metric("trt_sora_batches_total", clips=str(n)) - before[n] for n in (1, 2)}
    sizes = sorted(v["metadata"]["batch"]["clips"] for v in views[:3])
    assert sizes in ([1, 2, 2], [1, 1, 1]) and formed[2] == sizes.count(2) // 2
    assert formed[1] == 1 + sizes.count(1)  # the CFG job is never batched with the others
    assert views[3]["metadata"]["batch"] == {"clips": 1, "call_batch": 2, "index": 0}
    calls = http.metric("trt_sora_transformer_call_seconds_count", call_batch="2") - calls_before
    assert calls == 4 * (1 + sizes.count(2) // 2)  # 4 steps per call group of batch 2
    for job, v in zip(jobs, views):  # dynamic batching changes no bit of any clip
        status, raw, headers = http("GET", f"/v1/jobs/{v['id']}/result?format=npy")
        assert status == 200 and headers["X-Trt-Sora-Seed"] == str(job["seed"])
        want = rt.generate(tiny_runner, job["prompt"], seed=job["seed"], guidance=job.get("guidance"))[0]
        np.testing.assert_array_equal(np.load(io.BytesIO(raw)), want.frames)
    status, raw, headers = http("GET", f"/v1/jobs/{views[0]['id']}/result?format=mp4&scale=2")
    assert status == 200 and headers["content-type"] == "video/mp4" and raw[4:8] == b"ftyp"
    assert http.metric("trt_sora_queue_depth") == 0 and http.metric("trt_sora_host_rss_bytes") > 1e7


def test_429_when_the_queue_is_full(tiny_runner):
    """In-process over real HTTP, with the runner held at a gate: one job running and three queued fill a
    queue of 3, so the fifth submission - exactly that one - gets 429 with a Retry-After; once the gate
    opens, every accepted job finishes."""
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig
    from trt_sora.serve.server import make_app

    gated, metrics = Gated(tiny_runner), ServerMetrics()
    engine = Engine(gated, ServeConfig(max_queue=3, max_wait_s=0.0), metrics=metrics)
    engine.start(block=True)
    try:
        with http_server(make_app(engine, metrics)) as http:
            gated.arm()
            status, first = http.json("POST", "/v1/jobs", {"prompt": "flood 0", "seed": 0})
            assert status == 202 and gated.entered.wait(HANG)  # the worker holds job 0 at the gate
            queued = [http.json("POST", "/v1/jobs", {"prompt": f"flood {i}", "seed": i}) for i in (1, 2, 3)]
            assert [q[0] for q in queued] == [202] * 3 and http.metric("trt_sora_queue_depth") == 3
            status, raw, headers = http("POST", "/v1/jobs", {"prompt": "flood 4", "seed": 4})
            assert status == 429 and "queue is full" in json.loads(raw)["error"] and int(headers["Retry-After"]) >= 1
            assert http.metric("trt_sora_rejected_total", reason="queue_full") == 1
            gated.release.set()
            ids = [first["id"]] + [q[1]["id"] for q in queued]
            assert [http.wait_done(i)["status"] for i in ids] == ["done"] * 4
    finally:
        gated.release.set()
        engine.close()


def test_a_client_that_leaves_generate_cancels_its_job_alone(tiny_runner, tmp_path):
    """Two ``POST /v1/generate`` share one batch (the batcher waits for the second); while its first
    transformer call is held, one client closes its connection: its job ends cancelled (engine and
    job store) with no result; the other gets its clip, bit for bit the same batch's without the
    cancel."""
    from http.client import HTTPConnection

    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig
    from trt_sora.serve.server import make_app

    gated, metrics = Gated(tiny_runner), ServerMetrics()
    engine = Engine(gated, ServeConfig(max_wait_s=HANG, max_batch=2, cfg="split", state_dir=str(tmp_path / "s")),
                    metrics=metrics)
    engine.start(block=True)
    body = {"leaves": json.dumps({"prompt": "leaves", "seed": 3}), "stays": json.dumps({"prompt": "stays", "seed": 4})}
    with contextlib.ExitStack() as stack:
        stack.callback(engine.close)
        http = stack.enter_context(http_server(make_app(engine, metrics)))
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(2))
        stack.callback(gated.release.set)  # first on the way out: the server and pool wait for held requests

        def post(prompt):
            conn = HTTPConnection("127.0.0.1", int(http.base.rsplit(":", 1)[1]), timeout=HANG)
            conn.request("POST", "/v1/generate?format=npy", body=body[prompt],
                         headers={"Content-Type": "application/json"})
            return conn

        def answer(conn):
            r = conn.getresponse()
            return r.status, r.read()

        runs = [pool.submit(answer, post(p)) for p in body]  # no cancel
        (status, leaves), (status_2, want) = (r.result(HANG) for r in runs)
        assert status == status_2 == 200 and len(leaves) > 0
        gated.arm()
        leaving, stays = post("leaves"), pool.submit(answer, post("stays"))
        assert gated.entered.wait(HANG)  # the batch holds in its first call
        # the engine's own record: a job is in it before the worker can take it (a wrapper around
        # submit would record it only after the worker may have started the batch)
        submitted = list(engine._jobs.values())
        job = next(j for j in submitted[2:] if j.request.prompt == "leaves")
        assert [j.status for j in submitted[2:]] == ["running"] * 2
        leaving.close()
        assert job.cancel_event.wait(HANG), "the server did not see the client leave"
        gated.release.set()
        status, got = stays.result(HANG)
        assert engine.wait(job.id, HANG).status == "cancelled" and job.result_path is None
        assert engine.store.get(job.id).status == "cancelled"
        assert status == 200 and got == want
        assert sorted((j.request.prompt, j.status) for j in submitted) == \
            [("leaves", "cancelled"), ("leaves", "done"), ("stays", "done"), ("stays", "done")]


class _HoldAt(Gated):
    """A gated runner that counts its calls and holds only call number :attr:`at` (None: none)."""

    calls, at = 0, None

    def infer(self, feeds):
        self.calls += 1
        if self.calls == self.at:
            self.entered.set()
            assert self.release.wait(HANG), "the test never released the gate"
        return self._runner.infer(feeds)


def test_a_cancelled_job_of_a_shared_batch_is_not_decoded(tiny_runner):
    """Batches of two: a job cancelled while its batch's first call is held ends cancelled with no
    result and its clip is never decoded, the other's clip bit for bit the batch's without the cancel;
    a batch whose jobs are both cancelled while its last call is held decodes nothing."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.scheduler import Engine, ServeConfig

    held = _HoldAt(tiny_runner)
    engine = Engine(held, ServeConfig(max_wait_s=HANG, max_batch=2, cfg="split"))
    engine.start(block=True)
    decoded, decode_groups = [], engine.generator._parts()[1]

    def counted(latents):  # one entry per clip whose decode begins
        decoded.append(latents)
        yield from decode_groups(latents)

    engine.generator._decode_groups = counted

    def batch(cancel=(), at=None):
        start, held.at = held.calls, None if at is None else held.calls + at
        held.entered.clear()
        held.release.clear()
        jobs = [engine.submit(ClipRequest(p, seed=s)) for p, s in (("leaves", 3), ("stays", 4))]
        if at is not None:
            assert held.entered.wait(HANG) and [j.status for j in jobs] == ["running"] * 2  # one batch, held
            assert all(engine.cancel(jobs[i].id) for i in cancel)
            held.release.set()
        return [engine.wait(j.id, HANG) for j in jobs], held.calls - start, len(decoded)

    try:
        (leaves, want), calls, clips = batch()
        assert [leaves.status, want.status] == ["done"] * 2 and clips == 2 and calls > 1
        (leaving, stays), _, clips = batch(cancel=[0], at=1)
        assert leaving.status == "cancelled" and leaving.result_path is None and stays.status == "done"
        assert clips - 2 == 1, f"{clips - 2} clips decoded: the cancelled job's clip was decoded too"
        np.testing.assert_array_equal(np.load(stays.result_path), np.load(want.result_path))
        jobs, _, clips_after = batch(cancel=[0, 1], at=calls)
        assert [j.status for j in jobs] == ["cancelled"] * 2 and all(j.result_path is None for j in jobs)
        assert clips_after == clips, f"{clips_after - clips} clips decoded for a batch with every job cancelled"
    finally:
        held.release.set()
        engine.drain(HANG)
        engine.close()


def test_a_server_of_a_text_embeddings_file_warms_up_on_its_captions(tiny_runner, tmp_path):
    """A box without text encoder weights serves a text-embeddings file: the warm-up encodes one of
    the file's captions (it holds no other prompt), the server gets ready, and a job of another caption
    is that caption's clip: the one generate() makes from the same file."""
    import torch

    from trt_sora.models.text import save_embeddings
    from trt_sora.runtime import ClipRequest, generate
    from trt_sora.runtime.generate import generator_for
    from trt_sora.serve.scheduler import Engine, ServeConfig

    adapter = generator_for(tiny_runner).adapter
    negative = adapter.spec.defaults.get("negative_prompt")  # Wan encodes its own negative prompt
    captions = ["a red circle moves up", "a blue square moves down"] + ([negative] if negative is not None else [])
    path = tmp_path / "captions.safetensors"
    save_embeddings(captions, torch.randn(len(captions), 8, adapter.text_dim, generator=torch.manual_seed(0)), path)
    engine = Engine(tiny_runner, ServeConfig(max_wait_s=0.0), text_encoder=str(path))
    engine.start(block=True)
    try:
        assert engine.failed is None and engine.ready
        job = engine.wait(engine.submit(ClipRequest(captions[1], seed=5)).id, HANG)
        assert job.status == "done", job.error
        want = generate(tiny_runner, [captions[1]], seed=5, text_encoder=str(path))[0].frames
        np.testing.assert_array_equal(np.load(job.result_path), want)
    finally:
        engine.drain(HANG)
        engine.close()


def test_a_long_prompt_is_refused_unless_the_request_accepts_a_cut(server):
    _, http, _, _, _ = server
    long = " ".join(f"w{i}" for i in range(200))
    status, err = http.json("POST", "/v1/jobs", {"prompt": long})
    assert status == 400 and "prompt has 200 tokens; hash's text_len at this size is" in err["error"]
    assert '"truncate": true' in err["error"]
    status, job = http.json("POST", "/v1/jobs", {"prompt": long, "truncate": True, "steps": 1})
    assert status == 202 and job["truncated"]["text_len"][0] == 200
    assert http.wait_done(job["id"])["metadata"]["truncated"] == job["truncated"]


def test_sigterm_drains_then_exits_0(server):
    """Last in the module: it ends the server. SIGTERM while a job is held inside the model (so the
    drain cannot end before the test has looked): /readyz and new submissions answer 503, a finished
    job's clip is still served, and once the gate opens every accepted job finishes and the process
    exits 0."""
    proc, http, results, err, (arm, fifo, out) = server
    first = http.json("POST", "/v1/jobs", {"prompt": "drain 0", "seed": 0})[1]["id"]
    assert http.wait_done(first)["status"] == "done"
    arm.write_text("")  # the next transformer call waits at the gate
    ids = [first] + [http.json("POST", "/v1/jobs", {"prompt": f"drain {i}", "seed": i})[1]["id"] for i in (1, 2)]
    out.wait_for(r"^gate: entered")
    mark = len(err.lines)
    proc.send_signal(signal.SIGTERM)
    err.wait_for(r"signal SIGTERM: draining", start=mark)  # logged once the engine refuses new jobs
    status, body = http.json("GET", "/readyz")
    assert status == 503 and body["error"] == "draining"
    status, body = http.json("POST", "/v1/jobs", {"prompt": "too late"})
    assert status == 503 and "draining" in body["error"]
    assert [http.json("GET", f"/v1/jobs/{i}")[1]["status"] for i in ids] == ["done", "running", "queued"]
    assert http("GET", f"/v1/jobs/{first}/result?format=npy")[0] == 200  # results are served while draining
    with open(fifo, "w"):  # open the gate: the held job goes on
        pass
    assert proc.wait(timeout=HANG) == 0, err.text()[-2000:]
    assert {f"{i}.npy" for i in ids} <= {p.name for p in results.iterdir()}  # every accepted job finished


class _Clock:
    """A clock that moves only when the test moves it; :attr:`worker_read` is set each time the
    engine's batcher reads it (so the test knows the batcher has looked at the queue)."""

    def __init__(self):
        self.now = 1000.0
        self.worker_read = threading.Event()

    def __call__(self):
        if threading.current_thread().name.startswith("trt-sora-worker"):
            self.worker_read.set()
        return self.now


def test_dynamic_batching_waits_for_compatible_jobs(tiny_runner):
    """In-process on a test clock: inside the wait budget a compatible job joins the first one's batch;
    once the budget is spent the first job runs alone; without a budget (max_wait_s=0) a job that
    arrives while another runs gets a batch of its own."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig

    def sizes(*jobs):
        return [engine.wait(j.id, HANG).metadata["batch"]["clips"] for j in jobs]

    def spend_budget():
        clock.now += 2.0  # the oldest job has waited its budget: it goes with what is queued
        engine.wake()

    for wait, budget_spent in ((2.0, False), (2.0, True), (0.0, None)):
        clock = _Clock()
        engine = Engine(tiny_runner, ServeConfig(max_wait_s=wait), metrics=ServerMetrics(), clock=clock)
        engine.start(block=True)
        clock.worker_read.clear()
        a = engine.submit(ClipRequest("a cat", seed=1, guidance=1.0))
        assert clock.worker_read.wait(HANG)  # the batcher has seen job a alone in the queue
        if budget_spent:
            spend_budget()
            assert sizes(a) == [1]
        elif budget_spent is None:
            assert sizes(a) == [1]  # no budget: it went at once
        b = engine.submit(ClipRequest("a dog", seed=2, guidance=1.0))
        if budget_spent:
            spend_budget()
        got = sizes(a, b)
        assert got == ([2, 2] if budget_spent is False else [1, 1]), (wait, budget_spent, got)
        assert engine.drain(HANG)
        engine.close()


def test_each_job_is_resolved_once(tiny_runner, resolves):
    """The warm-up resolves one request (its batch of clips runs that resolution); a submitted job is
    resolved when it is taken (its size, key, batch cap) and its batch runs that resolution: the
    batch of two equals generate()'s clips of the same two requests, and the metrics count it."""
    import trt_sora.runtime as rt
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig

    metrics = ServerMetrics()
    engine = Engine(tiny_runner, ServeConfig(max_wait_s=HANG, max_batch=2), metrics=metrics)
    engine.start(block=True)
    try:  # the warm-up's request, and the probe that sets the batch-cap gauge
        assert resolves == {engine.generator.warmup_prompt: 1, "probe": 1}
        resolves.clear()
        jobs = [engine.submit(ClipRequest(p, seed=s, guidance=1.0)) for p, s in (("a cat walks", 5), ("a dog runs", 6))]
        done = [engine.wait(j.id, HANG) for j in jobs]
        assert resolves == {"a cat walks": 1, "a dog runs": 1}
        assert [j.metadata["batch"]["clips"] for j in done] == [2, 2]
        assert 'trt_sora_batches_total{clips="2"} 1.0' in metrics.exposition()[0].decode()
        want = rt.generate(tiny_runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0)
        for job, clip in zip(done, want):
            np.testing.assert_array_equal(np.load(job.result_path), clip.frames)
    finally:
        engine.drain(HANG)
        engine.close()


def test_batch_cap_scales_the_per_clip_bytes_by_latent_volume(tiny_runner):
    """cap_for scales the warm-up's measured bytes per clip by the clip's latent volume over the warm-up
    clip's: at its size the budget holds 2 clips, at twice its latent height 1."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.scheduler import Engine, ServeConfig

    engine = Engine(tiny_runner, ServeConfig(max_wait_s=HANG))
    engine.start(block=True)
    try:
        gen = engine.generator
        warm = gen.resolve(ClipRequest("x", guidance=1.0))
        f, h, w = warm.size
        tall = gen.resolve(ClipRequest("x", guidance=1.0, num_frames=f, height=2 * h, width=w))
        assert tall.point["latent_height"] == 2 * warm.point["latent_height"]
        engine.memory = {**engine.memory, "available_bytes": 2000, "headroom": 0.0, "base_bytes": 0,
                         "per_clip_bytes": 1000}
        assert gen.max_clips(warm) == gen.max_clips(tall) == 2  # the buckets take 2 of each
        assert (engine.cap_for(warm), engine.cap_for(tall)) == (2, 1)
    finally:
        engine.drain(HANG)
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
