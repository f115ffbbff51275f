"""The quantize stage's site plan: which linears and attentions get Q/DQ, at which amax, and why.

Computed from the graph's linears and attentions (names, widths, inputs), the calibration stats and
the recipe's ``quantization`` section; it reads no weight and changes no graph. ``quantize_onnx``
applies it (:func:`trt_sora.quantize.api.apply_plan`) and writes the result.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from trt_sora.config.recipe import DType, QuantConfig, QuantFormat
from trt_sora.errors import QuantizeError
from trt_sora.quantize import fuse_qkv
from trt_sora.site_policy import site_policy

_ATTN_SITE = re.compile(r"^(?P<module>.+)\.(?P<which>q|k|v)$")


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """Where Q/DQ goes.

    Attributes:
        format, graph_dtype: the recipe's quantization format and graph float type.
        sites: the graph's linear sites after QKV fusion, in graph order (fused sites last).
        decisions: ``site -> (quantized, reason)`` for every site before and after fusion.
        act_amax: per-tensor activation amax of each quantized site (a fused site: its members' max).
        weight_amax: per-channel weight amax ``[C_out]`` from the stats (absent: taken from the weight).
        attention_amax: ``<attention module>.q|k|v -> amax`` with ``fp8_attention``.
        fused: ``(fused site, member sites)`` groups, in fusion order.
        stats_entries: ``qdq_map`` entries for stats sites that get no Q/DQ (attention sites with
            ``fp8_attention`` off, recipe excludes and dead linears absent from the graph).
    """

    format: QuantFormat
    graph_dtype: DType
    sites: tuple[str, ...]
    decisions: Mapping[str, tuple[bool, str]]
    act_amax: Mapping[str, float]
    weight_amax: Mapping[str, np.ndarray]
    attention_amax: Mapping[str, float]
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    stats_entries: tuple[dict, ...] = ()

    @property
    def quantized(self) -> tuple[str, ...]:
        """The sites that get an activation Q/DQ and a weight DQ, in graph order."""
        return tuple(s for s in self.sites if self.decisions[s][0])

    @property
    def fused_of(self) -> dict[str, str]:
        """``member site -> fused site``."""
        return {m: f for f, members in self.fused for m in members}


def plan_sites(linears: Mapping, attentions: Mapping, calib, config: QuantConfig, *,
               family_excludes: Mapping[str, str] | None = None, fusable: tuple = (),
               dead: frozenset = frozenset(), graph_name: str = "the graph") -> SitePlan:
    """The :class:`SitePlan` for a graph's ``linears`` (``{site: Linear}``) and ``attentions``.

    ``calib``: the ``CalibStats`` (None only with ``format: none``); ``family_excludes`` and
    ``fusable``: the model family's default exclusions and fusable projection groups; ``dead``:
    linears the exporter dropped. Raises :class:`QuantizeError` when the stats do not fit the graph.
    """
    fmt = QuantFormat(config.format)
    if fmt is QuantFormat.NONE:
        decisions = {s: (False, "quantization.format is none") for s in linears}
    else:
        decisions = {s: site_policy(s, config, dict(family_excludes or {})) for s in linears}
    act, w_amax, att, entries = {}, {}, {}, []
    if calib is not None:
        act, w_amax, att, entries = _read_stats(calib, linears, attentions, decisions, config, dead, graph_name)
    fused = ()
    if config.fused_qkv:
        fused = _plan_fusion(linears, decisions, act, w_amax, fusable)
    sites = [s for s in linears if s not in {m for _, members in fused for m in members}] + [f for f, _ in fused]
    return SitePlan(fmt, DType(config.graph_dtype), tuple(sites), MappingProxyType(decisions),
                    MappingProxyType(act), MappingProxyType(w_amax), MappingProxyType(att), fused, tuple(entries))


def _read_stats(calib, linears, attentions, decisions, config, dead, graph_name):
    """``(activation amax, weight amax, attention amax, map entries)`` from the stats, checked against
    the graph: every stats site must name a linear, an attention, an exclusion or a dead linear."""
    act, w_amax, att, entries = {}, {}, {}, []
    for site, a in calib.amax.items():
        base = site[:-len(".weight")] if site.endswith(".weight") else None
        m = _ATTN_SITE.match(site)
        if site in linears:
            if decisions[site][0]:
                act[site] = amax_scalar(site, a)
        elif base in linears:
            if decisions[base][0]:
                w_amax[base] = _weight_amax(site, a, linears[base].out_features)
        elif m and (m["module"] in attentions or not config.fp8_attention):  # unused without fp8_attention
            if config.fp8_attention:
                att[site] = amax_scalar(site, a)
            else:
                entries.append({"site": site, "kind": "attention", "excluded": True,
                                "reason": "quantization.fp8_attention is off"})
        elif any(fnmatch.fnmatchcase(site, p) for p in config.exclude):
            entries.append({"site": site, "kind": "unmatched", "excluded": True,
                            "reason": "recipe exclude; no linear with this module scope in the graph"})
        elif site in dead:
            entries.append({"site": site, "kind": "unmatched", "excluded": True,
                            "reason": "not in the exported graph (dead code: its output is never used)"})
        elif base is None or base not in dead:  # else: the weight amax of a layer the exporter dropped
            near = sorted(linears, key=lambda s: -len(os.path.commonprefix([s, site])))[:1]
            raise QuantizeError(f"stats site {site!r} matches no linear or attention in {graph_name} "
                                f"(nearest: {near[0] if near else '-'}); the stats belong to another export - "
                                "recalibrate, or add the site to quantization.exclude")
    _check_complete(decisions, act, attentions, att, config)
    return act, w_amax, att, entries


def _check_complete(decisions, act, attentions, att, config) -> None:
    """Every quantized site has an activation amax; with ``fp8_attention``, every attention its q/k/v."""
    missing = [s for s, (q, _) in decisions.items() if q and s not in act]
    if missing:
        raise QuantizeError(f"site {missing[0]!r} (+{len(missing) - 1} more) is quantized but has no statistics; "
                            "recalibrate with hooks on every linear or add it to quantization.exclude")
    if config.fp8_attention:
        for mod in attentions:
            for w in "qkv":
                if f"{mod}.{w}" not in att:
                    raise QuantizeError(f"fp8_attention needs stats site '{mod}.{w}' (attention q/k/v observers); "
                                        "recalibrate with attention observers or turn fp8_attention off")


def _plan_fusion(linears, decisions, act, w_amax, fusable) -> tuple:
    """The fused QKV groups; adds each fused site's decision and amax (its members' max activation
    amax, their concatenated weight amax when every member has one) and drops the members' weight amax."""
    fused = []
    for fused_site, members in fuse_qkv.plan_groups(linears, lambda s: decisions[s][0], fusable):
        q = decisions[members[0]][0]
        w_stats = [w_amax.pop(m, None) for m in members]
        decisions[fused_site] = (q, f"fused {'+'.join(m.rsplit('.', 1)[1] for m in members)}")
        if q:
            act[fused_site] = max(act[m] for m in members)
            if all(w is not None for w in w_stats):
                w_amax[fused_site] = np.concatenate(w_stats)
        fused.append((fused_site, tuple(members)))
    return tuple(fused)


def _weight_amax(site: str, a, out_features: int) -> np.ndarray:
    arr = np.asarray(a.detach().cpu().numpy(), dtype=np.float32)
    if arr.ndim != 1 or arr.shape[0] != out_features:
        raise QuantizeError(f"site {site!r}: weight amax shape {arr.shape} != [{out_features}]; recalibrate")
    amax_scalar(site, arr, "weight amax")
    return arr


def amax_scalar(site: str, a, what: str = "amax") -> float:
    """The largest value of an amax tensor, checked finite and positive."""
    t = np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a, dtype=np.float64)
    if t.size == 0 or not np.all(np.isfinite(t)):
        raise QuantizeError(f"site {site!r}: {what} is not finite ({t.ravel()[:4].tolist()}); recalibrate "
                            "(NaN/inf activations) or exclude the site (quantization.exclude)")
    v = float(t.max())
    if not v > 0:
        raise QuantizeError(f"site {site!r}: {what} is {v:g} (the site saw only zeros); scale would be 0 - "
                            "recalibrate with real inputs or exclude the site (quantization.exclude)")
    return v
