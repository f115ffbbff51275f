"""What servers import: load a checked artifact, pick the bucket, warm up, run thread-safely.

::

    import trt_sora.runtime as rt
    runner = rt.load("build/wan-tiny/rtx4090-fp8", backend="auto")   # refuses unchecked artifacts
    out = runner.infer({"hidden_states": x, "timestep": t, "encoder_hidden_states": e})["sample"]
    pipe.transformer = rt.as_diffusers_transformer(runner)         # WanPipeline, unchanged

Importing this module loads neither torch nor onnx (standard library, numpy, trt_sora.config).
"""
from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from trt_sora.config.shapes import DIM_NAMES, ShapeProfile, check_point
from trt_sora.errors import ArtifactError, BackendMissingError, ShapeError, TrtSoraError
from trt_sora.manifest import read_manifest, sha256_file

log = logging.getLogger("trt_sora")

__all__ = ["InputError", "ServingRunner", "as_diffusers_transformer", "load"]

BACKENDS = ("auto", "trt", "ort", "torch", "torch-fp8")


class InputError(ShapeError):
    """A request's input has the wrong name, dtype or rank (the process keeps serving)."""


def _check_parity(run: Path, force: bool, candidate: Path | None) -> dict | None:
    rep_path = run / "parity" / "report.json"
    fix = f"run `trt-sora check --run {run} --recipe <recipe>`"
    if not rep_path.is_file():
        if force:
            log.warning("%s has no parity report; loading anyway (force=True)", run)
            return None
        raise ArtifactError(f"{run} has no parity/report.json: the artifact was never checked against PyTorch; "
                            f"{fix}, or pass force=True to load it unchecked")
    rep = json.loads(rep_path.read_text())
    if not rep.get("passed"):
        if force:
            log.warning("%s FAILED parity (%s); loading anyway (force=True)", run, rep.get("failed"))
            return rep
        raise ArtifactError(f"{run} failed its parity gates ({', '.join(rep.get('failed', [])) or '?'}; see "
                            f"{run}/parity/report.md); fix the artifact (recalibrate / exclude the named layer) "
                            f"and {fix}, or pass force=True")
    want = (rep.get("candidate") or {}).get("sha256")
    if candidate is not None and want and candidate.is_file() and rep.get("candidate", {}).get("path") == str(candidate):
        if sha256_file(candidate) != want and not force:
            raise ArtifactError(f"{candidate} changed after its parity check (sha256 differs); {fix} again")
    return rep


def _gpu_sm() -> int | None:
    """SM of GPU 0 as an int (90 for an H100/H200), or None without a CUDA GPU / torch."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    except ImportError:
        return None


def _auto_backend(run: Path, plans: list, qdq: Path) -> str:
    """A TensorRT engine when one was built and TensorRT + a GPU are here; else ``torch-fp8`` when
    the artifact is FP8, the GPU has FP8 tensor cores and parity passed on that backend; else ORT
    (logging what to run for the GPU paths)."""
    import importlib.util

    sm = _gpu_sm()
    if plans and sm is not None and (importlib.util.find_spec("tensorrt") or importlib.util.find_spec("tensorrt_rtx")):
        return "trt"
    if sm is not None and sm >= 89 and qdq.is_file():
        fmt = json.loads((run / "quant" / "qdq_map.json").read_text()).get("format")
        rep_path = run / "parity" / "report.json"
        rep = json.loads(rep_path.read_text()) if rep_path.is_file() else {}
        if fmt == "fp8_e4m3" and rep.get("passed") and rep.get("backend") == "torch-fp8":
            return "torch-fp8"
        if fmt == "fp8_e4m3":
            log.warning("runtime: this FP8 artifact was not checked on the GPU backend; serving ONNX Runtime. For "
                        "FP8 tensor cores run `trt-sora check --run %s --backend torch-fp8` on this GPU first", run)
    return "ort"


def _require_checked_backend(run: Path, rep: dict | None, backend: str, force: bool) -> None:
    """The backend that serves is the backend that passed (unless ``force``, logged loudly)."""
    got = (rep or {}).get("backend")
    if got == backend:
        return
    msg = (f"{run}/parity/report.json checked backend {got!r}, not {backend!r}: the {backend} kernels never ran "
           f"against PyTorch; run `trt-sora check --run {run} --backend {backend}` on this GPU")
    if not force:
        raise ArtifactError(msg + ", or pass force=True")
    log.warning("LOADING UNCHECKED BACKEND (force=True): %s", msg)


def _buckets(run: Path, rep: dict | None) -> tuple[ShapeProfile, ...]:
    """Buckets: the engine manifest's, else the parity report's, else the export's whole range."""
    for src in (run / "engine", run / "parity"):
        if (src / "manifest.json").is_file():
            res = read_manifest(src).get("results", {})
            if res.get("buckets"):
                return tuple(ShapeProfile.from_yaml(b, where=f"{src.name} bucket") for b in res["buckets"])
    if rep and rep.get("buckets"):
        return tuple(ShapeProfile.from_yaml(b) for b in rep["buckets"])
    dyn = read_manifest(run / "export", stage="export")["results"]["dynamic"]
    return (ShapeProfile.from_yaml({"name": "export-range", **dyn}),)


