"""Histograms of ``|x|`` on power-of-two ranges: updated on the device without a host sync, merged exactly.

A histogram of ``num_bins`` (a power of two) equal bins covers ``[0, 2**e)``, where
``e`` is the smallest exponent with ``2**e > max|x|`` seen so far (``frexp``'s
exponent of the running abs-max). A batch is binned at its own exponent ``e_b``:
``u = |x| * 2**-e_b`` is exact in fp32 and lies in ``[0, 1)``, so ``torch.histc(u,
num_bins, 0, 1)`` computes ``floor(u * num_bins)`` with no rounding. Going from
exponent ``e`` to ``e + k`` maps bin ``i`` to ``i >> k`` - also exact - so

* a running histogram equals the histogram of all its data binned once at the
  final exponent, whatever the batch order or size, and
* two histograms (two shards of a calibration) merge exactly: re-bin both to the
  larger exponent and add the counts.

Everything stays on the activations' device (exponent, counts, abs-max are
tensors): no ``float(...)`` of a device value per batch. Counts are int64; a
``histc`` call sees at most 2**24 elements, so its fp32 counts are exact. On CUDA
the counts come from one CUDA kernel with the same bins
(:mod:`trt_sora.kernels.cuda_hist`, int32 per block, int64 in total).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from trt_sora.errors import CalibrationError, ConfigError
from trt_sora.kernels import cuda_hist

#: Exponent of a histogram that has seen only zeros (every later exponent is larger).
EMPTY = -(1 << 20)
#: Elements per histc call (fp32 counts are exact up to 2**24; the fp32 temporary stays at 64 MB).
CHUNK = 1 << 24


def check_bins(num_bins: Any, name: str) -> int:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 2 or num_bins & (num_bins - 1):
        raise ConfigError(f"site {name!r}: num_bins={num_bins!r} must be a power of two >= 2 (e.g. 2048): "
                          "histograms use power-of-two ranges so that batches and shards merge exactly")
    return num_bins


def exponent_of(amax: Tensor) -> Tensor:
    """int64 0-d ``e`` with ``2**(e-1) <= amax < 2**e`` (``EMPTY`` for 0); on ``amax``'s device."""
    e = torch.frexp(amax.float()).exponent.to(torch.int64)
    return torch.where(amax > 0, e, torch.full_like(e, EMPTY))


def rebin(counts: Tensor, shift: Tensor) -> Tensor:
    """Counts of the same data on a range ``2**shift`` times larger (``shift`` >= 0, device int64)."""
    idx = torch.arange(counts.shape[0], device=counts.device) >> shift.clamp(max=62)
    return torch.zeros_like(counts).index_add_(0, idx, counts)


def unit_scale(e: Tensor) -> Tensor:
    """fp32 0-d ``2**-e`` on ``e``'s device (1 for ``EMPTY``): maps ``[0, 2**e)`` onto ``[0, 1)`` exactly."""
    one = torch.ones((), dtype=torch.float32, device=e.device)
    return torch.where(e > EMPTY, torch.ldexp(one, (-e).clamp(max=126).to(torch.float32)), one)


def batch_counts(x: Tensor, e: Tensor, num_bins: int, *, kernel: bool = True) -> Tensor:
    """int64 ``[num_bins]`` counts of ``|x|`` on ``[0, 2**e)`` (``|x| < 2**e``, finite).

    On CUDA (``kernel``) one NVRTC-compiled kernel counts ``x`` in its own dtype into shared-memory bins
    (:mod:`trt_sora.kernels.cuda_hist`, configured by :data:`CUDA_COPIES`) where NVRTC works and the
    bins fit: the same bins as ``histc`` below, faster (benchmarks/README.md). Otherwise, per chunk of at most
    :data:`CHUNK` elements: ``u = |x| * 2**-e`` in fp32 (exact), then one ``histc`` over ``[0, 1)``. On
    CUDA (``kernel``, Triton present) ``u`` comes from one Triton pass reading ``x`` in its own dtype
    (:func:`trt_sora.kernels.triton_ops.abs_scaled`); otherwise from an fp32 ``abs`` (a fresh
    temporary, never the caller's tensor) and an in-place multiply. Always in fp32: ``histc`` returns
    its counts in the input's dtype, so a bf16 input would count in bf16 (a bin stops growing near 256).
    Chunk counts are summed once, in int64.
    """
    scale = unit_scale(e)
    if kernel and CUDA_COPIES is not None and cuda_hist.supports(x, num_bins, CUDA_COPIES):
        return cuda_hist.abs_histogram(x, scale, num_bins, copies=CUDA_COPIES)
    fused = _gpu_abs_scaled() if kernel and x.is_cuda else None
    reps = REPLICAS if fused is not None and num_bins * REPLICAS <= MAX_REPLICATED_BINS else 1
    parts = []
    for chunk in x.reshape(-1).split(CHUNK):
        if fused is not None:
            u = fused(chunk, scale, num_bins, reps)
        else:
            u = chunk.abs() if chunk.dtype == torch.float32 else chunk.float().abs_()
            u.mul_(scale)
        parts.append(torch.histc(u, bins=num_bins * reps, min=0.0, max=1.0).view(reps, num_bins))
    if not parts:
        return torch.zeros(num_bins, dtype=torch.int64, device=x.device)
    return torch.cat(parts).to(torch.int64).sum(0)


