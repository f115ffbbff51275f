"""The reference HTTP server: FastAPI on uvicorn over :class:`~trt_sora.serve.scheduler.Engine`.

``trt-sora serve --run DIR [--host 127.0.0.1 --port 8000] [--state-dir S] [--api-keys-file K]``::

    POST /v1/jobs                 {"prompt": ..., "seed": 1, "steps": ..., ...}  -> 202 {"id", "status", ...}
    GET  /v1/jobs/{id}            status: queued / running / done / failed, timings, metadata
                                  (?wait=S: answer once the job is done or failed, or after S <= 60 s)
    GET  /v1/jobs/{id}/result     ?format=mp4|gif|png|npy&scale=N  -> the clip (409 until done)
    POST /v1/generate             same body, waits, returns the clip (?format=, ?timeout=); a client
                                  that disconnects first cancels the job
    GET  /v1/info                 artifact, backend, buckets, sampling defaults, batch cap, memory
    GET  /healthz                 200 while the process runs
    GET  /readyz                  200 after warm-up; 503 while warming up, after a failed start, draining
    GET  /metrics                 Prometheus text format (see trt_sora.serve.metrics)

Errors are JSON ``{"error": "one line naming the problem and the fix"}``: 400 for a bad request
(not JSON or not UTF-8, nested too deep, unknown key, bad or non-finite value, more steps than
``--max-steps``, a size no bucket takes, a query parameter of the wrong type), 401 without a valid
key, 404 unknown job (or another key's) or route, 405 wrong method, 409 result not ready, 413 body
past ``--max-body-bytes``, 429 queue full or the key's quota reached (``Retry-After`` from the
queue's measured drain rate), 503 not ready / draining, 500 a failed job, 502 a result the
``--results s3://`` bucket cannot give back (gone, changed, unreachable). Every answer is counted
in ``/metrics`` by route and code.

Jobs: with ``--state-dir`` each accepted job is committed to the store
(:class:`~trt_sora.serve.store.JobStore`) before the 202, and a restart resumes what was queued or
running (kill -9 included). Keys: with ``--api-keys-file`` every route but ``/healthz`` and
``/readyz`` (and ``/metrics`` with ``--metrics-open``) needs ``Authorization: Bearer KEY``; a
non-loopback ``--host`` without keys is refused unless ``--insecure-no-auth``.

SIGTERM (or SIGINT) drains: ``/readyz`` turns 503, new submissions get 503, accepted jobs finish
within ``--drain-timeout``; what does not fit stays in the store and the process exits 0 (see
:func:`serve`). SIGHUP reloads the keys.
"""
# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request) at runtime

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

from trt_sora import tracing
from trt_sora.errors import ConfigError, ShapeError, StorageError, require

log = logging.getLogger("trt_sora")

__all__ = ["make_app", "serve"]

MEDIA = {"mp4": "video/mp4", "gif": "image/gif", "png": "image/png", "npy": "application/octet-stream"}
MAX_POLL_WAIT_S = 60.0  # longest long-poll of GET /v1/jobs/{id}?wait=
MAX_BODY_BYTES = 64 * 1024  # default request body limit (--max-body-bytes); a data-URL image needs more
MAX_JSON_DEPTH = 8  # a request is one flat object; deeper nesting is refused before it is walked
BODY_TIMEOUT_S = 30.0  # default --body-timeout: headers to the body's last byte
MAX_CONNECTIONS = 1024  # default --max-connections (uvicorn answers 503 past it)


class BodyTooLarge(ConfigError):
    """The request body is larger than ``--max-body-bytes`` (HTTP 413)."""


class BodyTimeout(ConfigError):
    """The request body did not arrive within ``--body-timeout`` (HTTP 408): a slow or stalled client."""


class ClientGone(ConfigError):
    """The client closed the connection before its request was read (logged as 499, never sent)."""


