"""What servers import: load a checked artifact, pick the bucket, warm up, run thread-safely.

::

    import trt_sora.runtime as rt
    runner = rt.load("build/wan-tiny/rtx4090-fp8", backend="auto")   # serves only what parity verified
    out = runner.infer({"hidden_states": x, "timestep": t, "encoder_hidden_states": e})["sample"]
    pipe.transformer = rt.as_diffusers_transformer(runner)         # WanPipeline, unchanged
    clips = rt.generate(runner, ["a red circle moving right"])     # prompts -> uint8 clips + metadata
    pipe = rt.diffusers_pipeline(runner)                           # a ready WanPipeline over the runner

Importing this module loads neither torch nor onnx (standard library, numpy, trt_sora.config).
"""
from __future__ import annotations

import logging
import math
import queue
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trt_sora.config.shapes import DIM_NAMES, ShapeProfile, check_point
from trt_sora.errors import ArtifactError, BackendMissingError, ConfigError, NumericsError, ShapeError
from trt_sora.runfolder import CALIB_STATS, QDQ_MAP, RunFolder
from trt_sora.sm import sm_int

log = logging.getLogger("trt_sora")

__all__ = ["Clip", "ClipRequest", "Generator", "InputError", "NumericsError", "ServedCache", "ServingRunner",
           "as_diffusers_transformer", "caching_mismatch",
           "buckets_of", "diffusers_pipeline", "generate", "load", "mismatch", "read_report"]

BACKENDS = ("auto", "trt", "ort", "torch", "torch-fp8")


class InputError(ShapeError):
    """A request's input has the wrong name, dtype or rank (the process keeps serving)."""


# -- what was verified ---------------------------------------------------------------------------------
def _fix(run: Path, backend: str) -> str:
    dev = "" if backend in ("ort", "torch") else " on this GPU"
    check_backend = backend if backend != 'torch' else 'ort'
    return f"run `trt-sora check --run {run} --recipe <recipe> --backend {check_backend}`{dev}"


def read_report(run: Path) -> dict | None:
    """``parity/report.json`` after re-hashing the parity folder against its manifest (a report edited
    by hand is not a report); None when no check ever finished."""
    return RunFolder(run).read_report()


def _gpu_sm(device: str | None = None) -> int | None:
    """SM of the CUDA device as an int (90 for an H100/H200), or None without a CUDA GPU / torch."""
    try:
        import torch

        if not torch.cuda.is_available() or (device is not None and not str(device).startswith("cuda")):
            return None
        major, minor = torch.cuda.get_device_capability(torch.device(device or "cuda"))
        return major * 10 + minor
    except ImportError:
        return None


def _sm_int(sm) -> int | None:
    try:
        return sm_int(sm) if sm is not None else None
    except ConfigError:
        return None


def mismatch(rep: dict | None, backend: str, here_sm: int | None, model_hash: str | None = None) -> str | None:
    """Why ``rep`` does not vouch for serving ``backend`` here (None when it does).

    The backend that serves is the backend that passed: the report's candidate must be that backend
    and have executed; ``trt`` and ``torch-fp8`` also need the check to have run on a GPU of this SM
    (``torch-fp8``: SM >= 8.9, FP8 tensor cores). ``torch`` serves the reference itself: any passed
    report of the same model vouches for it.
    """
    if rep is None:
        return "has no parity report: the artifact was never checked against PyTorch"
    if not rep.get("passed"):
        return f"failed its parity gates ({', '.join(rep.get('failed', [])) or '?'}; see parity/report.md)"
    if backend == "torch":
        if model_hash and rep.get("model_hash") and rep["model_hash"] != model_hash:
            return f"was checked with model hash {rep['model_hash']}, but the model here is {model_hash}"
        return None
    cand = rep["candidate"]
    got = cand.get("backend", rep.get("backend"))
    if got != backend:
        return (f"was checked on backend {got!r}, not {backend!r}: the {backend} backend never ran against "
                "PyTorch")
    if not cand.get("executed"):
        return f"records a {backend} candidate that never executed"
    if backend in ("trt", "torch-fp8"):
        ran = _sm_int((cand.get("device") or {}).get("sm"))
        where = (cand.get("device") or {}).get("gpu") or (cand.get("device") or {}).get("device") or "?"
        if ran is None:
            need = "an SM >= 8.9 GPU (FP8 tensor cores)" if backend == "torch-fp8" else "a GPU"
            return f"was checked on {where}, not on {need}: {backend} results on this GPU are unverified"
        if backend == "torch-fp8" and ran < 89:
            return f"was checked on SM{ran} ({where}); torch-fp8 needs FP8 tensor cores (SM >= 8.9)"
        if here_sm != ran:
            return (f"was checked on SM{ran} ({where}) but this device is "
                    f"{'SM' + str(here_sm) if here_sm else 'not a CUDA GPU'}: {backend} numerics differ per GPU")
    if model_hash and rep.get("model_hash") and rep["model_hash"] != model_hash:
        return f"was checked with model hash {rep['model_hash']}, but the model here is {model_hash}"
    return None


