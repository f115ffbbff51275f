"""Calibration on every visible GPU: one shard per process under ``torchrun``, merged by rank 0.

``trt-sora calibrate --workers 8 ...`` re-executes itself as
``python -m torch.distributed.run --standalone --nproc-per-node 8 --max-restarts 3
-m trt_sora calibrate ...`` (:func:`torchrun_command`). Each worker calibrates
shard ``RANK / WORLD_SIZE`` on ``cuda:LOCAL_RANK`` into
``OUT.shards/shard-<rank>-of-<world>`` (:func:`run_worker`), waits at a barrier,
and rank 0 merges the shards into ``OUT`` exactly (:mod:`trt_sora.calibrate.shards`)
and writes the report.

Why torchrun and not Ray: the work is a fixed set of independent shards on one
host (or a few, with a shared ``OUT``); torchrun ships with torch (no new
dependency), gives each process its rank and GPU, restarts failed workers
(``--max-restarts``) and runs on CPU with the gloo backend (how the tests run it).
Ray would add a cluster runtime and an object store for what needs neither.

Resumable: a shard folder appears only when its shard finished (written
atomically), and a worker whose folder is already complete for the same recipe,
preset and model skips its work (:func:`shard_done`). A killed shard therefore
reruns alone - after a torchrun restart or when the same command is run again.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from trt_sora.calibrate.shards import shard_folder
from trt_sora.runfolder import CALIB_STATS, manifest_path

log = logging.getLogger("trt_sora")

#: How long rank 0 waits at the barrier for the slowest shard.
BARRIER_TIMEOUT = datetime.timedelta(hours=24)


def in_worker() -> bool:
    """True inside a torchrun worker (``RANK`` / ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(argv: Sequence[str], workers: int, *, max_restarts: int = 3) -> list[str]:
    """The command that runs ``trt-sora <argv>`` in ``workers`` torchrun processes on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(workers)}",
            f"--max-restarts={int(max_restarts)}", "-m", "trt_sora", *argv]


def shard_done(folder: Path, expect: Mapping) -> bool:
    """Whether ``folder`` holds a finished shard whose manifest matches ``expect`` (``config``, the model
    hash and the preset), so its work need not run again. A pair of experts' shard (``expect`` =
    ``{"experts": {expert: expect}}``) is finished when every expert's sub-folder is."""
    if "experts" in expect:
        return all(shard_done(folder / e, x) for e, x in expect["experts"].items())
    path = manifest_path(folder)
    if not (folder / CALIB_STATS).is_file() or not path.is_file():
        return False
    try:
        m = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    got = {"config": m.get("config"), "model_hash": m.get("inputs", {}).get("model", {}).get("model_hash"),
           "preset": m.get("inputs", {}).get("preset"), "shard": m.get("results", {}).get("shard")}
    return json.loads(json.dumps(got, default=str)) == json.loads(json.dumps(dict(expect), default=str))


def run_worker(out_dir: str | Path, device: str, *, run_shard: Callable[[tuple[int, int], Path, str], None],
               merge: Callable[[list[Path], str], None], expect: Callable[[tuple[int, int]], Mapping]) -> None:
    """The body of one torchrun worker: calibrate this rank's shard (unless done), barrier, rank 0 merges.

    ``device``: ``"cuda"`` (becomes ``cuda:LOCAL_RANK``, backend nccl) or a CPU device (gloo).
    ``run_shard((i, n), folder, device)`` writes a shard; ``merge(folders, device)`` writes ``out_dir``;
    ``expect((i, n))`` is what :func:`shard_done` compares.
    """
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = str(device).startswith("cuda")
    if cuda:
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=BARRIER_TIMEOUT)
    try:
        folder = shard_folder(out_dir, rank, world)
        if shard_done(folder, expect((rank, world))):
            log.info("calibration shard %d/%d is already complete in %s; skipping it", rank, world, folder)
        else:
            run_shard((rank, world), folder, device)
        dist.barrier()
        if rank == 0:
            merge([shard_folder(out_dir, i, world) for i in range(world)], device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
