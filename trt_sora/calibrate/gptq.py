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

Memory: one ``in x in`` fp64 Hessian per quantized linear input (wan-shapes: 8.5 MB; Wan 2.1 1.3B:
~22 GiB; 14B: ~120 GiB), bounded by ``calibration.gptq_max_hessian_gb`` (:func:`plan_hessians`):

* linears that read the same input share one Hessian - found by a probe forward at a tiny shape
  (:func:`shared_inputs`: q/k/v of self-attention, the cross-attention k/v of *every* block, which
  all read the text context) and verified value for value on every call of the calibration;
* when the rest does not fit, the Hessians are split into groups of consecutive linears that do,
  and the calibration reruns the same trajectories (same prompts, seeds, steps) once per group
  with hooks on that group only; each group is rounded and freed before the next. The rounded
  weights are those of one pass, bit for bit (the same inputs summed in the same order).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trt_sora.calibrate.fake_quant import fake_quant
from trt_sora.errors import CalibrationError, ConfigError
from trt_sora.formats import qmax
from trt_sora.runfolder import CALIB_WEIGHTS

__all__ = ["WEIGHTS_FILE", "HessianHooks", "HessianPlan", "gptq_round", "hessians_file",
           "load_hessians", "load_rounded_weights", "plan_hessians", "save_hessians", "save_rounded_weights",
           "shared_inputs", "smallest_budget_gb"]

WEIGHTS_FILE = CALIB_WEIGHTS
_FORMAT = "trt_sora.rounded_weights"


