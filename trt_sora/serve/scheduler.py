"""The serving engine: a bounded job queue, dynamic batching, a batch cap from measured memory.

::

    engine = Engine(lambda: trt_sora.runtime.load(run), ServeConfig(max_queue=64, max_wait_s=0.05))
    engine.start()                       # loads, warms up, measures memory, then ready
    job = engine.submit(ClipRequest("a red circle moving right", seed=1))
    engine.wait(job.id); engine.get(job.id).status == "done"

Dynamic batching: a worker takes the oldest queued job and gathers the queued jobs that can share
its transformer calls (same steps, guidance, shift and size; :attr:`_Resolved.key`) until the batch
holds ``cap`` clips or the oldest job has waited ``max_wait_s``; with CFG, both branches of every
clip go into one call when a bucket allows (so a batch of ``n`` clips runs calls of ``2n``). A
backlog dispatches at once (the wait budget is measured from the oldest job's arrival).

The cap: the most clips a bucket takes per call group (halved by batched CFG), the configured
``max_batch``, and what memory allows: warm-up runs one clip and a full batch, measures the peak
memory of each (GPU: ``torch.cuda.mem_get_info`` sampled during the call; CPU: the process RSS),
and caps the batch so ``base + n * per_clip`` stays under the free memory less ``headroom``.

The queue holds at most ``max_queue`` waiting jobs; more are refused (:class:`QueueFull`, HTTP 429).
:meth:`Engine.drain` stops taking jobs (:class:`Draining`, HTTP 503) and returns when every accepted
job has finished.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from trt_sora.errors import ConfigError, TrtSoraError

log = logging.getLogger("trt_sora")

__all__ = ["Draining", "Engine", "JobState", "NotReady", "QueueFull", "ServeConfig", "memory_cap"]

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"


class QueueFull(TrtSoraError):
    """The queue holds ``max_queue`` jobs; retry later (HTTP 429)."""


class Draining(TrtSoraError):
    """The server is shutting down and takes no new jobs (HTTP 503)."""


class NotReady(TrtSoraError):
    """The server is still loading / warming up (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Serving knobs.

    Attributes:
        max_queue: waiting jobs before submissions are refused (429).
        max_wait_s: how long the oldest job may wait for compatible jobs to join its batch (0: no
            dynamic batching beyond what is already queued).
        max_batch: at most this many clips per batch (None: the buckets' and memory's cap; 1: no batching).
        workers: batches generated at once (each needs its own pooled runner: ``load(concurrency=)``).
        memory_headroom: fraction of free memory kept free when sizing the batch cap.
        memory_budget_bytes: use this instead of the measured free memory (tests, shared GPUs).
        keep_results: finished jobs kept (older ones and their files are dropped).
        results_dir: where clips are kept (default: a temp folder).
        warmup_steps: denoising steps of the warm-up generations.
        cfg: ``auto`` / ``batched`` / ``split``.
        max_steps: most denoising steps one request may ask for (more: refused with a ConfigError,
            HTTP 400), so one request cannot hold the workers for hours.
    """

    max_queue: int = 64
    max_wait_s: float = 0.05
    max_batch: int | None = None
    workers: int = 1
    memory_headroom: float = 0.1
    memory_budget_bytes: int | None = None
    keep_results: int = 1000
    results_dir: str | None = None
    warmup_steps: int = 1
    cfg: str = "auto"
    max_steps: int = 250

    def __post_init__(self) -> None:
        if min(self.max_queue, self.workers, self.keep_results, self.warmup_steps, self.max_steps) < 1:
            raise ConfigError("max_queue, workers, keep_results, warmup_steps and max_steps must be >= 1")
        if self.max_wait_s < 0 or not 0 <= self.memory_headroom < 1:
            raise ConfigError("max_wait_s must be >= 0 and memory_headroom in [0, 1)")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch={self.max_batch} must be >= 1")


@dataclasses.dataclass
class JobState:
    """A submitted job. ``result_path``: the clip's frames (``.npy``) once done."""

    id: str
    request: Any  # ClipRequest
    resolved: Any  # _Resolved
    status: str = QUEUED
    submitted: float = dataclasses.field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    metadata: dict | None = None
    result_path: Path | None = None
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def view(self) -> dict:
        """JSON-safe status."""
        d = {"id": self.id, "status": self.status, "request": dataclasses.asdict(self.request),
             "submitted": self.submitted, "started": self.started, "finished": self.finished}
        if self.finished and self.started:
            d["seconds"] = {"queued": round(self.started - self.submitted, 4),
                            "generate": round(self.finished - self.started, 4),
                            "total": round(self.finished - self.submitted, 4)}
        if self.error:
            d["error"] = self.error
        if self.metadata:
            d["metadata"] = self.metadata
        return d


def memory_cap(one: int, full: int, full_clips: int, available: int, headroom: float) -> tuple[int, int, int]:
    """``(cap, base, per_clip)`` from two warm-up peaks: ``one`` bytes for 1 clip, ``full`` for
    ``full_clips`` clips. Linear model ``base + n * per_clip`` (with one measurement, all of it per
    clip); ``cap`` = the most clips within ``available * (1 - headroom)`` (0 when not even one fits)."""
    if full_clips > 1 and full > one:
        per = (full - one) / (full_clips - 1)
        base = max(0.0, one - per)
    else:
        per, base = float(max(one, full, 1)), 0.0
    budget = available * (1 - headroom)
    cap = int(math.floor((budget - base) / per)) if budget > base else 0
    return cap, int(base), int(per)


class _PeakSampler:
    """Peak memory above the start while a block runs: GPU free memory or process RSS, sampled."""

    def __init__(self, gpu: bool, period: float = 0.002):
        self.gpu, self.period = gpu, period
        self.peak = 0
        self._stop = threading.Event()

    def _used(self) -> int:
        if self.gpu:
            from trt_sora.serve.metrics import gpu_memory

            free, total = gpu_memory()
            return total - free
        import psutil

        return psutil.Process().memory_info().rss

    def __enter__(self):
        self.start = self._used()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used() - self.start)
            self._stop.wait(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._used() - self.start)


