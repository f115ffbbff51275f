"""Calibration data: presets (``calib/presets/*.yaml``) over the prompt sets of :mod:`trt_sora.prompts`
(re-exported here).

Names resolve under :func:`calib_dir` (``$TRT_SORA_CALIB_DIR`` or the
checkout's ``calib/``): prompt set ``video_prompts_v1`` is
``calib/prompts/video_prompts_v1.jsonl``, preset ``tiny`` is
``calib/presets/tiny.yaml``; a path to a file works too.

This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from trt_sora.config.base import did_you_mean
from trt_sora.errors import ConfigError
from trt_sora.prompts import (  # noqa: F401
    SPLITS,
    Prompt,
    calib_dir,
    list_prompt_sets,
    load_prompt_rows,
    load_prompts,
    resolve_prompt_set,
)

log = logging.getLogger("trt_sora")

__all__ = [
    "SPLITS", "CalibPreset", "CalibShape", "Prompt", "calib_dir", "list_presets", "list_prompt_sets",
    "load_preset", "load_prompt_rows", "load_prompts", "prompts_for_preset", "resolve_prompt_set",
]


def list_presets() -> dict[str, Path]:
    """``{name: path}`` of the presets under ``calib_dir()/presets``."""
    d = calib_dir() / "presets"
    return {p.stem: p for p in sorted(d.glob("*.yaml"))} if d.is_dir() else {}


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
    """A calibration run's data: which prompts, shapes, seed (and, rarely, sampling overrides).

    The trajectories follow the model's own sampling settings (``adapter.sampling``: the step
    count, CFG and shift users run); a preset may pin one of them, which the calibration
    report states (see :func:`trt_sora.calibrate.run.calibration_sampling`).

    Attributes:
        name: preset name (file stem).
        prompt_set: prompt set name or path (see :func:`resolve_prompt_set`).
        split: ``calib`` / ``heldout`` / ``all``.
        num_prompts: prompts drawn (deterministically by ``seed``).
        num_steps: denoising steps per trajectory; None = the model's.
        guidance_scale: CFG scale (``> 1`` runs both branches); None = the model's.
        shift: flow-matching timestep shift of the scheduler; None = the model's.
        shapes: latent shapes; each prompt is calibrated at each shape.
        seed: seeds prompt selection and initial latents.
        negative_prompt: text of the unconditional branch; None = the model's own unconditional
            conditioning (``adapter.negative_conditioning``: its negative prompt, or zeros).
        description: free text.
    """

    name: str
    prompt_set: str
    num_prompts: int
    shapes: tuple[CalibShape, ...]
    num_steps: int | None = None
    guidance_scale: float | None = None
    shift: float | None = None
    split: str = "calib"
    seed: int = 0
    negative_prompt: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"preset {self.name!r}: split {self.split!r}{did_you_mean(self.split, SPLITS)}; "
                              f"use one of {', '.join(SPLITS)}")
        for key in ("num_prompts", "num_steps"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ConfigError(f"preset {self.name!r}: {key}={v} must be >= 1")
        if self.guidance_scale is not None and self.guidance_scale < 0:
            raise ConfigError(f"preset {self.name!r}: guidance_scale={self.guidance_scale} must be >= 0")
        if self.shift is not None and self.shift <= 0:
            raise ConfigError(f"preset {self.name!r}: shift={self.shift} must be > 0")
        if not self.shapes:
            raise ConfigError(f"preset {self.name!r}: needs at least one entry in shapes")

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
