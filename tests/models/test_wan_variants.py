"""Wan 2.1 image-to-video and Wan 2.2 TI2V-5B in the Wan adapter: the math against diffusers (its
processor, its pipelines' conditioning rules), real sizes on the meta device, and every stage on the
tiny configs - export parity at 3 shapes, calibration, Q/DQ, a real TensorRT-RTX FP8 build, parity."""
from __future__ import annotations

import json

import pytest
import torch
from run_folders import WAN_POINTS as POINTS  # three points that differ in every dynamic dim
from run_folders import assert_every_stage_passed

from trt_sora.errors import ModelError
from trt_sora.models import get_adapter


@pytest.mark.parametrize("name,params,linears", [
    ("wan2.1-i2v-14b", 16.4e9, 40 * 12 + 8),  # 12 per block (image K/V added); embedders + head: 8
    ("wan2.2-ti2v-5b", 5.0e9, 30 * 10 + 6),
])
def test_real_sizes_on_meta(name, params, linears):
    a = get_adapter(name)
    with torch.device("meta"):
        m = a._construct()
    n = sum(p.numel() for p in m.parameters())
    assert 0.93 * params < n < 1.07 * params, n
    assert sum(isinstance(x, torch.nn.Linear) for x in m.modules()) == linears


def test_a14b_is_two_14b_experts_on_meta():
    a = get_adapter("wan2.2-t2v-a14b")
    assert a.experts == ("high", "low") and a.sampling.boundary_timestep == 875.0
    hashes = {a.expert(e).spec.model_hash() for e in a.experts}
    assert len(hashes) == 2  # two transformers, not one twice
    assert all(13.5e9 < a.expert(e).num_params() < 14.9e9 for e in a.experts)
    with pytest.raises(ModelError, match="pair of experts"):
        a.load()


def test_i2v_processor_matches_diffusers():
    """diffusers' processor assumes 512 text tokens (so compare at 512); ours takes the image tokens
    from the front of the context at any text length."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    a = get_adapter("wan-i2v-tiny")
    m = a.load()
    x = a.example_inputs({**POINTS[1], "text_len": 512})
    ours = a.forward(m, x)
    m.set_attn_processor(WanAttnProcessor())
    theirs = m(**x, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the image tokens matter (the added K/V path runs)
    x2 = {**x, "encoder_hidden_states_image": torch.zeros_like(x["encoder_hidden_states_image"])}
    assert (a.forward(a.load(), x2) - ours).abs().max() > 1e-3


def test_ti2v_frame_timesteps_are_diffusers_per_token_timesteps():
    a = get_adapter("wan-ti2v-tiny")
    m = a.load()
    x = a.example_inputs(POINTS[0])
    assert x["timestep"].shape == (1, 3) and a.input_ranks()["timestep"] == 2
    ours = a.forward(m, x)
    per_token = x["timestep"].repeat_interleave((4 // 2) * (6 // 2), dim=1)  # [B, F * H/2 * W/2]
    theirs = m(hidden_states=x["hidden_states"], timestep=per_token,
               encoder_hidden_states=x["encoder_hidden_states"], return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_ti2v_image_mode_follows_diffusers_first_frame_rule():
    """WanImageToVideoPipeline with expand_timesteps: the first latent frame is the image's and its
    tokens get timestep 0; the rest get t; the final latents take the image's frame back."""
    a = get_adapter("wan-ti2v-tiny")
    g = torch.Generator().manual_seed(0)
    lat, first = torch.randn(2, 48, 3, 4, 6, generator=g), torch.randn(2, 48, 1, 4, 6, generator=g)
    t = torch.full((2,), 700.0)
    inp = a.model_inputs(lat, t, {"encoder_hidden_states": torch.zeros(2, 5, 64), "first_frame": first})
    mask = torch.ones(1, 1, 3, 4, 6)
    mask[:, :, 0] = 0
    condition = torch.cat([first, torch.zeros(2, 48, 2, 4, 6)], dim=2)
    torch.testing.assert_close(inp["hidden_states"], (1 - mask) * condition + mask * lat)
    assert inp["timestep"].tolist() == [[0.0, 700.0, 700.0]] * 2
    assert set(inp) == {"hidden_states", "timestep", "encoder_hidden_states"}
    out = a.final_latents(lat, {"first_frame": first})
    torch.testing.assert_close(out, (1 - mask) * condition + mask * lat)


