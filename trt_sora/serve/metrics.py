"""Prometheus metrics of the server (prometheus-client, one registry per server).

``trt_sora_http_requests_total{route, method, status}``, ``trt_sora_http_request_seconds{route}``:
every HTTP request. ``trt_sora_job_seconds`` (submit -> done), ``trt_sora_queue_wait_seconds``,
``trt_sora_transformer_call_seconds{call_batch}`` (one transformer call of the sampler),
``trt_sora_stage_seconds{stage}`` (a batch's ``encode`` / ``sample`` / ``decode`` and a fetch's
``encode_video``),
``trt_sora_batch_clips`` (clips per formed batch, a histogram) and
``trt_sora_batches_total{clips}`` (exact formed sizes), ``trt_sora_queue_depth``,
``trt_sora_running_clips``, ``trt_sora_rejected_total{reason}``, ``trt_sora_jobs_total{status}``,
``trt_sora_batch_cap``, ``trt_sora_ready``, ``trt_sora_gpu_memory_bytes{kind}`` (used / total /
warm-up peak per clip; GPU only) and ``trt_sora_host_rss_bytes``.
"""
from __future__ import annotations

import contextlib
import time

from trt_sora.errors import require

__all__ = ["ServerMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)
_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    """The server's metrics on their own :class:`prometheus_client.CollectorRegistry`."""

    def __init__(self):
        pc = require("prometheus_client", extra="serve")
        self.pc = pc
        self.registry = pc.CollectorRegistry()
        r = self.registry
        self.http_requests = pc.Counter("trt_sora_http_requests_total", "HTTP requests", ["route", "method", "status"],
                                        registry=r)
        self.http_seconds = pc.Histogram("trt_sora_http_request_seconds", "HTTP request latency", ["route"],
                                         buckets=_LATENCY, registry=r)
        self.job_seconds = pc.Histogram("trt_sora_job_seconds", "job latency, submit to done", buckets=_LATENCY,
                                        registry=r)
        self.queue_wait = pc.Histogram("trt_sora_queue_wait_seconds", "time a job waited in the queue",
                                       buckets=_LATENCY, registry=r)
        self.call_seconds = pc.Histogram("trt_sora_transformer_call_seconds", "one transformer call of the sampler",
                                         ["call_batch"], buckets=_LATENCY, registry=r)
        self.stage_seconds = pc.Histogram("trt_sora_stage_seconds", "one stage of a batch (encode, sample, "
                                          "decode) or of a fetch (encode_video)", ["stage"], buckets=_LATENCY,
                                          registry=r)
        self.batch_clips = pc.Histogram("trt_sora_batch_clips", "clips per formed batch", buckets=_SIZES, registry=r)
        self.batches = pc.Counter("trt_sora_batches_total", "formed batches by size", ["clips"], registry=r)
        self.queue_depth = pc.Gauge("trt_sora_queue_depth", "jobs waiting", registry=r)
        self.running = pc.Gauge("trt_sora_running_clips", "clips being generated", registry=r)
        self.rejected = pc.Counter("trt_sora_rejected_total", "refused submissions", ["reason"], registry=r)
        self.jobs = pc.Counter("trt_sora_jobs_total", "finished jobs", ["status"], registry=r)
        self.batch_cap = pc.Gauge("trt_sora_batch_cap", "most clips one batch may hold (buckets, memory)", registry=r)
        self.ready = pc.Gauge("trt_sora_ready", "1 after warm-up, 0 while warming up or draining", registry=r)
        self.gpu_memory = pc.Gauge("trt_sora_gpu_memory_bytes", "GPU memory (used, total, per_clip)", ["kind"],
                                   registry=r)
        self.host_rss = pc.Gauge("trt_sora_host_rss_bytes", "resident memory of the server process", registry=r)

    @contextlib.contextmanager
    def time_call(self, call_batch: int):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.call_seconds.labels(call_batch=str(call_batch)).observe(time.perf_counter() - t0)

    def sampler_hook(self):
        """A :func:`trt_sora.sampling.sample` hook timing every transformer call."""
        return lambda info: self.time_call(int(info.inputs["hidden_states"].shape[0]))

    def refresh_memory(self) -> None:
        """Update the memory gauges (GPU: ``torch.cuda.mem_get_info`` when torch sees a GPU)."""
        try:
            import psutil

            self.host_rss.set(psutil.Process().memory_info().rss)
        except ImportError:
            pass
        free_total = gpu_memory()
        if free_total is not None:
            free, total = free_total
            self.gpu_memory.labels(kind="used").set(total - free)
            self.gpu_memory.labels(kind="total").set(total)

    def exposition(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text format."""
        self.refresh_memory()
        return self.pc.generate_latest(self.registry), self.pc.CONTENT_TYPE_LATEST


def gpu_memory() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the current CUDA device, or None without torch or a GPU (torch is
    only consulted when something already imported it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)
