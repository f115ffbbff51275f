"""Calibration observers: turn a stream of activations into one ``amax`` per site.

Every observer has the same small contract (after ModelOpt's calibrators)::

    obs = make_observer("percentile", name="blocks.0.attn1.to_q", percentile=99.99)
    for x in batches:          # any shape, any float dtype, any device
        obs.collect(x)
    amax = obs.compute_amax()  # fp32 tensor: shape [] per-tensor, [C] per-channel
    obs.reset()

* Pure torch and device-agnostic: state lives on the device of the first batch,
  memory is O(1) per observer (a histogram of ``num_bins`` counts at most),
  activations are never stored.
* ``amax`` is always the symmetric clipping bound, ``>= 0``, in the units of
  the activations; the quantization scale is ``amax / 448`` (FP8 E4M3) or
  ``amax / 127`` (INT8), see :mod:`trt_sora.calibrate.fake_quant`.
* NaN or inf in a batch raises :class:`~trt_sora.errors.CalibrationError`
  naming the site. The check rides on the per-batch min/max reduction every
  observer needs anyway. ``Observer.collect`` checks at once (one scalar host
  sync per batch); :class:`SiteStats`, the calibration hot path, only raises a
  device flag and :func:`check_finite` reads every site's flag in one sync per
  forward, so a GPU calibration never waits on the host inside a forward.
* Every update is device-side: min/max and EMA inputs are device tensors,
  histograms use power-of-two ranges (:mod:`trt_sora.calibrate.histogram`), and
  one histogram per site feeds both the percentile and the MSE observers.
* States merge exactly (:func:`merge_sites`, calibration shards): min/max by
  min/max, histograms by re-binning to the larger range and adding, EMA by
  concatenating the per-batch statistics it keeps (in shard order) and
  re-running the recurrence.
* ``state_dict()`` / ``load_state_dict()`` serialise an observer (tensors and
  plain values) so partial statistics can be saved, merged or resumed.

Per denoising step and CFG branch statistics live in :class:`SiteStats`,
which feeds one batch to several observers (e.g. all methods at once, so the
report compares them from one calibration pass) and keeps a
``[steps, branches]`` grid of abs-max values for drift plots.

Methods (``make_observer`` names, same strings as ``trt_sora.config.CalibMethod``):

=============  ==============================================================
``minmax``     running ``max |x|`` (per tensor, or per channel with ``axis``)
``ema``        exponential moving average of per-batch statistics (order dependent)
``percentile`` ``p``-th percentile of ``|x|`` from a growing histogram
``mse``        amax minimising FP8/INT8 fake-quant MSE over the histogram
=============  ==============================================================
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from trt_sora.calibrate.histogram import Histogram, check_bins
from trt_sora.errors import CalibrationError, ConfigError

log = logging.getLogger("trt_sora")

__all__ = [
    "Observer", "MinMaxObserver", "EmaObserver", "HistogramObserver", "PercentileObserver", "MseObserver",
    "SiteStats", "OBSERVERS", "make_observer", "observer_from_state_dict", "batch_minmax",
    "percentile_from_histogram", "check_finite",
]



def _fix_hint(name: str) -> str:
    return (f"check the inputs and the model in fp32 for site {name!r} (an fp16 overflow is the usual cause), "
            "or exclude the site from quantization (quantization.exclude in the recipe)")


def batch_minmax(x: Tensor, name: str, axis: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-batch ``(min, max)`` of ``x`` as fp32, checked for NaN/inf in the same reduction.

    Args:
        x: activations or weights, any shape, floating dtype, ``numel > 0``.
        name: site name used in error messages.
        axis: ``None`` reduces over everything (two 0-d tensors); an int keeps
            that dim (two ``[x.shape[axis]]`` tensors).

    Raises:
        CalibrationError: ``x`` has NaN/inf (names the site) or is not floating point.
    """
    mn, mx = _minmax(x, name, axis)
    # min/max propagate NaN and show +-inf, so this one check covers every element.
    if not bool(torch.isfinite(mn).all() & torch.isfinite(mx).all()):
        bad = "NaN" if bool(torch.isnan(mn).any() | torch.isnan(mx).any()) else "inf"
        raise CalibrationError(f"site {name!r}: the calibration batch contains {bad} (shape {tuple(x.shape)}, "
                               f"dtype {x.dtype}); {_fix_hint(name)}")
    return mn, mx


