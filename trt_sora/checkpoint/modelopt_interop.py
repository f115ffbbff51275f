"""NVIDIA ModelOpt as the independent reference of the checkpoint stage (``pip install 'trt_sora[modelopt]'``).

* :func:`reference_export`: ModelOpt's own ``export_hf_checkpoint`` of the same model,
  with its quantizers on exactly our sites and our calibrated amax loaded into them;
  our checkpoint must match it key for key and value for value (:func:`compare_checkpoints`).
* :func:`load_fake_quant`: read a checkpoint back as a consumer does (a linear is quantized
  when it carries ``weight_scale``; weights dequantized; activations quantized at
  ``input_scale``) and run it with ModelOpt's fake-quant ``TensorQuantizer`` modules.

diffusers' own ModelOpt quantizer (``NVIDIAModelOptConfig``) cannot load this format
(it reads ModelOpt's *modelopt-state* checkpoints and fails on ``quant_type``), which
is why the load-back goes through ModelOpt's quantizers directly.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trt_sora.checkpoint.modelopt_format import checkpoint_plan
from trt_sora.config.recipe import QuantConfig, QuantFormat
from trt_sora.errors import ArtifactError, require
from trt_sora.formats import QMAX

log = logging.getLogger("trt_sora")

__all__ = ["compare_checkpoints", "load_fake_quant", "read_checkpoint", "reference_export", "quantize_sites"]

_MO = "pip install 'trt_sora[modelopt]'  (nvidia-modelopt)"
_NUM_BITS = {QuantFormat.FP8_E4M3: (4, 3), QuantFormat.INT8: 8}


def _mtq():
    require("modelopt", extra="modelopt", pip=_MO)
    import modelopt.torch.quantization as mtq

    return mtq


def _quiet():
    """ModelOpt prints its progress and warns about untested library versions; library code stays quiet."""
    import contextlib
    import io
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _register_conv_subclasses(model) -> None:
    """ModelOpt wraps a module by its type, and a subclass only when it keeps the base's ``forward``.
    A torch convolution with its own ``forward`` (wan-shapes' frame-embedded patch convolution) is
    registered as that convolution, so ModelOpt sees the module as the conv it is."""
    import torch

    reg = _mtq().QuantModuleRegistry
    bases = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    for mod in model.modules():
        t = type(mod)
        base = next((b for b in bases if isinstance(mod, b)), None)
        if base is not None and t not in reg:
            reg.register({t: f"trt_sora.{t.__name__}"})(reg._registry[base])


def quantize_sites(model, fmt: QuantFormat | str, sites: dict[str, dict[str, Any]]) -> None:
    """Put ModelOpt quantizers on ``model`` (in place): enabled on ``sites`` only, with the given amax.

    Args:
        model: a diffusers transformer.
        fmt: ``fp8_e4m3`` (per-tensor weight and input) or ``int8`` (per-channel weight, per-tensor input).
        sites: ``{linear path: {"act_amax": float, "weight_amax": fp32 [out]}}``.
    """
    import torch

    mtq = _mtq()
    fmt = QuantFormat(fmt)
    bits = _NUM_BITS[fmt]
    w_axis = 0 if fmt is QuantFormat.INT8 else None
    cfg: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    for s in sites:
        cfg.append({"quantizer_name": f"{s}.weight_quantizer", "cfg": {"num_bits": bits, "axis": w_axis}})
        cfg.append({"quantizer_name": f"{s}.input_quantizer", "cfg": {"num_bits": bits, "axis": None}})
    _register_conv_subclasses(model)
    with _quiet():
        mtq.quantize(model, {"quant_cfg": cfg, "algorithm": None}, forward_loop=None)
    for s, p in sites.items():
        mod = model.get_submodule(s)
        w = torch.as_tensor(p["weight_amax"], dtype=torch.float32).reshape(-1)
        mod.weight_quantizer.amax = w.reshape(-1, 1) if w_axis == 0 else w.max().reshape(())
        mod.input_quantizer.amax = torch.tensor(float(p["act_amax"]), dtype=torch.float32)


def reference_export(model, stats, config: QuantConfig, out_dir, *, dtype, family_excludes) -> Path:
    """ModelOpt's ``export_hf_checkpoint`` of ``model`` (in place) with our sites and amax.

    ``model`` is the transformer loaded in ``dtype`` (a torch dtype); ``family_excludes`` its family's
    default exclusions (``adapter.quant_excludes``); returns ``out_dir``.
    """
    require("modelopt", extra="modelopt", pip=_MO)
    from modelopt.torch.export import export_hf_checkpoint

    plan = checkpoint_plan(model, stats, config, family_excludes)
    quantize_sites(model, config.format, plan["sites"])
    with _quiet():
        export_hf_checkpoint(model, dtype=dtype, export_dir=str(out_dir))
    return Path(out_dir)


def read_checkpoint(folder) -> tuple[dict, dict[str, Any]]:
    """``(config.json as a dict, {key: tensor})`` of every safetensors file in ``folder``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ArtifactError(f"{folder} has no config.json; it is not a diffusers checkpoint folder")
    tensors: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if not tensors:
        raise ArtifactError(f"{folder} has no *.safetensors weights")
    return json.loads(cfg_path.read_text()), tensors


def compare_checkpoints(ours, theirs) -> dict[str, Any]:
    """Key-for-key, bit-for-bit comparison of two checkpoint folders.

    Returns ``{"keys_only_ours", "keys_only_theirs", "dtype_or_shape_differs", "value_differs",
    "tensors", "config_differs"}`` (lists of names; ``config_differs`` compares the parsed
    ``config.json`` entry by entry, ``quantization_config`` included). Equal means all lists empty.
    """
    import torch

    c1, t1 = read_checkpoint(ours)
    c2, t2 = read_checkpoint(theirs)
    common = sorted(set(t1) & set(t2))
    meta, value = [], []
    for k in common:
        a, b = t1[k], t2[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            meta.append(k)
        elif not torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                             b.view(torch.uint8) if b.element_size() == 1 else b):
            value.append(k)
    cfg_keys = sorted(set(c1) | set(c2))
    return {"keys_only_ours": sorted(set(t1) - set(t2)), "keys_only_theirs": sorted(set(t2) - set(t1)),
            "dtype_or_shape_differs": meta, "value_differs": value, "tensors": len(common),
            "config_differs": [k for k in cfg_keys if c1.get(k) != c2.get(k)]}


def load_fake_quant(folder, model):
    """Load checkpoint ``folder`` into ``model`` (the same architecture, loaded; changed in place)
    and give it ModelOpt fake quantization as the checkpoint prescribes; returns ``model``.

    A linear is quantized when the checkpoint holds ``<m>.weight_scale``: its weight becomes
    ``weight * weight_scale`` (per tensor, or per output channel ``[out]``), its ModelOpt weight
    quantizer gets amax ``weight_scale * qmax`` and its input quantizer amax
    ``input_scale * qmax``; every other tensor is copied as stored. ``quant_algo`` picks FP8 or
    INT8. Raises ArtifactError when a key has no place in ``model`` or a quantized module is
    listed in ``ignore``.
    """
    import fnmatch

    import torch

    cfg, tensors = read_checkpoint(folder)
    qc = cfg.get("quantization_config") or {}
    algo = qc.get("quant_algo")
    fmt = {"FP8": QuantFormat.FP8_E4M3, "W8A8_SQ_PER_CHANNEL": QuantFormat.INT8}.get(algo)
    if fmt is None:
        raise ArtifactError(f"{folder}: quant_algo {algo!r} is not one this loader reads (FP8, W8A8_SQ_PER_CHANNEL)")
    qmax = QMAX[fmt]
    quantized = sorted(k[:-len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    for m in quantized:
        if any(fnmatch.fnmatchcase(m, p) for p in qc.get("ignore", [])):
            raise ArtifactError(f"{folder}: {m} carries quantized weights but matches the ignore list {qc['ignore']}")
    state = model.state_dict()
    sites = {}
    new_state = {}
    for m in quantized:
        w, ws = tensors.pop(f"{m}.weight"), tensors.pop(f"{m}.weight_scale").float()
        xs = tensors.pop(f"{m}.input_scale").float()
        deq = w.float() * (ws[:, None] if ws.dim() == 1 else ws)
        new_state[f"{m}.weight"] = deq.to(state[f"{m}.weight"].dtype)
        sites[m] = {"act_amax": float(xs) * qmax, "weight_amax": (ws * qmax).expand(w.shape[0]).clone()}
    new_state.update(tensors)
    unknown = sorted(set(new_state) - set(state))
    missing = sorted(set(state) - set(new_state))
    if unknown or missing:
        raise ArtifactError(f"{folder} does not fit the model: unknown keys {unknown[:3]}, missing keys {missing[:3]}")
    with torch.no_grad():
        model.load_state_dict({k: v.to(state[k].dtype) for k, v in new_state.items()}, strict=True)
    quantize_sites(model, fmt, sites)
    return model
