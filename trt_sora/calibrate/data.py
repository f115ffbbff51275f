"""Calibration data: prompt sets (``calib/prompts/*.jsonl``) and presets (``calib/presets/*.yaml``).

A prompt set is JSON Lines, one object per line::

    {"id": "vp1-0001", "prompt": "A red fox trots ...", "tags": ["subject:animals", ...], "split": "calib"}

``split`` is ``"calib"`` (used for calibration) or ``"heldout"`` (never
calibrated on; used to compare calibrators). Sets are loaded with the
``datasets`` library from the local file; nothing is downloaded.

Names resolve under :func:`calib_dir` (``$TRT_SORA_CALIB_DIR`` or the
checkout's ``calib/``): prompt set ``video_prompts_v1`` is
``calib/prompts/video_prompts_v1.jsonl``, preset ``tiny`` is
``calib/presets/tiny.yaml``; a path to a file works too.

This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from trt_sora.errors import CalibrationError, ConfigError
from trt_sora.config.base import did_you_mean

log = logging.getLogger("trt_sora")

__all__ = [
    "SPLITS", "CalibPreset", "CalibShape", "Prompt", "calib_dir", "list_presets", "list_prompt_sets",
    "load_preset", "load_prompt_dataset", "load_prompts", "prompts_for_preset", "resolve_prompt_set",
]

SPLITS = ("calib", "heldout", "all")


def calib_dir() -> Path:
    """Folder holding ``prompts/`` and ``presets/``: ``$TRT_SORA_CALIB_DIR``, else the checkout's ``calib/``."""
    env = os.environ.get("TRT_SORA_CALIB_DIR")
    if env:
        return Path(env)
    from trt_sora.config import repo_root

    return repo_root() / "calib"


def list_presets() -> dict[str, Path]:
    """``{name: path}`` of the presets under ``calib_dir()/presets``."""
    d = calib_dir() / "presets"
    return {p.stem: p for p in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


def list_prompt_sets() -> dict[str, Path]:
    """``{name: path}`` of the prompt sets under ``calib_dir()/prompts``."""
    d = calib_dir() / "prompts"
    return {p.stem: p for p in sorted(d.glob("*.jsonl"))} if d.is_dir() else {}


# -- prompts ---------------------------------------------------------------------------------------

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


# -- presets ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CalibShape:
    """One latent shape to calibrate at (latent space: Wan ``latent_frames = (frames - 1) // 4 + 1``,
    ``latent_height = height_px / 8``); ``text_len`` in tokens. All ints >= 1."""

    batch: int
    latent_frames: int
    latent_height: int
    latent_width: int
    text_len: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"shape {f.name}={v!r} must be an integer >= 1")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CalibPreset:
    """A calibration run's data: which prompts, how many denoising steps, CFG, shapes, seed.

    Attributes:
        name: preset name (file stem).
        prompt_set: prompt set name or path (see :func:`resolve_prompt_set`).
        split: ``calib`` / ``heldout`` / ``all``.
        num_prompts: prompts drawn (deterministically by ``seed``).
        num_steps: denoising steps per trajectory.
        guidance_scale: CFG scale; ``> 1`` runs both branches (cond + uncond).
        shift: flow-matching timestep shift of the scheduler.
        shapes: latent shapes; each prompt is calibrated at each shape.
        seed: seeds prompt selection and initial latents.
        negative_prompt: text of the unconditional branch.
        description: free text.
    """

    name: str
    prompt_set: str
    num_prompts: int
    num_steps: int
    guidance_scale: float
    shift: float
    shapes: tuple[CalibShape, ...]
    split: str = "calib"
    seed: int = 0
    negative_prompt: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"preset {self.name!r}: split {self.split!r}{did_you_mean(self.split, SPLITS)}; "
                              f"use one of {', '.join(SPLITS)}")
        for key in ("num_prompts", "num_steps"):
            v = getattr(self, key)
            if v < 1:
                raise ConfigError(f"preset {self.name!r}: {key}={v} must be >= 1")
        if self.guidance_scale < 0:
            raise ConfigError(f"preset {self.name!r}: guidance_scale={self.guidance_scale} must be >= 0")
        if self.shift <= 0:
            raise ConfigError(f"preset {self.name!r}: shift={self.shift} must be > 0")
        if not self.shapes:
            raise ConfigError(f"preset {self.name!r}: needs at least one entry in shapes")

    @property
    def uses_cfg(self) -> bool:
        """True when the unconditional branch runs too (``guidance_scale > 1``)."""
        return self.guidance_scale > 1.0

    @property
    def branches(self) -> tuple[str, ...]:
        """CFG branch names observed: ``("cond", "uncond")`` or ``("cond",)``."""
        return ("cond", "uncond") if self.uses_cfg else ("cond",)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/YAML-safe), e.g. for stats metadata and manifests."""
        d = dataclasses.asdict(self)
        d["shapes"] = [s.as_dict() for s in self.shapes]
        return d


def load_preset(name_or_path: str | os.PathLike) -> CalibPreset:
    """Load a preset by name (``tiny``) or path (``calib/presets/tiny.yaml``).

    Raises:
        ConfigError: missing file (naming the path and the existing presets),
            bad YAML, unknown key (with a close-match hint), bad value.
    """
    import yaml

    from trt_sora.config.base import from_dict

    ref = str(name_or_path)
    known = list_presets()
    if ref in known:
        path = known[ref]
    else:
        path = Path(ref)
        if not path.is_file():
            raise ConfigError(
                f"calibration preset {ref!r} not found (no file {path} and no "
                f"{calib_dir() / 'presets' / (ref + '.yaml')}){did_you_mean(ref, known)}; "
                f"existing presets: {', '.join(known) or '(none)'}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset must be a YAML mapping of {', '.join(_preset_keys())}")
    data = {"name": path.stem, **data}
    try:
        return from_dict(CalibPreset, data, where="")
    except ConfigError as exc:
        raise ConfigError(f"preset {path}: {exc}") from None


def _preset_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(CalibPreset) if f.name != "name"]


def prompts_for_preset(preset: CalibPreset, *, split: str | None = None,
                       num_prompts: int | None = None) -> list[Prompt]:
    """The preset's prompts (its ``split``/``num_prompts``/``seed`` unless overridden)."""
    return load_prompts(preset.prompt_set, split=split or preset.split,
                        num_prompts=num_prompts if num_prompts is not None else preset.num_prompts,
                        seed=preset.seed)
