"""Prompt sets (``calib/prompts/*.jsonl``): loading, validation, seeded selection.

Below every stage: calibration draws its prompts here, models name their held-out
captions here, parity and the report evaluate on them.

A prompt set is JSON Lines, one object per line::

    {"id": "vp1-0001", "prompt": "A red fox trots ...", "tags": ["subject:animals", ...], "split": "calib"}

``split`` is ``"calib"`` (used for calibration) or ``"heldout"`` (never
calibrated on; used to compare calibrators and to check quality). Sets are loaded with the
``datasets`` library from the local file; nothing is downloaded.

Names resolve under :func:`calib_dir` (``$TRT_SORA_CALIB_DIR`` or the
checkout's ``calib/``): prompt set ``video_prompts_v1`` is
``calib/prompts/video_prompts_v1.jsonl``; a path to a file works too.

This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from trt_sora.config.base import did_you_mean
from trt_sora.errors import CalibrationError, ConfigError

__all__ = ["SPLITS", "Prompt", "calib_dir", "list_prompt_sets", "load_prompt_dataset", "load_prompts",
           "resolve_prompt_set"]

SPLITS = ("calib", "heldout", "all")


def calib_dir() -> Path:
    """Folder holding ``prompts/`` and ``presets/``: ``$TRT_SORA_CALIB_DIR``, else the shipped ``calib/``
    (package data of the wheel; the checkout's folder in a source tree)."""
    env = os.environ.get("TRT_SORA_CALIB_DIR")
    if env:
        return Path(env)
    from trt_sora.config import data_dir

    return data_dir("calib")


def list_prompt_sets() -> dict[str, Path]:
    """``{name: path}`` of the prompt sets under ``calib_dir()/prompts``."""
    d = calib_dir() / "prompts"
    return {p.stem: p for p in sorted(d.glob("*.jsonl"))} if d.is_dir() else {}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One calibration prompt: ``id`` (unique in its set), ``prompt`` text, ``tags``, ``split``."""

    id: str
    prompt: str
    tags: tuple[str, ...] = ()
    split: str = "calib"


def resolve_prompt_set(ref: str | os.PathLike) -> Path:
    """Path of prompt set ``ref`` (a name under ``calib/prompts`` or a file path).

    Raises CalibrationError naming the missing path and the sets that exist.
    """
    s = str(ref)
    known = list_prompt_sets()
    if s in known:
        return known[s]
    path = Path(s)
    if path.is_file():
        return path
    raise CalibrationError(
        f"prompt set {s!r} not found (looked for {path} and {calib_dir() / 'prompts' / (s + '.jsonl')})"
        f"{did_you_mean(s, known)}; available sets: {', '.join(known) or '(none)'} - pass a name from "
        "that list or a path to a .jsonl file")


def _check_lines(path: Path) -> int:
    """Validate every line's JSON and fields before handing the file to ``datasets`` (exact line numbers)."""
    n = 0
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix that line") from None
            where = f"{path}:{lineno}"
            if not isinstance(row, dict):
                raise CalibrationError(f"{where}: each line must be a JSON object with id, prompt, tags, split")
            unknown = set(row) - {"id", "prompt", "tags", "split"}
            if unknown:
                k = sorted(unknown)[0]
                raise CalibrationError(f"{where}: unknown field {k!r}{did_you_mean(k, ('id', 'prompt', 'tags', 'split'))}"
                                       "; fields are id, prompt, tags, split")
            if not isinstance(row.get("id"), str) or not row["id"]:
                raise CalibrationError(f"{where}: 'id' must be a non-empty string")
            if row["id"] in seen:
                raise CalibrationError(f"{where}: duplicate id {row['id']!r} (first on line {seen[row['id']]}); "
                                       "ids must be unique - renumber one of them")
            seen[row["id"]] = lineno
            if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise CalibrationError(f"{where}: 'prompt' must be a non-empty string")
            tags = row.get("tags", [])
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise CalibrationError(f"{where}: 'tags' must be a list of strings")
            if row.get("split", "calib") not in ("calib", "heldout"):
                raise CalibrationError(f"{where}: 'split' is {row.get('split')!r}; use 'calib' or 'heldout'")
            n += 1
    return n


def load_prompt_dataset(ref: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None):
    """Load a prompt set as a ``datasets.Dataset`` (columns id, prompt, tags, split), validated.

    ``cache_dir`` is passed to ``datasets.load_dataset`` (default: its own cache).
    Raises CalibrationError: file missing, empty, malformed line (with its number), duplicate ids.
    """
    from trt_sora.errors import require

    path = resolve_prompt_set(ref)
    if _check_lines(path) == 0:
        raise CalibrationError(f"prompt set {path} is empty; add prompts (one JSON object per line) or pick "
                               f"another set: {', '.join(list_prompt_sets()) or '(none)'}")
    datasets = require("datasets", extra="export")
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # library code shows no progress bars; the CLI owns the terminal
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train",
                                   cache_dir=None if cache_dir is None else str(cache_dir))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    if "split" not in ds.column_names:
        ds = ds.add_column("split", ["calib"] * len(ds))
    if "tags" not in ds.column_names:
        ds = ds.add_column("tags", [[] for _ in range(len(ds))])
    return ds


def load_prompts(ref: str | os.PathLike, *, split: str = "calib", num_prompts: int | None = None,
                 seed: int = 0, cache_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """Prompts of ``split`` from set ``ref``, ``num_prompts`` of them chosen deterministically by ``seed``.

    Selection is a seeded permutation (``numpy.random.default_rng(seed)``) of
    the split's rows in file order, truncated to ``num_prompts`` (``None`` =
    all, in permuted order). The same seed with a larger ``num_prompts``
    extends the smaller selection.

    Raises:
        ConfigError: unknown split, or ``num_prompts`` < 1 or larger than the split.
        CalibrationError: missing/empty/malformed set, or an empty split.
    """
    import numpy as np

    if split not in SPLITS:
        raise ConfigError(f"split {split!r}{did_you_mean(split, SPLITS)}; use one of {', '.join(SPLITS)}")
    ds = load_prompt_dataset(ref, cache_dir=cache_dir)
    rows_in_split = [i for i, s in enumerate(ds["split"]) if split == "all" or (s or "calib") == split]
    n_avail = len(rows_in_split)
    if n_avail == 0:
        raise CalibrationError(f"prompt set {ref!r} has no prompts in split {split!r}; pick another split "
                               "('calib', 'heldout', 'all') or add prompts to it")
    if num_prompts is None:
        num_prompts = n_avail
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ConfigError(f"num_prompts={num_prompts!r} must be an integer >= 1")
    if num_prompts > n_avail:
        raise ConfigError(f"num_prompts={num_prompts} but prompt set {ref!r} has only {n_avail} prompts in split "
                          f"{split!r}; lower num_prompts or use split 'all'")
    order = np.random.default_rng(seed).permutation(n_avail)[:num_prompts]
    rows = ds.select([rows_in_split[i] for i in order.tolist()])
    return [Prompt(id=r["id"], prompt=r["prompt"], tags=tuple(r["tags"] or ()), split=r["split"] or "calib")
            for r in rows]
