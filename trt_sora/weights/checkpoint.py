"""Write a random-init checkpoint of a named architecture to disk, block by block (diffusers layout).

``trt-sora random-checkpoint --model wan2.1-t2v-14b --out DIR`` gives a folder
that every stage accepts as ``--model DIR`` (``config.json`` with ``_class_name``
+ ``diffusion_pytorch_model[-0000k-of-0000n].safetensors`` + index), so a 14B
model can run through export, quantize and build on a machine that could never
hold it: parameters are drawn one at a time (:mod:`~trt_sora.weights.random_init`,
the same values as ``get_adapter(name).load()``), cast to the checkpoint dtype
(``bf16``; diffusers' fp32-kept modules stay fp32, as ``save_pretrained`` of a
bf16-loaded model writes them) and appended to the current shard. Peak memory:
one parameter (Wan 14B: 283 MB in fp32).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from trt_sora.errors import ModelError

log = logging.getLogger("trt_sora")

WEIGHTS_NAME = "diffusion_pytorch_model"
PROVENANCE = "trt_sora_random_init.json"


def shard_plan(specs, shard_bytes: int) -> list[list]:
    """Consecutive groups of ``(name, shape, dtype)`` of at most ``shard_bytes`` each (one tensor may exceed it)."""
    from trt_sora.weights.safetensors_io import nbytes

    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n = nbytes(spec[1], spec[2])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def write_random_checkpoint(adapter, out_dir: str | Path, *, dtype: str = "bf16",
                            shard_bytes: int = 5 << 30,
                            progress: Callable[[int, int], None] | None = None) -> dict:
    """Write the random-init weights of named architecture ``model_ref`` as a diffusers model folder.

    Args:
        adapter: the model adapter of a registered random-init name (``trt-sora info``), e.g.
            ``get_adapter("wan2.1-t2v-14b")``.
        out_dir: the folder (written atomically: a temp folder renamed when complete).
        dtype: checkpoint dtype, ``bf16`` / ``fp16`` / ``fp32`` (fp32-kept modules stay fp32).
        shard_bytes: shard size; one file when the model fits.
        progress: ``progress(bytes_done, bytes_total)``.

    Returns a summary: files, bytes, parameters, seconds.
    """
    import diffusers

    from trt_sora.manifest import staged_dir
    from trt_sora.weights import RANDOM_INIT_VERSION
    from trt_sora.weights.safetensors_io import nbytes, write_safetensors
    from trt_sora.weights.sources import read_as

    model_ref = adapter.spec.ref
    if adapter.spec.source != "random-init":
        raise ModelError(f"{model_ref!r} is a checkpoint already ({adapter.spec.path}); random-checkpoint writes the "
                         "random weights of a named architecture (see `trt-sora info`)")
    t0 = time.perf_counter()
    empty = adapter.load_empty(dtype)
    source = adapter.weight_source()
    specs = [(n, tuple(p.shape), p.dtype) for n, p in empty.named_parameters()]
    total = sum(nbytes(s, d) for _, s, d in specs)
    shards = shard_plan(specs, shard_bytes)
    done = 0

    def produce(name: str):
        return read_as(source, name, params[name].dtype)

    def step(_name: str, nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    params = dict(empty.named_parameters())
    files = []
    with staged_dir(out_dir) as tmp:
        names = [f"{WEIGHTS_NAME}.safetensors"] if len(shards) == 1 else \
            [f"{WEIGHTS_NAME}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for fname, shard in zip(names, shards):
            write_safetensors(tmp / fname, shard, produce, metadata={"format": "pt"}, progress=step)
            weight_map.update({n: fname for n, _, _ in shard})
            files.append(fname)
            log.info("random-checkpoint: wrote %s (%d tensors)", fname, len(shard))
        if len(shards) > 1:
            (tmp / f"{WEIGHTS_NAME}.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        config = {"_class_name": type(empty).__name__, "_diffusers_version": diffusers.__version__,
                  **dict(adapter.spec.config)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        summary = {"model": model_ref, "seed": adapter.spec.seed, "init": RANDOM_INIT_VERSION, "dtype": dtype,
                   "files": files, "bytes": total, "parameters": sum(p.numel() for p in params.values()),
                   "seconds": round(time.perf_counter() - t0, 2),
                   "note": "random weights drawn per parameter by trt_sora (trt_sora/weights/random_init.py); "
                           "equal to get_adapter(model).load() rounded to dtype"}
        (tmp / PROVENANCE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
