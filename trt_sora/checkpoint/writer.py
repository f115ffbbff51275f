"""``export_checkpoint``: calibration stats + the PyTorch weights -> a ModelOpt-format quantized checkpoint.

The artifact is a diffusers component folder (``config.json`` with ModelOpt's
``quantization_config``, ``diffusion_pytorch_model*.safetensors``) that TensorRT-LLM
VisualGen, vLLM-Omni and SGLang-Diffusion load as a pre-quantized transformer,
plus trt_sora's ``manifest.json``. The tensors follow
:mod:`trt_sora.checkpoint.modelopt_format`; which linears are quantized follows the
recipe's ``quantization`` section exactly as the Q/DQ graph does
(:func:`trt_sora.site_policy.site_policy`), with the calibrated amax of
``stats.safetensors``.

It is a stage of its own, beside ``quantize``: it reads the PyTorch weights (not the
ONNX graph) and writes for other runtimes, so a deployment through TensorRT-LLM or
vLLM needs only ``calibrate`` before it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from trt_sora.checkpoint.modelopt_format import checkpoint_plan
from trt_sora.config.recipe import QuantConfig, QuantFormat
from trt_sora.errors import ArtifactError, QuantizeError, require
from trt_sora.manifest import read_manifest, sha256_file, staged_dir, write_manifest
from trt_sora.runfolder import has_manifest

log = logging.getLogger("trt_sora")

__all__ = ["CONFIG_NAME", "CheckpointResult", "FORMAT_REVISION", "export_checkpoint"]

CONFIG_NAME = "config.json"
#: The ModelOpt release whose unified HF export this layout reproduces (``producer.version``).
FORMAT_REVISION = "0.47.0"


@dataclasses.dataclass(frozen=True)
class CheckpointResult:
    """What :func:`export_checkpoint` wrote.

    Attributes:
        folder: the checkpoint folder (a diffusers component: point a pipeline's ``transformer`` at it).
        manifest: trt_sora's ``manifest.json`` content (``results`` has the counts and the ignore list).
    """

    folder: Path
    manifest: dict

    @property
    def quantization_config(self) -> dict:
        return json.loads((self.folder / CONFIG_NAME).read_text())["quantization_config"]


def _model_from_stats(stats_path: Path | None, model):
    """The adapter named by the calibration folder's manifest (or ``model``: a ref or an adapter)."""
    from trt_sora.models import ModelAdapter, adapter_for_manifest, get_adapter

    if isinstance(model, ModelAdapter):
        return model
    if model is not None:
        return get_adapter(model)
    if stats_path is None or not has_manifest(stats_path.parent):
        raise ArtifactError("cannot tell which model the stats belong to: pass model= (or --model), or use the "
                            "stats.safetensors inside a `trt-sora calibrate` folder (its manifest names the model)")
    entry = read_manifest(stats_path.parent, stage="calibrate")["inputs"]["model"]
    return adapter_for_manifest(entry)


def _rounded_weights(stats_path: Path | None, weights, fmt: QuantFormat):
    """``(path, {site: W' fp32 [out, in]})`` of the calibration's GPTQ-rounded weights, or ``(None, None)``.

    ``weights``: ``None`` = the file the calibration folder's manifest lists (``outputs.weights``), if any;
    ``False`` = none (round the original weights to nearest, as ModelOpt's export does); a path = that file.
    """
    from safetensors import safe_open

    if weights is False:
        return None, None
    if weights is None:
        if stats_path is None or not has_manifest(stats_path.parent):
            return None, None
        name = read_manifest(stats_path.parent, stage="calibrate").get("outputs", {}).get("weights")
        if not name:
            return None, None
        weights = stats_path.parent / name
    path = Path(weights)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist; pass the weights.safetensors of a calibration with "
                            "calibration.weight_rounding: gptq, or none")
    with safe_open(str(path), "pt") as f:
        rounded_for = (f.metadata() or {}).get("quant_format")
    if fmt is QuantFormat.FP8_E4M3:
        raise QuantizeError(f"{path}: the calibration rounded its weights with GPTQ onto per-channel FP8 grids, which "
                            "ModelOpt's FP8 checkpoint (one weight scale per tensor) cannot hold; pass "
                            "--nearest-weights "
                            "(weights=False) to round the original weights to nearest as ModelOpt does, or export "
                            "--format int8 from an int8 GPTQ calibration")
    if rounded_for != fmt.value:
        raise QuantizeError(f"{path} holds weights rounded for {rounded_for}, the checkpoint is {fmt.value}; "
                            f"calibrate with quantization.format {fmt.value}, or pass --nearest-weights")
    from trt_sora.calibrate.gptq import load_rounded_weights
    from trt_sora.errors import CalibrationError

    try:
        return path, load_rounded_weights(path)
    except CalibrationError as exc:
        raise QuantizeError(str(exc)) from None


