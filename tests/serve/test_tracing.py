"""OpenTelemetry traces exported by OTLP/HTTP to a receiver on 127.0.0.1 that decodes what arrives
with the OTLP protobuf schema: one request's spans (the request, the job, queue wait, text encode,
every denoising call, decode, the MP4 encode of a fetch) with their parents, times that nest, the
trace id in X-Trace-Id and the job record; the stages of `trt-sora engine`; and nothing at all
without an endpoint."""
import http.server
import json
import threading

import pytest
from http_helpers import HANG, http_server


class Receiver:
    """An OTLP/HTTP trace receiver: spans by trace id, :meth:`wait_for` blocks until a span arrives."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                msg = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                got = [{"name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                        "attrs": {a.key: a.value for a in s.attributes}}
                       for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans]
                with receiver.cond:
                    receiver.spans += got
                    receiver.cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_for(self, name: str, trace: str | None = None, start: int = 0) -> dict:
        """The first span named ``name`` (of ``trace``) among those received from index ``start`` on."""
        with self.cond:
            while True:
                for s in self.spans[start:]:
                    if s["name"] == name and trace in (None, s["trace"]):
                        return s
                assert self.cond.wait(HANG), f"no span {name!r}; got {[s['name'] for s in self.spans]}"


@pytest.fixture(scope="module")
def receiver():
    pytest.importorskip("opentelemetry.sdk")
    from trt_sora import tracing

    r = Receiver()
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracing._state.clear()
    yield r
    tracing.flush()
    tracing._state.get("provider") and tracing._state["provider"].shutdown()
    tracing._state.clear()
    mp.undo()
    r.server.shutdown()


def test_one_request_is_one_trace_from_submit_to_fetch(receiver, tiny_runner):
    from trt_sora import tracing
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig
    from trt_sora.serve.server import make_app

    metrics = ServerMetrics()
    engine = Engine(tiny_runner, ServeConfig(max_wait_s=0.0), metrics=metrics)
    engine.start(block=True)
    try:
        with http_server(make_app(engine, metrics)) as http:
            status, raw, headers = http("POST", "/v1/jobs", {"prompt": "a red kite", "seed": 3})
            job = json.loads(raw)
            assert status == 202 and len(headers["X-Trace-Id"]) == 32 and job["trace_id"] == headers["X-Trace-Id"]
            done = http.wait_done(job["id"])
            assert done["trace_id"] == job["trace_id"]
            status, _, fetch = http("GET", f"/v1/jobs/{job['id']}/result?format=mp4")
            assert status == 200
    finally:
        engine.drain(HANG)
        engine.close()
    tracing.flush()
    trace = job["trace_id"]
    spans = {n: receiver.wait_for(n, trace) for n in ("POST /v1/jobs", "job", "queue_wait", "text_encode", "denoise",
                                                       "decode")}
    steps = sorted((s for s in receiver.spans if s["trace"] == trace and s["name"].startswith("step ")),
                   key=lambda s: s["start"])
    assert [s["name"] for s in steps] == [f"step {i}" for i in range(4)]  # 4 steps, CFG pairs in one call
    post = spans["POST /v1/jobs"]
    assert post["parent"] == "" and post["attrs"]["http.status_code"].int_value == 202
    assert spans["job"]["parent"] == spans["POST /v1/jobs"]["id"]
    for n in ("queue_wait", "text_encode", "denoise", "decode"):
        assert spans[n]["parent"] == spans["job"]["id"], n
    d = spans["denoise"]
    assert all(s["parent"] == d["id"] and d["start"] <= s["start"] < s["end"] <= d["end"] for s in steps)
    order = [spans[n] for n in ("queue_wait", "text_encode", "denoise", "decode")]
    gaps = [b["start"] - a["end"] for a, b in zip(order, order[1:])]
    assert all(g >= -1000 for g in gaps), (gaps, [(s["name"], s["start"], s["end"]) for s in order])
    assert spans["job"]["start"] <= order[0]["start"] and order[-1]["end"] <= spans["job"]["end"]
    encode = receiver.wait_for("encode_video", fetch["X-Trace-Id"])
    assert encode["attrs"]["format"].string_value == "mp4"
    assert receiver.wait_for("GET /v1/jobs/{job_id}/result", fetch["X-Trace-Id"])["id"] == encode["parent"]


def test_engine_stages_are_spans_of_one_trace(receiver, pair_run):
    from trt_sora import tracing

    pipe, _ = pair_run
    tracing.flush()
    mark = len(receiver.spans)  # spans of the fixture's own build (if it ran here) came before
    outcomes = pipe.run()  # every stage reused: cheap, and still traced
    tracing.flush()
    root = receiver.wait_for("trt-sora engine", start=mark)
    stages = [receiver.wait_for(f"stage {o.stage}", root["trace"]) for o in outcomes]
    assert [s["attrs"]["status"].string_value for s in stages] == [o.status for o in outcomes]
    assert all(s["parent"] == root["id"] and root["start"] <= s["start"] <= s["end"] <= root["end"] for s in stages)


def test_without_an_endpoint_nothing_is_traced(tiny_runner, monkeypatch):
    from trt_sora import tracing
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine
    from trt_sora.serve.server import make_app

    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    assert not tracing.enabled()
    with tracing.span("nothing") as s:
        assert s is None
    metrics = ServerMetrics()
    with http_server(make_app(Engine(tiny_runner, metrics=metrics), metrics)) as http:
        assert "X-Trace-Id" not in http("GET", "/healthz")[2]


def test_an_endpoint_without_the_sdk_is_a_typed_error(monkeypatch):
    import sys

    from trt_sora import tracing
    from trt_sora.errors import BackendMissingError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    monkeypatch.setattr(tracing, "_state", {})
    with pytest.raises(BackendMissingError, match=r"trt_sora\[trace\]"):
        tracing.enabled()
