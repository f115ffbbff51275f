"""A ready diffusers pipeline over a loaded artifact (imports torch + diffusers).

``pipe = trt_sora.runtime.diffusers_pipeline(runner)``: the family's pipeline (``WanPipeline``)
with the runtime's transformer drop-in, the artifact's own text encoder (MiniLM for wan-shapes,
the checkpoint's UMT5, ...), its decoder (the checkpoint's VAE, or a pixel-space identity for
wan-shapes) and scheduler, and the artifact's size, steps, guidance and text length as call
defaults: ``pipe("a red circle moving right").frames`` works for every model the runtime loads.
"""
from __future__ import annotations


def make_pipeline(runner, *, text_encoder: str | None = None):
    """The family's diffusers pipeline over ``runner`` (a :class:`~trt_sora.runtime.ServingRunner`).

    Call defaults: ``num_frames``/``height``/``width`` (the first bucket's opt point),
    ``num_inference_steps``/``guidance_scale`` (the artifact's sampling settings),
    ``max_sequence_length`` (the bucket's text length); any of them can still be passed.
    """
    from trt_sora.runtime._diffusers import make_transformer
    from trt_sora.runtime.generate import generator_for

    gen = generator_for(runner, text_encoder=text_encoder)
    f, h, w = gen.default_size
    s = gen.settings
    defaults = {"num_frames": f, "height": h, "width": w, "num_inference_steps": s.num_steps,
                "guidance_scale": s.guidance_scale, "max_sequence_length": gen.default_point["text_len"]}
    if s.guidance_scale_2 is not None:  # a pair of experts: the drop-in routes by timestep, the pipeline's guidance
        defaults["guidance_scale_2"] = s.guidance_scale_2
    encode = gen.adapter.text_encoder(text_encoder)
    return gen.adapter.diffusers_pipeline(make_transformer(runner), encode=encode,
                                          scheduler=gen.adapter.scheduler(s.shift), defaults=defaults)