def _verify_candidate_files(run: Path, rep: dict) -> dict[str, Path]:
    """Re-hash every file the checked candidate loaded (paths relative to the run folder)."""
    from trt_sora.manifest import verify_file

    rf = RunFolder(run)
    files = rep["candidate"].get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{rf.parity_report} lists no candidate files (an old report); re-run "
                            f"`trt-sora check --run {run}`")
    out = {}
    for rel, sha in files.items():
        p = rf.resolve(rel)
        verify_file(p, sha, None, recorded_in=f"{rf.parity_report} (the checked candidate)",
                    fix=f"re-run the stage that writes it and `trt-sora check --run {run}`")
        out[rel] = p
    return out


def _loud(msg: str) -> None:
    log.warning("LOADING UNVERIFIED ARTIFACT (force=True): %s", msg)


def _auto_backend(run: Path, rep: dict | None, device: str | None) -> str:
    """The backend the report vouches for, when it can run here; else ArtifactError saying where it can.
    Without a passed report: ``ort`` (``load`` then refuses unless ``force``)."""
    if rep is None or not rep.get("passed"):
        return "ort"
    b = rep["candidate"].get("backend", rep.get("backend", "ort"))
    if b in ("ort", "torch"):
        sm = _gpu_sm(device)
        if sm is not None and sm >= 89 and RunFolder(run).qdq_map.is_file():
            log.info("runtime: serving ONNX Runtime (the checked backend). For FP8 tensor cores on this GPU run "
                     "`trt-sora check --run %s --backend torch-fp8` here first", run)
        return b
    ran = _sm_int((rep["candidate"].get("device") or {}).get("sm"))
    if _gpu_sm(device) is None or _gpu_sm(device) != ran:
        raise ArtifactError(f"{run} was checked on backend {b!r} (SM{ran}), which cannot serve on this machine "
                            f"({'SM' + str(_gpu_sm(device)) if _gpu_sm(device) else 'no CUDA GPU'}); load it on that "
                            f"GPU, or run `trt-sora check --run {run} --backend ort` here and load backend='ort'")
    return b


def _buckets(run: Path, rep: dict | None) -> tuple[ShapeProfile, ...]:
    """Buckets: the engine manifest's, else the parity report's, else the export's whole range."""
    rf = RunFolder(run)
    for src in ("engine", "parity"):
        if rf.has_manifest(src):
            res = rf.read_manifest(src, check_stage=False).get("results", {})
            if res.get("buckets"):
                return tuple(ShapeProfile.from_yaml(b, where=f"{src} bucket") for b in res["buckets"])
    if rep and rep.get("buckets"):
        return tuple(ShapeProfile.from_yaml(b) for b in rep["buckets"])
    dyn = rf.read_manifest("export")["results"]["dynamic"]
    return (ShapeProfile.from_yaml({"name": "export-range", **dyn}),)


