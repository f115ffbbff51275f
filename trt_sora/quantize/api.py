"""``quantize_onnx``: exported ``model.onnx`` + calibration stats -> ``model.qdq.onnx`` (+ map, manifest)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from trt_sora.config.recipe import DType, ExternalData, QuantConfig, QuantFormat
from trt_sora.errors import CalibrationError, QuantizeError, require
from trt_sora.manifest import (
    file_entry,
    load_onnx,
    read_manifest,
    recorded_file_entry,
    sha256_file,
    staged_dir,
    verified_input,
    write_json,
    write_manifest,
)
from trt_sora.quantize import dtype as dtype_mod
from trt_sora.quantize import fuse_qkv, qdq, tensors
from trt_sora.quantize.plan import SitePlan, plan_sites
from trt_sora.quantize.sites import find_attentions, find_linears, node_scopes
from trt_sora.runfolder import QDQ_MAP, QDQ_MODEL, has_manifest

log = logging.getLogger("trt_sora")

QDQ_NAME = QDQ_MODEL
MAP_NAME = QDQ_MAP
PROTOBUF_LIMIT = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class QuantResult:
    """What :func:`quantize_onnx` wrote.

    Attributes:
        onnx_path: ``out_dir/model.qdq.onnx``.
        map_path: ``out_dir/qdq_map.json`` (one entry per site: quantized or excluded + reason).
        manifest: the ``manifest.json`` content (``results.counts`` has the numbers).
    """

    onnx_path: Path
    map_path: Path
    manifest: dict

    @property
    def counts(self) -> dict[str, int]:
        return self.manifest["results"]["counts"]

    @property
    def qdq_map(self) -> list[dict]:
        return json.loads(self.map_path.read_text())["sites"]


def _load_stats(stats):
    from trt_sora.calibrate.stats import CalibStats

    if isinstance(stats, CalibStats):
        return stats, None
    if stats is None:
        raise QuantizeError("FP8/INT8 quantization needs calibration stats: run `trt-sora calibrate` and pass "
                            "--stats DIR/stats.safetensors (or set quantization.format: none)")
    path = verified_input(Path(stats), fix="re-run `trt-sora calibrate`")
    try:
        return CalibStats.load(path, validate=False), path
    except CalibrationError as exc:
        raise QuantizeError(f"cannot read calibration stats: {exc}") from None


def _export_manifest(onnx_path: Path) -> dict | None:
    if not has_manifest(onnx_path.parent):
        return None
    try:
        return read_manifest(onnx_path.parent, stage="export")
    except Exception:  # another stage's folder or an old manifest: no identity to check against
        return None


def _family_excludes(exp_model: dict, config: QuantConfig, onnx_path: Path) -> dict:
    """The model family's default exclusions (its adapter's ``quant_excludes``), from the export manifest."""
    if not config.default_excludes or QuantFormat(config.format) is QuantFormat.NONE:
        return {}
    if not exp_model.get("ref"):
        raise QuantizeError(f"no export manifest naming the model beside {onnx_path}: its family's default "
                            "exclusions are unknown; quantize the folder `trt-sora export` wrote, or set "
                            "quantization.default_excludes: false and list the exclusions")
    from trt_sora.models import adapter_for_manifest

    return dict(adapter_for_manifest(exp_model).quant_excludes)


def _fusable_projections(exp_model: dict) -> tuple:
    """The model family's fusable projection groups (its adapter's answer), from the export manifest."""
    if not exp_model.get("ref"):
        log.warning("no export manifest beside the ONNX: the model family is unknown, so no projections are fused")
        return ()
    from trt_sora.models import adapter_for_manifest

    return tuple(adapter_for_manifest(exp_model).fusable_projections)


def _dead_linears(exp: dict | None) -> frozenset:
    """The linears the exporter dropped as dead code (the export manifest's ``dead_linears``)."""
    return frozenset((exp or {}).get("results", {}).get("dead_linears") or ())


def _use_rounded_weights(linears: dict, path, dead=frozenset()) -> None:
    """Replace each listed site's weight constant by its rounded value (deferred, in the constant's own
    dtype and layout: ``[in, out]`` for MatMul, ``[out, in]`` for Gemm transB). ``dead``: linears the
    exporter dropped (unused output): their rounded weights have no constant to replace."""
    from trt_sora.calibrate.gptq import load_rounded_weights

    D = tensors.deferred_class()
    for site, w in load_rounded_weights(path).items():
        lin = linears.get(site)
        if lin is None and site in dead:
            continue
        if lin is None:
            raise QuantizeError(f"rounded weight for {site!r} in {path} matches no linear of the graph; the weights "
                                "file belongs to another model - recalibrate this one")
        old = tensors.of(lin.weight)
        arr = w.numpy().astype(np.float32)
        arr = np.ascontiguousarray(arr.T if lin.weight_axis == 1 else arr)
        if arr.shape != old.shape:
            raise QuantizeError(f"rounded weight for {site!r} has shape {arr.shape}, the graph's is {old.shape}; "
                                "recalibrate this model")
        lin.weight.values = D(old.shape, old.dtype, lambda a=arr, dt=old.dtype: a.astype(dt), f"{site}.rounded")


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What the stage reads besides the graph: the export manifest, the stats and the identity they share."""

    onnx_path: Path
    exp: dict | None
    calib: Any
    stats_path: Path | None
    model_hash: str | None

    @property
    def exp_model(self) -> dict:
        return (self.exp or {}).get("results", {}).get("model", {})


def quantize_onnx(onnx_path: str | os.PathLike, stats, config: QuantConfig, out_dir: str | os.PathLike, *,
                  model_hash: str | None = None, head_dim: int | None = None,
                  weights: str | os.PathLike | None = None) -> QuantResult:
    """Insert calibrated Q/DQ into an exported graph and convert its float type.

    Args:
        onnx_path: ``model.onnx`` from the export stage (fp32; external data beside it is read).
        stats: ``stats.safetensors`` path or a ``CalibStats``; per-tensor activation amax keyed by
            module path (``blocks.0.attn1.to_q``), optional ``<site>.weight`` per-channel weight amax
            ``[C_out]``, optional attention sites ``<attn>.q|k|v`` (used with ``fp8_attention``).
        config: the recipe's ``quantization`` section.
        out_dir: written atomically: ``model.qdq.onnx`` (+ ``model.qdq.onnx.data``),
            ``qdq_map.json``, ``manifest.json``.
        model_hash: identity the stats must match; default: the export manifest's
            ``results.model.model_hash`` (``onnx_path``'s folder).
        head_dim: attention head size for ``fp8_attention``; default: the export manifest's model config.
        weights: the calibration's ``weights.safetensors`` (GPTQ-rounded weights on the stats' own
            per-channel grid): they replace the graph's weights of those sites before Q/DQ insertion.

    Graph I/O after conversion: ``hidden_states``, ``encoder_hidden_states`` and ``sample`` in
    ``config.graph_dtype``, ``timestep`` fp32 ([B]). Raises :class:`QuantizeError` (one line, with the fix).
    """
    t0 = time.perf_counter()
    src, graph, opset, linears, attentions, plan = _prepare(Path(onnx_path), stats, config, model_hash, head_dim)
    if weights is not None:
        _use_rounded_weights(linears, weights, _dead_linears(src.exp))
    applied = apply_plan(graph, linears, attentions, plan, src.onnx_path.name)
    entries = [*plan.stats_entries, *_map_entries(linears, plan, applied)]
    return _write(graph, src, config, out_dir, entries=entries, counts=_counts(linears, plan, applied),
                  opset=opset, weights=weights, t0=t0)


def site_plan(onnx_path: str | os.PathLike, stats, config: QuantConfig, *, model_hash: str | None = None,
              head_dim: int | None = None) -> SitePlan:
    """The :class:`~trt_sora.quantize.plan.SitePlan` :func:`quantize_onnx` would apply to ``onnx_path``
    with these ``stats`` and ``config`` (same arguments, same checks); reads the graph, writes nothing."""
    return _prepare(Path(onnx_path), stats, config, model_hash, head_dim)[-1]


def _prepare(onnx_path: Path, stats, config: QuantConfig, model_hash: str | None, head_dim: int | None):
    """``(inputs, graph, opset, linears, attentions, plan)``: everything read and decided, nothing changed."""
    src = _read_inputs(onnx_path, stats, config, model_hash, head_dim)
    graph, opset, linears, attentions = _load_graph(src.onnx_path, config)
    excludes = _family_excludes(src.exp_model, config, src.onnx_path)
    plan = plan_sites(linears, attentions, src.calib, config, family_excludes=excludes,
                      fusable=_fusable_projections(src.exp_model) if config.fused_qkv else (),
                      dead=_dead_linears(src.exp), graph_name=src.onnx_path.name)
    return src, graph, opset, linears, attentions, plan


def _read_inputs(onnx_path: Path, stats, config: QuantConfig, model_hash: str | None,
                 head_dim: int | None) -> _Inputs:
    """The export manifest and the stats, checked: same model, and a head size FP8 attention can run."""
    if not onnx_path.is_file():
        raise QuantizeError(f"{onnx_path} does not exist; run `trt-sora export` first or pass the right --onnx")
    exp = _export_manifest(onnx_path)
    exp_model = (exp or {}).get("results", {}).get("model", {})
    none = QuantFormat(config.format) is QuantFormat.NONE and stats is None
    calib, stats_path = (None, None) if none else _load_stats(stats)
    expected = model_hash or exp_model.get("model_hash")
    if calib is not None:
        got = calib.metadata.model_hash
        if expected and got and got != expected:
            raise QuantizeError(f"calibration stats are for model hash {got} ({calib.metadata.model or '?'}) but the "
                                f"ONNX graph is model hash {expected} ({exp_model.get('ref', '?')}); calibrate "
                                "this model (trt-sora calibrate) or pass the matching --stats")
        if expected and not got:
            log.warning("stats carry no model hash; cannot prove they belong to model %s", expected)
    if config.fp8_attention:
        hd = head_dim or (exp_model.get("config") or {}).get("attention_head_dim")
        if hd is None:
            raise QuantizeError("fp8_attention needs the attention head_dim: quantize an export folder with its "
                                "manifest.json or pass head_dim=")
        if int(hd) % 16:
            raise QuantizeError(f"fp8_attention needs head_dim % 16 == 0 (FP8 attention kernels), this model has "
                                f"head_dim {hd}; set quantization.fp8_attention: false")
    return _Inputs(onnx_path, exp, calib, stats_path, expected)


def _load_graph(onnx_path: Path, config: QuantConfig):
    """``(graph, opset, linears, attentions)``: the graphsurgeon graph with lazy weights (read from the
    file only when the writer computes each output tensor) and its matchable linears and attentions."""
    onnx = require("onnx", extra="export")
    gs = require("onnx_graphsurgeon", extra="export")
    model = load_onnx(verified_input(onnx_path), load_external_data=False, fix="re-run `trt-sora export`")
    scopes = node_scopes(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if QuantFormat(config.format) is not QuantFormat.NONE and opset < 19:
        raise QuantizeError(f"{onnx_path} has opset {opset}; FP8/INT8 Q/DQ needs opset >= 19 (re-export with "
                            "export.opset: 20)")
    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=False)
    except Exception as exc:  # shapes are a convenience for dtype tracking; missing ones default to graph dtype
        log.warning("ONNX shape inference failed (%s); continuing", exc)
    graph = gs.import_onnx(model)
    del model
    tensors.make_lazy(graph, onnx_path.parent)
    linears = find_linears(graph, scopes)
    if not linears:
        raise QuantizeError(f"{onnx_path} has no matchable linear (MatMul/Gemm with a constant weight and a recorded "
                            "module scope); export it with trt_sora's dynamo exporter (trt-sora export)")
    attentions = find_attentions(graph, scopes, strict=bool(config.fp8_attention))
    return graph, opset, linears, attentions


@dataclasses.dataclass(frozen=True)
class _Applied:
    """What :func:`apply_plan` did: Q/DQ facts per site and attention, shared activation quantizers
    (``input tensor -> sites``) and the float-type conversion's counts."""

    info: dict[str, dict]
    attention: dict[str, dict]
    by_tensor: dict[str, list[str]]
    dtype_counts: dict[str, int]


def apply_plan(graph, linears: dict, attentions: dict, plan: SitePlan, graph_name: str) -> _Applied:
    """Rewrite ``graph`` as ``plan`` says: fuse the QKV groups (``linears`` follows), convert the float
    type, insert activation Q/DQ (one per input tensor, at its sites' largest amax), quantize the
    weights per channel and, with FP8 attention, quantize q/k/v and the softmax."""
    for fused_site, members in plan.fused:
        fuse_qkv.fuse_group(graph, linears, fused_site, list(members))
    if plan.fused:
        graph.cleanup()
    quantized = list(plan.quantized)
    dcounts = _convert_dtype(graph, plan.graph_dtype, {linears[s].weight.name for s in quantized}, graph_name)
    by_tensor: dict[str, list[str]] = {}
    for s in quantized:
        by_tensor.setdefault(linears[s].node.inputs[0].name, []).append(s)
    info = _insert_activation_qdq(graph, linears, plan, by_tensor)
    for s in quantized:
        info[s].update(_quantize_weight(graph, linears[s], plan, s))
    att_info = {}
    if plan.attention_amax:
        amax = plan.attention_amax
        for mod, att in attentions.items():
            att_info[mod] = qdq.insert_attention_qdq(graph, att, amax[f"{mod}.q"], amax[f"{mod}.k"],
                                                     amax[f"{mod}.v"], plan.graph_dtype)
    graph.cleanup().toposort()
    return _Applied(info, att_info, by_tensor, dcounts)


def _convert_dtype(graph, gdt: DType, skip: set[str], graph_name: str) -> dict[str, int]:
    """Convert an fp32 graph to ``gdt`` (quantized weights stay fp32 until quantized); a graph exported
    in ``gdt`` already is kept."""
    src = dtype_mod.source_dtype(graph)
    if src is DType.FP32:
        return dtype_mod.convert_graph_dtype(graph, gdt, skip_constants=skip)
    if src is gdt:  # exported in the graph dtype already (e.g. a bf16 export of a model too big for fp32 on disk)
        return {"fp32_nodes": 0, "low_nodes": 0, "casts": 0}
    raise QuantizeError(f"{graph_name} was exported in {src.value} but quantization.graph_dtype is "
                        f"{gdt.value}; export in fp32 (export.dtype: fp32) or set quantization.graph_dtype: "
                        f"{src.value}")


def _insert_activation_qdq(graph, linears: dict, plan: SitePlan, by_tensor: dict[str, list[str]]) -> dict:
    """One Q/DQ per shared input tensor, at the largest amax of the sites that read it."""
    info: dict[str, dict] = {}
    for tname, sites in by_tensor.items():
        amax = max(plan.act_amax[s] for s in sites)
        scale = qdq.stored_scale(np.float32(amax), plan.format, plan.graph_dtype, f"site {sites[0]!r} activation")
        tensor = linears[sites[0]].node.inputs[0]
        qdq.insert_activation_qdq(graph, tensor, [linears[s].node for s in sites], scale, plan.format, sites[0])
        for s in sites:
            info[s] = {"tensor": tname, "amax": amax, "site_amax": plan.act_amax[s],
                       "scale": float(np.asarray(scale, dtype=np.float32)), "shared_with": [x for x in sites if x != s]}
    return info


def _quantize_weight(graph, lin, plan: SitePlan, site: str) -> dict:
    """Per-channel weight quantization at the stats' weight amax, else at the weight's own."""
    wa = plan.weight_amax.get(site)
    if wa is None:  # one read of the weight, now (the quantized values are computed on write)
        w = tensors.values(lin.weight).astype(np.float32)
        wa = np.abs(w, out=w).max(axis=1 - lin.weight_axis)
    out = qdq.quantize_linear_weight(graph, lin, wa.astype(np.float32), plan.format, plan.graph_dtype)
    return {**out, "weight_amax_source": "stats" if site in plan.weight_amax else "weight"}


def _map_entries(linears: dict, plan: SitePlan, applied: _Applied) -> list[dict]:
    """``qdq_map.json``'s entries for the graph's linears, fused members and attention quantizers."""
    entries = []
    for s, lin in linears.items():
        e: dict[str, Any] = {"site": s, "kind": "linear", "node": lin.node.name, "op": lin.node.op}
        if lin.members:
            e["members"] = list(lin.members)
        q, reason = plan.decisions[s]
        if q:
            e.update({"excluded": False, "format": plan.format.value, "reason": reason, **applied.info[s]})
        else:
            e.update({"excluded": True, "reason": reason})
        entries.append(e)
    for m, f in plan.fused_of.items():
        entries.append({"site": m, "kind": "linear", "fused_into": f, "excluded": not plan.decisions[f][0],
                        "reason": plan.decisions[f][1],
                        **({"amax": plan.act_amax.get(m)} if m in plan.act_amax else {})})
    for mod, d in applied.attention.items():
        for tag, v in d.items():
            entries.append({"site": f"{mod}.{tag}", "kind": "attention", "excluded": False, "format": "fp8_e4m3",
                            **v})
    return entries


def _counts(linears: dict, plan: SitePlan, applied: _Applied) -> dict[str, int]:
    fused_of = plan.fused_of
    return {
        "linears": len(linears) + len(fused_of) - len(plan.fused),
        "graph_linears": len(linears),
        "quantized_linears": len(plan.quantized),
        "excluded_linears": len(linears) - len(plan.quantized),
        "fused_groups": len(plan.fused),
        "activation_quantizers": len(applied.by_tensor),
        "weight_dequantizers": len(plan.quantized),
        "attention_quantizers": sum(len(d) for d in applied.attention.values()),
        **applied.dtype_counts,
    }


def _write(graph, src: _Inputs, config: QuantConfig, out_dir, *, entries: list[dict], counts: dict, opset: int,
           weights, t0: float) -> QuantResult:
    """``model.qdq.onnx`` (checked by onnx.checker), ``qdq_map.json`` and ``manifest.json``, staged."""
    fmt, gdt = QuantFormat(config.format), DType(config.graph_dtype)
    size = tensors.constant_bytes(graph)
    external = {ExternalData.ALWAYS: True, ExternalData.NEVER: False}.get(config.external_data, size > PROTOBUF_LIMIT)
    if not external and size > PROTOBUF_LIMIT:
        raise QuantizeError(f"the Q/DQ model is {size / 1e9:.1f} GB, over protobuf's 2 GB limit; set "
                            "quantization.external_data to auto or always")
    inputs = _manifest_inputs(src, weights)
    with staged_dir(out_dir) as tmp:
        graph_io = _write_onnx(graph, tmp / QDQ_NAME, external=external, opset=opset)
        del graph
        qmap = {"format": fmt.value, "graph_dtype": gdt.value, "sites": entries}
        if weights is not None:  # the runners that simulate this graph must use the same rounded weights
            qmap["rounded_weights"] = {"path": os.path.relpath(Path(weights).resolve(), Path(out_dir).resolve()),
                                       "sha256": inputs["weights"]["sha256"]}
        write_json(tmp / MAP_NAME, qmap)
        outputs = {"onnx": QDQ_NAME, "qdq_map": MAP_NAME}
        if external:
            outputs["external_data"] = QDQ_NAME + ".data"
        results = {
            "model": src.exp_model or None,
            "model_hash": src.model_hash,
            "stats_model_hash": src.calib.metadata.model_hash if src.calib is not None else None,
            "graph_dtype": gdt.value,
            "graph_io": graph_io,
            "counts": counts,
            "external_data": external,
            "bytes": size,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        manifest = write_manifest(tmp, stage="quantize", inputs=inputs, config=config, results=results,
                                  outputs=outputs)
    out = Path(out_dir)
    log.info("quantize: %d/%d linears %s, %d fused groups, graph %s -> %s", counts["quantized_linears"],
             counts["linears"], fmt.value, counts["fused_groups"], gdt.value, out / QDQ_NAME)
    return QuantResult(out / QDQ_NAME, out / MAP_NAME, manifest)


def _manifest_inputs(src: _Inputs, weights) -> dict:
    inputs = {"onnx": recorded_file_entry(src.onnx_path, src.exp)}  # its hashes were verified before parsing
    if weights is not None:
        inputs["weights"] = file_entry(weights)
    if src.stats_path is not None:
        inputs["stats"] = {"path": str(Path(src.stats_path).resolve()), "sha256": sha256_file(src.stats_path)}
    elif src.calib is not None:
        inputs["stats"] = {"path": None, "sha256": None, "note": "CalibStats object passed in memory"}
    return inputs


def _write_onnx(graph, path: Path, *, external: bool, opset: int) -> dict:
    """Write the graph and check it with onnx.checker; returns its inputs' and outputs' element types."""
    onnx = require("onnx", extra="export")
    out_model = tensors.write_model(graph, path, external=external, opset=opset)
    graph_io = {"inputs": {i.name: _elem_name(i.type.tensor_type.elem_type) for i in out_model.graph.input},
                "outputs": {o.name: _elem_name(o.type.tensor_type.elem_type) for o in out_model.graph.output}}
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise QuantizeError(f"onnx.checker rejected the Q/DQ graph ({str(exc).splitlines()[0]}); this is a "
                            "trt_sora bug - please report it with the recipe") from None
    return graph_io


def _elem_name(e: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(e).lower()

