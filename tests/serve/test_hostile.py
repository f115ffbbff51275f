"""Hostile request bodies answered before any work: 413 past the body limit (by Content-Length or
while a chunked body streams in), 400 for invalid UTF-8, lone surrogate escapes and deep nesting;
small one-line answers that never echo the body; every refusal counted in /metrics.

The app runs in-process on 127.0.0.1 over an engine that was never started: each case must be
refused while the body is read and parsed, before the engine is asked for anything (a request
that got that far would answer 503, not ready)."""
import json
import socket
from http import client

import pytest
from http_helpers import HANG, http_server

from trt_sora.serve.metrics import ServerMetrics
from trt_sora.serve.scheduler import Engine, ServeConfig
from trt_sora.serve.server import MAX_JSON_DEPTH, make_app

LIMIT = 300_000  # above the 100k-deep body below, so that one reaches the parser


class _NoRunner:
    """Stands for the runner of an engine that is never started (no model is loaded)."""


@pytest.fixture(scope="module")
def hostile():
    metrics = ServerMetrics()
    engine = Engine(_NoRunner(), ServeConfig(), metrics=metrics)  # not started: nothing gets past parsing
    with http_server(make_app(engine, metrics, max_body_bytes=LIMIT)) as http:
        yield http, engine


@pytest.mark.parametrize("body, status, fragment", [
    (b'{"prompt": "a \xff cat"}', 400, "not UTF-8 (byte 14: invalid start byte)"),
    (b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    (b"[" * 100_000 + b"]" * 100_000, 400, f"nests deeper than {MAX_JSON_DEPTH} levels"),
    (json.dumps({"prompt": "x", "seed": [[[[[[[[[[1]]]]]]]]]]}).encode(), 400, "nests deeper"),
    (b'{"prompt": "a cat", "seed": 1', 400, "not JSON"),
    (b'{"prompt": "   "}', 400, "prompt is empty"),
])
def test_bad_bodies_are_refused_before_any_work(hostile, body, status, fragment):
    http, engine = hostile
    got, raw, _ = http("POST", "/v1/jobs", body)
    assert got == status and fragment in json.loads(raw)["error"], raw[:300]
    assert len(raw) < 600  # one line, the body not echoed
    assert engine.queue_depth == 0


def _connect(http):
    host, port = http.base.removeprefix("http://").split(":")
    return client.HTTPConnection(host, int(port), timeout=60)


def test_a_declared_size_past_the_limit_is_refused_before_the_body_is_sent(hostile):
    """20 MB announced, nothing sent: the 413 comes from the Content-Length alone."""
    http, _ = hostile
    conn = _connect(http)
    conn.putrequest("POST", "/v1/jobs")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(20_000_000))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and "the body has 20000000 bytes; the limit is 300000 bytes" in json.loads(r.read())["error"]
    conn.close()