def _gpu_check(run: Path) -> None:
    """Engine manifest records ``results.sm`` and TensorRT version; compare with this machine."""
    man = read_manifest(run / "engine")
    res = man.get("results", {})
    import torch

    if not torch.cuda.is_available():
        raise BackendMissingError("backend 'trt' needs an NVIDIA GPU; none is visible - use backend='ort' or 'torch'")
    major, minor = torch.cuda.get_device_capability()
    here = major * 10 + minor
    sm = res.get("sm") or res.get("compute_capability") or man.get("config", {}).get("compute_capability")
    if sm is not None:
        want = int(str(sm).replace(".", "")) if not isinstance(sm, int) else sm
        if want != here:
            raise ArtifactError(f"the engine was built for SM{want} but this GPU is SM{here} "
                                f"({torch.cuda.get_device_name()}); rebuild with a recipe for compute_capability "
                                f"{major}.{minor}")
    built = res.get("tensorrt_version") or man.get("tools", {}).get("tensorrt") or man.get("tools", {}).get(
        "tensorrt-rtx-cu13")
    from trt_sora.runners.trt_runner import import_tensorrt

    trt = import_tensorrt()
    if built and str(built).split(".")[:2] != str(trt.__version__).split(".")[:2]:
        raise ArtifactError(f"the engine was built with TensorRT {built} but this machine has {trt.__version__}; "
                            "rebuild the engine here or install the matching TensorRT")


