"""HunyuanVideo 1.5 (the second family, trt_sora/models/hunyuan.py): the export forward against
diffusers' own forward (masks, the ByT5 stream, image tokens), the text conditioning's masks, real
sizes on the meta device, and every stage on the tiny config - export parity in ONNX Runtime at 3
shapes that differ in every dynamic dim (its own ``text_len_2`` included), calibration, Q/DQ, a real
TensorRT-RTX FP8 build, parity."""
from __future__ import annotations

import json

import pytest
import torch
from run_folders import HUNYUAN_POINTS as POINTS  # three points that differ in every dim (text_len_2 too)
from run_folders import assert_every_stage_passed

from trt_sora.errors import ModelError
from trt_sora.models import get_adapter, list_models, resolve


@pytest.fixture(scope="module")
def tiny():
    a = get_adapter("hunyuan-tiny")
    return a, a.load()


def _stock(adapter):
    """The same weights with diffusers' own attention processors (the reference forward)."""
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    m = adapter.load()
    m.set_attn_processor({n: AttnProcessor2_0() if ".token_refiner." in f".{n}" else HunyuanVideo15AttnProcessor2_0()
                          for n in m.attn_processors})
    return m


@pytest.mark.parametrize("point", POINTS[:2])
def test_export_forward_matches_diffusers(tiny, point):
    """diffusers reorders each sample's valid text tokens and masks queries and keys; ours masks only
    the keys of one joint sequence. Same video output, with padding in both text streams (the first
    sample's ByT5 stream fully masked) and with image tokens present or absent."""
    a, m = tiny
    ref = _stock(a)
    x = a.example_inputs(point, seed=1)
    assert x["encoder_attention_mask"].sum(1).min() >= 1 and x["encoder_attention_mask_2"][0].sum() == 0
    ours = a.forward(m, x)
    theirs = ref(**x, return_dict=False)[0]
    assert ours.shape == (point["batch"], a.latent_channels, *x["hidden_states"].shape[2:])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    xi = {**x, "image_embeds": torch.randn_like(x["image_embeds"])}
    with_image = a.forward(m, xi)
    torch.testing.assert_close(with_image, ref(**xi, return_dict=False)[0], rtol=1e-5, atol=1e-5)
    assert (with_image - ours).abs().max() > 1e-3  # the image tokens are read when given
    # padded text tokens do not matter (masked), valid ones do
    xp = dict(x)
    xp["encoder_hidden_states"] = x["encoder_hidden_states"] + 5.0 * (1 - x["encoder_attention_mask"])[..., None]
    torch.testing.assert_close(a.forward(m, xp), ours, rtol=1e-5, atol=1e-5)


def test_bf16_forward_follows_the_pipeline(tiny):
    """In bf16 the fp32 graph input ``timestep`` is embedded in bf16, as diffusers' pipeline passes it
    (an fp32 timestep promoted the text stream to fp32 and the attention refused mixed dtypes)."""
    a, m = tiny
    x = a.example_inputs(POINTS[0], seed=1, dtype="bf16")
    assert x["timestep"].dtype == torch.float32 and x["hidden_states"].dtype == torch.bfloat16
    ref = _stock(a).to(torch.bfloat16)
    ours = a.forward(a.load("bf16"), x)
    theirs = ref(**{**x, "timestep": x["timestep"].to(torch.bfloat16)}, return_dict=False)[0]
    cos = torch.nn.functional.cosine_similarity
    assert cos(ours.float().flatten(), theirs.float().flatten(), dim=0) > 0.9999
    full = a.forward(m, {k: v.float() for k, v in x.items()})
    assert cos(ours.float().flatten(), full.flatten(), dim=0) > 0.999


def test_text_encoder_masks_follow_the_pipeline(tiny):
    a, _ = tiny
    enc = a.text_encoder()
    out = enc(['a cat holding a sign that says "hello"', "a dog"], 6, 8)
    assert out["encoder_attention_mask"].sum(1).tolist() == [6, 2]  # words, capped at text_len
    assert out["encoder_attention_mask_2"].sum(1).tolist() == [6, 0]  # quoted "hello" + 1; none quoted
    assert out["encoder_hidden_states_2"][1].abs().sum() == 0
    with pytest.raises(ModelError, match="not wired"):
        a.text_encoder("qwen")
    cond = a.image_conditioning({"batch": 2, "latent_frames": 2, "latent_height": 4, "latent_width": 4})
    assert cond["latent_condition"].shape == (2, a.in_channels - a.latent_channels, 2, 4, 4)
    assert not cond["latent_condition"].any() and not cond["image_embeds"].any()


def test_scheduler_runs_the_pipelines_sigmas():
    """HunyuanVideo15Pipeline passes sigmas linspace(1, 0, n + 1)[:-1], shifted: s' = k s / (1 + (k - 1) s)."""
    import numpy as np

    a = get_adapter("hunyuanvideo-1.5-480p-t2v")
    s = a.scheduler()
    s.set_timesteps(4)
    raw = np.linspace(1.0, 0.0, 5)[:-1]
    k = a.sampling.shift
    np.testing.assert_allclose(s.timesteps.numpy(), 1000 * k * raw / (1 + (k - 1) * raw), rtol=1e-5)
    assert (a.sampling.num_steps, a.sampling.guidance_scale, k) == (50, 6.0, 5.0)
    assert get_adapter("hunyuanvideo-1.5-720p-t2v").sampling.shift == 9.0


