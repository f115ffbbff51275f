"""Beyond one machine: Ray workers for ``trt-sora batch --ray`` and a Ray Serve deployment, both over
the same runtime (``pip install 'trt_sora[ray]'``).

Batch: :class:`RayExecutor` starts one actor per worker (each loads the run folder with
``trt_sora.runtime.load`` on its own GPU, or CPU) and hands them clip groups; the driver keeps
doing everything else - resolving jobs (once: a worker runs the driver's resolution), writing files
and records, retries, the summary - so resume works exactly as on one machine (the output folder
only needs to be on the driver). A worker that dies (``RayActorError``) is replaced and its group
retried as a transient error.

Serve: :func:`deployment` is a Ray Serve application whose replicas each run the FastAPI app of
:mod:`trt_sora.serve.server` over their own :class:`~trt_sora.serve.scheduler.Engine` (dynamic
batching per replica). Ray routes each HTTP request to any replica, so use the synchronous
``POST /v1/generate`` there (job ids live in the replica that took the job).
"""
from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trt_sora.errors import require

log = logging.getLogger("trt_sora")

__all__ = ["RayExecutor", "deployment"]

PIP = "pip install 'trt_sora[ray]'"


class _RunInfo:
    """What a driver-side :class:`~trt_sora.runtime.Generator` needs to resolve jobs without loading
    the model: the run folder, its buckets, the backend name."""

    def __init__(self, run_dir, backend: str):
        from trt_sora.runtime import buckets_of

        self.run_dir = Path(run_dir)
        self.buckets = buckets_of(self.run_dir)
        self.backend = backend

    def bucket_for(self, point):
        from trt_sora.config.shapes import check_point

        return check_point(point, self.buckets)


class _Worker:
    """One Ray actor: the run folder loaded (and the gate's reference), generating clip groups."""

    def __init__(self, run_dir: str, backend: str, force: bool, reference: str | None, cfg: str,
                 text_encoder: str | None, threads: int | None):
        import trt_sora.runtime as rt
        from trt_sora.runtime.generate import Generator

        device = "cuda" if _has_gpu() else None
        self.runner = rt.load(run_dir, backend=backend, force=force, device=device, threads=threads)
        self.generator = Generator(self.runner, text_encoder=text_encoder)
        self.reference = Generator(rt.load(run_dir, backend=reference, force=force, device=device, warmup=False),
                                   text_encoder=text_encoder) if reference else None
        self.cfg = cfg
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def run(self, resolved: list):
        """Clips (and the reference's) of requests the driver resolved (``Generator.run_resolved``: a
        worker tokenises no prompt again)."""
        from trt_sora.serve.batch import run_group

        clips, ref = run_group(self.generator, self.reference, resolved, self.cfg)
        for c in clips:
            c.metadata["worker"] = self.name
        return clips, ref

    def backend(self) -> str:
        return self.runner.backend


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class RayExecutor:
    """Clip groups over Ray actors (see the module docstring).

    Args:
        run_dir: the run folder (every worker must see it at this path: shared storage, or the same
            checkout on every node).
        backend: the runtime backend each worker loads (``auto`` picks per node).
        workers: actors (default: the cluster's GPUs, else 1).
        address: a running cluster (``ray://...`` or ``auto``); None starts a local one.
        reference: the quality gate's reference backend, loaded by every worker too.
        num_cpus: CPUs of a local cluster (default: this machine's).
    """

    def __init__(self, run_dir, *, backend: str = "auto", workers: int | None = None, address: str | None = None,
                 force: bool = False, reference: str | None = None, cfg: str = "auto",
                 text_encoder: str | None = None, num_cpus: int | None = None, threads: int | None = None):
        from trt_sora.runtime.generate import Generator

        self.ray = require("ray", extra="ray", pip=PIP)
        self._own = not self.ray.is_initialized()
        if self._own:
            kw = {"address": address} if address else {"num_cpus": num_cpus or os.cpu_count() or 1}
            self.ray.init(include_dashboard=False, log_to_driver=False, **kw)
        gpus = int(self.ray.cluster_resources().get("GPU", 0))
        self.workers = workers or max(1, gpus)
        per = {"num_gpus": 1} if gpus >= self.workers else {"num_cpus": 1}
        self._actor_cls = self.ray.remote(**per)(_Worker)
        self._args = (str(run_dir), backend, force, reference, cfg, text_encoder, threads)
        self._actors = [self._actor_cls.remote(*self._args) for _ in range(self.workers)]
        backends = self.ray.get([a.backend.remote() for a in self._actors])  # load errors surface here
        self.generator = Generator(_RunInfo(run_dir, backends[0]))
        log.info("ray: %d worker(s) (%s), backend %s", self.workers, per, backends[0])

    @property
    def max_batch(self) -> int | None:
        return None

    def run(self, groups: Sequence[list]) -> Iterator[tuple[list, Any]]:
        """Yield ``(group, (clips, reference clips) | exception)`` as the workers finish them."""
        ray = self.ray
        todo = list(groups)
        free = list(self._actors)
        flying: dict = {}
        while todo or flying:
            while todo and free:
                actor, group = free.pop(), todo.pop(0)
                flying[actor.run.remote([p.resolved for p in group])] = (actor, group)
            ready, _ = ray.wait(list(flying), num_returns=1)
            actor, group = flying.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the worker died: replace it, retry the group
                dead, actor = actor, self._actor_cls.remote(*self._args)
                self._actors = [a for a in self._actors if a is not dead] + [actor]
                result = exc
            except ray.exceptions.RayTaskError as exc:
                result = exc.as_instanceof_cause()
            free.append(actor)
            yield group, result

    def close(self) -> None:
        for a in self._actors:
            self.ray.kill(a)
        self._actors = []
        if self._own:
            self.ray.shutdown()