def export_checkpoint(stats, config: QuantConfig, out_dir: str | os.PathLike, *, model=None, dtype: str = "bf16",
                      max_shard_size: str | int = "10GB", loaded=None, verify: bool = False,
                      weights=None) -> CheckpointResult:
    """Write ``out_dir``: the quantized checkpoint of the calibrated model (see the module docstring).

    Args:
        stats: ``stats.safetensors`` (path; its folder's manifest names the model) or a ``CalibStats``.
        config: the recipe's ``quantization`` section: ``format`` (``fp8_e4m3`` -> ModelOpt ``FP8``,
            per-tensor weights; ``int8`` -> ``W8A8_SQ_PER_CHANNEL``), include/exclude, default exclusions.
        out_dir: written atomically: ``config.json``, ``diffusion_pytorch_model*.safetensors``
            (sharded past ``max_shard_size``), ``manifest.json``.
        model: model name, checkpoint folder or adapter; default: the one the calibration manifest names.
        dtype: load dtype of the model (``bf16``, ``fp16``, ``fp32``): the unquantized tensors are stored in it
            (diffusers keeps its fp32 modules), and quantized weights are divided by their scale in it.
        max_shard_size: diffusers' shard limit (``"10GB"``, bytes).
        loaded: an already loaded transformer in ``dtype`` to use instead of loading one; its quantized
            linears are rewritten in place (pass a copy if you need it afterwards).
        verify: also run NVIDIA ModelOpt's own ``export_hf_checkpoint`` on the same model with our
            sites and amax loaded into its quantizers, and require the two checkpoints to be equal key
            for key and bit for bit (``results.modelopt_match``; needs ``nvidia-modelopt``).
        weights: GPTQ-rounded weights (``calibration.weight_rounding: gptq``): ``None`` = the calibration
            folder's ``weights.safetensors`` when its manifest lists one, ``False`` = none, or a path. INT8
            stores their codes exactly (the same per-channel grid); FP8 cannot (per-tensor weight scales):
            a QuantizeError unless ``False``.

    Returns:
        :class:`CheckpointResult`.

    Raises:
        QuantizeError: stats for another model (hash), unusable amax, nothing to quantize.
        ArtifactError: the model cannot be told from the inputs.
        ConfigError: a format without a ModelOpt checkpoint layout (``none``).
        ArtifactError: ``verify`` found a difference from ModelOpt's export (nothing is written).
    """
    import torch

    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.checkpoint import modelopt_format as mf

    t0 = time.perf_counter()
    fmt = QuantFormat(config.format)
    algo = mf.quant_algo(fmt)
    stats_path = None if isinstance(stats, CalibStats) else Path(stats)
    calib = stats if stats_path is None else _load_stats(stats_path)
    adapter = _model_from_stats(stats_path, model)
    want, got = adapter.spec.model_hash(), calib.metadata.model_hash
    if got and got != want:
        raise QuantizeError(f"the stats are for model hash {got} ({calib.metadata.model or '?'}) but "
                            f"{adapter.spec.ref} "
                            f"is {want}; calibrate this model (trt-sora calibrate) or pass the matching --stats")
    require("diffusers", extra="export")
    from trt_sora.models.base import torch_dtype

    tdtype = torch_dtype(dtype)
    net = loaded if loaded is not None else adapter.load(dtype, "cpu")
    plan = checkpoint_plan(net, calib, config, adapter.quant_excludes)
    rounded_path, rounded = _rounded_weights(stats_path, weights, fmt)
    missing = sorted(set(plan["sites"]) - set(rounded or plan["sites"]))
    if missing:
        raise QuantizeError(f"{rounded_path} has no rounded weights for {missing[:3]} ({len(missing)} sites the recipe "
                            "quantizes); recalibrate with this recipe, or pass --nearest-weights")
    with torch.no_grad():
        for site, p in plan["sites"].items():
            mod = net.get_submodule(site)
            if rounded is not None:  # W' = codes x scale in fp32: dividing in fp32 gives the codes back exactly
                qweight, wscale = mf.pack_weight(rounded[site], p["weight_amax"], fmt, torch.float32)
            else:
                qweight, wscale = mf.pack_weight(mod.weight, p["weight_amax"], fmt, tdtype)
            mod.weight = torch.nn.Parameter(qweight, requires_grad=False)
            mod.register_buffer("weight_scale", wscale)
            mod.register_buffer("input_scale", mf.input_scale(p["act_amax"], fmt))
    qcfg = mf.quantization_config(fmt, plan["ignore"], FORMAT_REVISION)
    with staged_dir(out_dir) as tmp:
        net.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
        cfg_path = tmp / CONFIG_NAME
        data = json.loads(cfg_path.read_text())
        data["quantization_config"] = qcfg
        cfg_path.write_text(json.dumps(data, indent=4) + "\n")
        files = sorted(p.name for p in tmp.glob("*.safetensors"))
        integrity = _check_written(tmp, plan["sites"], fmt)
        match = _verify_with_modelopt(tmp, adapter, calib, config, dtype, rounded) if verify else None
        results = {
            "model": adapter.describe(), "format": fmt.value, "quant_algo": algo, "dtype": dtype,
            "counts": {"quantized_linears": len(plan["sites"]), "excluded_modules": len(plan["excluded"]),
                       "tensors": integrity["tensors"], "files": len(files)},
            "weight_granularity": "per_channel" if mf.WEIGHT_PER_CHANNEL[fmt] else "per_tensor",
            "weight_rounding": "gptq" if rounded is not None else "nearest",
            "ignore": plan["ignore"], "excluded": plan["excluded"],
            "bytes": sum((tmp / f).stat().st_size for f in files), "seconds": round(time.perf_counter() - t0, 2),
            "modelopt_match": match,
        }
        inputs = {"stats": {"path": str(stats_path.resolve()), "sha256": sha256_file(stats_path)}
                  if stats_path else {"path": None, "note": "CalibStats object passed in memory"},
                  "model": adapter.describe(),
                  **({"weights": {"path": str(rounded_path.resolve()), "sha256": sha256_file(rounded_path)}}
                     if rounded_path else {})}
        manifest = write_manifest(tmp, stage="checkpoint", inputs=inputs, config=config, results=results,
                                  outputs={"config": CONFIG_NAME, "weights": files})
    out = Path(out_dir)
    log.info("checkpoint: %d linears %s (%s), %d modules ignored -> %s", len(plan["sites"]), algo, dtype,
             len(plan["excluded"]), out)
    return CheckpointResult(out, manifest)


