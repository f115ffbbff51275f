"""PyTorch runners: the reference model and its fake-quantized twin (simulated Q/DQ)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trt_sora.errors import ArtifactError, QuantizeError
from trt_sora.runners.base import Runner, is_torch, to_numpy

log = logging.getLogger("trt_sora")


def as_adapter(model_ref):
    """The family adapter of ``model_ref`` (a model ref such as ``"wan-tiny"``, or an adapter as it is)."""
    from trt_sora.models import ModelAdapter, get_adapter

    return model_ref if isinstance(model_ref, ModelAdapter) else get_adapter(model_ref)


class TorchRunner(Runner):
    """The adapter's PyTorch transformer.

    Args:
        model_ref: registry name, checkpoint folder or :class:`ModelAdapter`.
        dtype: ``"fp32"`` / ``"bf16"`` / ``"fp16"`` compute dtype (``timestep`` stays fp32).
        device: ``"cpu"`` / ``"cuda"`` / ``"cuda:1"``.
        model: an already loaded module (shared between runners; not freed on deactivate).
        compile: wrap the forward in ``torch.compile`` (GPU benchmarking).
        sparse: a :class:`trt_sora.sparse.SparsePlan`: the self-attentions masked per call (None: dense).

    ``infer`` feeds: ``hidden_states`` [B, C, F, H, W], ``timestep`` [B] fp32,
    ``encoder_hidden_states`` [B, L, D]; returns ``{"sample": [B, C, F, H, W]}`` as numpy fp32
    for numpy feeds, or a torch tensor in ``dtype`` on ``device`` for torch feeds.
    """

    def __init__(self, model_ref, *, dtype: str = "fp32", device: str = "cpu", model=None,
                 compile: bool = False, name: str | None = None, sparse=None):
        super().__init__()
        self.adapter = as_adapter(model_ref)
        self.sparse = sparse
        self._sites: dict[str, Any] = {}
        self.dtype, self.device = dtype, device
        self._given_model = model
        self.model = None
        self._fwd = None
        self.compile = compile
        self.input_names = tuple(self.adapter.input_names)
        self.output_names = tuple(self.adapter.output_names)
        self.name = name or f"torch-{dtype}:{self.adapter.name}"

    def _load_model(self):
        return self._given_model if self._given_model is not None else self.adapter.load(self.dtype, self.device)

    def _activate_impl(self) -> None:
        import torch

        self.model = self._load_model()
        module = self.adapter.export_module(self.model).eval()
        self._fwd = torch.compile(module) if self.compile else module
        self._sites = self.adapter.sparse_attention_sites(self.model) if self.sparse is not None else {}

    def _deactivate_impl(self) -> None:
        self.model = None
        self._fwd = None

    def _to_torch(self, feeds: Mapping[str, Any]) -> dict:
        import torch

        from trt_sora.models.base import torch_dtype

        td = torch_dtype(self.dtype)
        out = {}
        for n in self.input_names:
            v = feeds[n]
            t = v if is_torch(v) else torch.from_numpy(to_numpy(v).copy())
            out[n] = t.to(self.device, torch.float32 if n == "timestep" else td)
        return out

    def _infer_impl(self, feeds):
        import torch

        as_torch = is_torch(next(iter(feeds.values())))
        inputs = self._to_torch(feeds)
        with torch.inference_mode(), self._sparse_call(inputs):
            y = self._fwd(*[inputs[n] for n in self.input_names])
        name = self.output_names[0]
        return {name: y if as_torch else to_numpy(y, "float32")}

    def _sparse_call(self, inputs: Mapping[str, Any]):
        """The sparse plan's seams for one call (a no-op when dense): the token grid of ``hidden_states``,
        the timestep of the call."""
        if self.sparse is None:
            return contextlib.nullcontext()
        grid = self.adapter.token_grid(inputs[self.input_names[0]].shape)
        return self.sparse.applied(self._sites, grid, float(inputs["timestep"].reshape(-1)[0]), self.device)

    def infer_probes(self, feeds, probes: Sequence[str]):
        """Also capture the outputs of the modules named in ``probes`` (module paths relative to
        the transformer, e.g. ``blocks.0`` or ``blocks.0.attn1.to_q``) as numpy fp32."""
        self._check_active()
        captured: dict[str, Any] = {}
        handles = []
        names = dict(self.model.named_modules())
        for p in probes:
            mod = names.get(p)
            if mod is None:
                continue

            def hook(_m, _inp, out, _p=p):
                t = out[0] if isinstance(out, (tuple, list)) else out
                captured[_p] = to_numpy(t, "float32")

            handles.append(mod.register_forward_hook(hook))
        try:
            out = self.infer(feeds)
        finally:
            for h in handles:
                h.remove()
        return out, captured


@dataclasses.dataclass(frozen=True)
class QdqSite:
    """One quantized ``nn.Linear`` of the Q/DQ graph.

    Attributes:
        module: module path (``blocks.0.attn1.to_q``); for a fused QKV the member linears appear
            one by one.
        format: ``fp8_e4m3`` / ``int8``.
        group: every module whose input shares this Q/DQ pair (one activation scale = the max of
            their amax, exactly as the Q/DQ graph does; fused QKV members, linears reading one tensor).
        graph_amax: the activation amax the Q/DQ graph used (from the map; for diagnostics).
        tensor: the ONNX tensor the activation Q/DQ sits on.
    """

    module: str
    format: str
    group: tuple[str, ...] = ()
    graph_amax: float | None = None
    tensor: str | None = None


def read_qdq_map(path_or_data) -> tuple[list[QdqSite], dict]:
    """Parse ``qdq_map.json`` (:func:`trt_sora.quantize.quantize_onnx`): ``{"format", "graph_dtype",
    "sites": [{"site", "kind", "excluded", "format", "tensor", "amax", "members"?, "fused_into"?}]}``.

    Returns ``(quantized linear sites as torch module paths, the whole map)``; fused QKV entries
    are expanded into their member linears.
    """
    if isinstance(path_or_data, (str, Path)):
        p = Path(path_or_data)
        if not p.is_file():
            raise ArtifactError(f"{p} does not exist; re-run `trt-sora quantize` to write the Q/DQ map")
        data = json.loads(p.read_text())
        data["_dir"] = str(p.resolve().parent)
    else:
        data = dict(path_or_data)
    entries = data.get("sites")
    if not isinstance(entries, list):
        raise ArtifactError("qdq_map.json has no 'sites' list; it was written by another trt_sora version - "
                            "re-run `trt-sora quantize`")
    by_tensor: dict[str, list[str]] = {}
    info: dict[str, dict] = {}
    for e in entries:
        if e.get("kind") != "linear" or e.get("excluded") or "fused_into" in e:
            continue
        members = list(e.get("members") or [e["site"]])
        key = e.get("tensor") or e["site"]
        for m in members:
            m = m[len("inner."):] if m.startswith("inner.") else m
            by_tensor.setdefault(key, []).append(m)
            info[m] = {"format": e.get("format") or data.get("format"), "amax": e.get("amax"), "tensor": key}
    sites = [QdqSite(module=m, format=str(i["format"]), group=tuple(by_tensor[i["tensor"]]),
                     graph_amax=None if i["amax"] is None else float(i["amax"]), tensor=i["tensor"])
             for m, i in info.items()]
    if not sites:
        raise QuantizeError("qdq_map.json lists no quantized linear; the Q/DQ graph quantized nothing "
                            "(check quantization.include/exclude)")
    return sites, data


def map_rounded_weights(qdq_meta: dict) -> dict | None:
    """``{site: W'}``: the GPTQ-rounded weights the Q/DQ graph was built with (``qdq_map.json``'s
    ``rounded_weights``, a path relative to the map, checked by sha256), or None (nearest rounding)."""
    ref = qdq_meta.get("rounded_weights")
    if not ref:
        return None
    from trt_sora.calibrate.gptq import load_rounded_weights
    from trt_sora.manifest import sha256_file

    path = Path(ref["path"])
    if not path.is_absolute():
        path = Path(qdq_meta.get("_dir", ".")) / path
    if not path.is_file() or sha256_file(path) != ref.get("sha256"):
        raise ArtifactError(f"the Q/DQ graph was built with rounded weights {path} but that file is "
                            f"{'missing' if not path.is_file() else 'changed'}; re-run `trt-sora quantize` with "
                            "the calibration's weights.safetensors")
    return load_rounded_weights(path)


def use_rounded_weights(model, qdq_meta: dict) -> int:
    """Copy the map's rounded weights (:func:`map_rounded_weights`) into ``model``'s linears, in place
    (backends that quantize the module's own weight, e.g. the torch-fp8 one); returns how many."""
    import torch

    rounded = map_rounded_weights(qdq_meta) or {}
    mods = dict(model.named_modules())
    with torch.no_grad():
        for site, w in rounded.items():
            if site not in mods:
                raise ArtifactError(f"rounded weight {site!r} is not a module of the model; the Q/DQ map belongs to "
                                    "another model - re-run `trt-sora quantize` on this model's export")
            mods[site].weight.copy_(w.to(mods[site].weight.device, mods[site].weight.dtype))
    return len(rounded)


def _stats_amax(stats, site: str):
    """Per-tensor input amax of ``site`` from CalibStats (keyed by module path), or None."""
    a = stats.amax.get(site) if stats is not None else None
    if a is None:
        return None
    return float(a.float().max())


def load_stats(stats):
    """``stats.safetensors`` path -> ``CalibStats``; a ``CalibStats`` or None passes through."""
    if stats is not None and not hasattr(stats, "amax"):
        from trt_sora.calibrate.stats import CalibStats

        return CalibStats.load(stats)
    return stats


def site_amaxes(sites: Sequence[QdqSite], stats) -> list[tuple[float, Any]]:
    """``(input amax, per-output-channel weight amax or None)`` of each quantized site, as the Q/DQ
    graph computes them: one input scale per shared tensor (the max over the site's group: fused
    QKV members, linears reading one tensor), from the calibration ``stats`` when they cover the
    whole group, else the map's recorded amax. Shared by the fake-quant and the FP8 runners."""
    out = []
    for s in sites:
        group = [_stats_amax(stats, m) for m in s.group]
        if stats is None or any(a is None for a in group):
            if s.graph_amax is None:
                raise QuantizeError(f"no input amax for {s.module!r} in the stats nor in qdq_map.json; "
                                    "pass the calibration stats the Q/DQ graph was made from")
            amax_f = s.graph_amax
        else:
            amax_f = max(group)
        out.append((amax_f, stats.amax.get(f"{s.module}.weight") if stats is not None else None))
    return out


class TorchFakeQuantRunner(TorchRunner):
    """The PyTorch model with simulated Q/DQ exactly where the Q/DQ graph has it.

    For every site of ``qdq_map``: the ``nn.Linear``'s input is fake-quantized per tensor at the
    calibration amax (``stats``; the map's own amax when stats lack the site) and its weight per
    output channel (stats' weight amax, else max |w| of each row), through
    :func:`trt_sora.calibrate.fakequant_model.fake_quantized` (ONNX Q/DQ semantics).

    Args:
        model_ref, dtype, device, model: as :class:`TorchRunner` (a given ``model`` is deep-copied onto ``device``).
        qdq_map: path to / parsed ``qdq_map.json``.
        stats: path to ``stats.safetensors`` or a ``CalibStats`` (the ones the Q/DQ graph was made
            from); ``None``: the map's recorded amax (then a wrong scale in the graph is invisible).
        round_inputs: ``"fp16"``/``"bf16"``: round each quantized input to that dtype first, as a
            Q/DQ graph in that dtype holds it (the parity checker's rounding-floor reference).
    """

    def __init__(self, model_ref, qdq_map, stats=None, *, dtype: str = "fp32", device: str = "cpu",
                 model=None, name: str | None = None, round_inputs: str | None = None):
        super().__init__(model_ref, dtype=dtype, device=device, model=model,
                         name=name or f"torch-fakequant-{dtype}")
        self.round_inputs = round_inputs
        self.sites, self.qdq_meta = read_qdq_map(qdq_map)
        self._stats_src = stats
        self._stack = None
        self.site_amax: dict[str, float] = {}

    def _load_model(self):
        import copy

        if self._given_model is None:
            return super()._load_model()
        return copy.deepcopy(self._given_model).to(self.device)  # its own copy, on this runner's device

    def _activate_impl(self) -> None:
        import contextlib

        import torch

        from trt_sora.calibrate.fakequant_model import fake_quantized
        from trt_sora.models.base import torch_dtype

        stats = load_stats(self._stats_src)
        super()._activate_impl()
        modules = dict(self.model.named_modules())
        by_format: dict[str, tuple[dict, dict]] = {}  # format -> ({site: act amax}, {site: weight amax})
        for s, (amax_f, w_amax) in zip(self.sites, site_amaxes(self.sites, stats)):
            mod = modules.get(s.module)
            if not isinstance(mod, torch.nn.Linear):
                raise QuantizeError(f"qdq_map site {s.module!r} is not an nn.Linear of {self.adapter.name} "
                                    f"(got {type(mod).__name__}); the map belongs to another model - re-run "
                                    "`trt-sora quantize` on this model's export")
            self.site_amax[s.module] = amax_f
            act, wam = by_format.setdefault(s.format, ({}, {}))
            act[s.module] = amax_f
            if w_amax is not None:
                wam[s.module] = w_amax
        # the same fake-quant model the calibration report evaluates (one implementation of the math)
        rounded = map_rounded_weights(self.qdq_meta)
        self._stack = contextlib.ExitStack()
        for fmt, (act, wam) in by_format.items():
            self._stack.enter_context(fake_quantized(
                self.model, act, fmt, weight_amax=wam or None, weights=rounded,
                round_inputs=torch_dtype(self.round_inputs) if self.round_inputs else None))
        log.info("%s: simulating Q/DQ at %d sites", self.name, len(self.sites))

    def _deactivate_impl(self) -> None:
        if getattr(self, "_stack", None) is not None:
            self._stack.close()
            self._stack = None
        super()._deactivate_impl()
