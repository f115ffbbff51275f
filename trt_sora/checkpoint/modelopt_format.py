"""The ModelOpt unified HF checkpoint format for a quantized diffusers component, as data.

What ``modelopt.torch.export.export_hf_checkpoint`` writes for a diffusers
transformer and what TensorRT-LLM VisualGen, vLLM(-Omni) and SGLang-Diffusion
read (``quant_method: modelopt``):

* the component's own ``config.json`` (diffusers ``save_config``) plus a
  ``quantization_config`` entry (:func:`quantization_config`);
* safetensors with every tensor of the state dict under its usual name, where each
  quantized ``nn.Linear`` ``<m>`` holds

  ==================  ==========================  ======================================  =========
  key                 FP8 (``quant_algo FP8``)    INT8 (``W8A8_SQ_PER_CHANNEL``)          meaning
  ==================  ==========================  ======================================  =========
  ``<m>.weight``      float8_e4m3fn ``[out, in]`` int8 ``[out, in]``                      W / scale
  ``<m>.weight_scale`` fp32 ``[]`` (per tensor)   fp32 ``[out]`` (per output channel)     amax / qmax
  ``<m>.input_scale`` fp32 ``[]``                 fp32 ``[]``                             static, amax / qmax
  ==================  ==========================  ======================================  =========

  so ``W ~= weight * weight_scale`` and a runtime quantizes the activation as
  ``x / input_scale`` (FP8: saturate to +-448; INT8: round, clamp to [-128, 127]);
* ``ignore``: the linear and convolution modules left in high precision, summarised
  with prefix wildcards (:func:`summarize_excludes`).

FP8 has no ModelOpt name for per-channel weights with a *static* activation scale
(``FP8_PER_CHANNEL_PER_TOKEN`` means dynamic per-token activations), so FP8 weights
are per tensor here, while INT8 weights are per output channel as in our Q/DQ graph.

This module loads no torch at import time; the packing functions import it.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trt_sora.config.recipe import QuantConfig, QuantFormat
from trt_sora.errors import ConfigError, QuantizeError
from trt_sora.formats import QMAX

__all__ = ["QUANT_ALGO", "SCALE_KEYS", "WEIGHT_PER_CHANNEL", "checkpoint_plan", "input_scale", "pack_weight",
           "quant_algo", "quantization_config", "summarize_excludes"]

#: Our format -> ModelOpt's ``quant_algo``.
QUANT_ALGO: dict[QuantFormat, str] = {
    QuantFormat.FP8_E4M3: "FP8",
    QuantFormat.INT8: "W8A8_SQ_PER_CHANNEL",
}
#: Whether the format's weight scale is per output channel (else per tensor).
WEIGHT_PER_CHANNEL: dict[QuantFormat, bool] = {QuantFormat.FP8_E4M3: False, QuantFormat.INT8: True}
#: Tensor names a quantized linear adds beside its ``weight``.
SCALE_KEYS = ("weight_scale", "input_scale")


def _fmt(fmt: QuantFormat | str) -> QuantFormat:
    f = QuantFormat(fmt)
    if f not in QUANT_ALGO:
        raise ConfigError(f"the ModelOpt checkpoint has no format for quantization.format {f.value!r}; "
                          "use fp8_e4m3 or int8")
    return f


def quant_algo(fmt: QuantFormat | str) -> str:
    """ModelOpt's ``quant_algo`` name of ``fmt``; ConfigError for a format it has no layout for."""
    return QUANT_ALGO[_fmt(fmt)]