def buckets_of(artifact_dir) -> tuple[ShapeProfile, ...]:
    """The shape buckets a run folder serves, read from its files (nothing is loaded)."""
    run = Path(artifact_dir)
    return _buckets(run, read_report(run))


def _gpu_check(run: Path) -> None:
    """Engine manifest records ``results.sm`` and TensorRT version; compare with this machine."""
    man = RunFolder(run).read_manifest("engine", check_stage=False)
    res = man.get("results", {})
    import torch

    if not torch.cuda.is_available():
        raise BackendMissingError("backend 'trt' needs an NVIDIA GPU; none is visible - use backend='ort' or 'torch'")
    major, minor = torch.cuda.get_device_capability()
    here = major * 10 + minor
    sm = res.get("sm") or res.get("compute_capability") or man.get("config", {}).get("compute_capability")
    if sm is not None:
        want = sm_int(sm)
        if want != here:
            raise ArtifactError(f"the engine was built for SM{want} but this GPU is SM{here} "
                                f"({torch.cuda.get_device_name()}); rebuild with a recipe for compute_capability "
                                f"{major}.{minor}")
    built = res.get("backend_version") or res.get("tensorrt_version") or man.get("tools", {}).get(
        "tensorrt") or man.get("tools", {}).get("tensorrt-rtx-cu13")
    from trt_sora.runners.trt_runner import import_tensorrt

    trt = import_tensorrt(res.get("backend"))
    if built and str(built).split(".")[:2] != str(trt.__version__).split(".")[:2]:
        raise ArtifactError(f"the engine was built with TensorRT {built} but this machine has {trt.__version__}; "
                            "rebuild the engine here or install the matching TensorRT")


