"""Simulated Q/DQ in PyTorch: fake-quantize linear inputs and weights of a loaded model.

:func:`fake_quantized` is a context manager; inside it, each selected
``nn.Linear`` computes ``F.linear(fq(x; a_site), fq(W; a_W per output channel), b)``
with :func:`trt_sora.calibrate.fake_quant.fake_quant` (ONNX Q/DQ semantics), which is
what the Q/DQ graph built by ``trt_sora.quantize`` computes: per-tensor activation
Q/DQ on the linear's input, per-output-channel weight DQ. On exit the model is
exactly as before (nothing is copied or written into its parameters)::

    with fake_quantized(model, {"blocks.0.attn1.to_q": 3.2, ...}, "fp8_e4m3") as sites:
        y = model(...)

``trt_sora.runners.torch_runner.TorchFakeQuantRunner`` does the same from a
``qdq_map.json`` (grouping fused/shared inputs to one scale, deep-copying the
model and overwriting its weights); this module is the map-free, copy-free form
the calibration report uses, and the runner may delegate to it.

:func:`quantized_sites` applies the quantize stage's policy
(:func:`trt_sora.site_policy.site_policy`: recipe include/exclude plus the
default exclusions - patch embedding, condition embedders, AdaLN, ``proj_out``),
so a simulation measures what will be built.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F

from trt_sora.calibrate.fake_quant import fake_quant
from trt_sora.config.recipe import QuantConfig, QuantFormat
from trt_sora.errors import CalibrationError
from trt_sora.formats import quant_format

log = logging.getLogger("trt_sora")

__all__ = ["fake_quantized", "quantized_sites"]


def quantized_sites(model: torch.nn.Module, config: QuantConfig | None,
                    family_excludes: Mapping[str, str]) -> list[str]:
    """Module paths of the ``nn.Linear`` layers the quantize stage would quantize under ``config``.

    ``config`` None is ``QuantConfig()`` (everything except the default exclusions);
    ``family_excludes``: the model family's default exclusions (``adapter.quant_excludes``).
    """
    from trt_sora.site_policy import site_policy

    config = config or QuantConfig()
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and site_policy(n, config, family_excludes)[0]]


def _scalar_amax(site: str, a) -> torch.Tensor:
    t = torch.as_tensor(a, dtype=torch.float32).detach()
    if t.numel() == 0 or not bool(torch.isfinite(t).all()):
        raise CalibrationError(f"site {site!r}: amax {t.flatten()[:4].tolist()} is not finite; recalibrate")
    return t.max().reshape(()).cpu()


@contextlib.contextmanager
def fake_quantized(model: torch.nn.Module, act_amax: Mapping[str, torch.Tensor | float],
                   fmt: QuantFormat | str, *, sites: Callable[[str], bool] | Iterable[str] | None = None,
                   weight_amax: Mapping[str, torch.Tensor] | None = None, quantize_weights: bool = True,
                   cache_weights: bool = True, round_inputs: torch.dtype | None = None,
                   enabled: Callable[[], bool] | None = None,
                   weights: Mapping[str, torch.Tensor] | None = None) -> Iterator[list[str]]:
    """Simulate FP8/INT8 Q/DQ on the selected linears of ``model`` while the context is open.

    Args:
        model: any ``nn.Module``; its ``nn.Linear`` children are addressed by module path.
        act_amax: ``{site: amax}`` input-activation clipping bounds (scalar; a ``[C]`` tensor is
            reduced to its max, i.e. per-tensor as the Q/DQ graph does).
        fmt: ``"fp8_e4m3"`` or ``"int8"``.
        sites: which linears to quantize: a predicate on the module path, an iterable of paths,
            or ``None`` = every linear that has an entry in ``act_amax``.
        weight_amax: optional ``{site: [out_features] amax}``; default ``max |W|`` per output row.
        quantize_weights: also fake-quantize weights per output channel (True, as built).
        cache_weights: precompute the fake-quantized weights once (one extra copy of the
            quantized linears' weights in their dtype); ``False`` recomputes them in every
            forward (no extra memory; for models that fill the device).
        round_inputs: round each quantized input to this dtype (e.g. ``torch.float16``) before
            quantizing it, as a Q/DQ graph in that dtype holds its activations. The parity
            checker uses it to measure the rounding floor: how far an fp16 graph's FP8
            roundings may legitimately drift from an fp32 simulation.
        weights: ``{site: W'}`` weights to quantize instead of the module's (GPTQ-rounded weights from
            ``weights.safetensors``, already on the grid, so quantizing them is the identity).
        enabled: ``enabled() -> bool`` asked on every call: False runs the unquantized linear
            (e.g. the steps a step-aware recipe keeps unquantized, or teacher-forced comparisons).

    Yields:
        the list of quantized module paths (module order).

    Raises:
        CalibrationError: a selected linear has no amax, or an amax is not finite.
        ConfigError: unknown ``fmt``.
    """
    fmt = quant_format(fmt).value
    if sites is None:
        selected: Callable[[str], bool] = lambda n: n in act_amax  # noqa: E731
    elif callable(sites):
        selected = sites
    else:
        wanted = set(sites)
        selected = wanted.__contains__
    patched: list[tuple[torch.nn.Module, Callable | None]] = []  # (module, its own instance forward)
    names: list[str] = []
    try:
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear) or not selected(name):
                continue
            if name not in act_amax:
                raise CalibrationError(f"site {name!r} is selected for fake quantization but has no activation "
                                       "amax; calibrate it or leave it out of the site filter")
            a = _scalar_amax(name, act_amax[name]).to(mod.weight.device)
            w_fq = None
            w_a = None
            w_src = None
            if quantize_weights:
                w_a = None if weight_amax is None or name not in weight_amax else \
                    torch.as_tensor(weight_amax[name], dtype=torch.float32).reshape(-1).to(mod.weight.device)
                if weights is not None and name in weights:
                    w_src = weights[name].to(mod.weight.device, mod.weight.dtype)
                if cache_weights or w_src is not None:
                    w_fq = _fq_weight(mod.weight if w_src is None else w_src, w_a, fmt)
            patched.append((mod, mod.__dict__.get("forward")))
            mod.forward = _make_forward(mod, a, fmt, quantize_weights, w_fq, w_a, round_inputs, enabled)
            names.append(name)
        log.debug("fake-quantizing %d linears in %s", len(names), fmt)
        yield names
    finally:
        for mod, own in patched:  # an instance forward (accelerate's hooks set one) comes back as it was
            if own is None:
                del mod.forward
            else:
                mod.forward = own


def _fq_weight(w: torch.Tensor, w_amax: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """``W`` [out, in] fake-quantized per output channel (axis 0), in ``W``'s dtype."""
    with torch.no_grad():
        wf = w.detach().float()
        a = wf.abs().amax(dim=1) if w_amax is None else w_amax
        return fake_quant(wf, a, fmt, axis=0).to(w.dtype)


def _make_forward(mod: torch.nn.Linear, amax: torch.Tensor, fmt: str, quantize_weights: bool,
                  w_fq: torch.Tensor | None, w_amax: torch.Tensor | None, round_inputs: torch.dtype | None = None,
                  enabled: Callable[[], bool] | None = None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if enabled is not None and not enabled():
            return F.linear(x, mod.weight, mod.bias)
        if round_inputs is not None:
            x = x.to(round_inputs).to(x.dtype)
        xq = fake_quant(x, amax, fmt)
        if not quantize_weights:
            w = mod.weight
        elif w_fq is not None:
            w = w_fq
        else:
            w = _fq_weight(mod.weight, w_amax, fmt)
        return F.linear(xq, w, mod.bias)

    return forward
