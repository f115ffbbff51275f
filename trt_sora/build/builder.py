"""Q/DQ ONNX -> TensorRT / TensorRT-RTX engine(s) + build report + ``manifest.json``.

One function, :func:`build_engine`, uses the TensorRT Python API (never a
subprocess): strongly typed network, ONNX parser reading external data from the
ONNX's folder, one optimization profile per shape bucket (or one engine per
bucket), timing cache next to the engine, optimization level, workspace,
compute-capability target (TensorRT-RTX), plugin libraries (full TensorRT). The
engine file name states the model, SM and backend version:
``wan-tiny.sm89.trtrtx-1.7.1.plan``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import resource
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trt_sora.build import report as rep
from trt_sora.build.backend import backend_version, check_target, is_rtx, load_backend
from trt_sora.config.recipe import AttentionMode, Backend, BuildConfig, QuantFormat, Recipe
from trt_sora.config.shapes import DIM_NAMES, ShapeProfile
from trt_sora.errors import BuildError, ConfigError, ShapeError
from trt_sora.manifest import (
    file_entry,
    load_onnx,
    read_manifest,
    staged_dir,
    verified_input,
    write_json,
    write_manifest,
)
from trt_sora.runfolder import RunFolder, manifest_path
from trt_sora.sm import sm_int

log = logging.getLogger("trt_sora")

TIMING_CACHE = "timing.cache"
BUILD_LOG = "build_log.txt"


@dataclasses.dataclass(frozen=True)
class BuildTarget:
    """Where the engine runs: backend, compute capability ``"8.9"``, GEMM quant format."""

    backend: Backend
    compute_capability: str
    quant_format: QuantFormat = QuantFormat.NONE

    @property
    def sm(self) -> int:
        return sm_int(self.compute_capability)


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """Engine file(s) (one per bucket when ``separate_engines``), report and manifest."""

    out_dir: Path
    engine_paths: tuple[Path, ...]
    report: dict
    manifest: dict

    @property
    def engine_path(self) -> Path:
        return self.engine_paths[0]


# ----------------------------------------------------------------------------- helpers

def _capture_logger(trt):
    """A ``trt.ILogger`` that keeps the lines the report needs and forwards problems to logging."""

    class CaptureLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.kept: list[str] = []
            self.errors: list[str] = []
            self.quiet_cuda = True  # CPU-only builders log a CUDA driver error at start-up; expected

        def log(self, severity, msg):  # noqa: D401 - TensorRT callback
            S = trt.ILogger.Severity
            if severity in (S.INTERNAL_ERROR, S.ERROR):
                if self.quiet_cuda and "cudaError" in msg:
                    log.debug("TensorRT (expected without a GPU): %s", msg)
                    return
                self.errors.append(msg)
                self.kept.append(f"[E] {msg}")
                log.warning("TensorRT: %s", msg)
            elif severity == S.WARNING:
                self.kept.append(f"[W] {msg}")
                log.info("TensorRT: %s", msg)
            elif msg.startswith("Layers:") or "I/O Tensors:" in msg or msg.startswith("Engine generation") \
                    or "Total Weights Memory" in msg or "Total Activation Memory" in msg:
                self.kept.append(msg)

        @property
        def text(self) -> str:
            return "\n".join(self.kept)

    return CaptureLogger()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _load_export_manifest(export_manifest, onnx_path: Path) -> dict | None:
    if isinstance(export_manifest, Mapping):
        return dict(export_manifest)
    if export_manifest is not None:
        p = Path(export_manifest)
        return read_manifest(p.parent if p.is_file() else p, stage="export")
    for cand in (onnx_path.parent, RunFolder(onnx_path.parent.parent).export):  # beside it, or the run's export/
        mp = manifest_path(cand)
        if mp.is_file():
            try:
                m = json.loads(mp.read_text())
            except json.JSONDecodeError:
                continue
            if m.get("stage") == "export":
                return m
    return None


def _input_dims(model) -> dict[str, list]:
    """ONNX graph inputs -> per-axis dim_param name or static int."""
    out = {}
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        out[vi.name] = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None)
                        for d in vi.type.tensor_type.shape.dim]
    return out


def _check_buckets(buckets: Sequence[ShapeProfile], dims: Mapping[str, list], export: dict | None) -> None:
    """Buckets must lie inside the exported dynamic ranges and agree with static ONNX sizes."""
    ranges = (export or {}).get("results", {}).get("dynamic") or {}
    for b in buckets:
        for dim, r in b.dims():
            if dim in ranges:
                lo, _, hi = ranges[dim]
                if r.min < lo or r.max > hi:
                    raise ShapeError(
                        f"bucket {b.name!r}: {dim} {r.min}..{r.max} lies outside the exported range {lo}..{hi}; "
                        f"re-export with a wider export.dynamic.{dim} or shrink the bucket")
    named = {d for ds in dims.values() for d in ds if isinstance(d, str)}
    dim_names = (export or {}).get("results", {}).get("dim_names") or {}
    for inp, axes in dim_names.items():  # static axes that the export manifest says are named dims
        for axis, dim in axes.items():
            shape = dims.get(inp)
            if shape is None or int(axis) >= len(shape) or not isinstance(shape[int(axis)], int):
                continue
            size = shape[int(axis)]
            for b in buckets:
                r = b.range(dim)
                if (r.min, r.max) != (size, size):
                    raise ShapeError(f"bucket {b.name!r}: {dim} {r.min}..{r.max} but the ONNX input {inp!r} has "
                                     f"a static size {size} on axis {axis}; re-export with {dim} dynamic or "
                                     f"set the bucket's {dim} to {size}")
    known = tuple(DIM_NAMES) + tuple(k for b in buckets for k, _ in b.extra if k not in DIM_NAMES)
    for inp, shape in dims.items():
        for axis, d in enumerate(shape):
            if isinstance(d, str) and d not in known:
                raise BuildError(f"ONNX input {inp!r} axis {axis} is dynamic with the unknown name {d!r}; "
                                 f"expected one of {known} — export with `trt-sora export` (and build with "
                                 "the model's buckets, which carry its own dims)")
            if d is None:
                raise BuildError(f"ONNX input {inp!r} axis {axis} is dynamic without a name; "
                                 "export with `trt-sora export` so every dynamic axis is named")
    if not named and dims:
        log.info("ONNX inputs are fully static; every bucket must match them")


def _shape(spec: list, point: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(point[d] if isinstance(d, str) else int(d) for d in spec)


def _check_quantized(facts: rep.OnnxFacts, fmt: QuantFormat, onnx_path: Path) -> None:
    want = {QuantFormat.FP8_E4M3: "fp8", QuantFormat.INT8: "int8"}.get(fmt)
    if want is None:
        return
    if facts.num_qdq == 0:
        raise BuildError(f"{onnx_path} has no Q/DQ nodes but the recipe asks for {fmt.value} GEMMs; "
                         "run the quantize stage first (`trt-sora quantize`, giving quant/model.qdq.onnx) "
                         "and build that file")
    if want not in facts.q_formats:
        raise BuildError(f"{onnx_path} holds {', '.join(sorted(facts.q_formats)) or 'unknown'} Q/DQ but the recipe "
                         f"asks for {fmt.value}; re-run the quantize stage with this recipe")


def _resolve_plugins(names: Sequence[str]) -> list[Path]:
    from trt_sora.config import repo_root

    out = []
    for n in names:
        p = Path(n)
        if p.is_file():
            out.append(p)
            continue
        folder = repo_root() / "plugins" / n
        libs = sorted(folder.glob("**/*.so")) if folder.is_dir() else []
        if not libs:
            raise BuildError(f"plugin {n!r}: no shared library found (looked for {p} and {folder}/**/*.so); "
                             f"build it first (see plugins/{n}/README.md) or remove it from build.plugins")
        out.append(libs[0])
    return out


def _timing_cache(trt, config, cache_file: Path | None, lg) -> tuple[Any, str]:
    """Create the builder's timing cache from ``cache_file`` if it is sound, else an empty one.

    Soundness: our sidecar ``<cache>.json`` sha256 must match, and TensorRT must accept
    the bytes without logging an error. Returns ``(cache, status)``.
    """
    with warnings.catch_warnings():  # TensorRT-RTX >= 1.2: timing cache ops are deprecated no-ops
        warnings.simplefilter("ignore", DeprecationWarning)
        status = "none"
        if cache_file is not None and cache_file.is_file():
            data = cache_file.read_bytes()
            side = cache_file.with_name(cache_file.name + ".json")
            problem = None
            try:
                meta = json.loads(side.read_text()) if side.is_file() else {}
            except json.JSONDecodeError:
                meta = {"sha256": "unreadable"}
            if meta.get("sha256") and meta["sha256"] != hashlib.sha256(data).hexdigest():
                problem = "its checksum does not match (corrupted or truncated)"
            cache = None
            if problem is None:
                n_err = len(lg.errors)
                try:
                    cache = config.create_timing_cache(data)
                except Exception as exc:  # TensorRT raises several types for bad caches
                    problem = f"TensorRT rejected it ({exc})"
                if cache is None and problem is None:
                    problem = "TensorRT rejected it"
                if len(lg.errors) > n_err and problem is None:
                    problem = f"TensorRT rejected it ({lg.errors[-1]})"
                    del lg.errors[n_err:]
            if problem is None:
                return cache, "loaded"
            log.warning("timing cache %s is unusable: %s; building without it (a fresh cache is written)",
                        cache_file, problem)
            status = "corrupt_ignored"
        return config.create_timing_cache(b""), status


def _save_timing_cache(config, path: Path, backend_ver: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cache = config.get_timing_cache()
        if cache is None:
            return
        data = bytes(cache.serialize())
    path.write_bytes(data)
    write_json(path.with_name(path.name + ".json"),
               {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "backend_version": backend_ver})


def engine_file_name(model: str, sm: int, backend: Backend, version: str, bucket: str | None = None) -> str:
    """``<model>[.<bucket>].sm<SM>.<trt|trtrtx>-<x.y.z>.plan``."""
    tag = "trtrtx" if Backend(backend) is Backend.TENSORRT_RTX else "trt"
    safe = lambda s: "".join(c if c.isalnum() or c in "-_." else "-" for c in s)  # noqa: E731
    parts = [safe(model)] + ([safe(bucket)] if bucket else []) + [f"sm{sm}", f"{tag}-{version}", "plan"]
    return ".".join(parts)


# ----------------------------------------------------------------------------- plan

@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """One engine file: its bucket (None: every bucket in one engine) and one optimization profile per
    bucket, ``(bucket name, {ONNX input: (min, opt, max) shape})``."""

    bucket: str | None
    profiles: tuple[tuple[str, Mapping[str, tuple[tuple[int, ...], ...]]], ...]


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """What :func:`build_engine` builds, decided from the ONNX file, its export manifest and the recipe
    before the backend loads. Every network is strongly typed, with detailed profiling verbosity.

    Attributes:
        name: the recipe's name (``"build"`` for a bare :class:`BuildConfig`).
        onnx_path: the (Q/DQ) ONNX file the parser reads.
        target, build, buckets: the backend / SM / quant format, the ``build`` section, the buckets.
        model_name: the engine files' model part.
        engines: one :class:`EnginePlan` per engine file.
        timing_cache: read from an earlier build, written by this one (when ``build.timing_cache``).
        facts: the ONNX graph's Q/DQ facts (the report compares the engine against them).
        has_export, export_created: whether an export manifest was found, and its ``created``
            (recorded as an input).
    """

    name: str
    onnx_path: Path
    target: BuildTarget
    build: BuildConfig
    buckets: tuple[ShapeProfile, ...]
    model_name: str
    engines: tuple[EnginePlan, ...]
    timing_cache: Path
    facts: rep.OnnxFacts
    has_export: bool = False
    export_created: str | None = None

    @property
    def workspace_bytes(self) -> int:
        return int(self.build.workspace_gb * (1 << 30))

    def engine_file(self, engine: EnginePlan, version: str) -> str:
        return engine_file_name(self.model_name, self.target.sm, self.target.backend, version, engine.bucket)


def plan_build(onnx_path: str | os.PathLike, config: Recipe | BuildConfig, out_dir: str | os.PathLike, *,
               buckets: Sequence[ShapeProfile] | None = None, target: BuildTarget | None = None,
               export_manifest: Mapping | str | os.PathLike | None = None, model_name: str | None = None,
               timing_cache: str | os.PathLike | None = None) -> BuildPlan:
    """The :class:`BuildPlan` for :func:`build_engine`'s arguments; reads the ONNX file (no weights),
    loads no backend, writes nothing. Raises what :func:`build_engine` raises for bad inputs."""
    onnx_path = Path(onnx_path)
    name, build_cfg, buckets, target, default_model = _settings(config, buckets, target, onnx_path)
    if not onnx_path.is_file():
        raise BuildError(f"{onnx_path} does not exist; run the export (and quantize) stage first")
    check_target(target.backend, target.sm, target.quant_format)
    if target.backend is Backend.TENSORRT_RTX and (build_cfg.plugins or build_cfg.attention is AttentionMode.PLUGIN):
        raise BuildError("TensorRT-RTX cannot build plugins (its network has no add_plugin_v3); set "
                         "`build.attention: native` and remove `build.plugins`, or use a `backend: tensorrt` recipe")
    model = load_onnx(verified_input(onnx_path), load_external_data=False, fix="re-run `trt-sora quantize`")
    facts = rep.onnx_facts(model)
    _check_quantized(facts, target.quant_format, onnx_path)
    export = _load_export_manifest(export_manifest, onnx_path)
    dims = _input_dims(model)
    del model
    _check_buckets(buckets, dims, export)
    res = (export or {}).get("results", {})
    patch = res.get("patch_size") or (res.get("model", {}).get("config", {}) or {}).get("patch_size")
    if patch and not isinstance(patch, int):
        for b in buckets:
            b.validate(tuple(patch))
    if model_name is None:
        ref = res.get("model", {}).get("ref")
        model_name = Path(str(ref)).name if ref else default_model
    groups = [(b.name, [b]) for b in buckets] if build_cfg.separate_engines else [(None, list(buckets))]
    engines = tuple(EnginePlan(g, tuple((b.name, _profile(dims, b)) for b in bs)) for g, bs in groups)
    cache_file = Path(timing_cache) if timing_cache else Path(out_dir) / TIMING_CACHE
    return BuildPlan(name, onnx_path, target, build_cfg, buckets, model_name, engines, cache_file, facts,
                     bool(export), (export or {}).get("created"))


def _settings(config: Recipe | BuildConfig, buckets, target, onnx_path: Path):
    """``(name, build config, buckets, target, default model name)`` from a recipe or a bare config."""
    if isinstance(config, Recipe):
        target = target or BuildTarget(config.backend, config.compute_capability, config.quantization.format)
        return config.name, config.build, tuple(buckets or config.buckets), target, config.model.default
    if not buckets or target is None:
        raise ConfigError("build_engine with a BuildConfig needs `buckets` and `target`; or pass a Recipe")
    return "build", config, tuple(buckets), target, onnx_path.stem


def _profile(dims: Mapping[str, list], bucket: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {name: tuple(_shape(spec, bucket.point(w)) for w in ("min", "opt", "max")) for name, spec in dims.items()}


# ----------------------------------------------------------------------------- the stage

def build_engine(onnx_path: str | os.PathLike, config: Recipe | BuildConfig, out_dir: str | os.PathLike, *,
                 buckets: Sequence[ShapeProfile] | None = None, target: BuildTarget | None = None,
                 export_manifest: Mapping | str | os.PathLike | None = None, model_name: str | None = None,
                 timing_cache: str | os.PathLike | None = None) -> BuildResult:
    """Build TensorRT engine(s) from a (Q/DQ) ONNX file into ``out_dir``.

    ``config`` is a :class:`Recipe` (buckets, backend, target and quant format come from
    it) or a :class:`BuildConfig` plus ``buckets`` and ``target``. ``export_manifest``
    (dict, folder or file; default: found beside the ONNX or in ``../export``) gives the
    exported dynamic ranges that buckets must lie in. ``timing_cache`` defaults to
    ``out_dir/timing.cache`` (read from an earlier build, written by this one).

    Writes ``out_dir/<model>.sm<SM>.<trt|trtrtx>-<ver>.plan`` (one per bucket with
    ``build.separate_engines``), ``build_report.json`` + ``.md``, ``build_log.txt``,
    ``timing.cache`` and ``manifest.json``, atomically. Raises :class:`ConfigError`
    (unsupported target), :class:`ShapeError` (bucket outside the exported ranges),
    :class:`BackendMissingError`, or :class:`BuildError` (parse/build failure, missing
    Q/DQ, unmet ``build.requirements`` — then ``build_report.failed.json`` is written
    to ``out_dir`` and any earlier artifact there is kept).
    """
    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    plan = plan_build(onnx_path, config, out_dir, buckets=buckets, target=target, export_manifest=export_manifest,
                      model_name=model_name, timing_cache=timing_cache)
    trt = load_backend(plan.target.backend)  # after the cheap checks: a missing backend fails fast, nothing lost
    with _scratch_dir(out_dir) as scratch:  # engines stream to disk here; moved in when all passed
        built = _build_engines(trt, plan, scratch)
        report = _report(trt, plan, built, t_start)
        _check_requirements(plan, built, report, out_dir)
        return _write(out_dir, plan, built, report)


@dataclasses.dataclass
class _Built:
    """The engines :func:`_build_engines` wrote to the scratch folder, and what the report needs."""

    version: str
    rtx: bool
    logger: Any
    engines: list[tuple[str, Path, str, int]] = dataclasses.field(default_factory=list)  # file, path, log, profiles
    cache_status: str = "disabled"
    seconds: float = 0.0
    last_config: Any = None


def _build_engines(trt, plan: BuildPlan, scratch: Path) -> _Built:
    """Parse, configure and build each planned engine into ``scratch``."""
    built = _Built(backend_version(trt), is_rtx(trt), _capture_logger(trt))
    lg = built.logger
    builder = trt.Builder(lg)
    lg.quiet_cuda = False
    if not built.rtx:
        for lib in _resolve_plugins(plan.build.plugins):
            if trt.get_plugin_registry().load_library(str(lib)) is None:
                raise BuildError(f"TensorRT could not load plugin library {lib}; rebuild it for TensorRT "
                                 f"{built.version}")
    for engine in plan.engines:
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, lg)
        if not parser.parse_from_file(str(plan.onnx_path)):  # resolves model.onnx.data next to the file
            errs = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
            raise BuildError(f"TensorRT's ONNX parser rejected {plan.onnx_path}: {errs or 'unknown error'}; "
                             "check that the .onnx.data file lies beside it and the opset is >= 19")
        bcfg = _builder_config(trt, builder, plan, built)
        _add_profiles(builder, network, bcfg, engine)
        n_prof = bcfg.num_optimization_profiles
        log.info("building %s for SM%d with %d profile(s) (%s %s)", plan.onnx_path.name, plan.target.sm, n_prof,
                 plan.target.backend.value, built.version)
        t0 = time.perf_counter()
        n_err = len(lg.errors)
        fname = plan.engine_file(engine, built.version)
        ok = _serialize_to_file(trt, builder, network, bcfg, scratch / fname)
        built.seconds += time.perf_counter() - t0
        if not ok:
            raise BuildError(f"TensorRT failed to build the engine for SM{plan.target.sm}: "
                             f"{'; '.join(lg.errors[n_err:][-3:]) or 'no error message'}")
        built.engines.append((fname, scratch / fname, lg.text, n_prof))
        lg.kept.clear()
        built.last_config = bcfg
        del parser, network
    return built


def _builder_config(trt, builder, plan: BuildPlan, built: _Built):
    """The builder config: optimization level, workspace, detailed profiling, the SM (TensorRT-RTX)
    and the timing cache."""
    bcfg = builder.create_builder_config()
    bcfg.builder_optimization_level = plan.build.optimization_level
    bcfg.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    bcfg.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if built.rtx:
        cc = getattr(trt.ComputeCapability, f"SM{plan.target.sm}", None)
        if cc is None:
            sms = [m for m in trt.ComputeCapability.__members__ if m.startswith("SM")]
            raise ConfigError(f"TensorRT-RTX {built.version} has no compute capability SM{plan.target.sm}; "
                              f"choose one of {sms}")
        bcfg.num_compute_capabilities = 1
        bcfg.set_compute_capability(cc, 0)
    if plan.build.timing_cache:
        tc, built.cache_status = _timing_cache(trt, bcfg, plan.timing_cache, built.logger)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            bcfg.set_timing_cache(tc, ignore_mismatch=False)
    return bcfg


def _add_profiles(builder, network, bcfg, engine: EnginePlan) -> None:
    """One optimization profile per planned bucket, over every network input."""
    for bucket, shapes in engine.profiles:
        prof = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            inp = network.get_input(i)
            if inp.name not in shapes:
                raise BuildError(f"network input {inp.name!r} is not an ONNX graph input")
            prof.set_shape(inp.name, *shapes[inp.name])
        if bcfg.add_optimization_profile(prof) < 0:
            raise BuildError(f"TensorRT rejected the profile for bucket {bucket!r}; check its shapes")


def _report(trt, plan: BuildPlan, built: _Built, t_start: float) -> dict:
    """``build_report.json``: engines, profiles, timings and what runs in which precision."""
    reports = []
    for fname, epath, text, n_prof in built.engines:
        layers, in_engine, evidence = _layer_info(trt, epath, text, built.logger)
        reports.append({"file": fname, "bytes": epath.stat().st_size, "profiles_built": n_prof,
                        "profiles_in_engine": in_engine, "evidence": evidence,
                        "analysis": rep.analyze(layers, plan.facts)})
    first = reports[0]
    return {
        "name": plan.name,
        "status": "ok",
        "failures": [],
        "backend": plan.target.backend.value,
        "backend_version": str(getattr(trt, "__version__", built.version)),
        "sm": plan.target.sm,
        "quant_format": QuantFormat(plan.target.quant_format).value,
        "onnx": str(plan.onnx_path.resolve()),
        "buckets": [b.to_yaml() for b in plan.buckets],
        "separate_engines": plan.build.separate_engines,
        "engines": [{"file": r["file"], "bytes": r["bytes"], "profiles": r["profiles_in_engine"]} for r in reports],
        "engine_bytes": sum(r["bytes"] for r in reports),
        "profiles": {"built": sum(r["profiles_built"] for r in reports),
                     "in_engine": sum(r["profiles_in_engine"] or 0 for r in reports),
                     "evidence": first["evidence"]},
        "build_seconds": round(built.seconds, 2),
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "timing_cache": built.cache_status + (" (TensorRT-RTX: timing cache ops are no-ops)" if built.rtx and
                                              plan.build.timing_cache else ""),
        "onnx_qdq_nodes": plan.facts.num_qdq,
        "analysis": first["analysis"],
        "per_engine": [{"file": r["file"], "analysis": r["analysis"]} for r in reports[1:]],
    }


def _check_requirements(plan: BuildPlan, built: _Built, report: dict, out_dir: Path) -> None:
    """Raise (writing ``build_report.failed.json`` and the log) when an engine misses ``build.requirements``."""
    fails = list(rep.check_requirements(report, plan.build.requirements))
    for r in report["per_engine"]:
        fails += [f"{r['file']}: {f}" for f in rep.check_requirements({"analysis": r["analysis"]},
                                                                     plan.build.requirements)]
    if fails:
        report["status"] = "failed"
        report["failures"] = fails
        path = rep.write_report(out_dir, report, failed=True)
        (out_dir / BUILD_LOG).write_text("\n\n".join(t for _, _, t, _ in built.engines))
        raise BuildError(f"engine misses the recipe's requirements: {'; '.join(fails)}. "
                         f"Report: {path}. Fix: {rep.requirement_fix_hint(fails)}")


def _write(out_dir: Path, plan: BuildPlan, built: _Built, report: dict) -> BuildResult:
    """Move the engines in and write the log, timing cache, report and manifest, staged."""
    with staged_dir(out_dir) as tmp:
        paths = []
        for fname, epath, _, _ in built.engines:
            os.replace(epath, tmp / fname)  # same filesystem: a rename, not a copy of the plan file
            paths.append(fname)
        (tmp / BUILD_LOG).write_text("\n\n".join(t for _, _, t, _ in built.engines))
        if plan.build.timing_cache and built.last_config is not None:
            _save_timing_cache(built.last_config, tmp / TIMING_CACHE, built.version)
        rep.write_report(tmp, report)
        spec = {"target": plan.target, "buckets": [b.to_yaml() for b in plan.buckets], "build": plan.build}
        inputs = {"onnx": file_entry(plan.onnx_path)}
        if plan.has_export:
            inputs["export_manifest_created"] = plan.export_created
        analysis = report["analysis"]
        manifest = write_manifest(
            tmp, stage="build", inputs=inputs, config=spec,
            outputs={"engines": paths, "report": rep.REPORT_JSON, "report_md": rep.REPORT_MD},
            results={k: report[k] for k in ("backend", "backend_version", "sm", "engine_bytes", "profiles",
                                            "build_seconds", "peak_rss_mb")}
            | {"fp8_gemm_fraction": analysis["fp8_gemm_fraction"],
               "int8_gemm_fraction": analysis["int8_gemm_fraction"],
               "gemm_counts": analysis["gemm_counts"],
               "attention_fused": analysis["attention"]["fused"]})
    log.info("built %s: %.1f MB, %d profile(s), FP8 GEMMs %d/%d, %.1f s", paths[0], report["engine_bytes"] / 1e6,
             report["profiles"]["in_engine"], analysis["gemm_counts"].get("fp8", 0), analysis["gemm_total"],
             built.seconds)
    return BuildResult(out_dir, tuple(out_dir / p for p in paths), report, manifest)


@contextlib.contextmanager
def _scratch_dir(out_dir: Path):
    """A hidden folder beside ``out_dir`` (same filesystem) for engine files as they are built; removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.engines-", dir=out_dir.parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _serialize_to_file(trt, builder, network, config, path: Path) -> bool:
    """Build and write the plan to ``path``: streamed chunk by chunk where the builder can
    (``build_serialized_network_to_stream``: a 15 GB plan never sits in host memory twice), else
    written from the builder's buffer without a Python copy. False when the build failed."""
    with open(path, "wb") as fh:
        if hasattr(builder, "build_serialized_network_to_stream"):
            writer = _stream_writer(trt, fh)
            ok = bool(builder.build_serialized_network_to_stream(network, config, writer))
            if writer.error is not None:
                raise BuildError(f"writing the engine to {path} failed: {writer.error}") from writer.error
        else:
            blob = builder.build_serialized_network(network, config)
            ok = blob is not None
            if ok:
                fh.write(memoryview(blob))
    return ok and path.stat().st_size > 0


