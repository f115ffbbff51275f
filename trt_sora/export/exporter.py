"""torch -> ONNX (dynamo exporter), named dynamic axes, external data, ORT verification.

Lessons baked in (see DESIGN.md): the TorchScript exporter silently bakes shapes,
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
from pathlib import Path
from typing import Any, Mapping, Sequence

from trt_sora.config import DIM_NAMES, DimRange, ExportConfig, ExternalData
from trt_sora.errors import ExportError, require
from trt_sora.manifest import file_entry, staged_dir, write_manifest
from trt_sora.metrics import compare  # noqa: F401 (one metric implementation for every stage)
from trt_sora.onnx_tools import ort_session  # noqa: F401 (re-exported: export verification's session)

log = logging.getLogger("trt_sora")

PROTOBUF_LIMIT = 2_000_000_000  # bytes; larger models must use external data
ONNX_NAME = "model.onnx"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    manifest: dict

    @property
    def parity(self) -> list[dict]:
        return self.manifest["results"]["parity"]


def _patch_of(adapter) -> dict[str, int]:
    pt, ph, pw = adapter.patch_size
    return {"batch": 1, "latent_frames": pt, "latent_height": ph, "latent_width": pw, "text_len": 1}


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
    for dim in DIM_NAMES:
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
    out = []
    for p in (a, b):
        out.append({d: _fit(p[d], ranges[d], steps[d]) for d in DIM_NAMES})
    return out


def _dynamic_shapes(adapter, ranges: Mapping[str, DimRange]) -> dict[str, dict[int, Any]]:
    import torch

    steps = _patch_of(adapter)
    dims: dict[str, Any] = {}
    for dim in DIM_NAMES:
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


def export_onnx(model_ref, config: ExportConfig, out_dir: str | Path, *, model=None) -> ExportResult:
    """Export ``model_ref`` (name, checkpoint folder or adapter) to ``out_dir/model.onnx``.

    Writes ``model.onnx`` (+ ``model.onnx.data`` when external), ``manifest.json``
    with the ONNX Runtime parity numbers. Raises :class:`ExportError` (and leaves
    ``out_dir`` untouched) when the export fails or parity misses the config's bar.
    """
    torch = require("torch", extra="export")
    require("onnx", extra="export")
    require("onnxscript", extra="export")
    from trt_sora.models import ModelAdapter, get_adapter

    adapter = model_ref if isinstance(model_ref, ModelAdapter) else get_adapter(model_ref)
    t0 = time.perf_counter()
    if model is None:
        model = adapter.load(config.dtype.value, "cpu")
    t_load = time.perf_counter() - t0
    ranges = config.dynamic
    point = export_point(adapter, ranges)
    points = [dict(p) for p in config.verify_points] or default_verify_points(adapter, ranges)
    for p in points:
        for d in DIM_NAMES:
            if not ranges[d].contains(p[d]):
                raise ExportError(f"verify point {p} has {d}={p[d]} outside the exported range "
                                  f"{ranges[d].min}..{ranges[d].max}")
    pb = _param_bytes(model)
    external = {ExternalData.ALWAYS: True, ExternalData.NEVER: False}.get(config.external_data, pb > PROTOBUF_LIMIT)
    if not external and pb > PROTOBUF_LIMIT:
        raise ExportError(f"model weights are {pb / 1e9:.1f} GB, over protobuf's 2 GB limit; "
                          "set export.external_data to auto or always")
    wrapper = adapter.export_module(model).eval()
    example = adapter.example_inputs(point, dtype=config.dtype.value)
    args = tuple(example[n] for n in adapter.input_names)
    with staged_dir(out_dir) as tmp:
        onnx_path = tmp / ONNX_NAME
        t1 = time.perf_counter()
        try:
            with torch.no_grad():
                program = torch.onnx.export(
                    wrapper, args, dynamo=True, opset_version=config.opset,
                    input_names=list(adapter.input_names), output_names=list(adapter.output_names),
                    dynamic_shapes=_dynamic_shapes(adapter, ranges), optimize=True, verbose=False,
                )
            program.save(str(onnx_path), external_data=external)
        except Exception as exc:  # the exporter raises many types; wrap them in one
            raise ExportError(f"torch.onnx.export failed for {adapter.name} at {point}: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        del program
        _rename_dims(onnx_path, adapter)
        t_export = time.perf_counter() - t1
        import onnx

        try:
            onnx.checker.check_model(str(onnx_path))
        except onnx.checker.ValidationError as exc:
            raise ExportError(f"onnx.checker rejected the export: {exc}") from None
        parity: list[dict] = []
        if config.verify:
            parity = verify_onnx(onnx_path, adapter, model, points, dtype=config.dtype.value)
            for p in parity:  # max-abs bar scales with the output's magnitude when it exceeds 1
                p["max_abs_limit"] = config.max_abs * max(1.0, p["ref_max_abs"])
            bad = [p for p in parity if not _passes(p, config)]
            if bad:
                b = bad[0]
                raise ExportError(
                    f"ONNX Runtime disagrees with PyTorch at {b['point']}: cosine {b['cosine']:.7f} "
                    f"(need >= {config.min_cosine}), max-abs {b['max_abs']:.3g} (need <= {b['max_abs_limit']:.3g}); "
                    "the graph probably baked a shape or an op exported wrongly")
        outputs = {"onnx": ONNX_NAME}
        if (tmp / (ONNX_NAME + ".data")).exists():
            outputs["external_data"] = ONNX_NAME + ".data"
        results = {
            "model": adapter.describe(),
            "export_point": point,
            "dynamic": {k: v.to_yaml() for k, v in ranges.items()},
            "input_names": list(adapter.input_names),
            "output_names": list(adapter.output_names),
            "dim_names": {k: {str(a): d for a, d in v.items()} for k, v in adapter.input_dims().items()},
            "external_data": external,
            "param_bytes": pb,
            "seconds": {"load": round(t_load, 2), "export": round(t_export, 2),
                        "total": round(time.perf_counter() - t0, 2)},
            "parity": parity,
        }
        manifest = write_manifest(tmp, stage="export", inputs={"model": adapter.describe()}, config=config,
                                  results=results, outputs=outputs)
    out = Path(out_dir)
    manifest["outputs"]["onnx_entry"] = file_entry(out / ONNX_NAME)
    return ExportResult(out / ONNX_NAME, manifest)


def _passes(p: dict, config: ExportConfig) -> bool:
    return p["cosine"] >= config.min_cosine and p["max_abs"] <= p["max_abs_limit"]


def verify_onnx(onnx_path, adapter, model, points: Sequence[Mapping[str, int]], *, dtype: str = "fp32",
                session=None) -> list[dict]:
    """Run PyTorch and ONNX Runtime at each point; return per-point metrics."""
    import torch

    sess = session or ort_session(onnx_path)
    out = []
    for i, point in enumerate(points):
        inputs = adapter.example_inputs(point, dtype=dtype, seed=1000 + i)
        with torch.no_grad():
            ref = adapter.forward(model, inputs).float().numpy()
        feeds = {k: v.numpy() if v.dtype != torch.bfloat16 else v.float().numpy() for k, v in inputs.items()}
        got = sess.run(None, feeds)[0]
        m = compare(ref, got)
        m["point"] = dict(point)
        m["max_abs_limit"] = None
        out.append(m)
    return out
