"""torch -> ONNX (dynamo exporter), named dynamic axes, external data, ORT verification.

Lessons baked in: the TorchScript exporter silently bakes shapes,
torch.export specialises size-1 dims (so we trace at a point where every dynamic
dim is >= 2), and ``timestep`` stays fp32. Every export is checked by
``onnx.checker`` and by ONNX Runtime against PyTorch at two points that differ in
every dynamic dim, batch included.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trt_sora.config import DimRange, DType, ExportConfig, ExternalData
from trt_sora.errors import ExportError, require
from trt_sora.manifest import recorded_file_entry, staged_dir, write_manifest
from trt_sora.metrics import compare  # noqa: F401 (one metric implementation for every stage)
from trt_sora.onnx_tools import ort_session  # noqa: F401 (re-exported: export verification's session)
from trt_sora.runfolder import ONNX_MODEL

log = logging.getLogger("trt_sora")

PROTOBUF_LIMIT = 2_000_000_000  # bytes; larger models must use external data
ONNX_NAME = ONNX_MODEL


@dataclasses.dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    manifest: dict

    @property
    def parity(self) -> list[dict]:
        return self.manifest["results"]["parity"]


def _patch_of(adapter) -> dict[str, int]:
    pt, ph, pw = adapter.patch_size
    return {**{d: 1 for d in adapter.dim_names}, "latent_frames": pt, "latent_height": ph, "latent_width": pw}


def export_ranges(adapter, config: ExportConfig) -> dict[str, DimRange]:
    """The exported range of every dim of ``adapter``: the recipe's ``export.dynamic`` plus the
    family's own dims (:attr:`~trt_sora.models.base.ModelAdapter.family_dims`) at their defaults."""
    return {**{k: DimRange(*v) for k, v in adapter.family_dims.items()}, **dict(config.dynamic)}


