"""Prompt sets (``calib/prompts/*.jsonl``): loading, validation, seeded selection.

Below every stage: calibration draws its prompts here, models name their held-out
captions here, parity and the report evaluate on them.

A prompt set is JSON Lines, one object per line::

    {"id": "vp1-0001", "prompt": "A red fox trots ...", "tags": ["subject:animals", ...], "split": "calib"}

``split`` is ``"calib"`` (used for calibration) or ``"heldout"`` (never
calibrated on; used to compare calibrators and to check quality). A user's own
table works too: a ``.parquet``/``.csv``/``.json`` file or a ``datasets`` folder
(``save_to_disk``, splits ``calib``/``heldout``) with a ``prompt`` column, read
through the ``datasets`` library (``pip install 'trt_sora[datasets]'``); our
JSONL sets need no ``datasets``. Nothing is downloaded.

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
from typing import Any

from trt_sora.config.base import did_you_mean
from trt_sora.errors import CalibrationError, ConfigError

__all__ = ["DATASET_FORMATS", "SPLITS", "Prompt", "calib_dir", "list_prompt_sets", "load_prompt_rows",
           "load_prompts", "resolve_prompt_set"]

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
    """Path of prompt set ``ref`` (a name under ``calib/prompts``, a file path, or a dataset folder).

    Raises CalibrationError naming the missing path and the sets that exist.
    """
    s = str(ref)
    known = list_prompt_sets()
    if s in known:
        return known[s]
    path = Path(s)
    if path.is_file() or path.is_dir():
        return path
    raise CalibrationError(
        f"prompt set {s!r} not found (looked for {path} and {calib_dir() / 'prompts' / (s + '.jsonl')})"
        f"{did_you_mean(s, known)}; available sets: {', '.join(known) or '(none)'} - pass a name from "
        "that list, a .jsonl/.parquet/.csv file or a datasets folder (save_to_disk)")


_FIELDS = ("id", "prompt", "tags", "split")
#: Files read through the ``datasets`` library (``pip install 'trt_sora[datasets]'``), by suffix.
DATASET_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}


def _check_row(row: Any, where: str, seen: dict[str, str]) -> Prompt:
    """One validated prompt; ``seen`` maps ids to where they first appeared."""
    if not isinstance(row, dict):
        raise CalibrationError(f"{where}: each row must be an object with id, prompt, tags, split")
    unknown = set(row) - set(_FIELDS)
    if unknown:
        k = sorted(unknown)[0]
        raise CalibrationError(f"{where}: unknown field {k!r}{did_you_mean(k, _FIELDS)}; fields are id, prompt, "
                               "tags, split")
    if not isinstance(row.get("id"), str) or not row["id"]:
        raise CalibrationError(f"{where}: 'id' must be a non-empty string")
    if row["id"] in seen:
        raise CalibrationError(f"{where}: duplicate id {row['id']!r} (first at {seen[row['id']]}); "
                               "ids must be unique - renumber one of them")
    seen[row["id"]] = where
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise CalibrationError(f"{where}: 'prompt' must be a non-empty string")
    tags = row.get("tags") or []
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise CalibrationError(f"{where}: 'tags' must be a list of strings")
    split = row.get("split") or "calib"
    if split not in ("calib", "heldout"):
        raise CalibrationError(f"{where}: 'split' is {split!r}; use 'calib' or 'heldout'")
    return Prompt(id=row["id"], prompt=row["prompt"], tags=tuple(tags), split=split)


def _jsonl_rows(path: Path) -> list[Prompt]:
    """Our JSON Lines format, every line validated (errors name the line number)."""
    rows: list[Prompt] = []
    seen: dict[str, str] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix that line") from None
            rows.append(_check_row(row, f"{path}:{lineno}", seen))
    return rows


def _dataset_rows(path: Path, cache_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """A user's table through ``datasets``: a .parquet/.csv/.json file, or a ``save_to_disk`` folder
    (a ``DatasetDict`` whose splits are ``calib``/``heldout``, or one ``Dataset``). A ``prompt``
    column is required; ``id`` defaults to ``<name>-<row>``, ``split`` (without splits) to ``calib``."""
    from trt_sora.errors import require

    datasets = require("datasets", extra="datasets")
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # library code shows no progress bars; the CLI owns the terminal
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
        elif path.suffix.lower() in DATASET_FORMATS:
            data = datasets.load_dataset(DATASET_FORMATS[path.suffix.lower()], data_files=str(path), split="train",
                                         cache_dir=None if cache_dir is None else str(cache_dir))
        else:
            raise CalibrationError(f"prompt set {path}: unknown file type {path.suffix!r}; use .jsonl (ours), "
                                   f"{', '.join(DATASET_FORMATS)} or a datasets folder (save_to_disk)")
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise CalibrationError(f"prompt set {path} cannot be read by datasets ({exc}); check the file") from None
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    parts = dict(data) if isinstance(data, datasets.DatasetDict) else {None: data}
    bad = [k for k in parts if k not in (None, "calib", "heldout")]
    if bad:
        raise CalibrationError(f"prompt set {path}: splits {sorted(parts)}; name them 'calib' and 'heldout' "
                               "(DatasetDict keys) or give one table with a 'split' column")
    rows: list[Prompt] = []
    seen: dict[str, str] = {}
    for split, table in parts.items():
        if "prompt" not in table.column_names:
            raise CalibrationError(f"prompt set {path}: no 'prompt' column (columns: {table.column_names}); "
                                   "rename the text column to 'prompt'")
        for i, row in enumerate(table):
            row = {k: v for k, v in row.items() if k in _FIELDS}  # other columns of a user table are ignored
            row.setdefault("id", f"{path.stem}-{split or 'row'}-{i:05d}")
            if split is not None:
                row["split"] = split
            rows.append(_check_row(row, f"{path} ({split or 'rows'} {i})", seen))
    return rows


def load_prompt_rows(ref: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> list[Prompt]:
    """Every prompt of set ``ref`` in file order, validated.

    ``.jsonl`` files (our format, see the module docstring) are read directly; ``.parquet``,
    ``.csv``, ``.json`` files and ``datasets`` folders go through the ``datasets`` library
    (``cache_dir``: its cache folder; default its own).
    Raises CalibrationError: missing or empty set, malformed row (with its line/row), duplicate ids.
    """
    path = resolve_prompt_set(ref)
    rows = _jsonl_rows(path) if path.is_file() and path.suffix.lower() == ".jsonl" else _dataset_rows(path, cache_dir)
    if not rows:
        raise CalibrationError(f"prompt set {path} is empty; add prompts (one JSON object per line) or pick "
                               f"another set: {', '.join(list_prompt_sets()) or '(none)'}")
    return rows


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
    rows = load_prompt_rows(ref, cache_dir=cache_dir)
    in_split = [r for r in rows if split == "all" or r.split == split]
    n_avail = len(in_split)
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
    return [in_split[i] for i in order.tolist()]