_BOUND: dict[str, Any] = {}


class _Late:
    """Forwards attribute access to the object bound under ``key`` in this process (a replica binds
    its engine in ``__init__``; Ray Serve pickles the FastAPI app, so the copies find it by key)."""

    def __init__(self, key: str):
        self.key = key

    def bind(self, obj) -> None:
        _BOUND[self.key] = obj

    def __getattr__(self, name):
        if name.startswith("__") or name == "key":
            raise AttributeError(name)
        return getattr(_BOUND[self.key], name)


def deployment(run_dir, *, backend: str = "auto", num_replicas: int = 1, config=None, force: bool = False,
               ray_actor_options: dict | None = None, text_encoder: str | None = None, threads: int | None = None):
    """A Ray Serve application serving ``run_dir``: ``serve.run(deployment(run), route_prefix="/")``.

    Each replica loads the run folder, warms up, and serves the HTTP API of
    :mod:`trt_sora.serve.server` (``/v1/generate``, ``/healthz``, ``/readyz``, ``/metrics``, ...)
    with its own dynamic batcher. ``ray_actor_options`` default: one GPU per replica when the
    cluster has GPUs, else one CPU.
    """
    ray = require("ray", extra="ray", pip=PIP)
    from ray import serve

    from trt_sora.serve.scheduler import ServeConfig
    from trt_sora.serve.server import make_app

    config = config or ServeConfig()
    import uuid

    tag = uuid.uuid4().hex
    engine, metrics = _Late(f"engine-{tag}"), _Late(f"metrics-{tag}")
    app = make_app(engine, metrics)
    if ray_actor_options is None:
        ray_actor_options = {"num_gpus": 1} if ray.is_initialized() and ray.cluster_resources().get("GPU") else \
            {"num_cpus": 1}
    run_dir = str(Path(run_dir).resolve())

    @serve.deployment(num_replicas=num_replicas, ray_actor_options=ray_actor_options,
                      max_ongoing_requests=config.max_queue + config.workers)
    @serve.ingress(app)
    class TrtSoraDeployment:
        def __init__(self):
            import trt_sora.runtime as rt
            from trt_sora.serve.metrics import ServerMetrics
            from trt_sora.serve.scheduler import Engine

            m = ServerMetrics()
            device = "cuda" if _has_gpu() else None
            e = Engine(lambda: rt.load(run_dir, backend=backend, force=force, device=device, threads=threads,
                                       concurrency=config.workers), config, metrics=m, text_encoder=text_encoder)
            e.start(block=True)
            if e.failed:
                raise RuntimeError(f"trt_sora replica failed to start: {e.failed}")
            metrics.bind(m)
            engine.bind(e)

        def check_health(self):  # Ray Serve's own health probe: a replica whose engine died is replaced
            if engine.failed or not engine.ready:
                raise RuntimeError(f"engine not ready: {engine.failed or 'warming up'}")

    return TrtSoraDeployment.bind()