class Observer:
    """Base class: ``collect(x)``, ``reset()``, ``compute_amax() -> Tensor``.

    Args:
        name: the site (module path, e.g. ``"blocks.0.ffn.net.0.proj"``); named in every error.
        axis: ``None`` for one amax per tensor; an int for one amax per channel
            along that dim (weights of ``nn.Linear``: ``axis=0``, per output channel).

    Attributes:
        num_batches: batches collected since the last reset.
        num_elements: elements collected since the last reset.
    """

    method: ClassVar[str] = ""
    supports_axis: ClassVar[bool] = True

    def __init__(self, name: str = "<unnamed>", *, axis: int | None = None) -> None:
        if axis is not None and not self.supports_axis:
            raise ConfigError(f"site {name!r}: the {self.method!r} observer is per-tensor only; "
                              "use method 'minmax' or 'ema' for per-channel (axis=...) statistics")
        self.name = name
        self.axis = axis
        self.reset()

    # -- contract -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything collected (settings are kept)."""
        self.num_batches = 0
        self.num_elements = 0
        self._num_channels: int | None = None

    def collect(self, x: Tensor) -> None:
        """Add one batch. ``x``: any shape (per-channel: ``x.shape[axis]`` channels), float dtype.

        Empty tensors are skipped. Raises CalibrationError on NaN/inf or a channel-count change.
        """
        if x.numel() == 0:
            return
        x = x.detach()
        mn, mx = batch_minmax(x, self.name, self.axis)
        self._observe(x, mn, mx)

    def compute_amax(self) -> Tensor:
        """The clipping bound: fp32, ``>= 0``; shape ``[]`` per-tensor or ``[C]`` per-channel.

        Raises CalibrationError if nothing was collected.
        """
        if self.num_batches == 0:
            raise CalibrationError(f"site {self.name!r}: observer {self.method!r} has collected no data; "
                                   "check that the calibration forward reaches this module (hook registered, "
                                   "at least one prompt and step)")
        return self._amax()

    def settings(self) -> dict[str, Any]:
        """JSON-safe settings (method + constructor arguments except ``name``), for stats metadata."""
        return {"method": self.method, "axis": self.axis}

    # -- serialisation --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Settings, counters and state tensors; plain values and tensors only."""
        return {"method": self.method, "name": self.name, "settings": self.settings(),
                "num_batches": self.num_batches, "num_elements": self.num_elements,
                "num_channels": self._num_channels, "tensors": self._state_tensors()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; settings must match this observer's."""
        if state.get("method") != self.method or dict(state.get("settings", {})) != self.settings():
            raise CalibrationError(
                f"site {self.name!r}: cannot load {state.get('method')!r} state with settings "
                f"{state.get('settings')} into a {self.method!r} observer with {self.settings()}; "
                "build the observer with observer_from_state_dict(state) instead")
        self.num_batches = int(state["num_batches"])
        self.num_elements = int(state["num_elements"])
        self._num_channels = state.get("num_channels")
        self._load_state_tensors(state["tensors"])

    # -- subclass hooks -------------------------------------------------------------------------
    def _observe(self, x: Tensor, mn: Tensor, mx: Tensor) -> None:
        """Fold one batch in; ``mn``/``mx`` are this batch's (already checked) fp32 min/max."""
        self._count(x.numel(), mn)
        self._update(x, mn, mx)

    def _count(self, numel: int, mn: Tensor) -> None:
        """Counters and the channel-count check of one batch (no data touched)."""
        if self.axis is not None:
            c = int(mn.numel())
            if self._num_channels is None:
                self._num_channels = c
            elif c != self._num_channels:
                raise CalibrationError(
                    f"site {self.name!r}: got {c} channels along axis {self.axis} after {self._num_channels} "
                    "before; the module's shape changed between calibration batches - check the model's "
                    "forward, or calibrate this site per tensor (axis=None)")
        self.num_batches += 1
        self.num_elements += numel

    def _update(self, x: Tensor, mn: Tensor, mx: Tensor) -> None:
        raise NotImplementedError

    def _amax(self) -> Tensor:
        raise NotImplementedError

    def _state_tensors(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_state_tensors(self, tensors: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "method")
        return f"{type(self).__name__}(name={self.name!r}, {args}, num_batches={self.num_batches})"


def _absmax(mn: Tensor, mx: Tensor) -> Tensor:
    return torch.maximum(mn.abs(), mx.abs())


def _minmax(x: Tensor, name: str, axis: int | None) -> tuple[Tensor, Tensor]:
    """fp32 ``(min, max)`` (per channel along ``axis``) without the finite check (see :func:`check_finite`)."""
    if not torch.is_floating_point(x):
        raise CalibrationError(f"site {name!r} got a {x.dtype} tensor; only floating-point activations can be "
                               "calibrated: exclude this site from calibration")
    if axis is None:
        mn, mx = torch.aminmax(x)
    else:
        ax = axis % x.dim()
        dims = tuple(d for d in range(x.dim()) if d != ax)
        mn, mx = (torch.amin(x, dim=dims), torch.amax(x, dim=dims)) if dims else (x, x)
    return mn.float(), mx.float()


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return t if t.shape[0] >= rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def check_finite(sites: Sequence[SiteStats], where: str = "") -> None:
    """Raise CalibrationError naming the first site whose batches held NaN/inf; one host sync for all."""
    flags = [s._nonfinite for s in sites if s._nonfinite is not None]
    if flags and bool(torch.stack(flags).any()):
        for s in sites:
            s.check_finite(where)


class MinMaxObserver(Observer):
    """Running absolute max: ``amax = max(|min_val|, |max_val|)`` over every batch.

    Equals ``torch.ao.quantization.MinMaxObserver`` (per-tensor) and
    ``PerChannelMinMaxObserver(ch_axis=axis)`` (per-channel), reduced to a
    symmetric bound.
    """

    method = "minmax"

    def reset(self) -> None:
        super().reset()
        self.min_val: Tensor | None = None
        self.max_val: Tensor | None = None

    def _update(self, x: Tensor, mn: Tensor, mx: Tensor) -> None:
        if self.min_val is None:
            self.min_val, self.max_val = mn.clone(), mx.clone()
        else:
            self.min_val = torch.minimum(self.min_val, mn)
            self.max_val = torch.maximum(self.max_val, mx)

    def _amax(self) -> Tensor:
        return _absmax(self.min_val, self.max_val)

    def _state_tensors(self) -> dict[str, Any]:
        return {"min_val": self.min_val, "max_val": self.max_val}

    def _load_state_tensors(self, tensors: Mapping[str, Any]) -> None:
        self.min_val, self.max_val = tensors["min_val"], tensors["max_val"]

    def merge(self, other: MinMaxObserver) -> None:
        if other.min_val is None:
            return
        if self.min_val is None:
            self.min_val, self.max_val = other.min_val.clone(), other.max_val.clone()
            return
        self.min_val = torch.minimum(self.min_val, other.min_val.to(self.min_val.device))
        self.max_val = torch.maximum(self.max_val, other.max_val.to(self.max_val.device))


class EmaObserver(Observer):
    """Exponential moving average of per-batch statistics.

    The first batch initialises the average to that batch's statistics (no
    bias towards 0, as in ``torch.ao``); every later batch ``b`` updates
    ``s <- s + c * (s_b - s)`` with ``c = averaging_constant``.

    ``track`` chooses what is averaged:

    * ``"amax"`` (default): the per-batch abs-max ``max|x_b|``; ``amax = s``.
      This is the quantity a symmetric scale needs.
    * ``"minmax"``: min and max separately, then ``amax = max(|ema_min|, |ema_max|)``;
      identical to ``torch.ao.quantization.MovingAverageMinMaxObserver`` (and
      ``MovingAveragePerChannelMinMaxObserver``) with the same constant.

    The two agree whenever the same side dominates every batch (e.g. all
    ``max_b >= -min_b``, as for post-GELU activations). Otherwise, by the
    triangle inequality, ``"minmax"`` <= ``"amax"``: averaging a large negative
    min of one batch with a small one of the next under-states the range that
    symmetric quantization must cover. Tested in ``tests/calibrate/test_observers.py``.

    The result depends on batch order: with per-step collection the average leans towards the
    last steps of the last prompts. The observer keeps every batch's min/max (two values, or two
    per channel, per batch) and evaluates the recurrence in fp32 on the host when asked, so
    shards of one calibration merge exactly when their histories are concatenated in the
    one-pass order (shard 0's batches first); any other order gives another average.
    """

    method = "ema"

    def __init__(self, name: str = "<unnamed>", *, axis: int | None = None, averaging_constant: float = 0.01,
                 track: str = "amax") -> None:
        if not 0.0 < float(averaging_constant) <= 1.0:
            raise ConfigError(f"site {name!r}: averaging_constant={averaging_constant} must be in (0, 1] "
                              "(e.g. 0.01)")
        if track not in ("amax", "minmax"):
            from trt_sora.config.base import did_you_mean

            raise ConfigError(f"site {name!r}: track={track!r}{did_you_mean(track, ('amax', 'minmax'))}; "
                              "use 'amax' or 'minmax'")
        self.averaging_constant = float(averaging_constant)
        self.track = track
        super().__init__(name, axis=axis)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "averaging_constant": self.averaging_constant, "track": self.track}

    def reset(self) -> None:
        super().reset()
        self._history: list[Tensor] = []  # per batch: stack([min, max]) ([2] or [2, C]), on the device

    def _update(self, x: Tensor, mn: Tensor, mx: Tensor) -> None:
        self._history.append(torch.stack([mn, mx]))

    @property
    def history(self) -> Tensor:
        """fp32 ``[batches, 2]`` (or ``[batches, 2, C]``): each batch's min and max, in collection order."""
        return torch.stack([h.to("cpu") for h in self._history]) if self._history else torch.zeros(0, 2)

    def _amax(self) -> Tensor:
        seq = self.history.numpy().astype(np.float32)
        c = np.float32(self.averaging_constant)
        vals = np.maximum(np.abs(seq[:, 0]), np.abs(seq[:, 1]))[:, None] if self.track == "amax" else seq
        s = vals[0].copy()
        for b in vals[1:]:  # the recurrence in fp32, in batch order
            s = s + c * (b - s)
        out = s[0] if self.track == "amax" else np.maximum(np.abs(s[0]), np.abs(s[1]))
        return torch.from_numpy(np.asarray(out, dtype=np.float32)).clone()

    def _state_tensors(self) -> dict[str, Any]:
        return {"history": self.history}

    def _load_state_tensors(self, tensors: Mapping[str, Any]) -> None:
        h = tensors.get("history")
        if h is None:
            raise CalibrationError(f"site {self.name!r}: EMA state without its per-batch history (written by an "
                                   "older trt_sora); recalibrate")
        self._history = list(torch.as_tensor(h).float().unbind(0))

    def merge(self, other: EmaObserver) -> None:
        """Append ``other``'s batches after this one's (shard order = one-pass order)."""
        self._history += list(other.history.unbind(0))


class HistogramObserver(Observer):
    """Histogram of ``|x|`` with ``num_bins`` (a power of two) equal bins over ``[0, 2**e)``, where
    ``2**e`` is the smallest power of two above every value seen (:mod:`~trt_sora.calibrate.histogram`).

    The range only ever doubles; old bins nest exactly in new ones, so the histogram equals the
    one a single pass at the final range would give, whatever the batch order, and no activation
    is ever stored. Counts are int64; each value ``v`` lies in its bin ``[i*w, (i+1)*w)`` with
    ``w = range / num_bins``. The exact running abs-max is kept too (:attr:`absmax`). Inside a
    :class:`SiteStats` the percentile and MSE observers share one histogram.

    This class computes no amax itself; see :class:`PercentileObserver` and
    :class:`MseObserver`.
    """

    supports_axis = False

    def __init__(self, name: str = "<unnamed>", *, axis: int | None = None, num_bins: int = 2048) -> None:
        self.num_bins = check_bins(num_bins, name)
        super().__init__(name, axis=axis)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "num_bins": self.num_bins}

    def reset(self) -> None:
        super().reset()
        self._h = Histogram(self.num_bins, self.name)

    @property
    def hist(self) -> Tensor | None:
        """int64 ``[num_bins]`` counts (None before the first batch)."""
        return self._h.counts

    @property
    def range(self) -> float:
        """Upper edge of the last bin; 0.0 before any non-zero data."""
        return self._h.range

    @property
    def absmax(self) -> Tensor | None:
        return self._h.absmax

    @property
    def bin_width(self) -> float:
        """Width of one bin (``range / num_bins``); 0 before any non-zero data."""
        return self.range / self.num_bins

    def histogram(self) -> tuple[Tensor, float]:
        """``(counts int64 [num_bins], range)``: bin ``i`` covers ``[i, i+1) * range / num_bins``."""
        if self._h.counts is None:
            return torch.zeros(self.num_bins, dtype=torch.int64), 0.0
        return self._h.counts.clone(), self.range

    def _update(self, x: Tensor, mn: Tensor, mx: Tensor) -> None:
        self._h.update(x, _absmax(mn, mx))

    def _state_tensors(self) -> dict[str, Any]:
        return self._h.state()

    def _load_state_tensors(self, tensors: Mapping[str, Any]) -> None:
        self._h.load(tensors)

    def merge(self, other: HistogramObserver) -> None:
        self._h.merge(other._h)

    def _amax(self) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def percentile_from_histogram(hist: Tensor, hist_range: float, percentile: float) -> float:
    """``percentile`` of the values a histogram holds, like ``numpy.percentile`` (linear method).

    Each order statistic is estimated by the upper edge of its bin, so the
    result is >= the exact value and exceeds it by less than one bin width
    (``hist_range / len(hist)``). ``hist``: counts ``[num_bins]``; returns a float.
    """
    counts = hist.to(torch.float64)
    n = int(hist.sum())
    if n == 0 or hist_range == 0.0:
        return 0.0
    cdf = torch.cumsum(counts, 0)
    rank = (n - 1) * percentile / 100.0
    lo = math.floor(rank)
    frac = rank - lo
    hi = min(lo + 1, n - 1)
    ranks = torch.tensor([lo, hi], dtype=torch.float64, device=cdf.device)
    bins = torch.searchsorted(cdf, ranks, right=True).clamp_(max=len(hist) - 1)
    upper = (bins.to(torch.float64) + 1.0) * (hist_range / len(hist))
    return float((1.0 - frac) * upper[0] + frac * upper[1])