def test_i2v_inputs_concatenate_mask_and_image_latents():
    a = get_adapter("wan-i2v-tiny")
    pt = {**POINTS[1]}
    cond = a.image_conditioning(pt, seed=3)
    assert cond["latent_condition"].shape == (2, 20, 2, 6, 4)
    assert cond["encoder_hidden_states_image"].shape == (2, 5, 24)
    mask = cond["latent_condition"][:, :4]
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()  # the first frame is given
    lat = torch.randn(2, 16, 2, 6, 4)
    inp = a.model_inputs(lat, torch.full((2,), 10.0), {"encoder_hidden_states": torch.zeros(2, 7, 64), **cond})
    assert inp["hidden_states"].shape[1] == 36 and "latent_condition" not in inp
    torch.testing.assert_close(inp["hidden_states"][:, :16], lat)
    with pytest.raises(ModelError, match="latent_condition"):
        a.model_inputs(lat, torch.full((2,), 10.0), {"encoder_hidden_states": torch.zeros(2, 7, 64)})
    # every Wan variant has the torch-fp8 block (tests/runtime/test_torch_fp8_wan_variants.py runs them)
    for name in ("wan-tiny", "wan-i2v-tiny", "wan-ti2v-tiny"):
        assert callable(get_adapter(name).torch_fp8_rewrite())
    assert callable(get_adapter("wan-a14b-tiny").expert("low").torch_fp8_rewrite())


# -- every stage on the tiny configs ----------------------------------------------------------------
@pytest.fixture(scope="module", params=["wan-i2v-tiny", "wan-ti2v-tiny"])
def variant_run(request):
    """The session's run folders of the tiny variants (tests/run_folders.py)."""
    return request.getfixturevalue({"wan-i2v-tiny": "i2v_run", "wan-ti2v-tiny": "ti2v_run"}[request.param])


@pytest.mark.trt_rtx
def test_every_stage_on_the_tiny_variants(variant_run):
    pipe, _ = variant_run
    attentions = 2 * (3 if pipe.adapter.is_i2v else 2)  # per block: self, text cross (+ image cross)
    assert_every_stage_passed(variant_run, POINTS, attentions=attentions)


@pytest.mark.trt_rtx
def test_tiny_variants_serve_what_passed(variant_run):
    import numpy as np

    import trt_sora.runtime as rt

    pipe, _ = variant_run
    r = rt.load(pipe.run_dir, backend="ort")
    feeds = r.example_feeds(r.buckets[0].point("opt"))
    out = r.infer(feeds)["sample"]
    assert out.shape[1] == pipe.adapter.latent_channels and np.isfinite(out).all()
    bad = dict(feeds)
    name = "encoder_hidden_states_image" if pipe.adapter.is_i2v else "timestep"
    bad[name] = bad[name][..., :1]
    with pytest.raises(rt.InputError):
        r.infer(bad)


def test_i2v_checkpoint_encodes_images_with_its_clip_like_the_pipeline(tmp_path):
    """A Wan 2.1 I2V pipeline folder with image_encoder/ + image_processor/: the adapter's image tokens are
    WanImageToVideoPipeline.encode_image's (CLIP's penultimate hidden states), and its conditioning is the
    pipeline's prepare_latents (the VAE latents of the image then black frames, after the first-frame mask)."""
    import numpy as np
    import transformers
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from trt_sora.models.wan import CONFIGS

    root = tmp_path / "pipe"
    (root / "transformer").mkdir(parents=True)  # the transformer's facts; its weights are not read here
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel",
                                                                  **CONFIGS["wan-i2v-tiny"]}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    clip = transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=2, image_size=32, patch_size=16)
    torch.manual_seed(0)
    transformers.CLIPVisionModel(clip).save_pretrained(root / "image_encoder")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor.save_pretrained(root / "image_processor")
    a = get_adapter(str(root))
    encode, desc = a.image_encoder()
    assert desc.startswith("CLIPVisionModel from") and a.image_input == "required"
    y, x = np.mgrid[0:32, 0:48]
    pixels = np.stack([x * 5, y * 7, 255 - x * 5], -1).astype(np.uint8)
    ref = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=a.vae()[0], scheduler=a.scheduler(),
                                  image_processor=processor, transformer=None,
                                  image_encoder=transformers.CLIPVisionModel.from_pretrained(root / "image_encoder"))
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    point = {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6}
    got = a.image_conditioning(point, images=image)
    torch.testing.assert_close(got["encoder_hidden_states_image"], ref.encode_image(Image.fromarray(pixels), "cpu"))
    _, want = ref.prepare_latents(ref.video_processor.preprocess(Image.fromarray(pixels), height=32, width=48), 1,
                                  16, 32, 48, 9, torch.float32, "cpu", None, torch.zeros(1, 16, 3, 4, 6))
    torch.testing.assert_close(got["latent_condition"], want, rtol=1e-5, atol=1e-5)