def test_real_size_on_meta():
    """The 480p release transformer: 8.3B parameters, 54 dual-stream blocks of 14 linears each."""
    a = get_adapter("hunyuanvideo-1.5-480p-t2v")
    with torch.device("meta"):
        m = a._construct()
    assert 8.2e9 < sum(p.numel() for p in m.parameters()) < 8.4e9
    assert len(m.transformer_blocks) == 54
    assert sum(isinstance(x, torch.nn.Linear) for x in m.transformer_blocks[0].modules()) == 14
    assert sum(isinstance(x, torch.nn.Linear) for x in m.modules()) == 54 * 14 + 28
    assert set(a.input_names) == set(a.input_dims()) - {"sample"}
    assert a.with_family_dims({"batch": 1})["text_len_2"] == 256


def test_registry_and_checkpoint_folders(tmp_path):
    assert {"hunyuan-tiny", "hunyuanvideo-1.5-480p-t2v"} <= set(list_models())
    folder = tmp_path / "hv" / "transformer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Transformer3DModel",
                                                     "target_size": 960, "in_channels": 65}))
    with pytest.raises(ModelError, match="no weight files"):
        resolve(str(tmp_path / "hv"))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    spec = resolve(str(tmp_path / "hv"))
    assert spec.family == "hunyuan" and spec.defaults["shift"] == 9.0 and spec.path == str(folder)


# -- every stage on the tiny config -----------------------------------------------------------------
@pytest.mark.trt_rtx
def test_every_stage_on_hunyuan_tiny(hunyuan_run):
    pipe, _ = hunyuan_run
    # 2 joint attentions (one per dual-stream block) + the refiner's self-attention
    exp = assert_every_stage_passed(hunyuan_run, POINTS, attentions=3)
    assert exp["dynamic"]["text_len_2"] == [1, 8, 16]
    sites = json.loads((pipe.folder("quantize") / "qdq_map.json").read_text())["sites"]
    fp8 = {s["site"] for s in sites if s["kind"] == "linear" and not s["excluded"] and "fused" not in s["reason"]}
    fp8 |= {s["site"] for s in sites if s["site"].endswith(("to_qkv", "to_added_qkv")) and not s["excluded"]}
    per_block = {"attn.to_qkv", "attn.to_added_qkv", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"}
    text_out = {"attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2"}  # dead in the last block
    assert fp8 == {f"transformer_blocks.0.{k}" for k in per_block | text_out} | \
        {f"transformer_blocks.1.{k}" for k in per_block}


@pytest.mark.trt_rtx
def test_hunyuan_tiny_serves_what_passed(hunyuan_run):
    import numpy as np

    import trt_sora.runtime as rt

    pipe, _ = hunyuan_run
    r = rt.load(pipe.run_dir, backend="ort")
    feeds = r.example_feeds(r.buckets[0].point("opt"))
    assert feeds["encoder_hidden_states_2"].shape[1] == 8
    out = r.infer(feeds)["sample"]
    assert out.shape[1] == pipe.adapter.latent_channels and np.isfinite(out).all()
    bad = dict(feeds)
    bad["encoder_attention_mask_2"] = bad["encoder_attention_mask_2"][:, :3]  # disagrees with its stream
    with pytest.raises(rt.InputError):
        r.infer(bad)


def _decode_errors(adapter, z, device=None, dtype=None):
    """``(grouped, one_shot)``: the largest error of the frame groups (on ``device`` in ``dtype``)
    and of diffusers' one-shot ``decode`` there, each against the one-shot decode in float64 on the CPU."""
    import copy

    vae, _ = adapter.vae()
    scale = float(vae.config.scaling_factor)
    parts = list(adapter.frame_decoder(device, dtype)[0](z))
    here, _ = adapter.vae_on(device, dtype)
    with torch.inference_mode():
        one_shot = here.decode((z / scale).to(device=device, dtype=dtype), return_dict=False)[0]
        exact = copy.deepcopy(vae).double().decode(z.double() / scale, return_dict=False)[0].clamp(-1, 1)
    grouped = torch.cat(parts, dim=2).cpu().double()
    one_shot = one_shot.cpu().double().clamp(-1, 1)
    return parts, (grouped - exact).abs().max().item(), (one_shot - exact).abs().max().item()


@pytest.mark.parametrize("latent", [(4, 2, 3), (6, 1, 1), (3, 4, 4)])
def test_frame_groups_are_the_one_shot_decode_within_its_rounding(tiny, latent):
    """Latent frame by latent frame (1 pixel frame, then 4), the causal convolutions carrying the
    frames before: the one-shot decode's frames, up to fp32 rounding. The groups run the same fp32
    operations at other sizes, where ATen picks another convolution algorithm or vector tail, so
    the bits may differ; each decode's own rounding error (against float64) is the scale, and the
    groups may be off by no more than 4 times the one-shot's."""
    adapter = tiny[0]
    z = torch.randn((1, adapter.latent_channels, *latent), generator=torch.Generator().manual_seed(0))
    parts, grouped, one_shot = _decode_errors(adapter, z)
    assert [p.shape[2] for p in parts] == [1] + [4] * (latent[0] - 1)
    assert 0 < one_shot < 1e-4 and grouped <= 4 * one_shot, (grouped, one_shot)
    assert torch.equal(adapter.decoder()[0](z), torch.cat(parts, dim=2))


@pytest.mark.gpu
def test_frame_groups_on_the_gpu_are_the_one_shot_decode_within_its_rounding(tiny):
    """The served decode (bf16 on CUDA): cuDNN may pick other algorithms for a group than for the
    clip, so the groups' error against float64 may be at most 4 times the one-shot bf16 decode's."""
    adapter = tiny[0]
    z = torch.randn((1, adapter.latent_channels, 5, 4, 6), generator=torch.Generator().manual_seed(0))
    parts, grouped, one_shot = _decode_errors(adapter, z, "cuda", torch.bfloat16)
    assert [p.shape[2] for p in parts] == [1, 4, 4, 4, 4]
    assert 0 < one_shot and grouped <= 4 * one_shot, (grouped, one_shot)
