"""Multi-GPU (and multi-process CPU) inference: CFG-parallel and Ulysses sequence parallelism.

One generation is split over ``world = cfg * ulysses`` processes of one ``torch.distributed``
job (NCCL on GPUs, gloo on CPUs; launched by ``torchrun`` or :func:`spawn`):

* **CFG-parallel** (``cfg = 2``): a batched-CFG call (batch ``2B`` = cond rows then uncond rows)
  runs its two halves on two process groups at once; the outputs are gathered back.
* **Ulysses** (``ulysses = U``, ``U`` divides the head count): inside the transformer each rank
  holds ``ceil(S / U)`` of the ``S`` video tokens (the last shard padded); around self-attention
  an all-to-all turns token shards into head shards (every rank: all tokens, ``H / U`` heads),
  attention runs on the full sequence, and a second all-to-all turns the result back. Everything
  else in a Wan block (modulation, cross-attention to the text, FFN) is per token and needs no
  communication. Padded tokens are cut off before attention, so they never act as keys.

Rank ``r`` is ``cfg_index * ulysses + seq_index``. Model families say where their blocks and
self-attention are (``ModelAdapter.enable_sequence_parallel``); this module holds the
communication only. Why not xDiT (``xfuser``) or ``yunchang``: both require flash-attn and pin
diffusers / attention kernels, and neither can place the all-to-all where our fused FP8 block
needs it (after the per-token RMSNorm statistics over all heads, before the per-head RoPE +
8-bit quantization epilogue); the two all-to-alls are 40 lines here.

No heavy imports at module load: torch is imported inside the functions.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from trt_sora.errors import ConfigError

__all__ = ["ParallelConfig", "Mesh", "SeqShard", "init_process_group", "spawn"]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one generation is split. ``cfg``: 1 or 2 (the CFG branches on separate ranks);
    ``ulysses``: sequence-parallel degree (must divide the model's head count)."""

    cfg: int = 1
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.cfg not in (1, 2):
            raise ConfigError(f"parallel cfg={self.cfg!r}: use 1 or 2 (the two CFG branches)")
        if isinstance(self.ulysses, bool) or not isinstance(self.ulysses, int) or self.ulysses < 1:
            raise ConfigError(f"parallel ulysses={self.ulysses!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """``"cfg=2,ulysses=4"`` (either part optional) -> config; typed error otherwise."""
        kw: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            key, _, val = part.partition("=")
            if key not in ("cfg", "ulysses") or not val.strip().isdigit():
                raise ConfigError(f"parallel spec {text!r}: write e.g. 'cfg=2,ulysses=2'")
            kw[key] = int(val)
        return cls(**kw)

    def check_heads(self, heads: int) -> None:
        if heads % self.ulysses:
            raise ConfigError(f"ulysses={self.ulysses} does not divide the model's {heads} attention heads; "
                              f"use a divisor of {heads}")


class SeqShard:
    """One rank's view of a sequence-parallel group: shard / gather tokens, the two all-to-alls.

    ``length`` (set by :meth:`shard`) is the true token count ``S``; each rank holds ``local``
    tokens, ``local * size >= S``.
    """

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.length = 0
        self.local = 0

    # -- tokens ---------------------------------------------------------------------------------
    def shard(self, x, dim: int = 1):
        """This rank's slice of ``x`` along ``dim`` (the sequence), zero-padded to ``size`` equal
        shards. Records ``length`` for :meth:`gather` and the attention all-to-alls."""
        import torch.nn.functional as F

        self.length = x.shape[dim]
        self.local = -(-self.length // self.size)
        pad = self.local * self.size - self.length
        if pad:
            spec = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
            x = F.pad(x, spec)
        return x.narrow(dim, self.rank * self.local, self.local).contiguous()

    def local_slice(self, x, dim: int = 1):
        """Full-sequence ``x`` (e.g. RoPE tables) -> this rank's rows, padded like :meth:`shard`."""
        import torch.nn.functional as F

        pad = self.local * self.size - x.shape[dim]
        if pad > 0:
            x = F.pad(x, [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad])
        return x.narrow(dim, self.rank * self.local, self.local)

    def gather(self, x, dim: int = 1):
        """Inverse of :meth:`shard`: all shards concatenated along ``dim``, padding removed."""
        import torch

        parts = [torch.empty_like(x) for _ in range(self.size)]
        _all_gather(parts, x.contiguous(), self.group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, self.length)

    # -- attention all-to-alls -------------------------------------------------------------------
    def tokens_to_heads(self, x, groups: int = 1):
        """``[B, local, groups * H * d]`` (token shard, all heads; ``groups`` stacked tensors such
        as Q, K, V) -> ``[B, S, groups * (H / size) * d]`` (all ``S`` tokens, this rank's heads),
        the padding cut off."""
        import torch

        b, s_loc, c = x.shape
        p = self.size
        x = x.reshape(b, s_loc, groups, p, c // (groups * p)).permute(3, 0, 1, 2, 4).contiguous()
        out = torch.empty_like(x)
        _all_to_all(out, x, self.group)  # [source rank (= token shard), B, local, groups, n]
        out = out.permute(1, 0, 2, 3, 4).reshape(b, p * s_loc, c // p)
        return out[:, :self.length].contiguous()

    def heads_to_tokens(self, x):
        """``[B, S, n]`` (all tokens, this rank's heads) -> ``[B, local, size * n]`` (this rank's
        tokens, all heads in rank order)."""
        import torch
        import torch.nn.functional as F

        b, s, n = x.shape
        p = self.size
        if self.local * p > s:
            x = F.pad(x, (0, 0, 0, self.local * p - s))
        x = x.reshape(b, p, self.local, n).permute(1, 0, 2, 3).contiguous()
        out = torch.empty_like(x)
        _all_to_all(out, x, self.group)  # [source rank (= head group), B, local, n]
        return out.permute(1, 2, 0, 3).reshape(b, self.local, p * n)

    def all_gather_rows(self, x):
        """``[B, local, k]`` per rank -> ``[B, S, k]`` (small per-token statistics)."""
        return self.gather(x, dim=1)


def _as_bytes(t):
    """Collectives on float8 (NCCL and gloo lack the dtype): move the bits as uint8."""
    import torch

    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _all_to_all(out, x, group) -> None:
    import torch.distributed as dist

    dist.all_to_all_single(_as_bytes(out), _as_bytes(x), group=group)


def _all_gather(parts, x, group) -> None:
    import torch.distributed as dist

    dist.all_gather([_as_bytes(p) for p in parts], _as_bytes(x), group=group)


class Mesh:
    """The process groups of a :class:`ParallelConfig` over the current ``torch.distributed`` job.

    Attributes: ``rank``, ``cfg_index`` (0: cond half, 1: uncond half), ``seq`` (a
    :class:`SeqShard` or None when ``ulysses == 1``), ``cfg_group`` (ranks with this seq index).
    """

    def __init__(self, config: ParallelConfig):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("parallel inference needs an initialised torch.distributed job: launch with "
                              "`torchrun --nproc-per-node N ...` or trt_sora.parallel.spawn")
        world = dist.get_world_size()
        if world != config.world_size:
            raise ConfigError(f"parallel cfg={config.cfg} x ulysses={config.ulysses} needs {config.world_size} "
                              f"processes, the job has {world}; launch with --nproc-per-node {config.world_size}")
        self.config = config
        self.rank = dist.get_rank()
        u = config.ulysses
        self.cfg_index, seq_index = divmod(self.rank, u)
        # every rank must create every group, in the same order
        self.seq = None
        for c in range(config.cfg):
            ranks = list(range(c * u, (c + 1) * u))
            g = dist.new_group(ranks) if u > 1 else None
            if c == self.cfg_index and u > 1:
                self.seq = SeqShard(g, seq_index, u)
        self.cfg_group = None
        for s in range(u):
            ranks = [c * u + s for c in range(config.cfg)]
            g = dist.new_group(ranks) if config.cfg > 1 else None
            if s == seq_index:
                self.cfg_group = g

    def gather_cfg(self, y):
        """The two CFG halves' outputs, concatenated on the batch dim in cfg order."""
        import torch

        parts = [torch.empty_like(y) for _ in range(self.config.cfg)]
        _all_gather(parts, y.contiguous(), self.cfg_group)
        return torch.cat(parts, dim=0)


def init_process_group(device: str = "cpu") -> None:
    """Initialise ``torch.distributed`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``PORT``): NCCL for CUDA (each rank on ``cuda:LOCAL_RANK``), gloo otherwise.
    NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    cuda = str(device).startswith("cuda")
    if cuda:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Registered by :func:`init_process_group` (so it runs after any later ``atexit`` hook, such as the
    runner's close that releases the followers): a group left to the interpreter's finalizer can abort
    the process (``terminate called without an active exception``, SIGABRT) while gloo's threads live."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned(rank: int, world: int, init_file: str, fn: Callable, args: Sequence[Any]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args, init_file: str, start_method: str = "spawn") -> None:
    """Run ``fn(rank, *args)`` in ``world`` CPU processes joined by gloo (tests, CPU-only boxes).
    ``init_file``: a path that does not exist yet (the rendezvous). ``start_method``: ``multiprocessing``'s;
    ``"forkserver"`` forks the workers from its server process, so what that server imported (its
    ``set_forkserver_preload`` list: torch, diffusers) each worker need not import again."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(world, init_file, fn, args), nprocs=world, join=True,
                       start_method=start_method)
