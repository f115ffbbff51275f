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

from trt_sora import tracing
from trt_sora.errors import ConfigError, TrtSoraError

log = logging.getLogger("trt_sora")

__all__ = ["Draining", "Engine", "JobState", "NotReady", "QueueFull", "QuotaExceeded", "ServeConfig", "memory_cap",
           "retry_after_seconds"]

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


class QueueFull(TrtSoraError):
    """The queue holds ``max_queue`` jobs; retry later (HTTP 429)."""


class QuotaExceeded(TrtSoraError):
    """The calling key has its most concurrent jobs queued or running (HTTP 429)."""


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
        results_dir: where clips are kept (default: a temp folder), or ``s3://bucket/prefix``: the
            clips go up to that bucket (:class:`~trt_sora.serve.objstore.S3Results`; credentials,
            endpoint and region from the AWS variables), the local folder caching the ones fetched.
        warmup_steps: denoising steps of the warm-up generations.
        cfg: ``auto`` / ``batched`` / ``split``.
        max_steps: most denoising steps one request may ask for (more: refused with a ConfigError,
            HTTP 400), so one request cannot hold the workers for hours.
        state_dir: the durable job store's folder (:class:`~trt_sora.serve.store.JobStore`): jobs are
            committed there before they are accepted and resumed by the next start; results live in
            its ``results/`` (``results_dir`` must then be unset or an ``s3://`` URL). None: jobs
            live in memory only.
        retention_s: finished jobs older than this are dropped from the store with their clips
            (None: kept until ``keep_results`` newer ones push them out).
        sweep_interval_s: how often the store's retention sweep runs.
        max_jobs_per_key: most jobs one API key may have queued or running (None: no quota).
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
    state_dir: str | None = None
    retention_s: float | None = None
    sweep_interval_s: float = 60.0
    max_jobs_per_key: int | None = None

    def __post_init__(self) -> None:
        if min(self.max_queue, self.workers, self.keep_results, self.warmup_steps, self.max_steps) < 1:
            raise ConfigError("max_queue, workers, keep_results, warmup_steps and max_steps must be >= 1")
        if self.max_wait_s < 0 or not 0 <= self.memory_headroom < 1:
            raise ConfigError("max_wait_s must be >= 0 and memory_headroom in [0, 1)")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch={self.max_batch} must be >= 1")
        if self.state_dir and self.results_dir and not self.results_dir.startswith("s3://"):
            raise ConfigError("give --state-dir or a local --results, not both: the job store keeps its clips in "
                              "STATE_DIR/results (--results s3://bucket/prefix does go with --state-dir)")
        if self.retention_s is not None and not 0 < self.retention_s < float("inf"):
            raise ConfigError(f"retention_s={self.retention_s} must be a number of seconds > 0")
        if not 0 < self.sweep_interval_s < float("inf"):
            raise ConfigError(f"sweep_interval_s={self.sweep_interval_s} must be a number of seconds > 0")
        if self.max_jobs_per_key is not None and self.max_jobs_per_key < 1:
            raise ConfigError(f"max_jobs_per_key={self.max_jobs_per_key} must be >= 1")


@dataclasses.dataclass
class JobState:
    """A submitted job. ``result_path``: the clip's frames (``.npy``) once done."""

    id: str
    request: Any  # ClipRequest
    resolved: Any  # _Resolved (None for a job resumed from the store until the engine is warm)
    status: str = QUEUED
    submitted: float = dataclasses.field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    metadata: dict | None = None
    result_path: Path | None = None
    result_sha256: str | None = None
    key_id: str | None = None
    attempts: int = 0
    trace_id: str | None = None
    span: Any = dataclasses.field(default=None, repr=False)  # the job's open trace span (tracing on)
    on_step: Any = dataclasses.field(default=None, repr=False)  # (step, num_steps) per denoising step
    on_frames: Any = dataclasses.field(default=None, repr=False)  # (frames,) per decoded group of frames
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    cancel_event: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def view(self) -> dict:
        """JSON-safe status."""
        r = dataclasses.asdict(self.request) if dataclasses.is_dataclass(self.request) else self.request
        d = {"id": self.id, "status": self.status, "request": r,
             "submitted": self.submitted, "started": self.started, "finished": self.finished}
        if self.key_id:
            d["key_id"] = self.key_id
        if self.resolved is not None and self.resolved.truncated:
            d["truncated"] = self.resolved.truncated  # {text dim: [tokens, kept]}: the prompt was cut
        if self.attempts:
            d["attempts"] = self.attempts + 1  # runs begun, the resumed one included
        if self.result_sha256:
            d["result_sha256"] = self.result_sha256
        if self.trace_id:
            d["trace_id"] = self.trace_id
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
        self._closed = threading.Event()  # set by close(): the sweeper ends at once
        self._tmp = None
        self._finishes: collections.deque[float] = collections.deque(maxlen=32)  # finish times: the drain rate
        self._warm_clip_s: float | None = None
        self._warm_volume = 1  # the warm-up clip's latent frames x height x width (cap_for's memory scale)
        self._resumed: list[JobState] = []
        self.store = None
        self.remote = None  # S3Results: where finished clips go (config.results_dir an s3:// URL)
        remote = config.results_dir if config.results_dir and config.results_dir.startswith("s3://") else None
        if remote:
            from trt_sora.serve.objstore import S3Results

            self.remote = S3Results(remote)  # no bucket, credentials or endpoint: refused before the model loads
        if config.state_dir:
            from trt_sora.serve.store import JobStore

            self.store = JobStore(config.state_dir)
            self.results = self.store.results
            self._load_unfinished()
        elif config.results_dir and not remote:
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
        self._resume()
        for i in range(self.config.workers):
            t = threading.Thread(target=self._work, name=f"trt-sora-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self.store is not None:
            t = threading.Thread(target=self._sweeper, name="trt-sora-sweep", daemon=True)
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
        image, prompt = gen.warmup_image, gen.warmup_prompt  # image-to-video: a grey image
        r = gen.resolve(ClipRequest(prompt, steps=self.config.warmup_steps, image=image))
        bucket_cap = gen.max_clips(r, self.config.cfg)
        gpu = _on_gpu(gen.runner)
        peaks = {}
        for n in sorted({1, bucket_cap}):
            # n clips of r's resolution (a seed changes none of it): the warm-up resolves one request
            rs = [dataclasses.replace(r, request=dataclasses.replace(r.request, seed=i)) for i in range(n)]
            gen.run_resolved(rs, cfg=self.config.cfg, max_batch=n)  # first call: allocations, kernels, caches
            t1 = time.perf_counter()
            with _PeakSampler(gpu) as s:
                gen.run_resolved(rs, cfg=self.config.cfg, max_batch=n)
            peaks[n] = s.peak
            if n == 1:  # a warm clip's seconds per step: Retry-After before any job has finished
                self._warm_clip_s = (time.perf_counter() - t1) / self.config.warmup_steps
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
        self._warm_volume = _latent_volume(r)
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
            ratio = _latent_volume(resolved) / self._warm_volume
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

    def stop_workers(self) -> list[str]:
        """Take no more batches (the running ones finish); returns the ids left queued. With a store
        they stay queued there, for the next start."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            return [j.id for j in self._queue]

    @property
    def running(self) -> int:
        return self._running

    @property
    def busy(self) -> bool:
        """A thread is inside the model: a batch runs, or the warm-up has not ended."""
        warming = self._threads and self._threads[0].is_alive() and self._threads[0].name == "trt-sora-warmup"
        return bool(self._running or warming)

    def wake(self) -> None:
        """Make the batcher re-read the clock (after a test clock moved)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._closed.set()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self.store is not None and not self._running:
            self.store.close()

    # -- the store --------------------------------------------------------------------------------
    def _load_unfinished(self) -> None:
        """The store's queued and running jobs of the last process, back in memory as queued (their
        requests are resolved once the engine is warm: :meth:`_resume`)."""
        from trt_sora.runtime.generate import ClipRequest

        rows = self.store.unfinished()
        self.store.requeue([r.id for r in rows if r.status == RUNNING])
        for r in rows:
            job = JobState(id=r.id, request=None, resolved=None, submitted=r.submitted, key_id=r.key_id,
                           attempts=r.attempts + (r.status == RUNNING), trace_id=r.trace_id)
            try:
                job.request = ClipRequest.from_dict(r.request, where=f"stored job {r.id}")
            except ConfigError as exc:
                job.request = r.request
                self._fail_resumed(job, exc)
                continue
            self._jobs[job.id] = job
            self._resumed.append(job)
        if rows:
            log.warning("serve: %d job(s) from %s resume once warm (%d were running)", len(self._resumed),
                        self.store.path, sum(r.status == RUNNING for r in rows))

    def _resume(self) -> None:
        """Queue the resumed jobs (oldest first) ahead of new ones; a job this artifact can no longer
        make fails with the reason."""
        with self._cond:
            for job in self._resumed:
                try:
                    job.resolved = self.generator.resolve(job.request)
                    self.generator.max_clips(job.resolved, self.config.cfg)
                except TrtSoraError as exc:
                    self._fail_resumed(job, exc)
                    continue
                self._queue.append(job)
            self._resumed = []
            self._gauges()

    def _fail_resumed(self, job: JobState, exc: Exception) -> None:
        now = self._clock()
        job.status, job.finished, job.error = FAILED, now, f"could not be resumed: {exc}"
        self.store.finished(job.id, now, error=job.error)
        job.done_event.set()

    def _from_store(self, job_id: str) -> JobState | None:
        """A finished job of an earlier process (or one evicted from memory), from the store."""
        from trt_sora.runtime.generate import ClipRequest

        row = self.store.get(job_id)
        if row is None or row.status not in (DONE, FAILED, CANCELLED):
            return None
        try:
            request = ClipRequest.from_dict(row.request)
        except ConfigError:
            request = row.request
        job = JobState(id=row.id, request=request, resolved=None, status=row.status, submitted=row.submitted,
                       started=row.started, finished=row.finished, error=row.error, metadata=row.metadata,
                       result_path=self.store.result_path(row), result_sha256=row.result, key_id=row.key_id,
                       attempts=row.attempts, trace_id=row.trace_id)
        job.done_event.set()
        return job

    def sweep(self) -> list[str]:
        """Apply the retention (``retention_s``, ``keep_results``) to the store; returns dropped ids."""
        dropped = self.store.sweep(self._clock(), max_age_s=self.config.retention_s, keep=self.config.keep_results)
        if self.remote is not None:  # the objects no row references, and uploads cut off
            self.remote.prune(self.store.live_results())
        with self._cond:
            for i in dropped:
                self._jobs.pop(i, None)
        if dropped:
            log.info("serve: retention dropped %d finished job(s)", len(dropped))
        return dropped

    def _forget(self, name: str) -> None:
        try:
            self.remote.delete(name)
        except TrtSoraError as exc:  # left in the bucket; logged, serving goes on
            log.error("serve: %s", exc)

    def _sweeper(self) -> None:
        while not self._closed.wait(self.config.sweep_interval_s) and not self._stop:
            try:
                self.sweep()
            except Exception as exc:  # a failed sweep must not stop serving; the next one retries
                log.error("serve: retention sweep failed: %s", exc)

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, request, *, key_id: str | None = None, trace_parent=None, on_step=None,
               on_frames=None) -> JobState:
        """Queue a :class:`~trt_sora.runtime.ClipRequest` (committed to the store first, when there is
        one). ``key_id``: the caller's API key id (quota, job record). ``trace_parent``: the request's
        span; the job's span (queue wait, each stage) is its child. ``on_step(step, num_steps)``: called
        from the worker as each denoising step of the job begins (1-based; a gRPC stream's progress).
        ``on_frames(frames)``: called from the worker with each group of the clip's uint8 frames
        ``[f, H, W, 3]`` as it is decoded (a gRPC stream's MP4 fragments).
        Raises NotReady, Draining, QueueFull, QuotaExceeded, and ConfigError / ShapeError for a
        request the artifact cannot make (checked now, not later)."""
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
            self._check_quota(key_id)
            job = JobState(id=uuid.uuid4().hex[:16], request=request, resolved=resolved, submitted=self._clock(),
                           key_id=key_id, on_step=on_step, on_frames=on_frames)
            job.span = tracing.start("job", parent=trace_parent, job_id=job.id, key_id=key_id)
            job.trace_id = tracing.trace_id(job.span)
            if self.store is not None:
                self.store.add(job.id, _stored_request(request), job.submitted, key_id, job.trace_id)
            self._jobs[job.id] = job
            self._queue.append(job)
            self._gauges()
            self._cond.notify_all()
        self._evict()
        return job

    def _check_quota(self, key_id: str | None) -> None:
        limit = self.config.max_jobs_per_key
        if limit is None or key_id is None:
            return
        mine = sum(1 for j in self._jobs.values() if j.key_id == key_id and j.status in (QUEUED, RUNNING))
        if mine >= limit:
            raise QuotaExceeded(f"key {key_id} has {mine} jobs queued or running, its limit "
                                "(`trt-sora serve --max-jobs-per-key`); wait for one to finish")

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job: a queued one leaves the queue now, a running one stops at
        its next denoising step (its batch goes on when other jobs of it still want their clips, and
        its clip is not decoded, or no further); status ``cancelled``. False when the job is unknown
        or finished."""
        with self._cond:
            job = self._jobs.get(job_id)
            if job is None or job.status not in (QUEUED, RUNNING) or job.cancel_event.is_set():
                return False
            job.cancel_event.set()
            queued = job.status == QUEUED
            if queued:
                self._queue.remove(job)
                self._running += 1  # _finish counts it out
        log.info("serve: job %s cancelled%s", job_id, "" if queued else "; it stops at its next step")
        if queued:
            self._finish([job], cancelled=True)
        return True

    def get(self, job_id: str) -> JobState | None:
        job = self._jobs.get(job_id)
        if job is None and self.store is not None:
            job = self._from_store(job_id)
        return job

    def wait(self, job_id: str, timeout: float | None = None) -> JobState | None:
        job = self.get(job_id)
        if job is not None:
            job.done_event.wait(timeout)
        return job

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def queue_position(self, job_id: str) -> int | None:
        """1 for the next job to run, ...; None once the job left the queue."""
        with self._cond:
            return next((i + 1 for i, j in enumerate(self._queue) if j.id == job_id), None)

    def retry_after(self) -> int:
        """Seconds a client refused for a full queue should wait: until one queued job leaves, at the
        queue's measured drain rate (see :func:`retry_after_seconds`)."""
        with self._cond:
            now = self._clock()
            running = [now - j.started for j in self._jobs.values() if j.status == RUNNING and j.started]
            steps = self.generator.settings.num_steps if self.generator is not None else 1
            fallback = (self._warm_clip_s or 1.0) * steps
            return retry_after_seconds(list(self._finishes), running, fallback)

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.running.set(self._running)

    def _evict(self) -> None:
        """Keep at most ``keep_results`` jobs in memory; without a store their clips go too (with one,
        the retention sweep decides)."""
        with self._cond:
            done = [j for j in self._jobs.values() if j.status in (DONE, FAILED)]
            for j in done[: max(0, len(self._jobs) - self.config.keep_results)]:
                self._jobs.pop(j.id, None)
                if self.store is None:
                    for p in self.results.glob(f"{j.id}.*"):
                        p.unlink(missing_ok=True)
                    if self.remote is not None and j.result_path is not None:
                        self._forget(j.result_path.name)

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
                        if self.store is not None:
                            self.store.started([j.id for j in batch], now)
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
        from trt_sora.serve.batch import is_oom, is_transient

        calls: list = []
        hook = _hooks(_cancel_calls(batch), self.metrics.sampler_hook() if self.metrics else None,
                      _timed_calls(calls) if any(j.span is not None for j in batch) else None,
                      _step_calls(batch) if any(j.on_step is not None for j in batch) else None)
        began = time.time_ns()
        try:
            clips = self.generator.run_resolved([j.resolved for j in batch], cfg=self.config.cfg,
                                                max_batch=len(batch), hook=hook, on_frames=_frame_calls(batch),
                                                wanted=lambda i: not batch[i].cancel_event.is_set())
            ended = time.time_ns()
        except _Cancelled:
            self._finish(batch, cancelled=True)
            return
        except Exception as exc:
            for j in batch:  # frames a stream got cannot be taken back: a rerun's go to the result file only
                j.on_frames = None
            if len(batch) > 1 and (not is_transient(exc) or is_oom(exc)):
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
            seconds = clips[0].metadata.get("seconds", {}) if clips else {}
            for stage in ("encode", "sample", "decode"):
                if stage in seconds:
                    self.metrics.stage_seconds.labels(stage=stage).observe(seconds[stage])
            self.metrics.batch_clips.observe(len(batch))
            self.metrics.batches.labels(clips=str(len(batch))).inc()
        kept = []
        cancelled = [j for j in batch if j.cancel_event.is_set()]
        for job, clip in zip(batch, clips):
            if job in cancelled:
                continue
            job.metadata = clip.metadata
            _trace_stages(job, began, ended, calls)
            try:
                self._keep(job, clip.frames)
            except TrtSoraError as exc:  # the upload failed: this job fails, named; the others are kept
                log.error("serve: job %s: %s", job.id, exc)
                self._finish([job], error=f"{type(exc).__name__}: {exc}")
                continue
            kept.append(job)
        self._finish(kept)
        self._finish(cancelled, cancelled=True)

    def _keep(self, job: JobState, frames) -> None:
        """Write the job's frames: ``results/<sha256>.npy`` with a store, ``<id>.npy`` without (temp
        file, then rename); then up to the bucket when results go to one."""
        if self.store is not None:
            job.result_sha256, job.result_path = self.store.put_result(frames)
        else:
            path = self.results / f"{job.id}.npy"
            tmp = path.with_name(f".{job.id}.tmp{os.getpid()}.npy")
            np.save(tmp, frames)
            os.replace(tmp, path)
            job.result_path = path
        if self.remote is not None:
            with tracing.span("upload", parent=job.span, job_id=job.id, to=str(self.remote)):
                try:
                    job.result_sha256 = self.remote.put(job.result_path)
                except TrtSoraError:
                    job.result_path.unlink(missing_ok=True)
                    job.result_path = job.result_sha256 = None
                    raise

    def result_file(self, job: JobState) -> Path:
        """The finished job's frames (``.npy``) on local disk; with results in a bucket, fetched from
        it into the local cache and checked against the job's sha256 (StorageError when they cannot be)."""
        path = job.result_path
        if self.remote is not None and not path.is_file():
            self.remote.fetch(path.name, job.result_sha256, path)
        return path

    def _finish(self, batch: list[JobState], error: str | None = None, cancelled: bool = False) -> None:
        now = self._clock()
        with self._cond:
            for j in batch:
                j.status, j.finished, j.error = (CANCELLED if cancelled else FAILED if error else DONE), now, error
                if self.store is not None:
                    self.store.finished(j.id, now, error=error, metadata=j.metadata, result=j.result_sha256,
                                        cancelled=cancelled)
                self._finishes.append(now)
                if j.span is not None:
                    j.span.set_attribute("status", j.status)
                    j.span.end()
                    j.span = None
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


def retry_after_seconds(finishes: list[float], running: list[float], fallback: float) -> int:
    """Whole seconds until the queue next moves: ``1 / rate`` for the drain rate measured over the
    recent finish times ``finishes`` (ascending clock readings; jobs per second over their span);
    with fewer than two finishes, a clip's expected time ``fallback`` less what the longest-running
    job has already spent (``running``: seconds each running job has run). At least 1, at most 3600."""
    if len(finishes) >= 2 and finishes[-1] > finishes[0]:
        wait = (finishes[-1] - finishes[0]) / (len(finishes) - 1)
    else:
        wait = fallback - max(running, default=0.0)
    return int(min(3600, max(1, math.ceil(wait))))


def _hooks(*hooks):
    """One sampler hook running each of ``hooks`` (None: skipped) around every transformer call."""
    import contextlib

    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None

    def hook(info):
        stack = contextlib.ExitStack()
        for h in hooks:
            cm = h(info)
            if cm is not None:
                stack.enter_context(cm)
        return stack
    return hook


def _timed_calls(calls: list):
    """A sampler hook appending ``(step, start_ns, end_ns)`` of every transformer call to ``calls``."""
    import contextlib

    @contextlib.contextmanager
    def timed(step):
        t0 = time.time_ns()
        yield
        calls.append((step, t0, time.time_ns()))
    return lambda info: timed(info.step)


class _Cancelled(Exception):
    """Every job of a batch was cancelled: its sampling stops."""


def _cancel_calls(batch: list[JobState]):
    """A sampler hook stopping the batch (:class:`_Cancelled`) before a call once all its jobs are cancelled."""
    def hook(info):
        if all(j.cancel_event.is_set() for j in batch):
            raise _Cancelled()
    return hook


def _step_calls(batch: list[JobState]):
    """A sampler hook calling each job's ``on_step(step + 1, num_steps)`` once per step (CFG split
    and expert switches make several calls of one step); a cancelled job's no more."""
    seen: set[int] = set()

    def hook(info):
        if info.step not in seen:
            seen.add(info.step)
            for j in batch:
                if j.on_step is not None and not j.cancel_event.is_set():
                    j.on_step(info.step + 1, info.num_steps)
    return hook


def _frame_calls(batch: list[JobState]):
    """The generator's ``on_frames(i, frames)`` calling job ``i``'s ``on_frames(frames)`` while the
    job is not cancelled (a job cancelled during its clip's decode gets no more)."""
    if all(j.on_frames is None for j in batch):
        return None

    def call(i, frames):
        job = batch[i]
        if job.on_frames is not None and not job.cancel_event.is_set():
            job.on_frames(frames)
    return call


def _trace_stages(job: JobState, began_ns: int, ended_ns: int, calls: list) -> None:
    """The job's spans of its batch, timed after the fact from the transformer calls' clock readings:
    queue wait, text encode (up to the first call), denoise (first to last call, each call a child),
    decode (after the last call) - the batch's shared stages: every job of the batch shows them."""
    if job.span is None or not calls:
        return
    submitted = job.span.start_time  # the same instant as job.submitted, in the span's own ns
    tracing.record("queue_wait", submitted, max(submitted, min(began_ns, int((job.started or 0) * 1e9))),
                   parent=job.span)
    first, last = calls[0][1], calls[-1][2]
    tracing.record("text_encode", began_ns, first, parent=job.span)
    denoise = tracing.start("denoise", parent=job.span, start_ns=first, calls=len(calls))
    for step, t0, t1 in calls:
        tracing.record(f"step {step}", t0, t1, parent=denoise)
    denoise.end(end_time=last)
    tracing.record("decode", last, ended_ns, parent=job.span)


def _stored_request(request) -> dict:
    """The request as JSON for the store; an in-process image (array, PIL) cannot be stored."""
    d = dataclasses.asdict(request)
    if d.get("image") is not None and not isinstance(d["image"], str):
        raise ConfigError("a server with a job store takes the image as a data URL or a path string, not a "
                          f"{type(d['image']).__name__}")
    return d


def _latent_volume(resolved) -> int:
    """Latent frames x height x width of a resolved request (what a clip's activations scale with)."""
    return int(np.prod([resolved.point[k] for k in ("latent_frames", "latent_height", "latent_width")]))


def _probe_request(generator):
    from trt_sora.runtime.generate import ClipRequest

    return ClipRequest("probe", image=generator.warmup_image)


def _on_gpu(runner) -> bool:
    """True when the runner computes on a CUDA device (so GPU memory is what caps the batch)."""
    from trt_sora.serve.metrics import gpu_memory

    return runner.backend in ("trt", "torch-fp8") or (runner.backend == "torch" and gpu_memory() is not None
                                                     and "cuda" in str(getattr(runner, "device", "cuda")))