def _stream_writer(trt, fh):
    """A ``trt.IStreamWriter`` appending each chunk to ``fh``; remembers the first error (TensorRT only
    logs exceptions raised inside the callback)."""

    class FileWriter(trt.IStreamWriter):
        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.error: BaseException | None = None

        def write(self, data, size=None):  # noqa: D401 - TensorRT callback
            try:
                if size is None:  # bytes-like (TensorRT-RTX 1.7)
                    fh.write(data)
                    return len(data)
                import ctypes  # a capsule around `size` bytes (other bindings)

                get = ctypes.pythonapi.PyCapsule_GetPointer
                get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
                name = ctypes.pythonapi.PyCapsule_GetName
                name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
                fh.write(ctypes.string_at(get(data, name(data)), int(size)))
                return int(size)
            except BaseException as exc:  # noqa: BLE001 - reported after the build
                self.error = self.error or exc
                return 0

    return FileWriter()


def _gpu_present() -> bool:
    """Whether a CUDA driver with at least one device is there (cheap; no torch, no TensorRT runtime)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except OSError:
        return False


def _layer_info(trt, path: Path, text: str, lg) -> tuple[list[rep.LayerInfo], int | None, str]:
    """Layers + profile count: EngineInspector when the engine deserializes (GPU), else the log."""
    if not _gpu_present():  # a CPU-only builder cannot deserialize: do not read a 15 GB plan to find out
        return _layers_from_log(text)
    lg.quiet_cuda = True
    try:
        runtime = trt.Runtime(lg)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    except Exception:  # no GPU: deserialization is impossible; fall back to the builder's log
        engine = None
    finally:
        lg.quiet_cuda = False
    if engine is not None:
        insp = engine.create_engine_inspector()
        lines = insp.get_engine_information(trt.LayerInformationFormat.ONELINE)
        return rep.parse_layer_dump(lines), engine.num_optimization_profiles, "deserialized engine"
    return _layers_from_log(text)


def _layers_from_log(text: str) -> tuple[list[rep.LayerInfo], int | None, str]:
    layers = rep.parse_layer_dump(text)
    if not layers:
        log.warning("the builder log has no per-layer dump; the report cannot prove precisions "
                    "(needs profiling verbosity DETAILED)")
    return layers, rep.parse_profile_count(text), "builder log (I/O tensor ProfileInfo; no GPU to deserialize)"