def make_app(engine, metrics, *, max_body_bytes: int = MAX_BODY_BYTES, keys=None, metrics_open: bool = False,
             body_timeout_s: float = BODY_TIMEOUT_S):
    """The FastAPI app over ``engine`` (shared by ``trt-sora serve`` and the Ray Serve deployment).
    ``max_body_bytes``: larger request bodies get 413, read no further than the limit.
    ``body_timeout_s``: a body not complete this long after the headers gets 408 (a stalled client
    holds no connection for longer).
    ``keys``: an :class:`~trt_sora.serve.auth.ApiKeys`; every route but ``/healthz`` and ``/readyz``
    (and ``/metrics`` when ``metrics_open``) then needs ``Authorization: Bearer KEY`` (401 without),
    and a key sees only its own jobs."""
    fastapi = require("fastapi", extra="serve")

    app = fastapi.FastAPI(title="trt_sora", version="1", docs_url="/docs")
    _json_errors(app, _error)
    if keys is not None:
        open_paths = {"/healthz", "/readyz"} | ({"/metrics"} if metrics_open else set())
        _add_auth(app, keys, metrics, open_paths)
    _add_metering(app, metrics)
    if tracing.enabled():
        _add_tracing(app)
    jobs = _Jobs(engine, metrics, keys, max_body_bytes, body_timeout_s)
    _add_job_routes(app, jobs)
    _add_result_routes(app, jobs)
    _add_health_routes(app, engine, metrics)
    return app