@functools.cache
def _gpu_abs_scaled():
    """The Triton ``|x| * scale`` kernel, or None where Triton is not installed."""
    try:
        from trt_sora.kernels.triton_ops import abs_scaled
    except ImportError:
        return None
    return abs_scaled


#: Sub-histograms per block of the CUDA counting kernel (:mod:`trt_sora.kernels.cuda_hist`); None: the Triton
#: pass + ``histc`` below (the benchmarks switch it to compare).
CUDA_COPIES: int | None = cuda_hist.DEFAULT_COPIES

#: Copies of each bin on the Triton + ``histc`` GPU path (see :func:`trt_sora.kernels.triton_ops.abs_scaled`):
#: ``histc``'s
#: shared-memory atomics on a crowded bin hit two addresses; 2 was the fastest of 1, 2, 4 and 8
#: (benchmarks/README.md).
REPLICAS = 2
#: Most ``histc`` bins (``num_bins * REPLICAS``) replicated; past it ``histc`` leaves shared memory.
MAX_REPLICATED_BINS = 1 << 14


class Histogram:
    """A running ``|x|`` histogram (see the module docstring); shared by a site's histogram observers.

    Attributes:
        num_bins: power of two.
        counts: int64 ``[num_bins]`` (None before the first batch), on the data's device.
        exponent: int64 0-d; the range is ``2**exponent`` (``EMPTY``: only zeros so far).
        absmax: fp32 0-d exact running ``max|x|``.
    """

    def __init__(self, num_bins: int, name: str = "<unnamed>") -> None:
        self.num_bins = check_bins(num_bins, name)
        self.name = name
        self.reset()

    def reset(self) -> None:
        self.counts: Tensor | None = None
        self.exponent: Tensor | None = None
        self.absmax: Tensor | None = None

    def update(self, x: Tensor, amax: Tensor) -> None:
        """Add batch ``x`` whose ``max|x|`` is ``amax`` (fp32 0-d, same device). No host sync."""
        self.add(*self.batch(x, amax, self.num_bins), amax)

    @staticmethod
    def batch(x: Tensor, amax: Tensor, num_bins: int) -> tuple[Tensor, Tensor]:
        """``(e_b, counts)`` of one batch at its own exponent (reusable by every histogram of ``num_bins``)."""
        e_b = exponent_of(amax)
        return e_b, batch_counts(x, e_b, num_bins)

    def add(self, e_b: Tensor, counts: Tensor, amax: Tensor) -> None:
        """Fold a batch's ``(e_b, counts)`` (see :meth:`batch`) in."""
        if self.counts is None:
            self.counts = torch.zeros(self.num_bins, dtype=torch.int64, device=counts.device)
            self.exponent = torch.full((), EMPTY, dtype=torch.int64, device=counts.device)
            self.absmax = amax.clone()
        e = torch.maximum(self.exponent, e_b)
        self.counts = rebin(self.counts, e - self.exponent) + rebin(counts, e - e_b)
        self.exponent = e
        self.absmax = torch.maximum(self.absmax, amax)

    def merge(self, other: Histogram) -> None:
        """Add ``other``'s data (same ``num_bins``): exact (see the module docstring)."""
        if other.num_bins != self.num_bins:
            raise CalibrationError(f"site {self.name!r}: cannot merge a {other.num_bins}-bin histogram into a "
                                   f"{self.num_bins}-bin one; calibrate every shard with the same num_bins")
        if other.counts is None:
            return
        if self.counts is None:
            self.counts, self.exponent, self.absmax = other.counts.clone(), other.exponent.clone(), other.absmax.clone()
            return
        oc, oe, oa = (t.to(self.counts.device) for t in (other.counts, other.exponent, other.absmax))
        e = torch.maximum(self.exponent, oe)
        self.counts = rebin(self.counts, e - self.exponent) + rebin(oc, e - oe)
        self.exponent, self.absmax = e, torch.maximum(self.absmax, oa)

    @property
    def range(self) -> float:
        """Upper edge of the last bin (``2**exponent``), 0.0 before any non-zero data (host sync)."""
        if self.exponent is None or int(self.exponent) == EMPTY:
            return 0.0
        return float(torch.ldexp(torch.tensor(1.0, dtype=torch.float64), self.exponent.cpu().double()))

    def state(self) -> dict[str, Any]:
        return {"hist": self.counts, "exponent": self.exponent, "absmax": self.absmax}

    def load(self, tensors: Mapping[str, Any]) -> None:
        self.counts, self.absmax = tensors["hist"], tensors["absmax"]
        e = tensors.get("exponent")
        if e is None and self.counts is not None:
            raise CalibrationError(f"site {self.name!r}: histogram state without a power-of-two exponent (written "
                                   "by an older trt_sora); recalibrate")
        self.exponent = None if e is None else torch.as_tensor(e, dtype=torch.int64)