class PercentileObserver(HistogramObserver):
    """``amax`` = the ``percentile``-th percentile of ``|x|`` over all collected data.

    Computed from the growing histogram (see :class:`HistogramObserver`): at
    most one bin width (``range / num_bins``) above ``numpy.percentile(|x|, p)``
    of the concatenated batches, and never above the exact max.

    Args:
        percentile: in ``(0, 100]``, e.g. ``99.99``; 100 gives the exact max.
        num_bins: histogram resolution, e.g. 2048.
    """

    method = "percentile"

    def __init__(self, name: str = "<unnamed>", *, axis: int | None = None, percentile: float = 99.99,
                 num_bins: int = 2048) -> None:
        if not 0.0 < float(percentile) <= 100.0:
            raise ConfigError(f"site {name!r}: percentile={percentile} must be in (0, 100] (e.g. 99.99)")
        self.percentile = float(percentile)
        super().__init__(name, axis=axis, num_bins=num_bins)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "percentile": self.percentile}

    def _amax(self) -> Tensor:
        if self.range == 0.0:  # only zeros so far
            return torch.zeros((), dtype=torch.float32)
        if self.percentile == 100.0:
            return self.absmax.clone()
        p = percentile_from_histogram(self.hist, self.range, self.percentile)
        return torch.minimum(torch.tensor(p, dtype=torch.float32, device=self.absmax.device), self.absmax)