class ServingRunner:
    """A thread-safe, input-validating front over a pool of backend runners.

    ``infer(feeds, stream=None) -> {"sample": array}``: ``hidden_states`` [B, C, F, H, W] float,
    ``timestep`` [B] float, ``encoder_hidden_states`` [B, L, D] float; numpy or torch. Each
    concurrent caller gets its own backend runner (execution context / session / model replica)
    from the pool. Bad inputs raise :class:`InputError` / :class:`ShapeError`.

    Attributes: ``backend``, ``buckets``, ``load_seconds``, ``warmup_seconds`` ({bucket: s}),
    ``model_config`` (the transformer's diffusers config), ``run_dir``.
    """

    def __init__(self, runners: list, *, backend: str, buckets, model_config: Mapping[str, Any], run_dir: Path,
                 input_ranks: Mapping[str, int], channels: Mapping[str, tuple[int, int]]):
        self._pool: queue.Queue = queue.Queue()
        for r in runners:
            self._pool.put(r)
        self._runners = runners
        self.backend = backend
        self.buckets = tuple(buckets)
        self.model_config = dict(model_config)
        self.run_dir = run_dir
        self._ranks = dict(input_ranks)
        self._channels = dict(channels)
        self.input_names = tuple(input_ranks)
        self.load_seconds = 0.0
        self.warmup_seconds: dict[str, float] = {}
        self._closed = False

    # -- validation -------------------------------------------------------------------------------
    def point_of(self, feeds: Mapping[str, Any]) -> dict[str, int]:
        """Validate names/dtypes/ranks; return the latent-space point ``{batch, latent_frames, ...}``."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; pass {list(self.input_names)}")
        for n in self.input_names:
            v = feeds[n]
            shape = tuple(getattr(v, "shape", ()))
            dt = str(getattr(v, "dtype", type(v).__name__)).replace("torch.", "")
            if not any(k in dt for k in ("float", "half", "bfloat")):
                raise InputError(f"{n} has dtype {dt}; pass a floating-point tensor (float32/float16/bfloat16)")
            if len(shape) != self._ranks[n]:
                raise InputError(f"{n} has rank {len(shape)} (shape {shape}); expected rank {self._ranks[n]}")
            if n in self._channels:
                axis, want = self._channels[n]
                if shape[axis] != want:
                    raise InputError(f"{n} has {shape[axis]} at axis {axis} (shape {shape}); this model needs {want}")
        hs, eh = tuple(feeds["hidden_states"].shape), tuple(feeds["encoder_hidden_states"].shape)
        if tuple(feeds["timestep"].shape)[0] != hs[0] or eh[0] != hs[0]:
            raise InputError(f"batch sizes differ: hidden_states {hs[0]}, timestep {tuple(feeds['timestep'].shape)[0]}, "
                             f"encoder_hidden_states {eh[0]}; pass one batch size")
        return {"batch": hs[0], "latent_frames": hs[2], "latent_height": hs[3], "latent_width": hs[4],
                "text_len": eh[1]}

    def bucket_for(self, feeds_or_point: Mapping[str, Any]) -> ShapeProfile:
        """The bucket holding these inputs (or point); ShapeError listing the buckets otherwise."""
        point = feeds_or_point if all(k in feeds_or_point for k in DIM_NAMES) else self.point_of(feeds_or_point)
        return check_point(point, self.buckets)

    def allows_batched_cfg(self, batch: int, point: Mapping[str, int] | None = None) -> bool:
        """True when a bucket takes ``2 * batch`` (both CFG branches in one call)."""
        p = dict(point or self.buckets[0].point("opt"))
        p["batch"] = 2 * batch
        return any(b.contains(p) for b in self.buckets)

    # -- inference --------------------------------------------------------------------------------
    def infer(self, feeds: Mapping[str, Any], stream=None) -> dict[str, Any]:
        if self._closed:
            raise ArtifactError("this runner was closed; call trt_sora.runtime.load(...) again")
        self.bucket_for(self.point_of(feeds))
        r = self._pool.get()
        try:
            if stream is not None and self.backend == "trt":
                return r.infer(feeds, stream=stream)
            return r.infer(feeds)
        finally:
            self._pool.put(r)

    __call__ = infer

    def warm_up(self) -> dict[str, float]:
        """One call per bucket at its opt point on every pooled runner; seconds per bucket."""
        import numpy as np

        for b in self.buckets:
            p = b.point("opt")
            g = np.random.default_rng(0)
            c = self._channels["hidden_states"][1]
            d = self._channels["encoder_hidden_states"][1]
            feeds = {"hidden_states": g.standard_normal((p["batch"], c, p["latent_frames"], p["latent_height"],
                                                         p["latent_width"]), dtype=np.float32),
                     "timestep": np.full((p["batch"],), 500.0, np.float32),
                     "encoder_hidden_states": g.standard_normal((p["batch"], p["text_len"], d), dtype=np.float32)}
            t0 = time.perf_counter()
            for r in self._runners:
                r.infer(feeds)
            self.warmup_seconds[b.name] = time.perf_counter() - t0
        return dict(self.warmup_seconds)

    def close(self) -> None:
        for r in self._runners:
            r.deactivate()
        self._closed = True

    def activate(self):
        return self

    def deactivate(self) -> None:
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(artifact_dir, backend: str = "auto", *, force: bool = False, concurrency: int = 1,
         device: str | None = None, dtype: str = "fp32", warmup: bool = True, compile: bool = False,
         threads: int | None = None) -> ServingRunner:
    """Load a run folder (``build/<model>/<recipe>/``) for serving.

    Args:
        artifact_dir: run folder with ``export/``, ``parity/`` and optionally ``quant/``, ``engine/``.
        backend: ``"trt"`` (engine; GPU + TensorRT), ``"ort"`` (Q/DQ ONNX, else plain ONNX),
            ``"torch"`` (PyTorch reference), ``"torch-fp8"`` (the calibrated sites as FP8
            tensor-core GEMMs + Triton kernels; SM >= 8.9; needs a parity report from that
            backend) or ``"auto"`` (trt when an engine, a GPU and TensorRT are present; else
            torch-fp8 when the artifact is FP8, the GPU has FP8 tensor cores and torch-fp8 passed
            parity; else ort).
        force: load even when the parity report is missing or failed (logged as a warning).
        concurrency: pooled runners (TensorRT execution contexts / ORT sessions / torch replicas
            share one model) = concurrent callers served at once; more callers wait.
        device: torch backend device (default ``cuda`` when available else ``cpu``); trt: ``cuda:N``.
        dtype: torch backend compute dtype (``fp32``/``bf16``/``fp16``).
        warmup: run every bucket once at load (timings in ``warmup_seconds``).
        compile: torch backend: ``torch.compile`` the forward.

    Raises ArtifactError (unchecked/failed/changed artifact, engine for another GPU or TensorRT),
    BackendMissingError (backend not installed / no GPU), ConfigError (unknown backend).
    """
    t0 = time.perf_counter()
    run = Path(artifact_dir)
    if backend not in BACKENDS:
        from trt_sora.config.base import did_you_mean
        from trt_sora.errors import ConfigError

        raise ConfigError(f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; use one of {BACKENDS}")
    exp = read_manifest(run / "export", stage="export")
    plans = sorted((run / "engine").glob("*.plan")) if (run / "engine").is_dir() else []
    qdq = run / "quant" / "model.qdq.onnx"
    if backend == "auto":
        backend = _auto_backend(run, plans, qdq)
    candidate = {"trt": plans[0] if plans else None, "ort": qdq if qdq.is_file() else run / "export" / "model.onnx",
                 "torch": None, "torch-fp8": run / "quant" / "qdq_map.json"}[backend]
    rep = _check_parity(run, force, candidate)
    if backend == "torch-fp8":
        _require_checked_backend(run, rep, backend, force)
    buckets = _buckets(run, rep)
    res = exp["results"]
    from trt_sora.models import adapter_for_manifest

    cfg = dict(res["model"].get("config") or {})
    family = adapter_for_manifest(res["model"])  # input ranks and fixed feature dims are family facts
    ranks, channels = family.input_ranks(), family.fixed_dims()
    runners: list = []
    if backend == "trt":
        if candidate is None:
            raise ArtifactError(f"{run}/engine has no .plan; run `trt-sora build` or use backend='ort'")
        _gpu_check(run)
        from trt_sora.runners.trt_runner import TrtRunner

        dev = int(str(device or "cuda:0").split(":")[-1]) if device and ":" in str(device) else 0
        tr = TrtRunner(candidate, device=dev, contexts=concurrency).activate()
        runners = [tr]
        pool_n = concurrency
    elif backend == "torch-fp8":
        from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

        ran = ((rep or {}).get("candidate") or {}).get("device") or {}
        runners = [TorchFp8Runner(family, run / "quant" / "qdq_map.json",
                                  run / "calib" / "stats.safetensors", device=device or "cuda",
                                  attention=AttentionPolicy.from_dict(ran.get("attention_policy"))).activate()]
        pool_n = concurrency
    elif backend == "ort":
        from trt_sora.runners.ort_runner import OrtRunner

        sess = OrtRunner(candidate, threads=threads).activate()  # ORT's run() is thread-safe: share it
        runners, pool_n = [sess], concurrency
    else:
        from trt_sora.runners.torch_runner import TorchRunner

        adapter = family
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = adapter.load(dtype, device)
        runners = [TorchRunner(adapter, dtype=dtype, device=device, model=model, compile=compile).activate()]
        pool_n = concurrency
    pooled = runners * pool_n if len(runners) == 1 else runners
    sr = ServingRunner(pooled, backend=backend, buckets=buckets, model_config=cfg, run_dir=run,
                       input_ranks=ranks, channels=channels)
    sr._runners = runners  # warm-up/close once per distinct runner
    sr.load_seconds = time.perf_counter() - t0
    if warmup:
        sr.warm_up()
    log.info("runtime: %s backend, %d bucket(s), loaded in %.2f s", backend, len(buckets), sr.load_seconds)
    return sr


def as_diffusers_transformer(runner, *, dtype=None, device=None):
    """A stand-in for ``WanTransformer3DModel`` in a diffusers pipeline, backed by ``runner``.

    ``pipe.transformer = as_diffusers_transformer(runner)``: the object has ``config`` (the
    exported transformer's diffusers config), ``dtype``, ``device``, ``cache_context(name, ...)`` and
    ``__call__(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
    return_dict=True, attention_kwargs=None)`` returning ``Transformer2DModelOutput(sample=...)``
    (or a 1-tuple). Imports torch/diffusers when called.
    """
    from trt_sora.runtime._diffusers import make_transformer

    return make_transformer(runner, dtype=dtype, device=device)