def _verify_with_modelopt(folder: Path, adapter, calib, config: QuantConfig, dtype: str,
                          rounded=None) -> dict[str, Any]:
    """ModelOpt's export of the same model (its rounded weights, if any) beside ``folder``, compared with it;
    raises on any difference."""
    import shutil
    import tempfile

    from trt_sora.checkpoint import modelopt_interop as mi
    from trt_sora.models.base import torch_dtype

    ref_dir = Path(tempfile.mkdtemp(prefix=".modelopt-ref-", dir=folder.parent))
    try:
        mi.reference_export(_with_weights(adapter.load(dtype, "cpu"), rounded), calib, config, ref_dir,
                            dtype=torch_dtype(dtype), family_excludes=adapter.quant_excludes)
        diff = mi.compare_checkpoints(folder, ref_dir)
    finally:
        shutil.rmtree(ref_dir, ignore_errors=True)
    bad = {k: v for k, v in diff.items() if k != "tensors" and v}
    if bad:
        key, names = next(iter(bad.items()))
        raise ArtifactError(f"the checkpoint differs from NVIDIA ModelOpt's export of the same model ({key}: "
                            f"{names[:3]}); this is a trt_sora bug or a ModelOpt format change - please report it "
                            "with both versions")
    import importlib.metadata

    return {"equal": True, "tensors": diff["tensors"], "modelopt": importlib.metadata.version("nvidia-modelopt")}


def _with_weights(net, rounded):
    """``net`` with the linears of ``rounded`` (``{site: W'}``) set to those weights (in place)."""
    import torch

    with torch.no_grad():
        for site, w in (rounded or {}).items():
            lin = net.get_submodule(site)
            lin.weight.copy_(w.to(lin.weight.dtype))
    return net


def _load_stats(path: Path):
    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.errors import CalibrationError

    try:
        return CalibStats.load(path, validate=False)
    except CalibrationError as exc:
        raise QuantizeError(f"cannot read calibration stats: {exc}") from None


def _check_written(folder: Path, sites: dict, fmt: QuantFormat) -> dict[str, int]:
    """Re-open what was written: every quantized linear has its weight in the format's dtype and both scales."""
    from safetensors import safe_open

    want = {QuantFormat.FP8_E4M3: "F8_E4M3", QuantFormat.INT8: "I8"}[fmt]  # safetensors dtype names
    dtypes: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                dtypes[k] = fh.get_slice(k).get_dtype()
    for site in sites:
        missing = [k for k in ("weight", "weight_scale", "input_scale") if f"{site}.{k}" not in dtypes]
        if missing:
            raise ArtifactError(f"the written checkpoint lacks {site}.{missing[0]}; this is a trt_sora bug - "
                                "please report it with the recipe")
        if dtypes[f"{site}.weight"] != want:
            raise ArtifactError(f"the written checkpoint stores {site}.weight as {dtypes[f'{site}.weight']}, "
                                f"expected {want}; this is a trt_sora bug - please report it")
    return {"tensors": len(dtypes)}