def _error(status: int, message: str, headers: dict | None = None):
    """The server's one error form: JSON ``{"error": message}``."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _caller(request) -> str | None:
    """The key id the auth middleware found for ``request`` (None without keys)."""
    return getattr(request.state, "key_id", None)


def _add_auth(app, keys, metrics, open_paths: set[str]) -> None:
    """401 for a request to a path outside ``open_paths`` without a known key; else the key's id on
    ``request.state.key_id``."""
    @app.middleware("http")
    async def authenticate(request, call_next):
        if request.url.path in open_paths:
            return await call_next(request)
        key_id = keys.identify(request.headers.get("authorization"))
        if key_id is None:
            metrics.rejected.labels(reason="unauthorized").inc()
            had = "an unknown key" if request.headers.get("authorization") else "no key"
            return _error(401, f"{had}: send `Authorization: Bearer KEY` with a key of this server's "
                               "--api-keys-file", {"WWW-Authenticate": "Bearer"})
        request.state.key_id = key_id
        return await call_next(request)


def _add_metering(app, metrics) -> None:
    """Every answer counted by route, method and code, and timed by route."""
    @app.middleware("http")
    async def measure(request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        path = _route_of(app, request.scope)
        metrics.http_requests.labels(route=path, method=request.method, status=str(response.status_code)).inc()
        metrics.http_seconds.labels(route=path).observe(time.perf_counter() - t0)
        return response


def _add_tracing(app) -> None:
    """A span per request (the parent of a submitted job's span); its id in ``X-Trace-Id``."""
    @app.middleware("http")
    async def trace(request, call_next):
        with tracing.span(f"{request.method} {request.url.path}", **{"http.method": request.method}) as s:
            request.state.span = s
            response = await call_next(request)
            s.update_name(f"{request.method} {_route_of(app, request.scope)}")
            s.set_attribute("http.status_code", response.status_code)
            response.headers["X-Trace-Id"] = tracing.trace_id(s)
            return response


@dataclasses.dataclass(frozen=True)
class _Jobs:
    """What the job and result routes share: reading a request into a ``ClipRequest``, submitting it,
    finding a key's job, and answering with its clip."""

    engine: object
    metrics: object
    keys: object
    max_body_bytes: int
    body_timeout_s: float

    def lookup(self, request, job_id: str):
        """The job, or None when it is unknown or another key's (a key sees only its own jobs)."""
        job = self.engine.get(job_id)
        if job is None or (self.keys is not None and job.key_id != _caller(request)):
            return None
        return job

    async def read_body(self, request) -> bytes:
        """The body, refused (BodyTooLarge) as soon as it is known to pass ``max_body_bytes``: by its
        Content-Length, else while it streams in; BodyTimeout when it takes past ``body_timeout_s``,
        ClientGone when the client hangs up first."""
        import anyio
        from starlette.requests import ClientDisconnect

        max_body_bytes, body_timeout_s = self.max_body_bytes, self.body_timeout_s
        fix = (f"the limit is {max_body_bytes} bytes (`trt-sora serve --max-body-bytes`); a request is a "
               "small JSON object")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise BodyTooLarge(f"the body has {declared} bytes; {fix}")
        chunks, size = [], 0
        try:
            with anyio.fail_after(body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_bytes:
                        raise BodyTooLarge(f"the body passed {max_body_bytes} bytes; {fix}")
                    chunks.append(chunk)
        except TimeoutError:
            raise BodyTimeout(f"the body was not complete {body_timeout_s:g} s after the headers ({size} bytes "
                              "came); send the whole request at once (`trt-sora serve --body-timeout`)") from None
        except ClientDisconnect:
            raise ClientGone(f"the client closed the connection after {size} bytes of the body") from None
        return b"".join(chunks)

    async def parse(self, request):
        from trt_sora.runtime.generate import ClipRequest

        raw = await self.read_body(request)
        try:
            body = json.loads(raw.decode("utf-8") or "null")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"the body is not UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 JSON") from None
        except RecursionError:
            raise ConfigError(f"the body nests deeper than {MAX_JSON_DEPTH} levels; send one flat JSON object") \
                from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the body is not JSON ({exc.msg}); send a JSON object such as "
                              '{"prompt": "a red circle moving right", "seed": 1}') from None
        _check_json(body)
        if isinstance(body, dict) and body.get("image") is not None and not str(body["image"]).startswith("data:"):
            # a path would read files of the server's machine: images travel in the request
            raise ConfigError('request body: "image" must be the image itself as a data URL '
                              '("data:image/png;base64,..."), not a path')
        return ClipRequest.from_dict(body, where="request body")

    def refused(self, exc: ConfigError):
        reason, status = {BodyTooLarge: ("body_too_large", 413), BodyTimeout: ("body_timeout", 408),
                          ClientGone: ("client_gone", 499)}.get(type(exc), ("bad_request", 400))
        self.metrics.rejected.labels(reason=reason).inc()
        return _error(status, str(exc))

    def submit_or_error(self, request, req):
        from trt_sora.serve.scheduler import Draining, NotReady, QueueFull, QuotaExceeded

        engine, rejected, key_id = self.engine, self.metrics.rejected, _caller(request)
        try:
            job = engine.submit(req, key_id=key_id, trace_parent=getattr(request.state, "span", None))
            log.info("serve: job %s accepted%s", job.id, f" for key {key_id}" if key_id else "")
            return job, None
        except QueueFull as exc:
            rejected.labels(reason="queue_full").inc()
            return None, _error(429, str(exc), {"Retry-After": str(engine.retry_after())})
        except QuotaExceeded as exc:
            rejected.labels(reason="quota").inc()
            return None, _error(429, str(exc), {"Retry-After": str(engine.retry_after())})
        except (Draining, NotReady) as exc:
            rejected.labels(reason="draining" if isinstance(exc, Draining) else "not_ready").inc()
            return None, _error(503, str(exc), {"Retry-After": "5"})
        except (ConfigError, ShapeError) as exc:
            rejected.labels(reason="bad_request").inc()
            return None, _error(400, str(exc))

    def result_response(self, job, fmt: str, scale: int):
        from fastapi.responses import FileResponse

        bad = _bad_output(fmt, scale)
        if bad is not None:
            return bad
        if job.status == "failed":
            return _error(500, f"job {job.id} failed: {job.error}")
        if job.status != "done":
            return _error(409, f"job {job.id} is {job.status}; poll /v1/jobs/{job.id} until it is done")
        t0 = time.perf_counter()
        try:
            with tracing.span("encode_video", format=fmt, scale=scale, job_id=job.id):
                path = _encoded(job, fmt, scale, self.engine)
        except StorageError as exc:  # results in a bucket that cannot give this one back
            return _error(502, f"job {job.id}: {exc}")
        self.metrics.stage_seconds.labels(stage="encode_video").observe(time.perf_counter() - t0)
        return FileResponse(path, media_type=MEDIA[fmt], filename=f"{job.id}.{fmt}",
                            headers={"X-Trt-Sora-Seed": str(job.request.seed)})


