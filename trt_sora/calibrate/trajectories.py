"""What calibration, its evaluation and the ModelOpt peer share: which trajectories they run.

A trajectory is one :func:`trt_sora.sampling.sample` call over a chunk of ``shape.batch`` prompts of a
preset, from seeded Gaussian noise, with both CFG branches' conditioning::

    settings, note = calibration_sampling(adapter, preset, config)
    for noise, cond, uncond, chunk in trajectory_feeds(adapter, encode, preset, prompts, shape,
                                                       uses_cfg=settings.uses_cfg, device="cpu"):
        sample(adapter_call(adapter, model), noise, cond, uncond, ...)

Seeds: trajectory ``k`` of a pass seeds both its noise and its image conditioning with
:func:`trajectory_seed` (``preset.seed * 1_000_003 + offset + k``); each pass (calibration,
evaluation, peer) has its own ``offset``, so their noises never coincide.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trt_sora.calibrate.data import CalibPreset, CalibShape, prompts_for_preset
from trt_sora.config.recipe import CalibConfig
from trt_sora.errors import CalibrationError, ConfigError, ModelError
from trt_sora.sampling import gaussian_noise, resolve_sampling

__all__ = ["EVALUATION_SEEDS", "PEER_SEEDS", "branch_inputs", "calibration_sampling", "chunks", "compute_dtype",
           "heldout_prompts", "noise", "trajectory_feeds", "trajectory_seed"]

#: Seed offsets of the evaluation's and the peer comparison's held-out trajectories (calibration: 0).
EVALUATION_SEEDS, PEER_SEEDS = 500_000, 700_000


def calibration_sampling(adapter, preset: CalibPreset, config: CalibConfig | None = None):
    """``(settings, note)``: the trajectories calibration runs (:func:`trt_sora.sampling.resolve_sampling`):
    the model's own settings unless the preset pins a value or the recipe's ``calibration.num_steps``
    sets the step count (the recipe wins over the preset)."""
    steps = config.num_steps if config is not None and config.num_steps is not None else preset.num_steps
    return resolve_sampling(adapter, "the preset/recipe", num_steps=steps, guidance_scale=preset.guidance_scale,
                            shift=preset.shift)


def chunks(prompts: Sequence[Any], batch: int) -> list[list[Any]]:
    """Consecutive chunks of ``batch`` prompts; the last one is filled by cycling from the start."""
    out = []
    for i in range(0, len(prompts), batch):
        c = list(prompts[i:i + batch])
        j = 0
        while len(c) < batch:
            c.append(prompts[j % len(prompts)])
            j += 1
        out.append(c)
    return out


def trajectory_seed(preset: CalibPreset, k: int, offset: int = 0) -> int:
    """The seed of trajectory ``k`` of a pass (``offset``: 0, :data:`EVALUATION_SEEDS` or :data:`PEER_SEEDS`)."""
    return preset.seed * 1_000_003 + offset + k


def noise(adapter, shape: CalibShape, seed: int, device):
    """Seeded Gaussian latents ``[B, C, F, H, W]`` fp32, drawn on the CPU (same on every device)."""
    return gaussian_noise((shape.batch, adapter.latent_channels, shape.latent_frames, shape.latent_height,
                           shape.latent_width), seed, device)


def compute_dtype(model):
    """The dtype most of ``model``'s parameters have (bf16 for a bf16 load that keeps norms in fp32)."""
    counts: dict = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get)


def _to(cond: Mapping[str, Any], device) -> dict[str, Any]:
    return {k: v.float().to(device) if v.is_floating_point() else v.to(device) for k, v in cond.items()}


def branch_inputs(adapter, encode, preset: CalibPreset, prompts: list[str], shape: CalibShape, *, uses_cfg: bool,
                  seed: int, device) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(cond, uncond)`` conditioning of one trajectory on ``device`` (the family's
    :meth:`~trt_sora.models.base.ModelAdapter.conditioning`): the unconditional branch's is the preset's
    negative prompt, else the model's own; an image-to-video model's image conditioning is seeded by ``seed``."""
    try:
        cond, uncond = adapter.conditioning(encode, prompts, shape.as_dict(), negative=preset.negative_prompt,
                                            seed=seed, cfg=uses_cfg)
    except ModelError as exc:
        raise CalibrationError(str(exc)) from None
    return _to(cond, device), (_to(uncond, device) if uncond is not None else None)


def heldout_prompts(preset: CalibPreset, num_prompts: int):
    """``num_prompts`` held-out prompts (split ``heldout``) of the preset's prompt set, or all it has."""
    try:
        return prompts_for_preset(preset, split="heldout", num_prompts=num_prompts)
    except ConfigError:  # fewer held-out prompts than asked: take them all
        return prompts_for_preset(preset, split="heldout", num_prompts=None)


def trajectory_feeds(adapter, encode, preset: CalibPreset, prompts, shape: CalibShape, *, uses_cfg: bool,
                     device, offset: int = 0) -> list[tuple[Any, dict, dict | None, list]]:
    """``[(noise, cond, uncond, chunk)]``: one trajectory's inputs per chunk of ``prompts`` at ``shape``,
    trajectory ``k`` seeded by :func:`trajectory_seed` ``(preset, k, offset)``."""
    feeds = []
    for k, chunk in enumerate(chunks(prompts, shape.batch)):
        seed = trajectory_seed(preset, k, offset)
        cond, uncond = branch_inputs(adapter, encode, preset, [p.prompt for p in chunk], shape, uses_cfg=uses_cfg,
                                     seed=seed, device=device)
        feeds.append((noise(adapter, shape, seed, device), cond, uncond, chunk))
    return feeds
