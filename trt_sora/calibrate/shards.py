"""Calibration in shards: each shard runs a contiguous slice of the trajectories, the merge is exact.

A calibration is a list of trajectories (preset shapes x prompt chunks, in a fixed
order with per-trajectory seeds). ``trt-sora calibrate --shard i/n`` runs slice
``i`` of ``n`` (:func:`shard_range`) and writes the observers' full states
(:mod:`trt_sora.calibrate.stats`); ``trt-sora calibrate --from-shards DIR...``
(or :func:`merge_stats`) folds them together in shard order:

* ``minmax``: max of the shards' abs-max - bit-exact;
* ``percentile``, ``mse``: computed from the merged histogram, which equals the
  one-pass histogram count for count (power-of-two ranges re-bin exactly) -
  bit-exact;
* ``ema``: the per-batch min/max histories are concatenated in shard order and
  the recurrence re-run, which is the one-pass order because shards are
  contiguous slices - bit-exact. EMA *is* order dependent: merging the same
  shards in another order gives another average, so the merge sorts by shard
  index and refuses gaps or duplicates;
* per-step grids: max (counts added);
* GPTQ input Hessians (``calibration.weight_rounding``): each shard writes its fp64 sums
  ``sum x x^T`` (``hessians.safetensors``, or one ``hessians.passNofM.safetensors`` per pass when
  the budget splits them), the merge adds them in shard order one pass group at a time and rounds
  the weights - the one-pass sums to fp64 rounding, the same rounded weights in practice.

Every shard must come from the same model (hash), preset, sampling settings,
observer settings and shard count. A shard folder is written atomically, so a
killed shard leaves nothing and reruns alone (:mod:`trt_sora.calibrate.launch`
skips the shards already done).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

from trt_sora.errors import CalibrationError, ConfigError

log = logging.getLogger("trt_sora")

#: Metadata keys every shard must agree on (besides the model hash).
_SAME = ("method", "observers", "num_steps", "branches", "shapes", "preset", "prompt_set", "seed",
         "guidance_scale", "shift")


def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)`` (0-based index ``i < n``)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not int(m[2]) >= 1 or not int(m[1]) < int(m[2]):
        raise ConfigError(f"--shard {text!r}: use i/n with 0 <= i < n, e.g. --shard 0/4")
    return int(m[1]), int(m[2])


def shard_range(total: int, index: int, count: int) -> range:
    """Trajectories ``[start, stop)`` of shard ``index`` of ``count`` over ``total`` (contiguous, near-equal)."""
    return range(total * index // count, total * (index + 1) // count)


def shard_folder(out_dir: str | Path, index: int, count: int) -> Path:
    """``<out>.shards/shard-<i>-of-<n>``: beside the merged folder (which is replaced as a whole when written)."""
    out = Path(out_dir)
    return out.parent / f"{out.name}.shards" / f"shard-{index}-of-{count}"


def merge_stats(parts: Sequence) -> object:
    """One :class:`~trt_sora.calibrate.stats.CalibStats` from the shards' (any order; merged in shard order).

    Raises CalibrationError: shards disagree on the model, preset or observer settings, a shard is
    missing or duplicated, or a file lacks the observer states.
    """
    import torch

    from trt_sora.calibrate.stats import CalibStats, StatsMetadata, sites_from_stats

    if not parts:
        raise CalibrationError("no shard statistics to merge; pass the shard folders (shards/shard-i-of-n)")
    parts = sorted(parts, key=lambda s: tuple(s.metadata.extra.get("shard") or (0, 1)))
    first = parts[0].metadata
    keys = [tuple(p.metadata.extra.get("shard") or (0, 1)) for p in parts]
    count = keys[0][1]
    if keys != [(i, count) for i in range(count)]:
        raise CalibrationError(f"shards {[f'{i}/{n}' for i, n in keys]} are not one complete set 0..{count - 1} of "
                               f"{count}; run the missing shards (trt-sora calibrate --shard i/{count})")
    for p in parts[1:]:
        m = p.metadata
        if m.model_hash != first.model_hash:
            raise CalibrationError(f"shard {m.extra.get('shard')} is of model hash {m.model_hash}, shard 0 of "
                                   f"{first.model_hash}; calibrate every shard of one model")
        for k in _SAME:
            if getattr(m, k) != getattr(first, k):
                raise CalibrationError(f"shard {m.extra.get('shard')} has {k}={getattr(m, k)!r} but shard 0 "
                                       f"{getattr(first, k)!r}; calibrate every shard with one recipe and preset")
        if m.extra.get("prompt_ids") != first.extra.get("prompt_ids"):
            raise CalibrationError(f"shard {m.extra.get('shard')} was cut from another prompt list than shard 0")
        if [t for t in m.timesteps] != [t for t in first.timesteps]:
            raise CalibrationError(f"shard {m.extra.get('shard')} ran other timesteps than shard 0")
    merged = None
    for p in parts:
        sites = sites_from_stats(p)
        if merged is None:
            merged = sites
            continue
        if set(sites) != set(merged):
            raise CalibrationError(f"shard {p.metadata.extra.get('shard')} has sites "
                                   f"{sorted(set(sites) ^ set(merged))[:3]} the others lack; shards of one model "
                                   "see the same sites")
        for name, s in sites.items():
            merged[name].merge(s)
    extra = {k: v for k, v in first.extra.items() if k not in ("shard", "shard_trajectories", "collect_seconds")}
    extra.update({"merged_shards": count,
                  "collect_seconds": round(sum(p.metadata.extra.get("collect_seconds", 0.0) for p in parts), 3)})
    meta = StatsMetadata(**{**first.to_dict(), "observers": {}, "extra": extra,
                            "num_samples": sum(p.metadata.num_samples for p in parts)})
    out = CalibStats.from_sites(merged, meta)
    for w in first.extra.get("weight_sites", []):  # weights are the same for every shard: take shard 0's
        if not all(torch.equal(p.amax[w], parts[0].amax[w]) for p in parts):
            raise CalibrationError(f"weight amax {w!r} differs between shards: the shards loaded different weights")
        out.amax[w] = parts[0].amax[w].clone()
    log.info("merged %d calibration shards: %d sites", count, len(out.amax))
    return out