def _bad_output(fmt: str, scale: int):
    """A 400 for a clip format or scale the result routes do not give, else None."""
    if fmt not in MEDIA:
        return _error(400, f"format={fmt!r}; use one of {', '.join(MEDIA)}")
    if scale < 1 or scale > 16:
        return _error(400, f"scale={scale} must be in 1..16")
    return None


def _add_job_routes(app, jobs: _Jobs) -> None:
    """``POST /v1/jobs`` (202 once accepted) and ``GET /v1/jobs/{id}`` (its status, long-polled)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.post("/v1/jobs", status_code=202)
    async def submit(request: Request):
        try:
            req = await jobs.parse(request)
        except ConfigError as exc:
            return jobs.refused(exc)
        job, err = jobs.submit_or_error(request, req)
        if err is not None:
            return err
        return JSONResponse({**job.view(), "links": {"status": f"/v1/jobs/{job.id}",
                                                     "result": f"/v1/jobs/{job.id}/result"}}, status_code=202)

    @app.get("/v1/jobs/{job_id}")
    async def status(request: Request, job_id: str, wait: float = 0.0):
        import anyio

        if not 0 <= wait <= MAX_POLL_WAIT_S:
            return _error(400, f"wait={wait} must be seconds in [0, {MAX_POLL_WAIT_S:g}]")
        job = jobs.lookup(request, job_id)
        if job is None:
            return _error(404, f"no job {job_id!r} (unknown, or dropped after keep_results newer jobs)")
        if wait > 0:
            await anyio.to_thread.run_sync(job.done_event.wait, wait)
        return job.view()


def _add_result_routes(app, jobs: _Jobs) -> None:
    """``GET /v1/jobs/{id}/result`` (the clip of a done job) and ``POST /v1/generate`` (submit and wait)."""
    from fastapi import Request

    @app.get("/v1/jobs/{job_id}/result")
    def result(request: Request, job_id: str, format: str = "mp4", scale: int = 1):
        job = jobs.lookup(request, job_id)
        if job is None:
            return _error(404, f"no job {job_id!r}")
        return jobs.result_response(job, format, scale)

    @app.post("/v1/generate")
    async def generate(request: Request, format: str = "mp4", scale: int = 1, timeout: float = 600.0):
        try:
            req = await jobs.parse(request)
        except ConfigError as exc:
            return jobs.refused(exc)
        if not 0 < timeout < float("inf"):
            return _error(400, f"timeout={timeout} must be a number of seconds > 0")
        bad = _bad_output(format, scale)  # before any work, not after the clip is made
        if bad is not None:
            return bad
        job, err = jobs.submit_or_error(request, req)
        if err is not None:
            return err
        if await _done_or_gone(request, job, timeout):  # nobody to send the clip to (nor its job id)
            log.info("serve: the client of job %s left; cancelling it", job.id)
            jobs.engine.cancel(job.id)
            return _error(499, f"the client closed the connection; job {job.id} was cancelled")
        return jobs.result_response(job, format, scale)


async def _done_or_gone(request, job, timeout: float) -> bool:
    """Wait until ``job`` ends or ``timeout`` seconds pass; True if the client disconnected first
    (its next ASGI message, the body being read, is ``http.disconnect``)."""
    import anyio

    gone = False
    async with anyio.create_task_group() as tasks:
        async def watch():
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        await anyio.to_thread.run_sync(job.done_event.wait, timeout, abandon_on_cancel=True)
        tasks.cancel_scope.cancel()
    return gone


def _add_health_routes(app, engine, metrics) -> None:
    """``/v1/info``, ``/healthz`` (the process runs), ``/readyz`` (warm, not draining), ``/metrics``."""
    from fastapi.responses import Response

    @app.get("/v1/info")
    def info():
        return engine.info()

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        if engine.ready and not engine.draining:
            return {"status": "ready", "backend": engine.generator.runner.backend,
                    "batch_cap": engine.memory.get("cap")}
        why = ("failed: " + engine.failed) if engine.failed else "draining" if engine.draining else "warming up"
        return _error(503, why)

    @app.get("/metrics")
    def prometheus():
        body, ctype = metrics.exposition()
        return Response(body, media_type=ctype)


def _route_of(app, scope) -> str:
    """The route template a request matched (``/v1/jobs/{job_id}``), also for one answered before
    routing (a 401 from the auth middleware); ``unmatched`` for paths no route takes."""
    route = scope.get("route")
    if route is not None:
        return route.path
    from starlette.routing import Match

    for r in app.routes:
        if r.matches(scope)[0] == Match.FULL:
            return r.path
    return "unmatched"


def _check_json(body, depth: int = 0) -> None:
    """ConfigError for nesting past :data:`MAX_JSON_DEPTH` or a string that is not valid Unicode (a lone
    surrogate escape such as ``"\\ud800"`` parses, then fails wherever the text is encoded)."""
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(f"the body nests deeper than {MAX_JSON_DEPTH} levels; send one flat JSON object")
    if isinstance(body, str):
        try:
            body.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError("the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff); send valid "
                              "Unicode text") from None
    elif isinstance(body, dict):
        for k, v in body.items():
            _check_json(k, depth + 1)
            _check_json(v, depth + 1)
    elif isinstance(body, list):
        for v in body:
            _check_json(v, depth + 1)


def _json_errors(app, error) -> None:
    """FastAPI's own refusals (a query parameter of the wrong type, an unknown route or method) in
    the server's one-line ``{"error": ...}`` form, 400 instead of 422."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request, exc):
        e = (exc.errors() or [{}])[0]
        loc = [str(x) for x in e.get("loc", ())]
        name = loc[-1] if loc else "request"
        where = f"{loc[0]} parameter " if len(loc) > 1 else ""
        return error(400, f"{where}{name}={e.get('input')!r}: {e.get('msg', 'invalid')}; "
                          f"see {request.url.path} in /docs")

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        if exc.status_code == 404:
            message = f"no route {request.url.path}; the routes are listed at /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; the routes are listed at /docs"
        else:
            message = str(exc.detail)
        return error(exc.status_code, message, getattr(exc, "headers", None))


