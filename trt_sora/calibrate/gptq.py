"""Error-compensating weight rounding (GPTQ) onto the Q/DQ graph's own weight grid.

Plain quantization rounds every weight to its nearest FP8 / INT8 value. The rounding error of a
weight is a *static* perturbation of the model: it acts the same way on every call of a
denoising trajectory, so it accumulates over the steps instead of averaging out (on wan-shapes
the FP8 weight rounding alone costs a held-out clip 21 dB, the FP8 activations alone 40 dB).

GPTQ (Frantar et al., 2023) rounds the columns of ``W`` [out, in] one at a time and pushes each
column's rounding error onto the columns not yet rounded, weighted by the inverse Hessian
``H = sum x x^T`` of the layer's inputs over the calibration trajectories, so that ``W' x`` stays
close to ``W x`` on the inputs the layer really sees. The per-output-channel scales
(``max |W|`` per row, ``<site>.weight`` in the stats) are unchanged: ``W'`` lies on exactly the
grid the Q/DQ graph stores, and quantizing it again is the identity (so every consumer - the Q/DQ
graph, the fake-quant runners, the torch-fp8 backend - only swaps ``W`` for ``W'``).

The calibration stage writes ``weights.safetensors``: per site the codes (``float8_e4m3fn`` or
``int8``, ``[out, in]``) and the per-row scale (fp32 ``[out]``) as ``<site>.codes`` /
``<site>.scale``; :func:`load_rounded_weights` returns ``{site: W'}`` fp32.

Memory: one ``in x in`` fp64 Hessian per quantized linear while the trajectories run
(wan-shapes: 8.5 MB; Wan 1.3B: ~25 GB - ``calibration.weight_rounding: auto`` then rounds to nearest).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from trt_sora.calibrate.fake_quant import fake_quant, qmax
from trt_sora.errors import CalibrationError, ConfigError

__all__ = ["HESSIANS_FILE", "WEIGHTS_FILE", "HessianHooks", "gptq_round", "hessian_bytes", "load_hessians",
           "load_rounded_weights", "save_hessians", "save_rounded_weights"]

WEIGHTS_FILE = "weights.safetensors"
HESSIANS_FILE = "hessians.safetensors"  # a shard's input Hessians (summed by the merge)
_FORMAT = "trt_sora.rounded_weights"


def hessian_bytes(model: torch.nn.Module, sites: Sequence[str]) -> int:
    """Memory of the fp64 input Hessians of ``sites`` (``in_features^2 x 8`` each)."""
    mods = dict(model.named_modules())
    return sum(mods[s].in_features ** 2 * 8 for s in sites)


class HessianHooks:
    """Accumulate ``H = sum_tokens x x^T`` (fp64, on the model's device) of each selected linear's input."""

    def __init__(self, model: torch.nn.Module, sites: Sequence[str], *, max_bytes: int = 4 << 30):
        mods = dict(model.named_modules())
        need = hessian_bytes(model, sites)
        if need > max_bytes:
            raise ConfigError(f"GPTQ weight rounding needs {need / 2**30:.1f} GiB of input Hessians for {len(sites)} "
                              f"linears (over the {max_bytes / 2**30:.1f} GiB limit); set calibration.weight_rounding: "
                              "nearest for this model")
        self.mods = {s: mods[s] for s in sites}
        self.hessians: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._handles: list = []

    def __enter__(self) -> "HessianHooks":
        for s, m in self.mods.items():
            self.hessians[s] = torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=m.weight.device)
            self.tokens[s] = 0
            self._handles.append(m.register_forward_pre_hook(self._hook(s)))
        return self

    def _hook(self, site: str):
        def h(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            self.hessians[site].addmm_(x.T, x)
            self.tokens[site] += x.shape[0]
        return h

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def save_hessians(path: str | os.PathLike, hessians: Mapping[str, torch.Tensor], tokens: Mapping[str, int]) -> Path:
    """A shard's input Hessians (fp64) and token counts: the merge sums them (:func:`load_hessians`)."""
    from safetensors.torch import save_file

    p = Path(path)
    save_file({s: h.cpu().contiguous() for s, h in hessians.items()}, str(p),
              metadata={"format": _FORMAT + ".hessians", "tokens": json.dumps(dict(tokens))})
    return p


def load_hessians(paths: Sequence[str | os.PathLike], sites: Sequence[str]) -> tuple[dict, dict]:
    """``({site: H}, {site: tokens})`` summed over shard files, in the order given (fp64 sums: the one-pass
    Hessians to rounding)."""
    from safetensors import safe_open

    hs: dict[str, torch.Tensor] = {}
    tokens: dict[str, int] = {s: 0 for s in sites}
    for path in paths:
        if not Path(path).is_file():
            raise CalibrationError(f"{path} does not exist: that shard ran without GPTQ weight rounding; rerun the "
                                   "shards with this recipe (calibration.weight_rounding)")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            missing = [s for s in sites if s not in f.keys()]
            if meta.get("format") != _FORMAT + ".hessians" or missing:
                raise CalibrationError(f"{path} lacks the Hessians of {missing[:1] or 'its sites'}; rerun the shards "
                                       "with this recipe")
            for s in sites:
                h = f.get_tensor(s)
                hs[s] = h if s not in hs else hs[s] + h
            for s, n in json.loads(meta["tokens"]).items():
                tokens[s] = tokens.get(s, 0) + int(n)
    return hs, tokens


def gptq_round(w: torch.Tensor, hessian: torch.Tensor, amax: torch.Tensor, fmt: str, *,
               damp: float = 0.01) -> torch.Tensor:
    """``W'`` [out, in] fp32 on the per-row grid of ``amax`` [out] (``fmt``: ``fp8_e4m3`` / ``int8``).

    Columns are rounded in order; column ``i``'s error ``(w_i - q_i) / Hinv_ii`` is subtracted from
    the later columns along row ``i`` of the upper Cholesky factor of ``H^-1``. ``damp`` x mean(diag H)
    is added to the diagonal (inputs that never vary); columns whose input is always zero are zeroed.
    """
    wd = w.detach().double().clone()
    n = wd.shape[1]
    h = hessian.to(wd.device, torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    wd[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(n, dtype=h.dtype, device=h.device)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError as exc:  # not positive definite even with damping
        raise CalibrationError(f"GPTQ: the input Hessian is not positive definite ({exc}); raise "
                               "calibration.gptq_damp or use weight_rounding: nearest") from None
    a = amax.detach().float().to(wd.device)
    q = torch.zeros_like(wd)
    for i in range(n):
        col = wd[:, i]
        q[:, i] = fake_quant(col.float(), a, fmt, axis=0).double()
        if i + 1 < n:
            wd[:, i + 1:] -= ((col - q[:, i]) / hinv[i, i]).unsqueeze(1) @ hinv[i, i + 1:].unsqueeze(0)
    return q.float()


def save_rounded_weights(path: str | os.PathLike, weights: Mapping[str, torch.Tensor],
                         amax: Mapping[str, torch.Tensor], fmt: str, meta: Mapping) -> Path:
    """Write ``weights.safetensors``: codes in the format's storage type and the per-row scales."""
    from safetensors.torch import save_file

    scale_of = {s: torch.where(a > 0, a / qmax(fmt), torch.ones_like(a)).float() for s, a in amax.items()}
    tensors = {}
    for s, w in weights.items():
        codes = w.float().cpu() / scale_of[s].cpu()[:, None]
        codes = codes.to(torch.float8_e4m3fn) if fmt == "fp8_e4m3" else torch.round(codes).to(torch.int8)
        tensors[f"{s}.codes"] = codes.contiguous()
        tensors[f"{s}.scale"] = scale_of[s].cpu().contiguous()
    p = Path(path)
    save_file(tensors, str(p), metadata={"format": _FORMAT, "quant_format": fmt, "meta": json.dumps(dict(meta))})
    return p


def load_rounded_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``{site: W'}`` fp32 ``[out, in]`` (codes x per-row scale) from ``weights.safetensors``."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"{p} does not exist; re-run calibration with calibration.weight_rounding: gptq")
    out = {}
    with safe_open(str(p), "pt") as f:
        if (f.metadata() or {}).get("format") != _FORMAT:
            raise CalibrationError(f"{p} is not a trt_sora rounded-weights file; re-run calibration")
        for k in f.keys():
            if k.endswith(".codes"):
                s = k[:-len(".codes")]
                out[s] = f.get_tensor(k).float() * f.get_tensor(f"{s}.scale")[:, None]
    return out
