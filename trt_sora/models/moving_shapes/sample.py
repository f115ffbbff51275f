"""Plain sampling loop: text embeddings + flow-matching Euler scheduler + CFG -> clip.

Readable top to bottom on purpose; the model card, the tests and the training
run's own evaluation all use it. Wan's pipeline does the same thing with a VAE
decode at the end; here the latents are pixels, so there is none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .data import HEIGHT, NUM_FRAMES, WIDTH

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Recommended settings, chosen on held-out captions with the probe (MODEL_CARD.md).
DEFAULT_STEPS = 30
DEFAULT_GUIDANCE = 4.0
DEFAULT_SHIFT = 2.0


@dataclass(frozen=True)
class SampleConfig:
    """Sampler settings. ``shift`` is FlowMatchEulerDiscreteScheduler's sigma shift."""

    steps: int = DEFAULT_STEPS
    guidance_scale: float = DEFAULT_GUIDANCE
    shift: float = DEFAULT_SHIFT
    seed: int = 0


def make_scheduler(shift: float = DEFAULT_SHIFT):
    """The diffusers scheduler the model is sampled with (the Wan family's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def sample(
    transformer,
    text_embeds: "torch.Tensor",
    config: SampleConfig = SampleConfig(),
    negative_embeds: "torch.Tensor | None" = None,
    dtype: "torch.dtype | None" = None,
) -> "torch.Tensor":
    """Generate one clip per prompt embedding.

    Args:
        transformer: a ``WanTransformer3DModel`` (this package's weights).
        text_embeds: float [B, text_len, 384], from :func:`text.encode`.
        config: steps, guidance scale, scheduler shift and noise seed.
        negative_embeds: unconditional embeddings, same shape; default zeros
            (the model was trained with both zeros and the encoding of ``""``
            as its dropped-text condition). Guidance <= 1 skips this branch.
        dtype: compute dtype of the transformer call (default: its parameters').

    Returns:
        float32 [B, 3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1] on text_embeds' device.
    """
    import torch

    device = text_embeds.device
    dtype = dtype or next(transformer.parameters()).dtype
    b = text_embeds.shape[0]
    use_cfg = config.guidance_scale > 1.0
    if negative_embeds is None:
        negative_embeds = torch.zeros_like(text_embeds)
    cond = torch.cat([text_embeds, negative_embeds]) if use_cfg else text_embeds

    gen = torch.Generator(device="cpu").manual_seed(config.seed)
    latents = torch.randn((b, 3, NUM_FRAMES, HEIGHT, WIDTH), generator=gen, dtype=torch.float32).to(device)
    scheduler = make_scheduler(config.shift)
    scheduler.set_timesteps(config.steps, device=device)

    with torch.no_grad():
        for t in scheduler.timesteps:
            model_in = torch.cat([latents, latents]) if use_cfg else latents
            # timestep stays fp32 (sigma * 1000), as in Wan's pipeline
            timestep = t.to(torch.float32).expand(model_in.shape[0])
            velocity = transformer(
                hidden_states=model_in.to(dtype),
                timestep=timestep,
                encoder_hidden_states=cond.to(dtype),
                return_dict=False,
            )[0].float()
            if use_cfg:
                v_cond, v_uncond = velocity.chunk(2)
                velocity = v_uncond + config.guidance_scale * (v_cond - v_uncond)
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    return latents.clamp(-1, 1)


def load_transformer(folder=None, dtype: "torch.dtype | None" = None):
    """``WanTransformer3DModel`` from ``folder`` (default: the shipped weights), eval mode."""
    import torch
    from diffusers import WanTransformer3DModel

    from . import WEIGHTS_DIR

    model = WanTransformer3DModel.from_pretrained(str(folder or WEIGHTS_DIR), torch_dtype=dtype or torch.float32)
    return model.eval()


def generate(prompts: list[str], config: SampleConfig = SampleConfig(), transformer=None) -> "torch.Tensor":
    """Prompts -> clips, on the CPU: float32 [B, 3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1]."""
    from . import text

    transformer = transformer or load_transformer()
    return sample(transformer, text.encode(prompts, text.TEXT_LEN), config)
