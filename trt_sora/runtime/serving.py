"""``ServingRunner``: the thread-safe, input-validating front ``runtime.load`` returns."""
from __future__ import annotations

import math
import queue
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trt_sora.config.shapes import DIM_NAMES, ShapeProfile, check_point
from trt_sora.errors import ArtifactError, NumericsError, ShapeError
from trt_sora.runtime.served_caching import ServedCache


class InputError(ShapeError):
    """A request's input has the wrong name, dtype or rank (the process keeps serving)."""


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
