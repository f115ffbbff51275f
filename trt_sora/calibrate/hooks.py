"""Collection hooks: feed every ``nn.Linear`` input and the attention Q/K/V to per-site observers.

:class:`CollectionHooks` is a context manager over a loaded transformer::

    with CollectionHooks(model, methods=("percentile", "minmax"), branches=("cond", "uncond")) as hooks:
        for step, t in enumerate(timesteps):
            with hooks.at(step=step, branch="cond"):
                model(...)          # every linear input / q,k,v is reduced on its device
    sites = hooks.sites             # {site: SiteStats}, module order

Sites are module paths relative to the model passed in (what the quantize stage
and ``qdq_map.json`` use): ``blocks.0.attn1.to_q`` for a linear's input
activation ``[..., in_features]``, ``blocks.0.attn1.q`` / ``.k`` / ``.v`` for
the attention inputs after norm + RoPE (``[B, S, H, D]``), seen through the
attention processor's ``observer(site, tensor)`` seam (any processor with an
``observer`` attribute, e.g. :class:`trt_sora.models.wan.WanExportAttnProcessor`).

Memory: nothing is stored but the observers' state (a histogram of
``num_bins`` int64 counts for histogram methods, a few scalars otherwise) and a
``[steps, branches]`` grid per site. Reductions run on the activation's device,
so a GPU calibration moves only scalars to the host.

:func:`offload_blocks` keeps a model's repeated blocks on the host and moves one
at a time to the compute device, for models whose weights do not fit next to
their activations (e.g. Wan 14B in fp32 on one 80 GB GPU).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from trt_sora.calibrate.observers import SiteStats, check_finite
from trt_sora.errors import CalibrationError

log = logging.getLogger("trt_sora")

__all__ = ["ATTENTION_SITES", "CollectionHooks", "attention_modules", "linear_sites", "offload_blocks"]

#: Suffixes of the attention sites each observed attention module gets.
ATTENTION_SITES = ("q", "k", "v")


def linear_sites(model: torch.nn.Module) -> list[str]:
    """Module paths of every ``nn.Linear`` in ``model``, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def attention_modules(model: torch.nn.Module) -> list[str]:
    """Module paths whose attention processor offers an ``observer`` seam."""
    return [n for n, m in model.named_modules()
            if n and hasattr(getattr(m, "processor", None), "observer")]