def _encoded(job, fmt: str, scale: int, engine):
    """The job's clip as ``fmt`` (encoded once, kept beside its frames)."""
    import numpy as np

    from trt_sora.runtime.video import write_clip

    if fmt == "npy" and scale == 1:
        return engine.result_file(job)
    path = engine.results / f"{job.id}.x{scale}.{fmt}"
    if not path.is_file():
        write_clip(np.load(engine.result_file(job)), path, float(job.metadata.get("fps", 16)), scale=scale)
    return path


@dataclasses.dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout_s: float = 600.0
    drain_grace_s: float = 2.0
    log_level: str = "warning"
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    api_keys_file: str | None = None
    metrics_open: bool = False
    insecure_no_auth: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.body_timeout_s < float("inf") or not 0 <= self.drain_timeout_s < float("inf") or \
                not 0 <= self.drain_grace_s < float("inf"):
            raise ConfigError(f"--body-timeout {self.body_timeout_s} must be > 0, --drain-timeout "
                              f"{self.drain_timeout_s} and --drain-grace {self.drain_grace_s} >= 0 seconds")
        if self.max_connections < 1 or self.max_body_bytes < 1 or not 0 <= self.port < 65536:
            raise ConfigError(f"--max-connections {self.max_connections} and --max-body-bytes "
                              f"{self.max_body_bytes} must be >= 1, --port {self.port} in 0..65535")

    def keys(self):
        """The API keys (None without a keys file); ConfigError for a public address without keys."""
        from trt_sora.serve.auth import ApiKeys, is_loopback

        if self.api_keys_file:
            return ApiKeys(self.api_keys_file)
        if not is_loopback(self.host) and not self.insecure_no_auth:
            raise ConfigError(f"--host {self.host} reaches beyond this machine and no --api-keys-file is given: "
                              "anyone could submit jobs; give --api-keys-file PATH (one key a line), or "
                              "--insecure-no-auth to serve without keys on purpose")
        return None


