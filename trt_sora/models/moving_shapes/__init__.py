"""wan-shapes: a small Wan-architecture text-to-video model trained on moving shapes.

A diffusers ``WanTransformer3DModel`` (6 layers, 4 heads x 64, pixel space:
3 channels, 9 frames of 32x32) trained with flow matching on the procedural
dataset of :mod:`.data`, conditioned on all-MiniLM-L6-v2 token states
(:mod:`.text`). Weights ship in :data:`WEIGHTS_DIR`; see MODEL_CARD.md.

No torch at import time: the submodules import it inside their functions.
"""
from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

# Facts an adapter needs (pixel space: the "latents" are the frames themselves).
LATENT_CHANNELS = 3
LATENT_FRAMES = 9
LATENT_HEIGHT = 32
LATENT_WIDTH = 32
TEXT_LEN = 16
TEXT_DIM = 384

#: How users sample it (the sampler of MODEL_CARD.md): FlowMatchEulerDiscreteScheduler(shift=2.0),
#: 20 steps, CFG 4. Calibration and parity run these unless told otherwise.
SAMPLING = {"num_steps": 20, "guidance_scale": 4.0, "shift": 2.0}
#: The unconditional branch is the zero embedding (trained with both zeros and the encoding of "").
NEGATIVE_PROMPT = None

#: Playback rate of its clips (the model card's GIFs: 180 ms a frame).
FPS = 5.5

__all__ = [
    "WEIGHTS_DIR",
    "LATENT_CHANNELS",
    "LATENT_FRAMES",
    "LATENT_HEIGHT",
    "LATENT_WIDTH",
    "TEXT_LEN",
    "TEXT_DIM",
    "SAMPLING",
    "FPS",
]