class CollectionHooks:
    """Install observers on ``model``; see the module docstring.

    Args:
        model: the transformer (``nn.Module``); not modified except for hooks and
            per-module attention-processor copies, all removed on exit.
        methods: observer methods fed with every batch; the first is the primary one.
        branches: CFG branch names (columns of the per-step grids).
        observer_kwargs: ``{method: kwargs}`` for :func:`~trt_sora.calibrate.observers.make_observer`.
        attention: also observe attention q/k/v (when the processors allow it).
        overlap: on CUDA, run the observers on a side stream of the activation's device, ordered after
            the kernel that produced each tensor (an event wait) and joined back before the one host
            sync per forward, so the forward's kernels fill the gaps between the observers' many small
            launches (the histograms' own kernels are not hidden, they share the SMs; benchmarks/README.md
            has the timings). The same kernels on the same
            data: the statistics are unchanged. False: the forward's own stream.

    Attributes:
        sites: ``{site: SiteStats}`` for every linear input and attention q/k/v, module order.
    """

    def __init__(self, model: torch.nn.Module, *, methods: Sequence[str] = ("minmax",),
                 branches: Sequence[str] = ("cond", "uncond"),
                 observer_kwargs: Mapping[str, Mapping[str, Any]] | None = None, attention: bool = True,
                 overlap: bool = True) -> None:
        self.model = model
        self.methods = tuple(getattr(m, "value", m) for m in methods)
        self.branches = tuple(branches)
        self.observer_kwargs = {k: dict(v) for k, v in (observer_kwargs or {}).items()}
        self.attention = attention
        self.overlap = overlap
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # device -> the observers' side stream
        self.sites: dict[str, SiteStats] = {}
        self._step: int | None = None
        self._branch: str | None = None
        self._handles: list = []
        self._last = None  # (weakref to the tensor, its version, CFG order, summary): see _last_summary
        self._saved_processors: list[tuple[torch.nn.Module, Any]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def _site(self, name: str) -> SiteStats:
        s = self.sites.get(name)
        if s is None:
            s = SiteStats(name, self.methods, branches=self.branches, observer_kwargs=self.observer_kwargs)
            self.sites[name] = s
        return s

    def __enter__(self) -> CollectionHooks:
        # One pass in module order, so the stats file lists sites as the model declares them.
        for name, mod in self.model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                site = self._site(name)
                self._handles.append(mod.register_forward_pre_hook(self._linear_hook(site)))
            elif self.attention and name and hasattr(getattr(mod, "processor", None), "observer"):
                sites = {w: self._site(f"{name}.{w}") for w in ATTENTION_SITES}
                proc = copy.copy(mod.processor)  # one processor instance may be shared by every module
                proc.observer = self._attention_observer(sites)
                self._saved_processors.append((mod, mod.processor))
                mod.processor = proc
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook and restore the original attention processors (idempotent)."""
        self._join()
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod, proc in self._saved_processors:
            mod.processor = proc
        self._saved_processors = []

    # -- where we are in the trajectory ---------------------------------------------------------
    @contextlib.contextmanager
    def at(self, *, step: int | None, branch: str | None) -> Iterator[None]:
        """Label the batches of the forwards inside with a denoising ``step`` and CFG ``branch``.

        ``branch`` ``"cond+uncond"``: a CFG-batched forward (both branches concatenated along the
        batch dim, in that order); observers see each tensor once, the per-step grid each half.
        On exit, every site's NaN/inf flag is read in one host sync (the only one per forward).
        """
        prev = self._step, self._branch
        self._step = step
        self._branch = tuple(branch.split("+")) if isinstance(branch, str) and "+" in branch else branch
        try:
            yield
        finally:
            self._join()
            self._step, self._branch = prev
            self._last = None
        check_finite(list(self.sites.values()), f" (denoising step {step}, CFG branch {branch!r})")

    def _join(self) -> None:
        """The forward's streams wait for the observers' side streams (no host sync)."""
        for dev, side in self._streams.items():
            torch.cuda.current_stream(dev).wait_stream(side)

    # -- hooks ----------------------------------------------------------------------------------
    def _collect(self, site: SiteStats, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise CalibrationError(f"site {site.name!r} got a {type(x).__name__} input, not a tensor; "
                                   "exclude it from calibration")
        if x.numel() == 0:
            return
        order = self._branch if isinstance(self._branch, tuple) else None
        if order is not None and (x.dim() == 0 or x.shape[0] % len(order)):
            site.collect_cfg_batch(x, step=self._step, order=order)  # raises, naming the site
        if not (self.overlap and x.is_cuda):
            return self._fold(site, x, order)
        side = self._streams.get(x.device)
        if side is None:
            side = self._streams[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))  # after the kernel that wrote x
        with torch.cuda.stream(side):
            x.record_stream(side)  # x's memory is not reused before the side stream has read it
            self._fold(site, x, order)

    def _fold(self, site: SiteStats, x: torch.Tensor, order) -> None:
        summary = self._last_summary(site, x, order)
        if order is not None:
            site.fold(summary, step=self._step, order=order)
        else:
            site.fold(summary, step=self._step, branch=self._branch)

    def _last_summary(self, site: SiteStats, x: torch.Tensor, order):
        """The batch summary of ``x``; the previous site's when it read the very same tensor (Q, K and V of
        one input, K and V of the text): computed once. One entry, held by weak reference, so no
        activation outlives its forward and a new tensor at a freed address never matches."""
        last, version = self._last, _version(x)
        if last is not None and last[0]() is x and last[1] == version and last[2] == order:
            return last[3]
        summary = site.summarize(x, order)
        self._last = (weakref.ref(x), version, order, summary)
        return summary

    def _linear_hook(self, site: SiteStats):
        def hook(_module, args):
            self._collect(site, args[0])

        return hook

    def _attention_observer(self, sites: Mapping[str, SiteStats]):
        def observer(which: str, tensor: torch.Tensor) -> None:
            s = sites.get(which)
            if s is not None:
                self._collect(s, tensor)

        return observer

    def used_sites(self) -> dict[str, SiteStats]:
        """Sites that saw at least one batch; logs the ones the forward never reached."""
        unused = [n for n, s in self.sites.items() if s.num_batches == 0]
        if unused:
            log.warning("calibration: %d site(s) never ran in the forward and get no statistics: %s",
                        len(unused), ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))
        return {n: s for n, s in self.sites.items() if s.num_batches}


def _version(x: torch.Tensor) -> int:
    """The tensor's in-place version counter (inference-mode tensors have none: nothing writes to them
    between two hooks of one forward)."""
    try:
        return x._version
    except RuntimeError:
        return -1


@contextlib.contextmanager
def offload_blocks(model: torch.nn.Module, device: str | torch.device, *, container: str
                   ) -> Iterator[torch.nn.Module]:
    """Run ``model`` on ``device`` with its repeated blocks kept on the host, one block resident at a time.

    ``container``: the family's ``block_container``. Everything outside ``model.<container>`` moves
    to ``device`` for the duration; each block moves to ``device`` in a forward pre-hook and back to the host after
    its forward. Peak device memory: the non-block weights + one block + activations
    (Wan 14B bf16: ~0.7 GB per block instead of 28 GB). Slow (host<->device copies
    every forward); use it when the model does not fit, else ``model.to(device)``.

    Everything is moved back to the host on exit.
    """
    blocks = getattr(model, container, None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise CalibrationError(f"offload_blocks: the model has no ModuleList {container!r}; calibrate without "
                               "offload (load it on the device in bf16) or name its block container")
    host = torch.device("cpu")
    handles = []
    for name, child in model.named_children():
        if name != container:
            child.to(device)
    for p in model.parameters(recurse=False):
        p.data = p.data.to(device)
    for b in blocks:
        handles.append(b.register_forward_pre_hook(lambda m, args: m.to(device) and None))
        handles.append(b.register_forward_hook(lambda m, args, out: m.to(host) and None))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        model.to(host)