class MseObserver(HistogramObserver):
    """``amax`` minimising the fake-quantization MSE of the collected ``|x|`` histogram.

    Candidates are ``num_candidates`` bin upper edges spread evenly over the
    histogram's range plus the exact max; each bin's count is represented by
    its centre, fake-quantized in ``fmt`` (``"fp8_e4m3"`` or ``"int8"``) with
    the candidate amax; the candidate with the lowest weighted squared error
    wins (ties: the smaller amax).
    """

    method = "mse"

    def __init__(self, name: str = "<unnamed>", *, axis: int | None = None, fmt: str = "fp8_e4m3",
                 num_bins: int = 2048, num_candidates: int = 256) -> None:
        from trt_sora.formats import quant_format

        self.fmt = quant_format(fmt).value
        if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 1:
            raise ConfigError(f"site {name!r}: num_candidates={num_candidates!r} must be an integer >= 1")
        self.num_candidates = num_candidates
        super().__init__(name, axis=axis, num_bins=num_bins)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "fmt": self.fmt, "num_candidates": self.num_candidates}

    def _amax(self) -> Tensor:
        from trt_sora.calibrate.fake_quant import fake_quant

        if self.range == 0.0:
            return torch.zeros((), dtype=torch.float32)
        dev = self.hist.device
        n = self.num_bins
        w = self.range / n
        counts = self.hist.to(torch.float64)
        centres = (torch.arange(n, dtype=torch.float64, device=dev) + 0.5) * w
        centres = torch.minimum(centres, self.absmax.double())
        k = min(self.num_candidates, n)
        edges = (torch.linspace(n / k, n, k, dtype=torch.float64, device=dev).round() * w)
        cand = torch.cat([edges[edges < float(self.absmax)], self.absmax.double().reshape(1)]).float()
        grid = centres.float().expand(len(cand), n)
        err = (grid.double() - fake_quant(grid, cand, self.fmt, axis=0).double()).square() @ counts
        return cand[int(torch.argmin(err))].clone()