def serve(load, config, http: HttpConfig = HttpConfig(), *, text_encoder: str | None = None,
          on_listen=None, on_ready=None, hard_exit: bool = False) -> int:
    """Run the server until a signal drains it; returns the exit code.

    ``load``: ``() -> runner`` (loading and warm-up happen after the port is open, so ``/healthz``
    answers at once and ``/readyz`` turns 200 when the engine is warm).
    ``on_listen(engine, host, port)``: called once the socket is bound (``http.port`` 0 binds a free
    port: this is where its number is known). ``on_ready(engine)``: called once the engine is warm.

    The first SIGTERM/SIGINT drains: running and queued jobs finish within ``drain_timeout_s``. If
    they do not (or a second signal comes), the workers take no more batches; with a job store
    (``config.state_dir``) the jobs left stay queued there for the next start and the exit code is
    0, without one they are lost and it is 1. ``hard_exit``: when a batch is still inside the model
    at that point, end the process with ``os._exit`` (a native call cannot be interrupted, and
    finalizing the interpreter under it aborts); the store has every job already.
    SIGHUP reloads ``--api-keys-file``.
    """
    uvicorn = require("uvicorn", extra="serve")
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine

    keys = http.keys()
    tracing.enabled()  # OTEL_EXPORTER_OTLP_ENDPOINT without the trace extra: refused before the model loads
    metrics = ServerMetrics()
    engine = Engine(load, config, metrics=metrics, text_encoder=text_encoder, on_ready=on_ready)
    app = make_app(engine, metrics, max_body_bytes=http.max_body_bytes, keys=keys, metrics_open=http.metrics_open,
                   body_timeout_s=http.body_timeout_s)
    outcome = {"code": 0}

    def stop_now(why: str) -> None:
        left = engine.stop_workers()
        if engine.store is not None:
            log.warning("serve: %s: %d queued job(s) stay in %s for the next start; %d running", why, len(left),
                        engine.store.path, engine.running)
        elif left or engine.running:
            outcome["code"] = 1
            log.error("serve: %s: %d queued and %d running job(s) are lost (no --state-dir)", why, len(left),
                      engine.running)

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first SIGTERM/SIGINT drains the engine before shutting down."""

        def handle_exit(self, sig, frame):  # noqa: ARG002 (signal handler signature)
            name = signal.Signals(sig).name
            if engine.draining:  # a second signal: stop now
                stop_now(f"second {name}")
                self.force_exit = self.should_exit = True
                return
            engine.begin_drain()  # /readyz and new submissions answer 503 from here on
            log.warning("serve: signal %s: draining (%d queued)", name, engine.queue_depth)
            threading.Thread(target=self._drain, daemon=True).start()

        def _drain(self):
            if engine.drain(http.drain_timeout_s):
                time.sleep(http.drain_grace_s)  # let clients fetch the last results
            else:
                stop_now(f"drain timed out after {http.drain_timeout_s:g} s")
            self.should_exit = True

    sock = _bind(http.host, http.port)
    host, port = sock.getsockname()[:2]
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=http.log_level,
                                           lifespan="off", timeout_graceful_shutdown=5,
                                           limit_concurrency=http.max_connections))
    if keys is not None:
        _reload_on_sighup(keys)
    if on_listen:
        on_listen(engine, host, port)
    engine.start()
    server.run(sockets=[sock])
    busy = engine.busy
    engine.close()
    tracing.flush()
    if busy and hard_exit:
        log.warning("serve: exiting while the model runs (%d clip(s), warm-up %s)", engine.running,
                    "done" if engine.ready else "unfinished")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome["code"])
    return outcome["code"]


def _reload_on_sighup(keys) -> None:
    def reload(sig, frame):  # noqa: ARG001 (signal handler signature)
        try:
            log.warning("serve: SIGHUP: %d API key(s) loaded from %s", keys.reload(), keys.path)
        except ConfigError as exc:
            log.error("serve: SIGHUP: keeping the %d key(s) in use: %s", len(keys), exc)

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, reload)


def _bind(host: str, port: int):
    """A listening TCP socket on ``host:port`` (port 0: a free one, read back by the caller)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port (0: any free "
                          "port) or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