def quantization_config(fmt: QuantFormat | str, ignore: Iterable[str], producer_version: str) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` (ModelOpt's llm-compressor-style layout).

    Args:
        fmt: ``fp8_e4m3`` or ``int8``.
        ignore: module patterns left unquantized (see :func:`summarize_excludes`), sorted here.
        producer_version: recorded as ``producer.version`` (the ModelOpt format revision we follow).
    """
    f = _fmt(fmt)
    cfg: dict[str, Any] = {}
    if f is QuantFormat.FP8_E4M3:  # ModelOpt writes config_groups for FP8 (and NVFP4) only
        static8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        cfg["config_groups"] = {"group_0": {"input_activations": dict(static8), "weights": dict(static8),
                                            "targets": ["Linear"]}}
    cfg["ignore"] = sorted(ignore)
    cfg["quant_algo"] = QUANT_ALGO[f]
    cfg["producer"] = {"name": "modelopt", "version": producer_version}
    cfg["quant_method"] = "modelopt"
    return cfg


def summarize_excludes(unquantized: Iterable[str], quantized: Iterable[str]) -> set[str]:
    """Cover every ``unquantized`` module name with as few prefix patterns as possible.

    A pattern is ``<prefix>*`` where the prefix ends just before a ``.`` of the name
    (``condition_embedder*``), ``<prefix>.*`` when the bare ``<prefix>*`` would also match
    a quantized name, or the name itself. No pattern may match a ``quantized`` name, or
    a name's prefix wildcard that a quantized name also has. The shortest admissible
    pattern wins, so ``blocks.0.attn1.to_q`` next to quantized ``blocks.0.attn1.to_k``
    stays an exact name. This is the rule ModelOpt's exporter applies (same output).
    """
    quantized = list(quantized)
    forbidden: set[str] = set()
    for q in quantized:
        forbidden.add(q)
        forbidden.update(q[:i] + "*" for i in range(len(q) + 1))
    out: set[str] = set()
    for name in unquantized:
        chosen: list[str] = []
        for cand in _candidates(name):
            if any(c in forbidden for c in cand):
                continue
            if all(c in out for c in cand):
                chosen = []
                break
            chosen = cand
            break
        if len(chosen) == 2:  # {prefix, prefix.*}: a deployment reads "prefix.*" for both
            a, b = sorted(chosen, key=len)
            out.update([b] if b == a + ".*" else chosen)
        else:
            out.update(chosen)
    return out


def _candidates(name: str):
    """Prefix patterns of ``name`` at each ``.``, shortest first, then the name itself."""
    for i, ch in enumerate(name):
        if ch == ".":
            yield [name[:i] + "*"]
            yield [name[:i], name[:i] + ".*"]
    yield [name]


def pack_weight(weight, amax, fmt: QuantFormat | str, dtype=None):
    """``(quantized weight, weight_scale)`` of one linear weight ``[out, in]``.

    Args:
        weight: the float weight ``[out, in]``.
        amax: per-output-channel ``[out]`` (or scalar) clipping bounds; FP8 uses their max
            (per tensor), INT8 keeps one per channel.
        fmt: ``fp8_e4m3`` -> float8_e4m3fn weight, fp32 ``[]`` scale; ``int8`` -> int8 weight,
            fp32 ``[out]`` scale.
        dtype: the weight is cast to this dtype before dividing by the scale (ModelOpt's export
            dtype; default: its own dtype).

    The scale is ``amax / qmax`` in fp32 (an all-zero row's 0 becomes 1). The arithmetic is
    ModelOpt's export arithmetic (``weight.to(dtype) / scale``; INT8 rounds half to even and
    clamps to [-128, 127]), so the stored values are bit-identical to its export.
    """
    import torch

    f = _fmt(fmt)
    a = torch.as_tensor(amax, dtype=torch.float32).detach().cpu()
    w = weight.detach().cpu()
    if dtype is not None:
        w = w.to(dtype)
    if f is QuantFormat.FP8_E4M3:
        scale = a.max().reshape(()) / QMAX[f]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (w / scale).to(torch.float8_e4m3fn), scale
    scale = a.reshape(-1) / QMAX[f]
    if scale.numel() == 1 and w.shape[0] != 1:
        scale = scale.expand(w.shape[0]).clone()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale


def input_scale(amax, fmt: QuantFormat | str):
    """The static activation scale: fp32 ``[]`` = per-tensor ``amax / qmax``."""
    import torch

    f = _fmt(fmt)
    return (torch.as_tensor(amax, dtype=torch.float32).detach().cpu().max() / QMAX[f]).reshape(())


#: Module types whose unquantized instances ModelOpt lists in ``ignore`` (linears and convolutions).
_IGNORABLE = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


def checkpoint_plan(model, stats, config: QuantConfig, family_excludes: Mapping[str, str]) -> dict[str, Any]:
    """Which linears are quantized with which amax, and what ``ignore`` lists.

    Args:
        model: the loaded diffusers transformer (module paths = state-dict prefixes).
        stats: :class:`~trt_sora.calibrate.stats.CalibStats` (``<site>`` activation amax,
            optional ``<site>.weight`` per-channel weight amax).
        config: the recipe's ``quantization`` section (site policy and format).
        family_excludes: the model family's default exclusions (``adapter.quant_excludes``).

    Returns:
        ``{"sites": {site: {"act_amax": float, "weight_amax": fp32 [out]}}, "excluded":
        {site: reason}, "ignore": sorted patterns}``.

    Raises:
        QuantizeError: a site the policy quantizes has no (or no usable) activation amax.
    """
    import torch

    from trt_sora.site_policy import site_policy

    ignorable = tuple(getattr(torch.nn, n) for n in _IGNORABLE)
    sites: dict[str, dict[str, Any]] = {}
    excluded: dict[str, str] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, ignorable):
            continue
        linear = isinstance(mod, torch.nn.Linear)
        quantize, why = site_policy(name, config, family_excludes) if linear else (False, "convolution")
        if not quantize:
            excluded[name] = why
            continue
        if name not in stats.amax:
            raise QuantizeError(f"site {name!r} is quantized by the recipe's policy but the stats have no amax for "
                                "it; recalibrate this model (trt-sora calibrate) or add it to quantization.exclude")
        act = _positive(name, stats.amax[name], "activation amax")
        w = stats.amax.get(f"{name}.weight")
        if w is None:  # stats without weight amax: max |W| per output row, as the Q/DQ pass does
            w = mod.weight.detach().float().abs().amax(dim=1).cpu()
        w = torch.as_tensor(w, dtype=torch.float32).reshape(-1)
        if w.numel() != mod.weight.shape[0]:
            raise QuantizeError(f"site {name!r}: weight amax has {w.numel()} values but the weight has "
                                f"{mod.weight.shape[0]} output channels; the stats belong to another model - "
                                "recalibrate")
        _positive(f"{name}.weight", w, "weight amax")
        sites[name] = {"act_amax": act, "weight_amax": w}
    if not sites:
        raise QuantizeError("no linear is quantized under the recipe's quantization policy; check "
                            "quantization.include/exclude (or use the unquantized model as it is)")
    return {"sites": sites, "excluded": excluded, "ignore": sorted(summarize_excludes(excluded, sites))}


def _positive(site: str, a, what: str) -> float:
    import torch

    t = torch.as_tensor(a, dtype=torch.float32)
    if t.numel() == 0 or not bool(torch.isfinite(t).all()) or not float(t.min()) > 0:
        raise QuantizeError(f"site {site!r}: {what} {t.flatten()[:4].tolist()} is not finite and > 0; recalibrate "
                            "(NaN/inf or all-zero activations) or exclude the site (quantization.exclude)")
    return float(t.max())