OBSERVERS: dict[str, type[Observer]] = {
    cls.method: cls for cls in (MinMaxObserver, EmaObserver, PercentileObserver, MseObserver)
}


def make_observer(method: str, name: str = "<unnamed>", **kwargs: Any) -> Observer:
    """Build an observer by method name (``minmax``, ``ema``, ``percentile``, ``mse``).

    ``method`` may be a ``trt_sora.config.CalibMethod``. ``kwargs`` go to the
    class (``axis``, ``averaging_constant``, ``track``, ``percentile``,
    ``num_bins``, ``fmt``, ``num_candidates``); unknown ones are ConfigErrors.

    Raises:
        ConfigError: unknown method (with a close-match hint) or argument.
    """
    from trt_sora.config.base import did_you_mean

    key = getattr(method, "value", method)
    if key not in OBSERVERS:
        raise ConfigError(f"unknown calibration method {key!r}{did_you_mean(key, OBSERVERS)}; "
                          f"choose one of {', '.join(OBSERVERS)}")
    cls = OBSERVERS[key]
    try:
        return cls(name, **kwargs)
    except TypeError as exc:
        import inspect

        params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "name")]
        bad = next((k for k in kwargs if k not in params), None)
        hint = did_you_mean(bad, params) if bad else ""
        raise ConfigError(f"method {key!r} does not take {bad!r}{hint}; valid arguments: {', '.join(params)}"
                          ) from exc