class ServingRunner:
    """A thread-safe, input-validating front over a pool of backend runners.

    ``infer(feeds, stream=None) -> {"sample": array}``: ``hidden_states`` [B, C, F, H, W] float,
    ``timestep`` [B] float, ``encoder_hidden_states`` [B, L, D] float; numpy or torch. Each
    concurrent caller gets its own backend runner (execution context / session / model replica)
    from the pool. Bad inputs raise :class:`InputError` / :class:`ShapeError` before any backend
    runs (names, dtypes, ranks, channels, batch, buckets, the model's patch divisibility, and - with
    ``check_finite`` - NaN/inf); NaN/inf outputs from finite inputs raise :class:`NumericsError`.

    Attributes: ``backend``, ``buckets``, ``load_seconds``, ``warmup_seconds`` ({bucket: s}),
    ``model_config`` (the transformer's diffusers config), ``run_dir``, ``check_finite``,
    ``verified`` (False when loaded with ``force=True`` past a failed verification), ``caching``
    (the :class:`ServedCache` its check passed, which generation replays; None: every step computes).
    """

    def __init__(self, runners: list, *, backend: str, buckets, model_config: Mapping[str, Any], run_dir: Path,
                 input_ranks: Mapping[str, int], channels: Mapping[str, Any],
                 input_dims: Mapping[str, Mapping[int, str]], patch: tuple[int, int, int] = (1, 1, 1),
                 check_finite: bool = True, mask_inputs: tuple[str, ...] = ()):
        self._pool: queue.Queue = queue.Queue()
        for r in runners:
            self._pool.put(r)
        self._runners = runners
        self.backend = backend
        self.buckets = tuple(buckets)
        self.model_config = dict(model_config)
        self.run_dir = run_dir
        self._ranks = dict(input_ranks)
        # {input: {axis: size}} (an older (axis, size) pair is one fixed axis)
        self._fixed = {n: (dict([v]) if isinstance(v, tuple) else {int(a): int(z) for a, z in v.items()})
                       for n, v in channels.items()}
        self._dims = {n: {int(a): d for a, d in axes.items()} for n, axes in input_dims.items()
                      if n in self._ranks}
        self._masks = tuple(mask_inputs)
        self.patch = tuple(patch)
        self.check_finite = check_finite
        self.verified = True
        self.input_names = tuple(input_ranks)
        self.load_seconds = 0.0
        self.warmup_seconds: dict[str, float] = {}
        self.caching: ServedCache | None = None
        self._closed = False

    @property
    def device(self) -> str:
        """Where the model computes: ``cuda[:N]`` for torch / torch-fp8 / TensorRT runners on a GPU,
        else ``cpu`` (ONNX Runtime's CPU provider)."""
        r = self._runners[0]
        return str(getattr(r, "device", None) or ("cuda" if self.backend == "trt" else "cpu"))

    # -- validation -------------------------------------------------------------------------------
    def point_of(self, feeds: Mapping[str, Any]) -> dict[str, int]:
        """Validate names/dtypes/ranks/fixed sizes; return the latent-space point ``{batch,
        latent_frames, ...}`` (every named dim of the model's inputs, which must agree)."""
        from trt_sora.config.base import did_you_mean

        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds must be a mapping of input name -> array, got {type(feeds).__name__}")
        missing = [n for n in self.input_names if n not in feeds]
        extra = [n for n in feeds if n not in self.input_names]
        if extra:
            raise InputError(f"unknown input(s) {extra}{did_you_mean(extra[0], self.input_names)}; this model takes "
                             f"{list(self.input_names)}")
        if missing:
            raise InputError(f"missing input(s) {missing}; pass {list(self.input_names)}")
        point: dict[str, int] = {}
        seen: dict[str, str] = {}
        for n in self.input_names:
            v = feeds[n]
            if not hasattr(v, "shape") or not hasattr(v, "dtype"):
                raise InputError(f"{n} is a {type(v).__name__}; pass a numpy array or a torch tensor")
            shape = tuple(v.shape)
            dt = str(v.dtype).replace("torch.", "")
            if not any(k in dt for k in ("float", "half", "bfloat")):
                raise InputError(f"{n} has dtype {dt}; pass a floating-point tensor (float32/float16/bfloat16)")
            if len(shape) != self._ranks[n]:
                raise InputError(f"{n} has rank {len(shape)} (shape {shape}); expected rank {self._ranks[n]}")
            for axis, want in self._fixed.get(n, {}).items():
                if shape[axis] != want:
                    raise InputError(f"{n} has {shape[axis]} at axis {axis} (shape {shape}); this model needs {want}")
            for axis, dim in self._dims.get(n, {}).items():
                if dim in point and point[dim] != shape[axis]:
                    what = "batch sizes differ" if dim == "batch" else f"{dim} differs"
                    raise InputError(f"{what}: {seen[dim]} has {point[dim]}, {n} has {shape[axis]} (axis {axis}); "
                                     f"pass one {dim}")
                point.setdefault(dim, int(shape[axis]))
                seen.setdefault(dim, n)
        return point

    def bucket_for(self, feeds_or_point: Mapping[str, Any]) -> ShapeProfile:
        """The bucket holding these inputs (or point); ShapeError listing the buckets otherwise."""
        point = feeds_or_point if all(k in feeds_or_point for k in DIM_NAMES) else self.point_of(feeds_or_point)
        for dim, p in zip(("latent_frames", "latent_height", "latent_width"), self.patch):
            if int(point[dim]) % p:
                v = int(point[dim])
                raise ShapeError(f"{dim}={v} is not a multiple of the model's patch size {p} along that axis; "
                                 f"pass {v - v % p or p} or {v - v % p + p}")
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
        if self.check_finite:
            for n in self.input_names:
                bad = _non_finite(feeds[n])
                if bad:
                    raise InputError(f"{n} holds {bad} NaN/inf value(s); pass finite inputs (load with "
                                     "check_finite=False to skip this check where inputs are checked upstream)")
        r = self._pool.get()
        try:
            out = r.infer(feeds, stream=stream) if stream is not None and self.backend == "trt" else r.infer(feeds)
        finally:
            self._pool.put(r)
        if self.check_finite:
            for k, v in out.items():
                bad = _non_finite(v)
                if bad:
                    raise NumericsError(f"the {self.backend} backend returned {bad} NaN/inf value(s) in {k!r} for "
                                        f"finite inputs at {self.point_of(feeds)}; the artifact is numerically "
                                        f"broken at this shape - re-run `trt-sora check --run {self.run_dir}`"
                                        + ("" if self.verified else " (it was loaded unverified, force=True)"))
        return out

    __call__ = infer

    def warm_up(self) -> dict[str, float]:
        """One call per bucket at its opt point on every pooled runner; seconds per bucket."""
        for b in self.buckets:
            feeds = self.example_feeds(b.point("opt"))
            t0 = time.perf_counter()
            for r in self._runners:
                r.infer(feeds)
            self.warmup_seconds[b.name] = time.perf_counter() - t0
        return dict(self.warmup_seconds)

    def example_feeds(self, point: Mapping[str, int], seed: int = 0) -> dict[str, Any]:
        """Random fp32 inputs at ``point`` (numpy): normal values, masks all ones, timestep 500."""
        import numpy as np

        g = np.random.default_rng(seed)
        feeds = {}
        for n in self.input_names:
            axes = {**{a: int(point[d]) for a, d in self._dims.get(n, {}).items()}, **self._fixed.get(n, {})}
            shape = tuple(axes[a] for a in range(self._ranks[n]))
            if n == "timestep":
                feeds[n] = np.full(shape, 500.0, np.float32)
            elif n in self._masks:
                feeds[n] = np.ones(shape, np.float32)
            else:
                feeds[n] = g.standard_normal(shape, dtype=np.float32)
        return feeds

    def close(self) -> None:
        for r in self._runners:
            r.deactivate()
        self._closed = True

    def follow(self) -> int:
        """Ranks != 0 of a ``load(..., parallel=...)`` job: compute rank 0's calls until it closes;
        returns how many were served."""
        if not hasattr(self._runners[0], "follow"):
            raise ArtifactError("follow() is for ranks != 0 of a parallel runtime (load(..., parallel=...))")
        n = self._runners[0].follow()
        self._closed = True
        return n

    def activate(self):
        return self

    def deactivate(self) -> None:
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _non_finite(x) -> int:
    """How many NaN/inf values ``x`` (numpy or torch) holds; 0 after one max and one min when all are
    finite (NaN propagates through both, +-inf shows in one), without a temporary the size of ``x``.
    CUDA tensors: one ``isfinite().all()`` kernel (and the sync its result needs)."""
    import numpy as np

    from trt_sora.runners.base import is_torch

    if is_torch(x):
        import torch

        if x.device.type == "cpu" and x.dtype in (torch.float16, torch.float32, torch.float64):
            x = x.detach().numpy()  # a view: numpy's reductions are faster than torch's on the CPU
        else:
            return 0 if bool(torch.isfinite(x).all()) else int((~torch.isfinite(x)).sum())
    a = np.asarray(x)
    if a.size == 0 or (math.isfinite(a.max()) and math.isfinite(a.min())):
        return 0
    return int((~np.isfinite(a)).sum())