def hessians_file(group: int, groups: int) -> str:
    """The name of a shard's input Hessians of pass ``group`` of ``groups`` (summed by the merge)."""
    return "hessians.safetensors" if groups == 1 else f"hessians.pass{group + 1}of{groups}.safetensors"


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` holds the values of ``y`` (the same tensor object, or equal values)."""
    if x is y:
        return True
    return x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and bool(torch.equal(x, y))


def shared_inputs(model: torch.nn.Module, sites: Sequence[str], probe: Callable[[], Any]) -> dict[str, str]:
    """``{site: leader}``: the first of ``sites`` (in call order) whose input tensor each site reads.

    ``probe()`` runs one forward of ``model`` (a tiny shape is enough: which linear reads which tensor
    is a property of the graph); every input is held and compared by value with the earlier distinct
    inputs, so a leader and its members are exactly the linears fed the same tensor. A site called
    more than once shares only if every call agrees; a site the probe never reaches leads itself.
    :class:`HessianHooks` checks the sharing again on every calibration call.
    """
    mods = dict(model.named_modules())
    distinct: list[tuple[str, torch.Tensor]] = []  # (first reader, the input) per distinct input
    leader: dict[str, str] = {}

    def hook(site):
        def h(_mod, args):
            x = args[0].detach()
            found = next((s for s, y in distinct if _same_tensor(x, y)), None)
            if found is None:
                distinct.append((site, x))
                found = site
            leader[site] = found if leader.get(site, found) == found else site
        return h

    handles = [mods[s].register_forward_pre_hook(hook(s)) for s in sites]
    try:
        with torch.no_grad():
            probe()
    finally:
        for h in handles:
            h.remove()
    out = {s: leader.get(s, s) for s in sites}
    return {s: ld if out[ld] == ld else s for s, ld in out.items()}


@dataclasses.dataclass(frozen=True)
class HessianPlan:
    """Which input Hessians are accumulated in which pass over the calibration trajectories.

    Attributes:
        leader: ``{site: the site whose Hessian it uses}`` (itself, or the first linear reading its input).
        groups: per pass, the leaders whose Hessians it accumulates (consecutive, in module order).
        nbytes: ``{leader: fp64 Hessian bytes}``.
        max_bytes: the budget every group fits in (``calibration.gptq_max_hessian_gb``).
    """

    leader: Mapping[str, str]
    groups: tuple[tuple[str, ...], ...]
    nbytes: Mapping[str, int]
    max_bytes: int

    @property
    def passes(self) -> int:
        return len(self.groups)

    def sites_of(self, group: int) -> list[str]:
        """The sites rounded after pass ``group`` (its leaders and the linears sharing their inputs)."""
        keys = set(self.groups[group])
        return [s for s, ld in self.leader.items() if ld in keys]

    def group_bytes(self, group: int) -> int:
        return sum(self.nbytes[k] for k in self.groups[group])

    def describe(self) -> dict:
        """What the manifest records (sizes in bytes)."""
        shared = sum(1 for s, ld in self.leader.items() if s != ld)
        return {"passes": self.passes, "hessians": len(self.nbytes), "shared_inputs": shared,
                "hessian_bytes": sum(self.nbytes.values()),
                "unshared_hessian_bytes": sum(self.nbytes[ld] for ld in self.leader.values()),
                "max_hessian_bytes": self.max_bytes,
                "group_bytes": [self.group_bytes(g) for g in range(self.passes)],
                "group_sites": [len(self.sites_of(g)) for g in range(self.passes)]}


def smallest_budget_gb(nbytes: int) -> float:
    """``nbytes`` in GiB rounded *up* to 3 significant digits (the smallest workable budget)."""
    v = nbytes / 2 ** 30
    e = math.floor(math.log10(v)) - 2
    return float(f"{math.ceil(v / 10 ** e - 1e-9)}e{e}")


def plan_hessians(model: torch.nn.Module, leader: Mapping[str, str], max_gb: float) -> HessianPlan:
    """Split the distinct Hessians of ``leader`` (see :func:`shared_inputs`) into the fewest groups of
    consecutive linears (module order) whose fp64 Hessians each fit ``max_gb`` GiB.

    Raises:
        ConfigError: one Hessian alone exceeds ``max_gb`` (names the smallest workable
            ``calibration.gptq_max_hessian_gb``).
    """
    max_bytes = int(max_gb * 2 ** 30)
    mods = dict(model.named_modules())
    keys = list(dict.fromkeys(ld for ld in leader.values()))
    order = {n: i for i, n in enumerate(mods)}
    keys.sort(key=order.__getitem__)
    nbytes = {k: mods[k].in_features ** 2 * 8 for k in keys}
    largest = max(nbytes, key=nbytes.get)
    if nbytes[largest] > max_bytes:
        raise ConfigError(f"GPTQ: the input Hessian of {largest} alone needs {nbytes[largest] / 2**30:.3g} GiB, "
                          f"over calibration.gptq_max_hessian_gb: {max_gb:.3g}; set it to at least "
                          f"{smallest_budget_gb(nbytes[largest]):g} or use calibration.weight_rounding: nearest")
    groups: list[list[str]] = [[]]
    held = 0
    for k in keys:
        if held + nbytes[k] > max_bytes:
            groups.append([])
            held = 0
        groups[-1].append(k)
        held += nbytes[k]
    return HessianPlan(dict(leader), tuple(tuple(g) for g in groups), nbytes, int(max_bytes))


class HessianHooks:
    """Accumulate ``H = sum_tokens x x^T`` (fp64, on the model's device) of each selected linear's input.

    ``shared``: ``{site: leader}`` (:func:`shared_inputs`): one Hessian per leader (``hessians`` and
    ``tokens`` are keyed by leaders); a member's input is checked to be its leader's on every call.
    Without it every site has its own.
    """

    def __init__(self, model: torch.nn.Module, sites: Sequence[str], *, shared: Mapping[str, str] | None = None):
        mods = dict(model.named_modules())
        self.mods = {s: mods[s] for s in sites}
        self.leader = {s: (shared or {}).get(s, s) for s in sites}
        missing = sorted({ld for ld in self.leader.values() if ld not in self.mods})
        if missing:
            raise ValueError(f"HessianHooks: the leaders {missing[:3]} of shared inputs are not among the sites")
        self.members = {ld: [s for s, x in self.leader.items() if x == ld and s != ld] for ld in self.leader.values()}
        self.hessians: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._last: dict[str, tuple[torch.Tensor, int]] = {}  # leader -> (its input, members still to read it)
        self._handles: list = []

    @property
    def nbytes(self) -> int:
        """Bytes of the Hessians held."""
        return sum(h.numel() * h.element_size() for h in self.hessians.values())

    def __enter__(self) -> HessianHooks:
        for s, m in self.mods.items():
            if self.leader[s] == s:
                self.hessians[s] = torch.zeros(m.in_features, m.in_features, dtype=torch.float64,
                                               device=m.weight.device)
                self.tokens[s] = 0
                self._handles.append(m.register_forward_pre_hook(self._accumulate(s)))
            else:
                self._handles.append(m.register_forward_pre_hook(self._check(s)))
        return self

    def _accumulate(self, site: str):
        def h(_mod, args):
            x = args[0].detach()
            if self.members[site]:
                self._last[site] = (x, len(self.members[site]))
            x = x.reshape(-1, x.shape[-1]).double()
            self.hessians[site].addmm_(x.T, x)
            self.tokens[site] += x.shape[0]
        return h

    def _check(self, site: str):
        ld = self.leader[site]

        def h(_mod, args):
            held, left = self._last.pop(ld, (None, 0))
            if held is None or not _same_tensor(args[0].detach(), held):
                raise CalibrationError(f"GPTQ: {site} was found to read the input of {ld} (one shared Hessian) "
                                       "but reads another tensor in this forward; use calibration.weight_rounding: "
                                       "nearest for this model and report it")
            if left > 1:
                self._last[ld] = (held, left - 1)
        return h

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._last = {}


def save_hessians(path: str | os.PathLike, hessians: Mapping[str, torch.Tensor], tokens: Mapping[str, int]) -> Path:
    """A shard's input Hessians (fp64) and token counts: the merge sums them (:func:`load_hessians`)."""
    from safetensors.torch import save_file

    p = Path(path)
    save_file({s: h.cpu().contiguous() for s, h in hessians.items()}, str(p),
              metadata={"format": _FORMAT + ".hessians", "tokens": json.dumps(dict(tokens))})
    return p


def load_hessians(folders: Sequence[str | os.PathLike], keys: Sequence[str]) -> tuple[dict, dict]:
    """``({key: H}, {key: tokens})`` of ``keys`` (Hessian leaders) summed over the shard folders in the
    order given, read from whichever of a folder's ``hessians*.safetensors`` holds each (fp64 sums: the
    one-pass Hessians to rounding). Only the tensors of ``keys`` are read."""
    from safetensors import safe_open

    hs: dict[str, torch.Tensor] = {}
    tokens: dict[str, int] = {k: 0 for k in keys}
    for folder in folders:
        files = sorted(Path(folder).glob("hessians*.safetensors"))
        if not files:
            raise CalibrationError(f"{folder} holds no hessians*.safetensors: that shard ran without GPTQ weight "
                                   "rounding; rerun the shards with this recipe (calibration.weight_rounding)")
        found: set[str] = set()
        for path in files:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != _FORMAT + ".hessians":
                    raise CalibrationError(f"{path} is not a trt_sora Hessians file; rerun the shards")
                here = [k for k in keys if k in f.keys()]
                counts = json.loads(meta["tokens"])
                for k in here:
                    h = f.get_tensor(k)
                    if k in hs:
                        hs[k].add_(h)
                    else:
                        hs[k] = h
                    tokens[k] += int(counts[k])
                found.update(here)
        missing = [k for k in keys if k not in found]
        if missing:
            raise CalibrationError(f"{folder} lacks the Hessians of {missing[:1]}; rerun the shards with this recipe")
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
    with _one_cpu_thread(wd.device):
        for i in range(n):
            col = wd[:, i]
            q[:, i] = fake_quant(col.float(), a, fmt, axis=0).double()
            if i + 1 < n:
                wd[:, i + 1:] -= ((col - q[:, i]) / hinv[i, i]).unsqueeze(1) @ hinv[i, i + 1:].unsqueeze(0)
    return q.float()


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """One intra-op thread for the column loop on the CPU: its ~10 small ops per column are
    latency-bound, and a thread pool on busy cores makes each one wait (a 1536-wide linear: 3.8 s on
    one thread vs 36.5 s on two cores under load). Elementwise ops and rank-1 products sum nothing,
    so the result is the same bit for bit; the thread count is restored."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