def _fit(v: int, r: DimRange, step: int) -> int:
    """Nearest multiple of ``step`` inside ``r`` (prefer <= v)."""
    lo = math.ceil(r.min / step) * step
    hi = (r.max // step) * step
    if lo > hi:
        raise ExportError(f"range {r.min}..{r.max} holds no multiple of the patch size {step}; widen it")
    return max(lo, min(hi, (v // step) * step or step))


def export_point(adapter, ranges: Mapping[str, DimRange]) -> dict[str, int]:
    """Trace point: every dim >= 2 (torch.export specialises 0/1) and divisible by the patch."""
    steps = _patch_of(adapter)
    point = {}
    for dim in adapter.dim_names:
        r, s = ranges[dim], steps[dim]
        want = max(2 * s, 2, r.min)
        if want > r.max:
            raise ExportError(f"export.dynamic.{dim} max={r.max} is below 2; a dynamic dim must reach >= 2 "
                              "at export (torch.export specialises size-1 dims)")
        point[dim] = _fit(want, r, s)
    return point


def default_verify_points(adapter, ranges: Mapping[str, DimRange]) -> list[dict[str, int]]:
    """Two small points that differ in every dim (batch included), odd frames, non-square."""
    steps = _patch_of(adapter)
    a = {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 7}
    b = {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 4, "text_len": 12}
    for k, extra in enumerate(adapter.family_dims):  # a family's own dims differ between the points too
        a[extra], b[extra] = 5 + k, 9 + k
    out = []
    for p in (a, b):
        out.append({d: _fit(p[d], ranges[d], steps[d]) for d in adapter.dim_names})
    return out


def _dynamic_shapes(adapter, ranges: Mapping[str, DimRange]) -> dict[str, dict[int, Any]]:
    import torch

    steps = _patch_of(adapter)
    dims: dict[str, Any] = {}
    for dim in adapter.dim_names:
        r, s = ranges[dim], steps[dim]
        if s == 1:
            dims[dim] = torch.export.Dim(dim, min=max(1, r.min), max=r.max)
        else:  # derived dim: the patchify reshape needs divisibility, say it up front
            dims[dim] = s * torch.export.Dim(f"{dim}_div{s}", min=max(1, math.ceil(r.min / s)), max=r.max // s)
    spec = adapter.input_dims()
    return {name: {axis: dims[d] for axis, d in spec[name].items()} for name in adapter.input_names}


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())


def _rename_dims(onnx_path: Path, adapter) -> None:
    """Give graph inputs/outputs our dim names instead of the exporter's ``s0``/``2*s1``."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    spec = adapter.input_dims()
    rename: dict[str, str] = {}
    for vi in list(model.graph.input) + list(model.graph.output):
        for axis, dim in spec.get(vi.name, {}).items():
            d = vi.type.tensor_type.shape.dim[axis]
            if d.dim_param and d.dim_param != dim:
                rename.setdefault(d.dim_param, dim)
            d.dim_param = dim
    for vi in model.graph.value_info:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]
    onnx.save(model, str(onnx_path))


#: Weightless exports verify the whole graph in one ONNX Runtime session up to this many weight bytes,
#: and segment by segment (one block's weights at a time) above it.
WHOLE_GRAPH_VERIFY_BYTES = 1 << 30


def dead_linears(onnx_path, model) -> list[str]:
    """The ``nn.Linear`` modules of ``model`` with no node in the exported graph: dead code the exporter
    dropped because their output is never used (the quantize stage skips their statistics)."""
    import onnx
    import torch

    from trt_sora.onnx_tools import module_path, node_scopes

    graph = onnx.load(str(onnx_path), load_external_data=False)
    seen = {module_path(sc) for sc in node_scopes(graph).values()}
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in seen]


#: A fp16 export's ONNX Runtime and PyTorch outputs each round in fp16 (other accumulation orders): the
#: max-abs bar is at least this many units in the last place of the dtype at the output's scale.
ROUNDING_ULPS = 4
_EPS = {DType.FP32: 0.0, DType.FP16: 2.0 ** -10, DType.BF16: 2.0 ** -7}


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What :func:`export_onnx` traces, writes and verifies.

    Attributes:
        ranges: every dynamic dim's exported range (the recipe's ``export.dynamic`` + the family's dims).
        point: the trace point (every dim >= 2, divisible by the patch).
        verify_points: where ONNX Runtime is compared with PyTorch (empty when ``verify`` is off).
        opset, dtype: the ONNX opset and the float type of the weights.
        weightless: the graph is traced from the empty model, weights streamed from the source.
        param_bytes: weight bytes; ``external``: whether they go to ``model.onnx.data``.
        verify_mode: ``"whole-graph"``, ``"segmented"`` (one block's weights at a time) or None.
    """

    ranges: Mapping[str, DimRange]
    point: Mapping[str, int]
    verify_points: tuple[Mapping[str, int], ...]
    opset: int
    dtype: DType
    weightless: bool
    param_bytes: int
    external: bool
    verify_mode: str | None


def plan_export(adapter, config: ExportConfig, model, *, weightless: bool,
                segmented: bool | None = None) -> ExportPlan:
    """The :class:`ExportPlan` for ``model`` (loaded, or the family's empty model when ``weightless``);
    changes nothing. Raises :class:`ExportError` for a verify point outside the ranges or weights over
    protobuf's limit without external data."""
    ranges = export_ranges(adapter, config)
    point = export_point(adapter, ranges)
    points = [adapter.with_family_dims(p) for p in config.verify_points] or default_verify_points(adapter, ranges)
    for p in points:
        for d in adapter.dim_names:
            if not ranges[d].contains(p[d]):
                raise ExportError(f"verify point {p} has {d}={p[d]} outside the exported range "
                                  f"{ranges[d].min}..{ranges[d].max}")
    pb = _param_bytes(model)
    external = {ExternalData.ALWAYS: True, ExternalData.NEVER: False}.get(config.external_data, pb > PROTOBUF_LIMIT)
    if not external and pb > PROTOBUF_LIMIT:
        raise ExportError(f"model weights are {pb / 1e9:.1f} GB, over protobuf's 2 GB limit; "
                          "set export.external_data to auto or always")
    mode = None
    if config.verify:
        seg = (weightless and pb > WHOLE_GRAPH_VERIFY_BYTES) if segmented is None else segmented
        mode = "segmented" if seg else "whole-graph"
    return ExportPlan(ranges, point, tuple(points), config.opset, config.dtype, weightless, pb, external, mode)


def export_onnx(model_ref, config: ExportConfig, out_dir: str | Path, *, model=None,
                segmented: bool | None = None, traces: dict | None = None) -> ExportResult:
    """Export ``model_ref`` (name, checkpoint folder or adapter) to ``out_dir/model.onnx``.

    Without ``model`` the export is *weightless*: the graph is traced from the family's empty model
    (fake tensors, no weight memory) and the weights are streamed tensor by tensor from the
    checkpoint's safetensors (or the named config's random init) into ``model.onnx.data``; the
    graph and the bytes are the same as with ``model=adapter.load(config.dtype)`` (the weights in
    memory), and peak memory is one weight tensor plus the graph. Verification then runs the
    PyTorch reference with one block's weights loaded at a time and, above
    :data:`WHOLE_GRAPH_VERIFY_BYTES` of weights (or with ``segmented=True``), ONNX Runtime
    segment by segment (:mod:`~trt_sora.export.segments`).

    Writes ``model.onnx`` (+ ``model.onnx.data`` when external), ``manifest.json`` with the ONNX
    Runtime parity numbers. Two exports of one model are byte-identical. ``traces``: a dict that the
    exports of models with one graph share (the pipeline's, for the experts of a pair; with ``model``, the same
    weights too): the graph is traced once and copied (:func:`trt_sora.export.trace.trace`), the bytes are the
    same. Raises :class:`ExportError` (and leaves ``out_dir`` untouched) when the export fails or parity misses
    the config's bar.
    """
    require("torch", extra="export")
    require("onnx", extra="export")
    require("onnxscript", extra="export")
    from trt_sora.models import ModelAdapter, get_adapter

    adapter = model_ref if isinstance(model_ref, ModelAdapter) else get_adapter(model_ref)
    if config.verify and config.dtype is DType.BF16:
        raise ExportError("export.dtype bf16 cannot be verified: ONNX Runtime has no bf16 kernels for the "
                          "graph's Conv/MatMul; export with --no-verify (export.verify: false), or export fp32 "
                          "and let quantize cast the graph (quantization.graph_dtype: bf16)")
    t0 = time.perf_counter()
    source = None
    if model is None:
        from trt_sora.weights.sources import check_covers

        model, source = adapter.load_empty(config.dtype.value), adapter.weight_source()
        check_covers(model, source)
    seconds, peak_mb = {"load": round(time.perf_counter() - t0, 2)}, {"load": _peak_rss_mb()}
    plan = plan_export(adapter, config, model, weightless=source is not None, segmented=segmented)
    refs = None
    if plan.weightless and plan.verify_mode:  # the PyTorch reference needs no graph: run it while tracing
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trt_sora-reference")
        refs = pool.submit(_streamed_reference, adapter, source, list(plan.verify_points), config.dtype.value)
        pool.shutdown(wait=False)
    with staged_dir(out_dir) as tmp:
        copied = _write_graph(adapter, model, source, plan, config, tmp / ONNX_NAME, seconds, peak_mb, traces)
        parity = _verify(adapter, model, plan, config, tmp / ONNX_NAME, refs, seconds, peak_mb)
        dead = dead_linears(tmp / ONNX_NAME, model)
        if dead:
            log.info("export of %s: %d linear(s) have no node in the graph (their output is unused): %s",
                     adapter.name, len(dead), ", ".join(dead[:6]) + (" ..." if len(dead) > 6 else ""))
        seconds["total"] = round(time.perf_counter() - t0, 2)
        manifest = _write_manifest(tmp, adapter, config, plan, source, parity=parity, dead=dead,
                                   seconds=seconds, peak_mb=peak_mb, copied=copied)
    out = Path(out_dir)
    manifest["outputs"]["onnx_entry"] = recorded_file_entry(out / ONNX_NAME, manifest)
    log.info("export of %s: %s", adapter.name, seconds)
    return ExportResult(out / ONNX_NAME, manifest)


def _write_graph(adapter, model, source, plan: ExportPlan, config: ExportConfig, onnx_path: Path,
                 seconds: dict, peak_mb: dict, traces: dict | None = None) -> bool:
    """Trace at the plan's point (or copy the trace in ``traces``: returns whether it did), bind the weights,
    optimize, save, name the dims and run onnx.checker."""
    from trt_sora.export import optimize as opt
    from trt_sora.export import trace as tr

    t1 = time.perf_counter()
    program = tr.trace(adapter, model, plan.point, config, _dynamic_shapes(adapter, plan.ranges),
                       weightless=plan.weightless, traces=traces)
    seconds["trace"] = round(time.perf_counter() - t1, 2)
    peak_mb["trace"] = _peak_rss_mb()
    t1 = time.perf_counter()
    read = tr.bind_weights(program.model, model, source) if plan.weightless else None
    opt.optimize(program.model, read=read)
    opt.canonicalize(program.model)
    seconds["optimize"] = round(time.perf_counter() - t1, 2)
    peak_mb["optimize"] = _peak_rss_mb()
    t1 = time.perf_counter()
    _save(program.model, onnx_path, plan.external)
    copied = program.copied
    del program
    _rename_dims(onnx_path, adapter)
    seconds["write"] = round(time.perf_counter() - t1, 2)
    peak_mb["write"] = _peak_rss_mb()
    import onnx

    try:
        onnx.checker.check_model(str(onnx_path))
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"onnx.checker rejected the export: {exc}") from None
    return copied


def _verify(adapter, model, plan: ExportPlan, config: ExportConfig, onnx_path: Path, refs, seconds: dict,
            peak_mb: dict) -> list[dict]:
    """ONNX Runtime vs PyTorch at the plan's verify points; raises when a point misses the config's bar."""
    if plan.verify_mode is None:
        return []
    t1 = time.perf_counter()
    parity = verify_onnx(onnx_path, adapter, model, list(plan.verify_points), dtype=config.dtype.value,
                         segmented=plan.verify_mode == "segmented", refs=refs.result() if refs is not None else None)
    seconds["verify"] = round(time.perf_counter() - t1, 2)
    peak_mb["verify"] = _peak_rss_mb()
    rel = max(config.max_abs, ROUNDING_ULPS * _EPS[config.dtype])  # fp16: both sides round in fp16
    for p in parity:  # max-abs bar scales with the output's magnitude when it exceeds 1
        p["max_abs_limit"] = rel * max(1.0, p["ref_max_abs"])
    bad = [p for p in parity if not _passes(p, config)]
    if bad:
        b = bad[0]
        raise ExportError(
            f"ONNX Runtime disagrees with PyTorch at {b['point']}: cosine {b['cosine']:.7f} "
            f"(need >= {config.min_cosine}), max-abs {b['max_abs']:.3g} (need <= {b['max_abs_limit']:.3g}); "
            "the graph probably baked a shape or an op exported wrongly")
    return parity


def _write_manifest(tmp: Path, adapter, config: ExportConfig, plan: ExportPlan, source, *, parity: list[dict],
                    dead: list[str], seconds: dict, peak_mb: dict, copied: bool = False) -> dict:
    outputs = {"onnx": ONNX_NAME}
    if (tmp / (ONNX_NAME + ".data")).exists():
        outputs["external_data"] = ONNX_NAME + ".data"
    results = {
        "model": adapter.describe(),
        "export_point": dict(plan.point),
        "dynamic": {k: v.to_yaml() for k, v in plan.ranges.items()},
        "patch_size": list(adapter.patch_size),
        "input_names": list(adapter.input_names),
        "output_names": list(adapter.output_names),
        "dim_names": {k: {str(a): d for a, d in v.items()} for k, v in adapter.input_dims().items()},
        "dead_linears": dead,
        "external_data": plan.external,
        "param_bytes": plan.param_bytes,
        "weights": source.describe() if plan.weightless else "in memory",
        "verify_mode": plan.verify_mode,
        "graph": "copied from an earlier trace of the same graph" if copied else "traced",
        "seconds": seconds,
        "peak_rss_mb": peak_mb,
        "parity": parity,
    }
    return write_manifest(tmp, stage="export", inputs={"model": adapter.describe()}, config=config,
                          results=results, outputs=outputs)


def _streamed_reference(adapter, source, points, dtype: str) -> list:
    """PyTorch outputs at ``points`` (verification inputs) with one block's weights loaded at a time."""
    from trt_sora.weights.sources import run_lockstep, streamed

    # all points in lockstep threads: each block's weights are read (or drawn) once for every point
    with streamed(adapter.load_empty(dtype), source, concurrent=len(points)) as model:
        fns = [lambda i=i, p=p: reference_outputs(adapter, model, [p], dtype, first_index=i)[0]
               for i, p in enumerate(points)]
        return run_lockstep(model, fns)


def _peak_rss_mb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB


def _save(ir_model, path: Path, external: bool) -> None:
    """Write the ``onnx_ir`` model; weights (lazy ones read one at a time, two threads materializing them,
    at most 1 GB in flight) into ``model.onnx.data``. The bytes do not depend on the thread count."""
    import onnx_ir as ir

    if external:
        ir.save(ir_model, str(path), external_data=path.name + ".data", max_workers=2)
    else:
        ir.save(ir_model, str(path))


def _passes(p: dict, config: ExportConfig) -> bool:
    return p["cosine"] >= config.min_cosine and p["max_abs"] <= p["max_abs_limit"]


def _verify_inputs(adapter, point, dtype: str, i: int):
    return adapter.example_inputs(point, dtype=dtype, seed=1000 + i)


def reference_outputs(adapter, model, points: Sequence[Mapping[str, int]], dtype: str = "fp32", *,
                      first_index: int = 0) -> list:
    """PyTorch outputs (fp32 numpy) of ``model`` at the verification inputs of ``points``
    (``first_index``: index of ``points[0]`` in the export's verification list; it seeds the inputs)."""
    import torch

    out = []
    for i, point in enumerate(points, start=first_index):
        with torch.no_grad():
            out.append(adapter.forward(model, _verify_inputs(adapter, point, dtype, i)).float().numpy())
    return out


def verify_onnx(onnx_path, adapter, model, points: Sequence[Mapping[str, int]], *, dtype: str = "fp32",
                session=None, segmented: bool = False, refs: Sequence | None = None) -> list[dict]:
    """Run PyTorch and ONNX Runtime at each point; return per-point metrics.

    ``segmented``: run the ONNX graph block by block (:func:`trt_sora.export.segments.run_segmented`).
    ``refs``: the PyTorch outputs, already computed (:func:`reference_outputs`); ``model`` is then unused.
    """
    import torch

    refs = list(refs) if refs is not None else reference_outputs(adapter, model, points, dtype)
    feeds = []
    for i, point in enumerate(points):
        inputs = _verify_inputs(adapter, point, dtype, i)
        feeds.append({k: v.numpy() if v.dtype != torch.bfloat16 else v.float().numpy() for k, v in inputs.items()})
    if segmented:
        from trt_sora.export.segments import run_segmented

        got = [o[0] for o in run_segmented(onnx_path, feeds, session_factory=ort_session,
                                               container=adapter.block_container)]
    else:
        sess = session or ort_session(onnx_path)
        got = [sess.run(None, f)[0] for f in feeds]
    out = []
    for point, ref, g in zip(points, refs, got):
        m = compare(ref, g)
        m["point"] = dict(point)
        m["max_abs_limit"] = None
        out.append(m)
    return out
