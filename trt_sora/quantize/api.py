"""``quantize_onnx``: exported ``model.onnx`` + calibration stats -> ``model.qdq.onnx`` (+ map, manifest)."""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import re
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
    sha256_file,
    staged_dir,
    verified_input,
    write_json,
    write_manifest,
)

log = logging.getLogger("trt_sora")

QDQ_NAME = "model.qdq.onnx"
MAP_NAME = "qdq_map.json"
PROTOBUF_LIMIT = 2_000_000_000
_ATTN_SITE = re.compile(r"^(?P<module>.+)\.(?P<which>q|k|v)$")


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
    if not (onnx_path.parent / "manifest.json").is_file():
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
    from trt_sora.quantize import tensors

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


def _amax_scalar(site: str, a, what: str = "amax") -> float:
    t = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a, dtype=np.float64)
    if t.size == 0 or not np.all(np.isfinite(t)):
        raise QuantizeError(f"site {site!r}: {what} is not finite ({t.ravel()[:4].tolist()}); recalibrate "
                            "(NaN/inf activations) or exclude the site (quantization.exclude)")
    v = float(t.max())
    if not v > 0:
        raise QuantizeError(f"site {site!r}: {what} is {v:g} (the site saw only zeros); scale would be 0 - "
                            "recalibrate with real inputs or exclude the site (quantization.exclude)")
    return v


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
    onnx = require("onnx", extra="export")
    gs = require("onnx_graphsurgeon", extra="export")
    from trt_sora.quantize import dtype as dtype_mod
    from trt_sora.quantize import fuse_qkv, qdq, tensors
    from trt_sora.quantize.sites import find_attentions, find_linears, node_scopes
    from trt_sora.site_policy import site_policy

    t0 = time.perf_counter()
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise QuantizeError(f"{onnx_path} does not exist; run `trt-sora export` first or pass the right --onnx")
    fmt = QuantFormat(config.format)
    gdt = DType(config.graph_dtype)
    exp = _export_manifest(onnx_path)
    exp_model = (exp or {}).get("results", {}).get("model", {})

    # -- statistics and identity -------------------------------------------------------------------
    calib, stats_path = (None, None) if fmt is QuantFormat.NONE and stats is None else _load_stats(stats)
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

    # -- graph ------------------------------------------------------------------------------------
    # weights stay in the file until the writer computes each output tensor (quantize.tensors)
    model = load_onnx(verified_input(onnx_path), load_external_data=False, fix="re-run `trt-sora export`")
    scopes = node_scopes(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if fmt is not QuantFormat.NONE and opset < 19:
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
    if weights is not None:
        _use_rounded_weights(linears, weights, _dead_linears(exp))

    family_excludes = _family_excludes(exp_model, config, onnx_path)
    decisions = {s: site_policy(s, config, family_excludes) for s in linears}
    if fmt is QuantFormat.NONE:
        decisions = {s: (False, "quantization.format is none") for s in linears}
    entries: list[dict[str, Any]] = []
    act_amax: dict[str, float] = {}
    w_amax_stats: dict[str, np.ndarray] = {}
    att_amax: dict[str, float] = {}

    if calib is not None:
        # linears of the model the exporter dropped (their output is never used, e.g. the last dual-stream
        # block's text branch): their statistics have nothing to quantize
        dead = _dead_linears(exp)
        for site, a in calib.amax.items():
            if site in linears:
                if decisions[site][0]:
                    act_amax[site] = _amax_scalar(site, a)
                continue
            if site.endswith(".weight") and site[:-len(".weight")] in linears:
                base = site[:-len(".weight")]
                arr = np.asarray(a.detach().cpu().numpy(), dtype=np.float32)
                if decisions[base][0]:
                    if arr.ndim != 1 or arr.shape[0] != linears[base].out_features:
                        raise QuantizeError(f"site {site!r}: weight amax shape {arr.shape} != "
                                            f"[{linears[base].out_features}]; recalibrate")
                    _amax_scalar(site, arr, "weight amax")
                    w_amax_stats[base] = arr
                continue
            m = _ATTN_SITE.match(site)
            if m and (m["module"] in attentions or not config.fp8_attention):  # unused without fp8_attention
                if config.fp8_attention:
                    att_amax[site] = _amax_scalar(site, a)
                else:
                    entries.append({"site": site, "kind": "attention", "excluded": True,
                                    "reason": "quantization.fp8_attention is off"})
                continue
            if any(fnmatch.fnmatchcase(site, p) for p in config.exclude):
                entries.append({"site": site, "kind": "unmatched", "excluded": True,
                                "reason": "recipe exclude; no linear with this module scope in the graph"})
                continue
            if site in dead:
                entries.append({"site": site, "kind": "unmatched", "excluded": True,
                                "reason": "not in the exported graph (dead code: its output is never used)"})
                continue
            if site.endswith(".weight") and site[:-len(".weight")] in dead:
                continue  # the weight amax of a layer the exporter dropped
            near = sorted(linears, key=lambda s: -_common_prefix(s, site))[:1]
            raise QuantizeError(f"stats site {site!r} matches no linear or attention in {onnx_path.name} "
                                f"(nearest: {near[0] if near else '-'}); the stats belong to another export - "
                                "recalibrate, or add the site to quantization.exclude")
        missing = [s for s, (q, _) in decisions.items() if q and s not in act_amax]
        if missing:
            raise QuantizeError(f"site {missing[0]!r} (+{len(missing) - 1} more) is quantized but has no statistics; "
                                "recalibrate with hooks on every linear or add it to quantization.exclude")
    if config.fp8_attention:
        for mod in attentions:
            for w in "qkv":
                if f"{mod}.{w}" not in att_amax:
                    raise QuantizeError(f"fp8_attention needs stats site '{mod}.{w}' (attention q/k/v observers); "
                                        "recalibrate with attention observers or turn fp8_attention off")

    # -- fused QKV --------------------------------------------------------------------------------
    fused_of: dict[str, str] = {}
    if config.fused_qkv:
        for fused_site, members in fuse_qkv.plan_groups(linears, lambda s: decisions[s][0],
                                                        _fusable_projections(exp_model)):
            q = decisions[members[0]][0]
            w_stats = [w_amax_stats.pop(m, None) for m in members]
            fuse_qkv.fuse_group(graph, linears, fused_site, members)
            decisions[fused_site] = (q, f"fused {'+'.join(m.rsplit('.', 1)[1] for m in members)}")
            if q:
                act_amax[fused_site] = max(act_amax[m] for m in members)
                if all(w is not None for w in w_stats):
                    w_amax_stats[fused_site] = np.concatenate(w_stats)
            for m in members:
                fused_of[m] = fused_site
        graph.cleanup()

    # -- graph dtype + Q/DQ -----------------------------------------------------------------------
    quantized = [s for s in linears if decisions[s][0]]
    src = dtype_mod.source_dtype(graph)
    if src is DType.FP32:
        dcounts = dtype_mod.convert_graph_dtype(graph, gdt, skip_constants={linears[s].weight.name for s in quantized})
    elif src is gdt:  # exported in the graph dtype already (e.g. a bf16 export of a model too big for fp32 on disk)
        dcounts = {"fp32_nodes": 0, "low_nodes": 0, "casts": 0}
    else:
        raise QuantizeError(f"{onnx_path.name} was exported in {src.value} but quantization.graph_dtype is "
                            f"{gdt.value}; export in fp32 (export.dtype: fp32) or set quantization.graph_dtype: "
                            f"{src.value}")
    by_tensor: dict[str, list[str]] = {}
    for s in quantized:
        by_tensor.setdefault(linears[s].node.inputs[0].name, []).append(s)
    info: dict[str, dict] = {}
    for tname, sites in by_tensor.items():
        amax = max(act_amax[s] for s in sites)
        scale = qdq.stored_scale(np.float32(amax), fmt, gdt, f"site {sites[0]!r} activation")
        tensor = linears[sites[0]].node.inputs[0]
        qdq.insert_activation_qdq(graph, tensor, [linears[s].node for s in sites], scale, fmt, sites[0])
        for s in sites:
            info[s] = {"tensor": tname, "amax": amax, "site_amax": act_amax[s],
                       "scale": float(np.asarray(scale, dtype=np.float32)), "shared_with": [x for x in sites if x != s]}
    for s in quantized:
        lin = linears[s]
        wa = w_amax_stats.get(s)
        if wa is None:  # one read of the weight, now (the quantized values are computed on write)
            w = tensors.values(lin.weight).astype(np.float32)
            wa = np.abs(w, out=w).max(axis=1 - lin.weight_axis)
        info[s].update(qdq.quantize_linear_weight(graph, lin, wa.astype(np.float32), fmt, gdt))
        info[s]["weight_amax_source"] = "stats" if s in w_amax_stats else "weight"
    att_info = {}
    if config.fp8_attention:
        for mod, att in attentions.items():
            att_info[mod] = qdq.insert_attention_qdq(graph, att, att_amax[f"{mod}.q"], att_amax[f"{mod}.k"],
                                                     att_amax[f"{mod}.v"], gdt)
    graph.cleanup().toposort()

    # -- map --------------------------------------------------------------------------------------
    for s, lin in linears.items():
        e: dict[str, Any] = {"site": s, "kind": "linear", "node": lin.node.name, "op": lin.node.op}
        if lin.members:
            e["members"] = list(lin.members)
        if decisions[s][0]:
            e.update({"excluded": False, "format": fmt.value, "reason": decisions[s][1], **info[s]})
        else:
            e.update({"excluded": True, "reason": decisions[s][1]})
        entries.append(e)
    for m, f in fused_of.items():
        entries.append({"site": m, "kind": "linear", "fused_into": f, "excluded": not decisions[f][0],
                        "reason": decisions[f][1], **({"amax": act_amax.get(m)} if m in act_amax else {})})
    for mod, d in att_info.items():
        for tag, v in d.items():
            entries.append({"site": f"{mod}.{tag}", "kind": "attention", "excluded": False, "format": "fp8_e4m3",
                            **v})
    counts = {
        "linears": len(linears) + len(fused_of) - len({f for f in fused_of.values()}),
        "graph_linears": len(linears),
        "quantized_linears": len(quantized),
        "excluded_linears": len(linears) - len(quantized),
        "fused_groups": len(set(fused_of.values())),
        "activation_quantizers": len(by_tensor),
        "weight_dequantizers": len(quantized),
        "attention_quantizers": sum(len(d) for d in att_info.values()),
        **dcounts,
    }

    # -- write ------------------------------------------------------------------------------------
    size = tensors.constant_bytes(graph)
    external = {ExternalData.ALWAYS: True, ExternalData.NEVER: False}.get(config.external_data, size > PROTOBUF_LIMIT)
    if not external and size > PROTOBUF_LIMIT:
        raise QuantizeError(f"the Q/DQ model is {size / 1e9:.1f} GB, over protobuf's 2 GB limit; set "
                            "quantization.external_data to auto or always")
    inputs = {"onnx": _input_entry(onnx_path, exp)}
    if weights is not None:
        inputs["weights"] = file_entry(weights)
    if stats_path is not None:
        inputs["stats"] = {"path": str(Path(stats_path).resolve()), "sha256": sha256_file(stats_path)}
    elif calib is not None:
        inputs["stats"] = {"path": None, "sha256": None, "note": "CalibStats object passed in memory"}
    with staged_dir(out_dir) as tmp:
        path = tmp / QDQ_NAME
        out_model = tensors.write_model(graph, path, external=external, opset=opset)
        del graph
        graph_io = {"inputs": {i.name: _elem_name(i.type.tensor_type.elem_type) for i in out_model.graph.input},
                    "outputs": {o.name: _elem_name(o.type.tensor_type.elem_type) for o in out_model.graph.output}}
        try:
            onnx.checker.check_model(str(path))
        except onnx.checker.ValidationError as exc:
            raise QuantizeError(f"onnx.checker rejected the Q/DQ graph ({str(exc).splitlines()[0]}); this is a "
                                "trt_sora bug - please report it with the recipe") from None
        qmap = {"format": fmt.value, "graph_dtype": gdt.value, "sites": entries}
        if weights is not None:  # the runners that simulate this graph must use the same rounded weights
            qmap["rounded_weights"] = {"path": os.path.relpath(Path(weights).resolve(), Path(out_dir).resolve()),
                                       "sha256": inputs["weights"]["sha256"]}
        write_json(tmp / MAP_NAME, qmap)
        outputs = {"onnx": QDQ_NAME, "qdq_map": MAP_NAME}
        if external:
            outputs["external_data"] = QDQ_NAME + ".data"
        results = {
            "model": exp_model or None,
            "model_hash": expected,
            "stats_model_hash": calib.metadata.model_hash if calib is not None else None,
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


def _input_entry(onnx_path: Path, exp: dict | None) -> dict:
    """The input's :func:`file_entry`, from its export manifest's hashes when that manifest lists it (those
    were verified against the file before parsing it: no second pass over a 57 GB ``model.onnx.data``)."""
    files = (exp or {}).get("files") or {}
    if onnx_path.name not in files:
        return file_entry(onnx_path)
    entry = {"path": str(onnx_path.resolve()), **files[onnx_path.name]}
    data = files.get(onnx_path.name + ".data")
    if data is not None:
        entry["external_data"] = {"path": str(onnx_path.with_name(onnx_path.name + ".data").resolve()), **data}
    return entry


def _elem_name(e: int) -> str:
    import onnx

    return onnx.TensorProto.DataType.Name(e).lower()


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))
