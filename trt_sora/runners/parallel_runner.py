"""A torch runner spread over the processes of a ``torch.distributed`` job (CFG-parallel x Ulysses).

Two ways to drive it:

* **SPMD** (``leader=False``, what ``torchrun`` scripts do): every rank calls ``infer`` with the
  same feeds and gets the whole output.
* **Leader / followers** (``leader=True``, what a server does): rank 0 alone calls ``infer``; it
  broadcasts the feeds, every rank computes its part, rank 0 gets the output. The other ranks run
  :meth:`ParallelRunner.follow` until rank 0 deactivates the runner.

See :mod:`trt_sora.parallel` for the split itself.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from trt_sora.errors import ConfigError
from trt_sora.runners.base import Runner, is_torch, to_numpy

log = logging.getLogger("trt_sora")

__all__ = ["ParallelRunner"]

_STOP = "__trt_sora_stop__"


class ParallelRunner(Runner):
    """``inner`` (a :class:`~trt_sora.runners.torch_runner.TorchRunner` or
    :class:`~trt_sora.runners.fp8_runner.TorchFp8Runner`, not yet activated or active) under a
    :class:`~trt_sora.parallel.ParallelConfig`.

    A batched-CFG call (even batch) runs its halves on the two CFG groups; an odd batch runs
    whole on both. Inside each group the transformer's sequence is split over ``ulysses`` ranks.
    """

    def __init__(self, inner, config, *, leader: bool = False):
        super().__init__()
        self.inner, self.config, self.leader = inner, config, leader
        self.input_names, self.output_names = inner.input_names, inner.output_names
        self.name = f"{inner.name} [cfg={config.cfg} x ulysses={config.ulysses}]"
        self.mesh = None
        self._lock = threading.Lock()

    def _activate_impl(self) -> None:
        from trt_sora.parallel import Mesh

        adapter = self.inner.adapter
        self.config.check_heads(adapter.num_heads)
        if getattr(self.inner, "cuda_graphs", False) and self.config.ulysses > 1:
            self.inner.cuda_graphs = False  # collectives inside a captured graph: not supported here
        self.mesh = Mesh(self.config)
        self.inner.activate()
        if self.mesh.seq is not None:
            adapter.enable_sequence_parallel(self.inner.model, self.mesh.seq)

    def _deactivate_impl(self) -> None:
        if self.leader and self.mesh is not None and self.mesh.rank == 0:
            self._broadcast(_STOP)
        self.inner.deactivate()
        self.mesh = None

    @property
    def rank(self) -> int:
        return self.mesh.rank if self.mesh is not None else 0

    # -- inference ---------------------------------------------------------------------------------
    def _infer_impl(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.leader:
                if self.rank != 0:
                    raise ConfigError("in leader mode only rank 0 calls infer; the other ranks call follow()")
                self._broadcast({k: to_numpy(v) for k, v in feeds.items()})
            return self._compute(feeds)

    def follow(self) -> int:
        """Ranks != 0 in leader mode: serve rank 0's calls until it deactivates. Returns the number
        of calls served."""
        if not self.leader or self.rank == 0:
            raise ConfigError("follow() is for ranks != 0 of a leader-mode ParallelRunner")
        self._check_active()
        n = 0
        while True:
            feeds = self._broadcast(None)
            if isinstance(feeds, str) and feeds == _STOP:
                self.inner.deactivate()
                self._active = False
                return n
            self._compute(feeds)
            n += 1

    def _broadcast(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _compute(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        name = self.output_names[0]
        n = int(next(iter(feeds.values())).shape[0])
        split = self.config.cfg == 2 and n % 2 == 0
        if split:
            c, h = self.mesh.cfg_index, n // 2
            feeds = {k: v[c * h:(c + 1) * h] for k, v in feeds.items()}
        y = self.inner.infer(feeds)[name]
        if not split:
            return {name: y}
        as_torch = is_torch(y)
        yt = y if as_torch else torch.from_numpy(y)
        if torch.distributed.get_backend() == "nccl":
            yt = yt.to(torch.device("cuda", torch.cuda.current_device()))
        out = self.mesh.gather_cfg(yt)
        return {name: out.to(y.device) if as_torch else to_numpy(out, "float32")}

    def report(self) -> dict[str, Any]:
        rep = self.inner.report() if hasattr(self.inner, "report") else {}
        return {**rep, "parallel": {"cfg": self.config.cfg, "ulysses": self.config.ulysses, "rank": self.rank}}