def load(artifact_dir, backend: str = "auto", *, force: bool = False, concurrency: int = 1,
         device: str | None = None, dtype: str = "fp32", warmup: bool = True, compile: bool = False,
         threads: int | None = None, check_finite: bool = True, parallel=None, caching: bool = True) -> ServingRunner:
    """Load a run folder (``build/<model>/<recipe>/``) for serving - only what its parity check verified.

    The parity report (``parity/report.json``, re-hashed against its manifest) must have passed with
    this backend as its candidate, on this GPU's SM for ``trt`` / ``torch-fp8``; every file that
    candidate loaded is re-hashed (sha256, cached by size + mtime + ctime) before it is loaded, so a
    copy, a symlink or an absolute path of the run folder serves exactly the checked bytes.

    Args:
        artifact_dir: run folder with ``export/``, ``parity/`` and optionally ``quant/``, ``engine/``.
        backend: ``"trt"`` (engine; GPU + TensorRT), ``"ort"`` (the checked ONNX), ``"torch"`` (the
            PyTorch reference itself), ``"torch-fp8"`` (the calibrated sites as FP8 tensor-core GEMMs +
            Triton kernels; SM >= 8.9) or ``"auto"`` (the backend the report was checked on; an error
            naming the GPU it needs when that cannot run here).
        force: load even when the report is missing, failed, for another backend/GPU, or a file changed;
            every such problem is logged as a WARNING (``LOADING UNVERIFIED ARTIFACT``).
        concurrency: pooled runners (TensorRT execution contexts / ORT sessions / torch replicas
            share one model) = concurrent callers served at once; more callers wait.
        device: torch backends' device (default ``cuda`` when available else ``cpu``); trt: ``cuda:N``;
            ort: ``cpu`` (CPU provider only), ``cuda[:N]`` (the CUDA provider of onnxruntime-gpu, required),
            default CUDA when onnxruntime-gpu has it, else CPU.
        dtype: torch backend compute dtype (``fp32``/``bf16``/``fp16``).
        warmup: run every bucket once at load (timings in ``warmup_seconds``).
        compile: torch backend: ``torch.compile`` the forward.
        check_finite: reject NaN/inf inputs (InputError) and NaN/inf outputs (NumericsError) on every
            call; ``False`` for servers that check upstream. Cost: a max and a min over each input and
            the output (numpy / CPU tensors), one ``isfinite`` kernel + sync per tensor on CUDA.
        parallel: a :class:`trt_sora.parallel.ParallelConfig` (CFG-parallel x Ulysses) for the
            ``torch`` / ``torch-fp8`` backends, inside a ``torch.distributed`` job (``torchrun``;
            :func:`trt_sora.parallel.init_process_group`). Call ``load`` on every rank: rank 0 serves
            (``infer``), the other ranks call ``follow()`` until rank 0 closes.
        caching: serve the run folder's step caching (its ``recipe.yaml``'s ``caching`` section; without
            one, the setting its check passed) - only when the parity report checked exactly that setting
            with this backend, else ArtifactError (see :func:`caching_mismatch`); False: every step computes.

    Raises ArtifactError (unchecked/failed/changed artifact, report of another backend or GPU),
    BackendMissingError (backend not installed / no GPU), ConfigError (unknown backend).
    """
    t0 = time.perf_counter()
    run = Path(artifact_dir)
    if backend not in BACKENDS:
        from trt_sora.config.base import did_you_mean

        raise ConfigError(f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; use one of {BACKENDS}")
    rf = RunFolder(run)
    pair = rf.read_pair()  # a pair of experts (Wan 2.2 A14B): high/ and low/ expert folders
    exp = rf.export_side(pair).read_manifest("export")
    rep = read_report(run)
    if backend == "auto":
        backend = _auto_backend(run, rep, device)
    res = exp["results"]
    model_hash = pair["model_hash"] if pair else (res.get("model") or {}).get("model_hash")
    why = mismatch(rep, backend, _gpu_sm(device if backend != "trt" else (device or "cuda")), model_hash)
    verified = why is None
    if why is not None:
        msg = f"{run} {why}; {_fix(run, backend)}"
        if not force:
            raise ArtifactError(msg + ", or pass force=True")
        _loud(msg)
    files: dict[str, Path] = {}
    if rep is not None and backend != "torch" and verified:
        try:
            files = _verify_candidate_files(run, rep)
        except ArtifactError as exc:
            if not force:
                raise
            verified = False
            _loud(str(exc))
    if backend == "torch":
        files = {}
    buckets = _buckets(run, rep)
    from trt_sora.models import adapter_for_manifest

    cfg = dict(res["model"].get("config") or {})
    family = adapter_for_manifest(res["model"])  # input ranks, fixed feature dims and patch are family facts
    ranks, channels = family.input_ranks(), family.fixed_axes()
    kw = dict(concurrency=concurrency, device=device, dtype=dtype, compile=compile, threads=threads)
    if pair:
        from trt_sora.runtime.experts import ExpertsRunner

        per = {e: _make_runners(rf.expert(e).path, backend, {r: p for r, p in files.items()
                                                             if r.startswith(f"{e}/")}, rep,
                                family.expert(e), **kw)[0] for e in pair["experts"]}
        runners = [ExpertsRunner(per, pair["boundary_timestep"])]
    else:
        runners = _make_runners(run, backend, files, rep, family, **kw)
    if parallel is not None:
        runners = _parallel(runners, backend, parallel, concurrency)
    pooled = runners * concurrency if len(runners) == 1 else runners
    sr = ServingRunner(pooled, backend=backend, buckets=buckets, model_config=cfg, run_dir=run,
                       input_ranks=ranks, channels=channels, patch=tuple(family.patch_size),
                       check_finite=check_finite, input_dims=family.input_dims(), mask_inputs=family.mask_inputs)
    sr._runners = runners  # warm-up/close once per distinct runner
    sr.verified = verified
    sr.caching = _served_caching(run, rep, backend, force) if caching else None
    sr.load_seconds = time.perf_counter() - t0
    if warmup and getattr(runners[0], "rank", 0) == 0:  # followers warm up by following rank 0's calls
        sr.warm_up()
    log.info("runtime: %s backend, %d bucket(s), loaded in %.2f s%s", backend, len(buckets), sr.load_seconds,
             "" if verified else " (UNVERIFIED, force=True)")
    return sr


class ServedCache:
    """The step caching a run folder's check passed: its ``schedule`` (:class:`trt_sora.caching.CacheSchedule`),
    the ``sampling`` settings it was checked at (a request with other settings computes every step) and the
    report's ``record`` (setting, call counts, curve)."""

    def __init__(self, record: Mapping[str, Any], run: Path):
        from trt_sora.caching import CacheSchedule

        self.record = dict(record)
        self.schedule = CacheSchedule.from_dict(record.get("schedule") or {}, where=f"{run}/parity/report.json caching")
        self.sampling = dict(record.get("sampling") or {})

    def applies_to(self, settings) -> bool:
        """True when ``settings`` (SamplingSettings) are the checked ones."""
        return settings.to_dict() == self.sampling


def _run_caching(run: Path, rep: dict | None) -> dict | None:
    """The caching setting a run folder asks for: its ``recipe.yaml``'s section (None when off), else
    (no recipe recorded) the setting its report checked."""
    from trt_sora.config import load_recipe, to_dict

    rf = RunFolder(run)
    if rf.recipe.is_file():
        c = load_recipe(rf.recipe).caching
        return to_dict(c) if c.enabled else None
    return ((rep or {}).get("caching") or {}).get("setting")


def caching_mismatch(wanted: dict | None, rep: dict | None, backend: str) -> str | None:
    """Why ``rep`` does not vouch for serving the caching setting ``wanted`` (None when it does, or when
    ``wanted`` is None: no caching, what the loop level checked)."""
    if wanted is None:
        return None
    checked = (rep or {}).get("caching")
    name = f"{wanted.get('method')} threshold {wanted.get('threshold')}"
    if checked is None:
        return f"asks for step caching ({name}) that its parity check never ran"
    if checked.get("setting") != wanted:
        got = checked.get("setting") or {}
        diff = sorted(k for k in set(wanted) | set(got) if wanted.get(k) != got.get(k))
        said = ", ".join(f"{k}: checked {got.get(k)!r}, asked {wanted.get(k)!r}" for k in diff)
        return f"asks for step caching ({name}) but its check passed another setting ({said})"
    if not checked.get("passed"):
        return f"asks for step caching ({name}) that failed its gates (see parity/report.md)"
    ran = rep["candidate"].get("backend", rep.get("backend"))
    if ran != backend:
        return f"asks for step caching ({name}) checked on backend {ran!r}, not {backend!r}"
    return None


def _served_caching(run: Path, rep: dict | None, backend: str, force: bool) -> ServedCache | None:
    """The step caching to serve (None: every step computes); ArtifactError when the run folder's setting was
    not the one its check passed (``force``: logged, and served uncached)."""
    wanted = _run_caching(run, rep)
    why = caching_mismatch(wanted, rep, backend)
    if why is not None:
        msg = (f"{run} {why}; run `trt-sora check --run {run} --backend {'ort' if backend == 'torch' else backend}` "
               "with that recipe, or load with caching=False")
        if not force:
            raise ArtifactError(msg)
        _loud(msg + " (serving without caching)")
        return None
    return ServedCache(rep["caching"], run) if wanted is not None else None


def _parallel(runners: list, backend: str, parallel, concurrency: int) -> list:
    """The backend runner under CFG-parallel x Ulysses, rank 0 leading (see ServingRunner.follow)."""
    from trt_sora.runners.parallel_runner import ParallelRunner

    if backend not in ("torch", "torch-fp8"):
        raise ConfigError(f"parallel inference runs the torch backends (torch, torch-fp8), not {backend!r}; "
                          "load with backend='torch-fp8' or 'torch'")
    if concurrency != 1:
        raise ConfigError("parallel inference serves one call at a time across its ranks; use concurrency=1")
    return [ParallelRunner(runners[0], parallel, leader=True).activate()]


def _candidate_path(run: Path, files: Mapping[str, Path], suffix: str, fallback: Path | None) -> Path | None:
    """The verified file ending in ``suffix``; without a verified report (force=True) the fallback."""
    hits = [p for rel, p in files.items() if rel.endswith(suffix)]
    return hits[0] if hits else fallback


def _make_runners(run: Path, backend: str, files, rep, family, *, concurrency, device, dtype, compile,
                  threads) -> list:
    """The backend runner(s) over exactly the verified files."""
    rf = RunFolder(run)
    if backend == "trt":
        plan = _candidate_path(run, files, ".plan", rf.engine_plan(check_stage=False))
        if plan is None:
            raise ArtifactError(f"{rf.engine} has no engine; run `trt-sora build` or use backend='ort'")
        _gpu_check(run)
        from trt_sora.runners.trt_runner import TrtRunner

        dev = int(str(device).split(":")[-1]) if device and ":" in str(device) else 0
        flavor = rf.read_manifest("engine", check_stage=False).get("results", {}).get("backend")
        return [TrtRunner(plan, device=dev, contexts=concurrency, flavor=flavor).activate()]
    if backend == "torch-fp8":
        from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

        ran = ((rep or {}).get("candidate") or {}).get("device") or {}
        qmap = _candidate_path(run, files, QDQ_MAP, rf.qdq_map)
        stats = _candidate_path(run, files, CALIB_STATS, rf.calib_stats)
        return [TorchFp8Runner(family, qmap, stats, device=device or "cuda",
                               attention=AttentionPolicy.from_dict(ran.get("attention_policy")),
                               fast_accum=bool(ran.get("gemm_fast_accum", False))).activate()]
    if backend == "ort":
        from trt_sora.runners.ort_runner import OrtRunner, providers_for

        onnx = _candidate_path(run, files, ".onnx", rf.qdq_model if rf.qdq_model.is_file() else rf.onnx_model)
        # ORT's run() is thread-safe: share one session
        return [OrtRunner(onnx, threads=threads, providers=providers_for(device)).activate()]
    from trt_sora.runners.torch_runner import TorchRunner

    adapter = family
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = adapter.load(dtype, device)
    return [TorchRunner(adapter, dtype=dtype, device=device, model=model, compile=compile).activate()]


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


def diffusers_pipeline(runner, **kwargs):
    """A ready diffusers pipeline over ``runner`` (see :func:`trt_sora.runtime._pipeline.make_pipeline`)."""
    from trt_sora.runtime._pipeline import make_pipeline  # not "diffusers_pipeline": importing that
    # submodule would rebind this function's name on the package to the module (a second call then fails)

    return make_pipeline(runner, **kwargs)


from trt_sora.runtime.generate import Clip, ClipRequest, Generator, generate  # noqa: E402  (numpy + stdlib only)
