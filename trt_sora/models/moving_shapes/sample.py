"""Sampling the model: text embeddings -> :func:`trt_sora.sampling.sample` (flow-matching Euler +
CFG, the loop every stage shares) -> clip.

The model card, the tests and the training run's own evaluation all use it. Wan's
pipeline does the same thing with a VAE decode at the end; here the latents are
pixels, so there is none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import FPS, SAMPLING
from .data import HEIGHT, NUM_FRAMES, WIDTH

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Recommended settings (MODEL_CARD.md): the model's sampling settings, one place (``SAMPLING``).
DEFAULT_STEPS = SAMPLING["num_steps"]
DEFAULT_GUIDANCE = SAMPLING["guidance_scale"]
DEFAULT_SHIFT = SAMPLING["shift"]


@dataclass(frozen=True)
class SampleConfig:
    """Sampler settings. ``shift`` is FlowMatchEulerDiscreteScheduler's sigma shift."""

    steps: int = DEFAULT_STEPS
    guidance_scale: float = DEFAULT_GUIDANCE
    shift: float = DEFAULT_SHIFT
    seed: int = 0


def make_scheduler(shift: float = DEFAULT_SHIFT):
    """The diffusers scheduler the model is sampled with (the Wan family's)."""
    from trt_sora.models.wan import make_scheduler as wan_scheduler

    return wan_scheduler(shift)


def sample(
    transformer,
    text_embeds: torch.Tensor,
    config: SampleConfig = SampleConfig(),
    negative_embeds: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
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

    from trt_sora.sampling import SamplingSettings, gaussian_noise
    from trt_sora.sampling import sample as run_sampler

    settings = SamplingSettings(num_steps=config.steps, guidance_scale=config.guidance_scale, shift=config.shift)
    if negative_embeds is None:
        negative_embeds = torch.zeros_like(text_embeds)
    noise = gaussian_noise((text_embeds.shape[0], 3, NUM_FRAMES, HEIGHT, WIDTH), config.seed, text_embeds.device)
    res = run_sampler(lambda inputs: transformer(**inputs, return_dict=False)[0], noise, text_embeds,
                      negative_embeds, scheduler=make_scheduler(config.shift), settings=settings, cfg="batched",
                      dtype=dtype or _dtype_of(transformer))
    return res.latents.clamp(-1, 1)


def _dtype_of(transformer) -> torch.dtype:
    """The compute dtype of a transformer: its ``dtype`` (diffusers models and the runtime's drop-in,
    which has no parameters of its own), else its first parameter's."""
    dt = getattr(transformer, "dtype", None)
    return dt if dt is not None else next(transformer.parameters()).dtype


def load_transformer(folder=None, dtype: torch.dtype | None = None):
    """``WanTransformer3DModel`` from ``folder`` (default: the shipped weights), eval mode."""
    import torch

    from trt_sora.models import frame_embed

    from . import WEIGHTS_DIR

    return frame_embed.load(folder or WEIGHTS_DIR, dtype or torch.float32).eval()


def generate(prompts: list[str], config: SampleConfig = SampleConfig(), transformer=None) -> torch.Tensor:
    """Prompts -> clips, on the CPU: float32 [B, 3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1]."""
    from . import text

    transformer = transformer or load_transformer()
    return sample(transformer, text.encode(prompts, text.TEXT_LEN), config)


def save_gif(clips: torch.Tensor, path, columns: int = 4, scale: int = 4, gap: int = 2) -> None:
    """Clips [B, 3, F, H, W] in [-1, 1] -> one animated GIF, clips tiled ``columns`` wide."""
    import numpy as np
    from PIL import Image

    x = ((clips.float().cpu().clamp(-1, 1) + 1) * 127.5).round().byte().numpy()  # [B, 3, F, H, W]
    b, _, f, h, w = x.shape
    rows = (b + columns - 1) // columns
    frames = []
    for j in range(f):
        canvas = np.full((rows * (h * scale + gap), columns * (w * scale + gap), 3), 255, np.uint8)
        for i in range(b):
            r, c = divmod(i, columns)
            tile = np.transpose(x[i, :, j], (1, 2, 0)).repeat(scale, 0).repeat(scale, 1)
            canvas[r * (h * scale + gap):r * (h * scale + gap) + h * scale,
                   c * (w * scale + gap):c * (w * scale + gap) + w * scale] = tile
        frames.append(Image.fromarray(canvas))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / FPS), loop=0)


def main(argv=None) -> int:
    """Generate clips for captions on this machine, probe them, optionally save a GIF."""
    import argparse

    from . import data
    from .probe import probe_batch

    p = argparse.ArgumentParser(description="wan-shapes: captions -> clips (+ probe verdicts)")
    p.add_argument("captions", nargs="*", help="captions (default: --heldout N of the held-out split)")
    p.add_argument("--heldout", type=int, default=8, help="held-out captions to use when none are given")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    p.add_argument("--shift", type=float, default=DEFAULT_SHIFT)
    p.add_argument("--seed", type=int, default=data.HELDOUT_SEED_START)
    p.add_argument("--gif", default=None, help="write the clips, tiled, as an animated GIF")
    args = p.parse_args(argv)
    captions = args.captions or [s.caption() for s in data.all_caption_specs("heldout")[::11][: args.heldout]]
    clips = generate(captions, SampleConfig(args.steps, args.guidance, args.shift, args.seed))
    hits = 0
    for caption, r in zip(captions, probe_batch(clips)):
        try:
            ok = r.passes(data.parse_caption(caption))
        except ValueError:
            ok = None
        hits += bool(ok)
        print(f"{caption!r}: probe colour={r.colour} motion={r.motion} background={r.background} "
              f"shape={r.shape} -> {'pass' if ok else 'FAIL' if ok is False else 'n/a'}")
    print(f"colour+motion right on {hits}/{len(captions)}")
    if args.gif:
        save_gif(clips, args.gif)
        print(f"wrote {args.gif}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
