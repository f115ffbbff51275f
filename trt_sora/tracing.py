"""OpenTelemetry traces, exported by OTLP (HTTP/protobuf) when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, and nothing at all otherwise.

::

    from trt_sora import tracing

    with tracing.span("stage quantize", model="wan-tiny") as s:   # a no-op without an endpoint
        ...
    tracing.record("decode", start_ns, end_ns, parent=s)          # a span timed after the fact

The standard ``OTEL_*`` variables configure the exporter (headers, timeout, service name: default
``trt-sora``). Setting an endpoint without the ``trace`` extra installed is a
:class:`~trt_sora.errors.BackendMissingError` naming the extra, raised by :func:`enabled` (the
server and the pipeline call it before any model loads).
"""
from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["enabled", "flush", "record", "span", "trace_id"]

_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_lock = threading.Lock()
_state: dict = {}


def enabled() -> bool:
    """True when an OTLP endpoint is configured (the SDK is then set up once, here)."""
    if not any(os.environ.get(k) for k in _ENV):
        return False
    with _lock:
        if "tracer" not in _state:
            _state["tracer"] = _setup()
    return True


def _setup():
    from trt_sora.errors import require

    require("opentelemetry.sdk", extra="trace", pip="pip install 'trt_sora[trace]'")
    require("opentelemetry.exporter.otlp.proto.http", extra="trace", pip="pip install 'trt_sora[trace]'")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from trt_sora import __version__

    name = os.environ.get("OTEL_SERVICE_NAME", "trt-sora")
    provider = TracerProvider(resource=Resource.create({"service.name": name, "service.version": __version__}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _state["provider"] = provider
    return provider.get_tracer("trt_sora", __version__)


def _context(parent):
    if parent is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(parent)


@contextlib.contextmanager
def span(name: str, *, parent=None, start_ns: int | None = None, **attributes):
    """A span around the block (the current one, or a child of ``parent``); yields it, or None when
    tracing is off. An exception in the block is recorded on the span and re-raised."""
    if not enabled():
        yield None
        return
    tracer = _state["tracer"]
    s = tracer.start_span(name, context=_context(parent), start_time=start_ns, attributes=_clean(attributes))
    from opentelemetry import trace

    with trace.use_span(s, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        yield s


def start(name: str, *, parent=None, start_ns: int | None = None, **attributes):
    """A span left open (end it with ``s.end(end_time=ns)``), or None when tracing is off."""
    if not enabled():
        return None
    return _state["tracer"].start_span(name, context=_context(parent), start_time=start_ns,
                                       attributes=_clean(attributes))


def record(name: str, start_ns: int, end_ns: int, *, parent=None, **attributes) -> None:
    """A finished span timed after the fact (a batch's stages, shared by every job of the batch)."""
    s = start(name, parent=parent, start_ns=start_ns, **attributes)
    if s is not None:
        s.end(end_time=end_ns)


def trace_id(s) -> str | None:
    """The span's trace id as 32 hex digits (what the server returns in ``X-Trace-Id``)."""
    if s is None:
        return None
    return format(s.get_span_context().trace_id, "032x")


def flush(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (before the process exits)."""
    provider = _state.get("provider")
    if provider is not None:
        provider.force_flush(timeout_ms)


def _clean(attributes: dict) -> dict:
    """OTel takes str/bool/int/float (and lists of them): other values become their str."""
    return {k: v if isinstance(v, (str, bool, int, float)) else str(v) for k, v in attributes.items()
            if v is not None}