def test_a_chunked_body_is_cut_off_at_the_limit(hostile):
    """No Content-Length: the server counts the bytes as they stream in and answers 413 past the limit."""
    http, _ = hostile
    conn = _connect(http)
    conn.request("POST", "/v1/jobs", body=(b"x" * 8192 for _ in range(64)), encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 413 and "passed 300000 bytes" in json.loads(r.read())["error"]
    conn.close()


def test_refusals_are_counted_by_route_and_code(hostile):
    http, _ = hostile
    before = http.metric("trt_sora_rejected_total", reason="body_too_large")
    assert http("POST", "/v1/generate", b"y" * (LIMIT + 1))[0] == 413
    assert http.metric("trt_sora_rejected_total", reason="body_too_large") == before + 1
    assert http.metric("trt_sora_http_requests_total", method="POST", route="/v1/generate", status="413") >= 1
    assert http.metric("trt_sora_http_requests_total", method="POST", route="/v1/jobs", status="400") >= 1


def test_output_format_and_scale_are_refused_before_the_job_is_made(hostile):
    """A valid body with ?format=avi: 400 from the query, not 503 (the engine was never asked)."""
    http, engine = hostile
    for query, fragment in (("format=avi", "format='avi'; use one of mp4"), ("scale=0", "scale=0 must be in 1..16")):
        status, raw, _ = http("POST", f"/v1/generate?{query}", {"prompt": "a cat", "seed": 1})
        assert status == 400 and fragment in json.loads(raw)["error"], raw
    assert engine.queue_depth == 0


def test_retry_after_follows_the_measured_drain_rate():
    from trt_sora.serve.scheduler import retry_after_seconds

    assert retry_after_seconds([100.0, 110.0, 120.0, 130.0], [], 5.0) == 10  # one job leaves every 10 s
    assert retry_after_seconds([100.0, 100.0, 100.5], [], 5.0) == 1  # a batch of 3, then one: 0.25 s -> 1
    assert retry_after_seconds([100.0], [4.0, 1.0], 30.0) == 26  # before a rate: a clip's time less the oldest run
    assert retry_after_seconds([], [], 2.2) == 3 and retry_after_seconds([], [50.0], 30.0) == 1
    assert retry_after_seconds([0.0, 1e6], [], 1.0) == 3600


@pytest.fixture(scope="module")
def impatient(tiny_runner):
    """A started engine on the tiny runner held at a gate, served with a 0.3 s body timeout."""
    from http_helpers import Gated

    gated, metrics = Gated(tiny_runner), ServerMetrics()
    engine = Engine(gated, ServeConfig(max_wait_s=0.0), metrics=metrics)
    engine.start(block=True)
    try:
        with http_server(make_app(engine, metrics, body_timeout_s=0.3)) as http:
            yield http, gated, engine
    finally:
        gated.release.set()
        engine.drain(HANG)  # no thread left inside the model when the interpreter exits
        engine.close()


def _partial(http, sent: bytes, declared: int) -> socket.socket:
    """A POST announcing ``declared`` bytes whose headers and first ``sent`` bytes go in one write (so
    the server has those bytes when its body timeout starts, however late this process runs next)."""
    host, port = http.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + sent)
    return sock


def test_a_stalled_body_gets_408_and_holds_nothing(impatient):
    """10 of 100 announced bytes, then silence: the body timeout answers 408; nothing is queued."""
    http, _, engine = impatient
    sock = _partial(http, b'{"prompt":', 100)
    r = client.HTTPResponse(sock)
    r.begin()
    assert r.status == 408 and "not complete 0.3 s after the headers (10 bytes came)" in json.loads(r.read())["error"]
    sock.close()
    assert engine.queue_depth == 0 and http.metric("trt_sora_rejected_total", reason="body_timeout") == 1


def test_a_client_that_hangs_up_mid_body_is_counted_not_crashed(hostile):
    """16 of 100 announced bytes, then the client closes: 499 and client_gone, on the default body timeout
    (30 s). Not on `impatient`'s 0.3 s: a server thread that waits that long for the CPU (a loaded 2-core
    machine) meets the timeout before the hang-up, and counts a 408 instead."""
    http, engine = hostile
    _partial(http, b'{"prompt": "a ca', 100).close()
    # the server sees the hang-up when its event loop next reads the socket, and counts the request
    # once its handler returns (after the refusal's count)
    assert http.wait_metric("trt_sora_http_requests_total", 1, method="POST", route="/v1/jobs", status="499") == 1
    assert http.metric("trt_sora_rejected_total", reason="client_gone") == 1
    assert engine.queue_depth == 0 and http("GET", "/healthz")[0] == 200


def test_a_client_that_leaves_while_its_clip_is_made_cancels_its_job(impatient):
    """POST /v1/generate, then the client hangs up while the job is inside the model: no one can
    be sent the clip (the client never learned the job's id), so the job is cancelled and stops at
    its next step; the request is counted as 499 and the server goes on answering."""
    http, gated, engine = impatient
    gated.arm()
    conn = _connect(http)
    conn.request("POST", "/v1/generate", body=json.dumps({"prompt": "a cat", "seed": 9}),
                 headers={"Content-Type": "application/json"})
    assert gated.entered.wait(HANG)
    conn.close()
    (job,) = [j for j in engine._jobs.values() if j.request.seed == 9]
    assert job.cancel_event.wait(HANG), "the server did not see the client leave"
    gated.release.set()
    assert engine.wait(job.id, HANG).status == "cancelled" and job.result_path is None
    assert http.json("GET", f"/v1/jobs/{job.id}")[1]["status"] == "cancelled"
    # the endpoint's answer (to no one) is counted once its handler returns
    assert http.wait_metric("trt_sora_http_requests_total", 1, method="POST", route="/v1/generate", status="499") == 1
    assert http("GET", "/healthz")[0] == 200
