"""One FP8 linear of the ``torch-fp8`` backend, family-independent: :class:`Gemm` (static per-tensor
input scale, per-output-channel weight scales, FP8 E4M3 GEMM through :func:`trt_sora.kernels.ops.linear_fp8`)
and :class:`Fp8Linear`, its drop-in for one ``nn.Linear``. A family's torch-fp8 block rewrite
(``ModelAdapter.torch_fp8_rewrite``) builds its blocks from them (:func:`site`, :func:`fused_gemm`) and
finishes the model with :func:`swap_linears` and :func:`finish`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trt_sora.kernels import ops
from trt_sora.kernels.reference import FP8, dequant_scale, quantize

__all__ = ["Fp8Linear", "Gemm", "finish", "fused_gemm", "site", "swap_linears"]


class Gemm(torch.nn.Module):
    """One linear: FP8 (static per-tensor input scale, per-output-channel weight scales, weight
    quantized once here) when ``act_amax`` is given, else BF16.

    Args:
        weight: [N, K] (any float dtype; quantized from its own precision).
        bias: [N] or None.
        act_amax: the input's calibrated amax (per tensor) or None for a BF16 GEMM.
        weight_amax: [N] per-output-channel amax from the calibration stats; None: ``max |W|`` per row.
        counters: dict counting executed GEMMs by kind (``fp8_gemm`` / ``bf16_gemm``).

    ``fast_accum`` (set by :func:`prepare`): the FP8 GEMM accumulates with cuBLASLt's fast accumulation.
    """

    fast_accum = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_amax: float | None,
                 weight_amax: torch.Tensor | None, counters: dict):
        super().__init__()
        self.counters = counters
        self.fp8 = act_amax is not None
        self.out_features, self.in_features = weight.shape
        b = None if bias is None else bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", b, persistent=False)
        if self.fp8:
            wf = weight.detach().float()
            wa = wf.abs().amax(dim=1) if weight_amax is None else weight_amax.float().reshape(-1).to(wf.device)
            ws = dequant_scale(wa)
            self.register_buffer("w8", quantize(wf, ws[:, None]), persistent=False)
            self.register_buffer("w_scale", ws.reshape(1, -1).contiguous(), persistent=False)
            self.register_buffer("act_scale", dequant_scale(torch.tensor(float(act_amax), device=wf.device)),
                                 persistent=False)
            self._rows: dict[int, torch.Tensor] = {}
        else:
            self.register_buffer("w", weight.detach().to(torch.bfloat16), persistent=False)
            self.act_scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: FP8 at ``act_scale`` (fused producer) or bf16 (quantized here: the unfused path)."""
        if not self.fp8:
            self.counters["bf16_gemm"] = self.counters.get("bf16_gemm", 0) + 1
            return F.linear(x.to(torch.bfloat16), self.w, self.bias)
        if x.dtype != FP8:
            x = ops.quantize(x.to(torch.bfloat16), self.act_scale)
        self.counters["fp8_gemm"] = self.counters.get("fp8_gemm", 0) + 1
        return ops.linear_fp8(x, self.w8, self.act_scale, self.w_scale, self.bias, self._rows, self.fast_accum)

    def dequantized_weight(self) -> torch.Tensor:
        """[N, K] fp32: what the GEMM multiplies by (for tests and reports)."""
        return self.w8.float() * self.w_scale.reshape(-1, 1) if self.fp8 else self.w.float()


class Fp8Linear(torch.nn.Module):
    """Drop-in for one ``nn.Linear`` (the ladder's first rung: FP8 GEMMs, quantize unfused)."""

    def __init__(self, lin: torch.nn.Linear, act_amax: float, weight_amax, counters: dict):
        super().__init__()
        self.gemm = Gemm(lin.weight, lin.bias, act_amax, weight_amax, counters)

    def forward(self, x):
        return self.gemm(x).to(x.dtype)


def site(plan: Mapping[str, Any], name: str):
    """``(act_amax, weight_amax)`` of a module path, or ``(None, None)`` for an unquantized linear."""
    p = plan.get(name)
    return (None, None) if p is None else (p.act_amax, p.weight_amax)


def fused_gemm(mods: list[tuple[str, torch.nn.Linear]], plan: Mapping[str, Any], counters: dict) -> Gemm:
    """One GEMM over linears that read the same tensor (their weights stacked on N), quantized as the
    Q/DQ graph's fused site: all members planned (the largest input amax) or none."""
    acts = [site(plan, n)[0] for n, _ in mods]
    if len({a is None for a in acts}) != 1:
        raise ValueError(f"{[n for n, _ in mods]} read one tensor but are not all quantized alike; the Q/DQ graph "
                         "fuses them only when they are - re-run `trt-sora quantize`")
    w = torch.cat([m.weight for _, m in mods])
    b = None if mods[0][1].bias is None else torch.cat([m.bias for _, m in mods])
    if acts[0] is None:
        return Gemm(w, b, None, None, counters)
    was = [site(plan, n)[1] for n, _ in mods]
    wa = torch.cat([x.float().reshape(-1) if x is not None else m.weight.detach().float().abs().amax(1)
                    for x, (_, m) in zip(was, mods)])
    return Gemm(w, b, max(acts), wa, counters)


def swap_linears(model, plan: Mapping[str, Any], counters: dict) -> int:
    """Every planned ``nn.Linear`` still in ``model`` becomes an :class:`Fp8Linear` (eager quantize of
    its input). Returns how many were swapped."""
    n = 0
    for name, mod in list(model.named_modules()):
        for child, lin in list(mod.named_children()):
            path = f"{name}.{child}" if name else child
            if isinstance(lin, torch.nn.Linear) and path in plan:
                setattr(mod, child, Fp8Linear(lin, plan[path].act_amax, plan[path].weight_amax, counters))
                n += 1
    return n


def finish(model, fast_accum: bool) -> None:
    """The end of a rewrite: every FP8 GEMM's accumulation mode, the remaining parameters in bf16
    except diffusers' ``_keep_in_fp32_modules`` (as ``from_pretrained`` loads them)."""
    for m in model.modules():
        if isinstance(m, Gemm) and m.fp8:
            m.fast_accum = fast_accum
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if keep & set(name.split(".")) else torch.bfloat16)
