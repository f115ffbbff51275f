"""The sampling-loop and decoded-frame levels' inputs: held-out prompts and seeded noise at a
bucket point, driven through :func:`trt_sora.sampling.sample` with any runner as the transformer,
decoded with the family's decoder (``adapter.decoder()``)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

log = logging.getLogger("trt_sora")

#: Prompts never used for calibration (calib/prompts hold the calibration sets); the fallback when
#: the model names no held-out prompt set of its own.
HELD_OUT_PROMPTS = (
    "a red paper boat drifting down a rain-soaked street at dusk",
    "a slow pan across a snowy pine forest under northern lights",
    "a close-up of a hummingbird hovering over a purple flower",
    "an old lighthouse on a cliff during a thunderstorm",
)


def loop_inputs(adapter, point: Mapping[str, int], *, seed: int = 0, prompts=None,
                text_encoder: str | None = None):
    """Noise ``[B, C, F, H, W]`` and the (cond, uncond) conditioning mappings for ``point`` (batch = B
    prompts per branch, so the CFG batch is 2B): ``prompts`` (cycled), by default the model's own
    held-out prompts when it has them, else :data:`HELD_OUT_PROMPTS`; its own unconditional
    conditioning, and what both branches share (an image-to-video model's seeded image conditioning).
    ``text_encoder``: the adapter's text-encoder source (None: its default; a ``.safetensors`` of
    precomputed embeddings on machines without the encoder)."""
    from trt_sora.sampling import gaussian_noise

    b = int(point["batch"])
    point = adapter.with_family_dims(point)
    prompts = prompts or adapter.heldout_prompts() or HELD_OUT_PROMPTS
    enc = adapter.text_encoder(text_encoder)
    cond, uncond = adapter.conditioning(enc, [prompts[i % len(prompts)] for i in range(b)], point, seed=seed)
    noise = gaussian_noise((b, adapter.latent_channels, int(point["latent_frames"]), int(point["latent_height"]),
                            int(point["latent_width"])), seed)
    return noise, cond, uncond


def sample_loop(infer, noise, cond, uncond, scheduler, *, steps: int, guidance: float, batched: bool,
                record: list | None = None):
    """Final latents of :func:`trt_sora.sampling.sample` over ``infer(feeds) -> {name: array}``
    (a runner's ``infer``); ``record`` (a list) receives the latents after each step.

    Kept for scripts; new code calls :func:`trt_sora.sampling.sample` directly.
    """
    from trt_sora.sampling import SamplingSettings, sample

    settings = SamplingSettings(num_steps=steps, guidance_scale=guidance, shift=float(getattr(
        getattr(scheduler, "config", None), "shift", 1.0) or 1.0))
    res = sample(lambda f: _first_tensor(infer(f)), noise, cond, uncond, scheduler=scheduler, settings=settings,
                 cfg="batched" if batched else "split", keep=("latents",) if record is not None else ())
    if record is not None:
        record.extend(r.latents for r in res.steps)
    return res.latents


def _first_tensor(out):
    import torch

    v = next(iter(out.values())) if isinstance(out, Mapping) else out
    return v if isinstance(v, torch.Tensor) else torch.from_numpy(v)


def decoder(adapter) -> tuple[Callable, str]:
    """``adapter.decoder()``: the family's latents -> frames ``[B, 3, F', H', W']`` in [-1, 1]."""
    return adapter.decoder()