def observer_from_state_dict(state: Mapping[str, Any]) -> Observer:
    """Rebuild an observer (settings + state) from :meth:`Observer.state_dict`."""
    settings = {k: v for k, v in state["settings"].items() if k != "method"}
    obs = make_observer(state["method"], state.get("name", "<unnamed>"), **settings)
    obs.load_state_dict(state)
    return obs


class SiteStats:
    """Everything calibration keeps about one site: observers + a per-step, per-branch abs-max grid.

    Args:
        name: the site (module path).
        methods: observers fed with every batch, as method names (built with
            ``observer_kwargs[method]``) or ready observers keyed by method.
            The first one is the *primary* method (``compute_amax()`` default).
        branches: CFG branch names, the columns of :attr:`amax_per_step`;
            ``("cond", "uncond")`` by default, ``("cond",)`` without CFG.
        observer_kwargs: per-method constructor arguments, e.g.
            ``{"percentile": {"percentile": 99.9}, "ema": {"averaging_constant": 0.05}}``;
            ``axis`` given here applies to every method that supports it.

    Memory: the observers (a histogram at most each) plus ``steps x branches``
    fp32 values; no activation is stored.

    The per-step grid is per tensor (max over channels for per-channel
    sites) and holds 0 where a (step, branch) was never seen; see
    :attr:`count_per_step`.
    """

    def __init__(self, name: str, methods: Sequence[str] | Mapping[str, Observer] = ("minmax",), *,
                 branches: Sequence[str] = ("cond", "uncond"),
                 observer_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if isinstance(methods, Mapping):
            self.observers: dict[str, Observer] = dict(methods)
        else:
            kw = dict(observer_kwargs or {})
            self.observers = {getattr(m, "value", m): make_observer(m, name, **dict(kw.get(getattr(m, "value", m), {})))
                              for m in methods}
        if not self.observers:
            raise ConfigError(f"site {name!r}: SiteStats needs at least one method (e.g. ['minmax'])")
        if not branches or len(set(branches)) != len(branches):
            raise ConfigError(f"site {name!r}: branches must be unique names, got {list(branches)}")
        axes = {o.axis for o in self.observers.values()}
        if len(axes) != 1:
            raise ConfigError(f"site {name!r}: all observers of a site must share one axis, got {axes}")
        self.name = name
        self.axis = axes.pop()
        self.branches = tuple(branches)
        self.reset()

    def _link_histograms(self) -> None:
        """Histogram observers of one ``num_bins`` share one histogram, updated once per batch."""
        shared: dict[int, Histogram] = {}
        for o in self.observers.values():
            if isinstance(o, HistogramObserver):
                o._h = shared.setdefault(o.num_bins, o._h)
        self._histograms = list(shared.values())

    @property
    def primary(self) -> str:
        """The method whose amax goes into ``<site>.amax`` (the first one given)."""
        return next(iter(self.observers))

    def reset(self) -> None:
        """Reset every observer and the per-step grid."""
        for o in self.observers.values():
            o.reset()
        self._link_histograms()
        self._nonfinite: Tensor | None = None  # device bool: a batch had NaN/inf (read by check_finite)
        self._grid: Tensor | None = None  # fp32 [steps, branches]
        self._count: Tensor | None = None  # int64 [steps, branches]

    def _branch_index(self, branch: str | int | None) -> int:
        if branch is None:
            if len(self.branches) == 1:
                return 0
            raise ConfigError(f"site {self.name!r}: pass branch= one of {self.branches} (CFG calibration)")
        if isinstance(branch, int):
            if not 0 <= branch < len(self.branches):
                raise ConfigError(f"site {self.name!r}: branch index {branch} outside 0..{len(self.branches) - 1}")
            return branch
        if branch not in self.branches:
            from trt_sora.config.base import did_you_mean

            raise ConfigError(f"site {self.name!r}: unknown branch {branch!r}"
                              f"{did_you_mean(branch, self.branches)}; known: {self.branches}")
        return self.branches.index(branch)

    def _record(self, step: int, col: int, amax: Tensor) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"site {self.name!r}: step must be an int >= 0 (the denoising step index), got {step!r}")
        amax = amax.max() if amax.dim() else amax  # per-channel -> per tensor
        if self._grid is None:
            self._grid = torch.zeros(0, len(self.branches), dtype=torch.float32, device=amax.device)
            self._count = torch.zeros(0, len(self.branches), dtype=torch.int64, device=amax.device)
        if step >= self._grid.shape[0]:
            extra = step + 1 - self._grid.shape[0]
            self._grid = torch.cat([self._grid, self._grid.new_zeros(extra, len(self.branches))])
            self._count = torch.cat([self._count, self._count.new_zeros(extra, len(self.branches))])
        self._grid[step, col] = torch.maximum(self._grid[step, col], amax)
        self._count[step, col] += 1

    def collect(self, x: Tensor, *, step: int | None = None, branch: str | int | None = None) -> None:
        """Feed one batch to every observer and, if ``step`` is given, to the per-step grid.

        Args:
            x: activations, any shape, float dtype (per-channel: ``x.shape[axis]`` channels).
            step: denoising step index (0-based), or None to skip the per-step grid.
            branch: CFG branch name or column index; may be None with a single branch.
        """
        if x.numel() == 0:
            return
        self.fold(self.summarize(x), step=step, branch=branch)

    def summarize(self, x: Tensor, order: Sequence[str] | None = None) -> dict[str, Any]:
        """What a batch contributes, computed once on its device (no host sync): min/max (per CFG part
        when ``order`` names the concatenated branches) and each histogram's batch counts. Sites that
        read the same tensor (Q/K/V projections of one input) fold one summary
        (:class:`~trt_sora.calibrate.hooks.CollectionHooks` does)."""
        x = x.detach()
        if order is not None:
            parts = [_minmax(p, self.name, self.axis) for p in x.chunk(len(order), dim=0)]
            mn = torch.stack([p[0] for p in parts]).amin(0)
            mx = torch.stack([p[1] for p in parts]).amax(0)
        else:
            parts = None
            mn, mx = _minmax(x, self.name, self.axis)
        amax = _absmax(mn, mx)
        hists = {h.num_bins: Histogram.batch(x, amax, h.num_bins) for h in self._histograms}
        return {"mn": mn, "mx": mx, "amax": amax, "parts": parts, "hists": hists, "numel": x.numel()}

    def fold(self, summary: Mapping[str, Any], *, step: int | None = None, branch: str | int | None = None,
             order: Sequence[str] | None = None) -> None:
        """Fold a :meth:`summarize` result into every observer and the per-step grid."""
        mn, mx = summary["mn"], summary["mx"]
        bad = ~(torch.isfinite(mn).all() & torch.isfinite(mx).all())
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
        for o in self.observers.values():
            o._count(summary["numel"], mn)
            if not isinstance(o, HistogramObserver):
                o._update(None, mn, mx)  # min/max and EMA read only the batch's min/max
        for h in self._histograms:
            h.add(*summary["hists"][h.num_bins], summary["amax"])
        if step is None:
            return
        if summary["parts"] is None:
            self._record(step, self._branch_index(branch), summary["amax"])
        else:
            for b, (pmn, pmx) in zip(order, summary["parts"]):
                self._record(step, self._branch_index(b), _absmax(pmn, pmx))

    def check_finite(self, where: str = "") -> None:
        """Raise CalibrationError if a batch since the last reset held NaN/inf (one host sync)."""
        if self._nonfinite is not None and bool(self._nonfinite):
            raise CalibrationError(f"site {self.name!r}: a calibration batch contains NaN or inf{where}; "
                                   f"{_fix_hint(self.name)}")

    def collect_cfg_batch(self, x: Tensor, *, step: int | None, order: Sequence[str] | None = None) -> None:
        """Feed a forward that ran all CFG branches in one batch (concatenated along dim 0).

        Observers see ``x`` whole (one batch); the per-step grid gets each
        branch's own abs-max. ``order`` names the chunks in batch order
        (default: :attr:`branches`); ``x.shape[0]`` must divide evenly.
        """
        order = tuple(order or self.branches)
        if x.numel() == 0:
            return
        if x.dim() == 0 or x.shape[0] % len(order):
            raise CalibrationError(f"site {self.name!r}: CFG-batched tensor of shape {tuple(x.shape)} cannot be "
                                   f"split into {len(order)} branches {order} along dim 0; run the branches as "
                                   "separate forwards and use collect(..., branch=...)")
        self.fold(self.summarize(x, order), step=step, order=order)

    def compute_amax(self, method: str | None = None) -> Tensor:
        """amax of ``method`` (default: :attr:`primary`); fp32 ``[]`` or ``[C]``."""
        key = getattr(method, "value", method) or self.primary
        self.check_finite()
        if key not in self.observers:
            from trt_sora.config.base import did_you_mean

            raise ConfigError(f"site {self.name!r}: no {key!r} observer{did_you_mean(key, self.observers)}; "
                              f"this site collected {list(self.observers)}")
        return self.observers[key].compute_amax()

    def compute_all(self) -> dict[str, Tensor]:
        """``{method: amax}`` for every observer (CalibrationError if a batch held NaN/inf)."""
        self.check_finite()
        return {m: o.compute_amax() for m, o in self.observers.items()}

    @property
    def amax_per_step(self) -> Tensor:
        """fp32 ``[steps, len(branches)]`` abs-max per denoising step and branch (0 = not seen)."""
        if self._grid is None:
            return torch.zeros(0, len(self.branches), dtype=torch.float32)
        return self._grid.clone()

    @property
    def count_per_step(self) -> Tensor:
        """int64 ``[steps, len(branches)]`` batches seen per step and branch."""
        if self._count is None:
            return torch.zeros(0, len(self.branches), dtype=torch.int64)
        return self._count.clone()

    @property
    def num_batches(self) -> int:
        """Batches fed to the observers (a CFG-batched forward counts once)."""
        return next(iter(self.observers.values())).num_batches

    def state_dict(self) -> dict[str, Any]:
        """Observers' states plus the per-step grid; tensors and plain values only."""
        return {"name": self.name, "branches": list(self.branches),
                "observers": {m: o.state_dict() for m, o in self.observers.items()},
                "grid": self._grid, "count": self._count}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> SiteStats:
        """Inverse of :meth:`state_dict`."""
        obs = {m: observer_from_state_dict(s) for m, s in state["observers"].items()}
        site = cls(state["name"], obs, branches=state["branches"])
        for m, s in state["observers"].items():
            site.observers[m].load_state_dict(s)  # __init__ reset them
        site._link_histograms()
        site._grid, site._count = state["grid"], state["count"]
        return site

    def merge(self, other: SiteStats) -> None:
        """Fold ``other`` (the same site, methods and settings, later batches) into this one, exactly:
        min/max by min/max, histograms re-binned and added, EMA histories appended, the per-step grid
        by max (counts added)."""
        if list(other.observers) != list(self.observers) or other.branches != self.branches:
            raise CalibrationError(f"site {self.name!r}: cannot merge statistics of methods {list(other.observers)} / "
                                   f"branches {other.branches} into {list(self.observers)} / {self.branches}; "
                                   "calibrate every shard with the same recipe")
        done: set[int] = set()
        for m, o in self.observers.items():
            theirs = other.observers[m]
            if o.settings() != theirs.settings():
                raise CalibrationError(f"site {self.name!r}: {m} settings differ between shards ({o.settings()} vs "
                                       f"{theirs.settings()}); calibrate every shard with the same recipe")
            if isinstance(o, HistogramObserver):
                if id(o._h) not in done:
                    o.merge(theirs)
                    done.add(id(o._h))
            else:
                o.merge(theirs)
            o.num_batches += theirs.num_batches
            o.num_elements += theirs.num_elements
        if other._grid is not None:
            if self._grid is None:
                self._grid, self._count = other._grid.clone(), other._count.clone()
            else:
                rows = max(self._grid.shape[0], other._grid.shape[0])
                g, c = _pad_rows(self._grid, rows), _pad_rows(self._count, rows)
                self._grid = torch.maximum(g, _pad_rows(other._grid.to(g.device), rows))
                self._count = c + _pad_rows(other._count.to(c.device), rows)

    def __repr__(self) -> str:
        steps = 0 if self._grid is None else self._grid.shape[0]
        return (f"SiteStats({self.name!r}, methods={list(self.observers)}, branches={self.branches}, "
                f"steps={steps}, num_batches={self.num_batches})")