class Engine:
    """Queue + dynamic batcher + result store over one loaded artifact.

    Args:
        load: ``() -> runner`` (called in :meth:`start`'s thread, e.g. ``lambda: rt.load(run)``), or
            a loaded runner.
        config: :class:`ServeConfig`.
        metrics: a :class:`~trt_sora.serve.metrics.ServerMetrics` (optional).
        text_encoder: override the recorded text encoder.
        clock: ``() -> seconds`` for job times and the batching wait budget (default ``time.time``).
            A test clock that jumps calls :meth:`wake` after each jump, so the batcher re-reads it.
        on_ready: called with the engine once it is warm and taking jobs (e.g. the CLI's "ready" line).
    """

    def __init__(self, load, config: ServeConfig = ServeConfig(), *, metrics=None, text_encoder: str | None = None,
                 clock=time.time, on_ready=None):
        self._load = load if callable(load) and not hasattr(load, "infer") else (lambda: load)
        self._clock = clock
        self._on_ready = on_ready
        self.config = config
        self.metrics = metrics
        self.text_encoder = text_encoder
        self.generator = None
        self.ready = False
        self.draining = False
        self.failed: str | None = None
        self.memory: dict = {}
        self.warmup_seconds: float | None = None
        self._jobs: collections.OrderedDict[str, JobState] = collections.OrderedDict()
        self._queue: list[JobState] = []
        self._running = 0
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._tmp = None
        if config.results_dir:
            self.results = Path(config.results_dir)
        else:
            import tempfile

            self._tmp = tempfile.TemporaryDirectory(prefix="trt_sora_serve_")
            self.results = Path(self._tmp.name)
        self.results.mkdir(parents=True, exist_ok=True)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, *, block: bool = False) -> None:
        """Load, warm up and start the workers (in a thread unless ``block``)."""
        if block:
            self._start()
            return
        t = threading.Thread(target=self._start, name="trt-sora-warmup", daemon=True)
        t.start()
        self._threads.append(t)

    def _start(self) -> None:
        try:
            from trt_sora.runtime.generate import generator_for

            runner = self._load()
            self.generator = generator_for(runner, text_encoder=self.text_encoder)
            self._warm_up()
        except Exception as exc:  # the server reports it on /readyz and keeps answering /healthz
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("serve: start-up failed: %s", self.failed)
            return
        for i in range(self.config.workers):
            t = threading.Thread(target=self._work, name=f"trt-sora-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        self.ready = True
        if self.metrics:
            self.metrics.ready.set(1)
            self.metrics.batch_cap.set(self.cap_for(self.generator.resolve(_probe_request(self.generator))))
        log.info("serve: ready (%s backend, batch cap %s, warm-up %.1f s)", self.generator.runner.backend,
                 self.memory.get("cap"), self.warmup_seconds or 0)
        if self._on_ready is not None:
            self._on_ready(self)

    def _warm_up(self) -> None:
        """One clip, then a full batch, at the default size and ``warmup_steps`` steps; measures the
        peak memory of both and sets the memory cap."""
        from trt_sora.runtime.generate import ClipRequest

        t0 = time.perf_counter()
        gen = self.generator
        image = gen.warmup_image  # an image-to-video model warms up on a grey image
        r = gen.resolve(ClipRequest("warm-up", steps=self.config.warmup_steps, image=image))
        bucket_cap = gen.max_clips(r, self.config.cfg)
        gpu = _on_gpu(gen.runner)
        peaks = {}
        for n in sorted({1, bucket_cap}):
            reqs = [ClipRequest("warm-up", seed=i, steps=self.config.warmup_steps, image=image) for i in range(n)]
            gen.run(reqs, cfg=self.config.cfg, max_batch=n)  # first call: allocations, kernels, caches
            with _PeakSampler(gpu) as s:
                gen.run(reqs, cfg=self.config.cfg, max_batch=n)
            peaks[n] = s.peak
        if self.config.memory_budget_bytes is not None:
            available, source = int(self.config.memory_budget_bytes), "memory_budget_bytes"
        elif gpu:
            from trt_sora.serve.metrics import gpu_memory

            available, source = gpu_memory()[0], "free GPU memory after warm-up"
        else:
            import psutil

            available, source = int(psutil.virtual_memory().available), "available host memory after warm-up"
        cap, base, per = memory_cap(peaks[1], peaks[bucket_cap], bucket_cap, available, self.config.memory_headroom)
        if cap < 1:
            raise TrtSoraError(f"not even one clip fits: {source} is {available / 2**20:.0f} MiB, one clip at "
                               f"{r.size} needs about {(base + per) / 2**20:.0f} MiB (headroom "
                               f"{self.config.memory_headroom:.0%}); free memory or lower the resolution")
        self.memory = {"device": "gpu" if gpu else "host", "available_bytes": available, "available_source": source,
                       "peak_bytes": {str(k): v for k, v in peaks.items()}, "base_bytes": base, "per_clip_bytes": per,
                       "headroom": self.config.memory_headroom, "memory_cap": cap, "bucket_cap": bucket_cap,
                       "at_size": list(r.size), "cap": min(cap, bucket_cap, self.config.max_batch or bucket_cap)}
        if self.metrics and gpu:
            self.metrics.gpu_memory.labels(kind="per_clip").set(per)
        self.warmup_seconds = time.perf_counter() - t0

    def cap_for(self, resolved) -> int:
        """Most clips one batch of ``resolved``'s kind may hold: buckets, ``max_batch``, memory (the
        measured per-clip bytes scaled by the latent volume relative to the warm-up size)."""
        cap = self.generator.max_clips(resolved, self.config.cfg)
        if self.config.max_batch:
            cap = min(cap, self.config.max_batch)
        m = self.memory
        if m:
            warm = self.generator.resolve(_probe_request(self.generator)).point
            ratio = np.prod([resolved.point[k] for k in ("latent_frames", "latent_height", "latent_width")]) / \
                np.prod([warm[k] for k in ("latent_frames", "latent_height", "latent_width")])
            budget = m["available_bytes"] * (1 - m["headroom"]) - m["base_bytes"]
            per = max(1.0, m["per_clip_bytes"] * ratio)
            cap = min(cap, max(1, int(budget // per)))
        return max(1, cap)

    def begin_drain(self) -> None:
        """Refuse new jobs from now on (Draining, HTTP 503); the queued and running ones go on."""
        with self._cond:
            self.draining = True
            if self.metrics:
                self.metrics.ready.set(0)
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Refuse new jobs and wait until every accepted job finished; False on timeout."""
        self.begin_drain()
        with self._cond:
            end = None if timeout is None else time.monotonic() + timeout
            while self._queue or self._running:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def wake(self) -> None:
        """Make the batcher re-read the clock (after a test clock moved)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._tmp is not None:
            self._tmp.cleanup()

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, request) -> JobState:
        """Queue a :class:`~trt_sora.runtime.ClipRequest`. Raises NotReady, Draining, QueueFull, and
        ConfigError / ShapeError for a request the artifact cannot make (checked now, not later)."""
        if self.failed:
            raise NotReady(f"the server failed to start: {self.failed}")
        if not self.ready:
            raise NotReady("still warming up; retry when /readyz answers 200")
        resolved = self.generator.resolve(request)
        if resolved.settings.num_steps > self.config.max_steps:
            raise ConfigError(f"steps={resolved.settings.num_steps} is more than this server takes "
                              f"({self.config.max_steps}, `trt-sora serve --max-steps`); ask for fewer")
        self.generator.max_clips(resolved, self.config.cfg)  # a size no bucket takes: refused here
        with self._cond:
            if self.draining:
                raise Draining("the server is draining (shutting down) and takes no new jobs; retry on another "
                               "replica")
            if len(self._queue) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({len(self._queue)} jobs waiting); retry later")
            job = JobState(id=uuid.uuid4().hex[:16], request=request, resolved=resolved, submitted=self._clock())
            self._jobs[job.id] = job
            self._queue.append(job)
            self._gauges()
            self._cond.notify_all()
        self._evict()
        return job

    def get(self, job_id: str) -> JobState | None:
        return self._jobs.get(job_id)

    def wait(self, job_id: str, timeout: float | None = None) -> JobState | None:
        job = self._jobs.get(job_id)
        if job is not None:
            job.done_event.wait(timeout)
        return job

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one batch's time."""
        done = [j for j in self._jobs.values() if j.finished and j.started]
        per = np.mean([j.finished - j.started for j in done[-16:]]) if done else 1.0
        return max(1, int(math.ceil(per)))

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.running.set(self._running)

    def _evict(self) -> None:
        with self._cond:
            done = [j for j in self._jobs.values() if j.status in (DONE, FAILED)]
            for j in done[: max(0, len(self._jobs) - self.config.keep_results)]:
                self._jobs.pop(j.id, None)
                for p in self.results.glob(f"{j.id}.*"):
                    p.unlink(missing_ok=True)

    # -- the batcher ------------------------------------------------------------------------------
    def _next_batch(self) -> list[JobState] | None:
        with self._cond:
            while not self._stop:
                if self._queue:
                    first = self._queue[0]
                    cap = self.cap_for(first.resolved)
                    same = [j for j in self._queue if j.resolved.key == first.resolved.key]
                    wait = first.submitted + self.config.max_wait_s - self._clock()
                    if len(same) >= cap or wait <= 0 or self.draining:
                        batch = same[:cap]
                        now = self._clock()
                        for j in batch:
                            self._queue.remove(j)
                            j.status, j.started = RUNNING, now
                        self._running += len(batch)
                        self._gauges()
                        return batch
                    self._cond.wait(wait)
                else:
                    self._cond.wait(1.0)
        return None

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _run(self, batch: list[JobState], retried: bool = False) -> None:
        from trt_sora.serve.batch import _is_oom, is_transient

        hook = self.metrics.sampler_hook() if self.metrics else None
        try:
            clips = self.generator.run([j.request for j in batch], cfg=self.config.cfg, max_batch=len(batch),
                                       hook=hook)
        except Exception as exc:
            if len(batch) > 1 and (not is_transient(exc) or _is_oom(exc)):
                half = len(batch) // 2  # find the job at fault / fit in memory: smaller batches
                self._run(batch[:half], retried)
                self._run(batch[half:], retried)
                return
            if is_transient(exc) and not retried:
                self._run(batch, True)
                return
            self._finish(batch, error=f"{type(exc).__name__}: {exc}")
            return
        if self.metrics:
            self.metrics.batch_clips.observe(len(batch))
            self.metrics.batches.labels(clips=str(len(batch))).inc()
        for job, clip in zip(batch, clips):
            path = self.results / f"{job.id}.npy"
            tmp = path.with_name(f".{job.id}.tmp{os.getpid()}.npy")
            np.save(tmp, clip.frames)
            os.replace(tmp, path)
            job.result_path = path
            job.metadata = clip.metadata
        self._finish(batch)

    def _finish(self, batch: list[JobState], error: str | None = None) -> None:
        now = self._clock()
        with self._cond:
            for j in batch:
                j.status, j.finished, j.error = (FAILED if error else DONE), now, error
                if self.metrics:
                    self.metrics.jobs.labels(status=j.status).inc()
                    self.metrics.job_seconds.observe(now - j.submitted)
                    self.metrics.queue_wait.observe((j.started or now) - j.submitted)
                j.done_event.set()
            self._running -= len(batch)
            self._gauges()
            self._cond.notify_all()

    def info(self) -> dict:
        """What the server serves (for ``/v1/info``)."""
        g = self.generator
        d: dict[str, Any] = {"ready": self.ready, "draining": self.draining, "failed": self.failed,
                             "config": dataclasses.asdict(self.config), "queue_depth": len(self._queue)}
        if g is not None:
            f, h, w = g.default_size
            d.update({"run": str(g.run_dir), "backend": g.runner.backend, "model": g.adapter.spec.ref,
                      "sampling": g.settings.to_dict(), "text_encoder": g.text_encoder_source,
                      "default_size": {"num_frames": f, "height": h, "width": w}, "fps": g.adapter.fps,
                      "buckets": [b.to_yaml() for b in g.runner.buckets], "memory": self.memory,
                      "warmup_seconds": self.warmup_seconds, "checked": g.checked})
        return d


def _probe_request(generator):
    from trt_sora.runtime.generate import ClipRequest

    return ClipRequest("probe", image=generator.warmup_image)


def _on_gpu(runner) -> bool:
    """True when the runner computes on a CUDA device (so GPU memory is what caps the batch)."""
    from trt_sora.serve.metrics import gpu_memory

    return runner.backend in ("trt", "torch-fp8") or (runner.backend == "torch" and gpu_memory() is not None
                                                     and "cuda" in str(getattr(runner, "device", "cuda")))

