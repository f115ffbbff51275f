"""The sampling-loop and decoded-frame levels: flow-matching Euler + CFG with any runner as the
transformer, and the family's decoder (Wan VAE; identity for pixel-space models)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

log = logging.getLogger("trt_sora")

#: Prompts never used for calibration (calib/prompts hold the calibration sets).
HELD_OUT_PROMPTS = (
    "a red paper boat drifting down a rain-soaked street at dusk",
    "a slow pan across a snowy pine forest under northern lights",
    "a close-up of a hummingbird hovering over a purple flower",
    "an old lighthouse on a cliff during a thunderstorm",
)


def cfg_velocity(infer: Callable[[Mapping[str, Any]], dict], latents, t, cond, uncond, guidance: float,
                 *, batched: bool, dtype=None):
    """Classifier-free-guided velocity ``v_u + g (v_c - v_u)`` (torch fp32, shape of ``latents``).

    ``batched=True`` runs both branches as one batch-2B call (the bucket must allow it); else
    two calls. ``latents`` [B, C, F, H, W] fp32, ``t`` scalar tensor, ``cond``/``uncond`` [B, L, D].
    """
    import torch

    dtype = dtype or torch.float32
    b = latents.shape[0]

    def call(x, emb):
        ts = t.to(torch.float32).reshape(1).expand(x.shape[0]).contiguous()
        out = infer({"hidden_states": x.to(dtype), "timestep": ts, "encoder_hidden_states": emb.to(dtype)})
        return next(iter(out.values())).float()

    if guidance <= 1.0:
        return call(latents, cond)
    if batched:
        v = call(torch.cat([latents, latents]), torch.cat([cond, uncond]))
        v_c, v_u = v[:b], v[b:]
    else:
        v_c, v_u = call(latents, cond), call(latents, uncond)
    return v_u + guidance * (v_c - v_u)


def sample_loop(infer, noise, cond, uncond, scheduler, *, steps: int, guidance: float, batched: bool,
                record: list | None = None):
    """Run ``steps`` Euler steps from ``noise`` [B, C, F, H, W] fp32; returns the final latents.

    ``record`` (a list) receives ``(step, latents_after_step)`` and ``inputs`` dicts are not kept.
    """
    import torch

    scheduler.set_timesteps(steps)
    latents = noise.clone()
    with torch.inference_mode():
        for i, t in enumerate(scheduler.timesteps):
            v = cfg_velocity(infer, latents, t, cond, uncond, guidance, batched=batched)
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
            if record is not None:
                record.append(latents.clone())
    return latents


def loop_inputs(adapter, point: Mapping[str, int], *, seed: int = 0, prompts=HELD_OUT_PROMPTS):
    """Noise ``[B, C, F, H, W]`` and (cond, uncond) embeddings ``[B, L, D]`` for ``point`` (batch = B
    prompts per branch, so the CFG batch is 2B)."""
    import torch

    b = int(point["batch"])
    prompts = adapter.heldout_prompts() or prompts
    enc = adapter.text_encoder()
    cond = enc([prompts[i % len(prompts)] for i in range(b)], int(point["text_len"])).float()
    uncond = enc([""] * b, int(point["text_len"])).float()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(b, adapter.latent_channels, int(point["latent_frames"]), int(point["latent_height"]),
                        int(point["latent_width"]), generator=g)
    return noise, cond, uncond


def decoder(adapter) -> tuple[Callable, str]:
    """``(decode, description)``: latents [B, C, F, H, W] -> frames [B, 3, F', H', W'] in [-1, 1].

    Pixel-space models (3 latent channels): the latents are the frames (clamped). Wan: the
    checkpoint's ``vae/`` when the model came from a pipeline folder, else a small random
    ``AutoencoderKLWan`` (seeded; enough to see how latent error turns into pixel error).
    """
    import torch

    if adapter.latent_channels == 3:
        return (lambda z: z.float().clamp(-1, 1)), "identity (pixel-space model: latents are frames)"
    from pathlib import Path

    from diffusers import AutoencoderKLWan

    vae, desc = None, ""
    if adapter.spec.path:
        root = Path(adapter.spec.path)
        for cand in (root.parent / "vae", root / "vae"):
            if (cand / "config.json").is_file():
                vae = AutoencoderKLWan.from_pretrained(str(cand), torch_dtype=torch.float32)
                desc = f"AutoencoderKLWan from {cand}"
                break
    if vae is None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            vae = AutoencoderKLWan(base_dim=8, z_dim=adapter.latent_channels, dim_mult=[1, 1, 1, 1],
                                   num_res_blocks=1, temperal_downsample=[False, True, True])
        desc = "random tiny AutoencoderKLWan (seed 0; no VAE weights with this model)"
    vae = vae.eval().requires_grad_(False)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def decode(z):
        with torch.inference_mode():
            x = vae.decode(z.float() * std + mean, return_dict=False)[0]
        return x.float().clamp(-1, 1)

    return decode, desc
