"""Wan adapter: registry, named configs on the meta device, loading local diffusers checkpoints."""
import json

import pytest
import torch

from trt_sora.errors import ModelError
from trt_sora.models import get_adapter, list_models, resolve


def test_registry_names():
    assert {"wan-tiny", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b"} <= set(list_models())


@pytest.mark.parametrize("name,params", [("wan2.1-t2v-1.3b", 1.3e9), ("wan2.1-t2v-14b", 14e9)])
def test_real_architectures_on_meta(name, params):
    n = get_adapter(name).num_params()  # meta device: nothing allocated
    assert 0.9 * params < n < 1.15 * params


def test_tiny_forward_shapes_and_determinism(tiny_adapter):
    m1, m2 = tiny_adapter.load(), tiny_adapter.load()
    point = {"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 5}
    x = tiny_adapter.example_inputs(point)
    assert x["timestep"].dtype == torch.float32 and x["hidden_states"].shape == (2, 16, 3, 4, 6)
    y1, y2 = tiny_adapter.forward(m1, x), tiny_adapter.forward(m2, x)
    assert y1.shape == x["hidden_states"].shape
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)  # seeded random init


def test_export_processor_matches_diffusers(tiny_adapter, tiny_model):
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    from trt_sora.models.wan import WanExportAttnProcessor

    x = tiny_adapter.example_inputs({"batch": 1, "latent_frames": 2, "latent_height": 4, "latent_width": 4,
                                     "text_len": 3})
    ours = tiny_adapter.forward(tiny_model, x)
    tiny_model.set_attn_processor(WanAttnProcessor())
    try:
        theirs = tiny_adapter.forward(tiny_model, x)
    finally:
        tiny_model.set_attn_processor(WanExportAttnProcessor())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_keep_fp32_modules_in_half(tiny_adapter):
    m = tiny_adapter.load("bf16")
    dtypes = {n: p.dtype for n, p in m.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32


@pytest.mark.parametrize("layout", ["transformer", "pipeline"])
def test_load_from_checkpoint_folder_and_export(tmp_path, tiny_adapter, tiny_model, layout, tiny_points):
    from trt_sora.config import ExportConfig
    from trt_sora.export import export_onnx

    root = tmp_path / "ckpt"
    target = root / "transformer" if layout == "pipeline" else root
    tiny_model.save_pretrained(target)
    if layout == "pipeline":
        (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    adapter = get_adapter(str(root))
    assert adapter.spec.source == "checkpoint" and adapter.spec.path == str(target)
    loaded = adapter.load("fp32")
    x = tiny_adapter.example_inputs(tiny_points[0])
    torch.testing.assert_close(adapter.forward(loaded, x), tiny_adapter.forward(tiny_model, x))
    if layout == "transformer":
        res = export_onnx(str(root), ExportConfig(verify_points=tiny_points[:2]), tmp_path / "exp")
        assert res.manifest["results"]["model"]["source"] == "checkpoint"
        assert all(p["cosine"] >= 0.99999 for p in res.parity)


def test_bad_model_refs(tmp_path):
    with pytest.raises(ModelError, match="did you mean 'wan-tiny'"):
        resolve("wan-tiny2")
    (tmp_path / "notackpt").mkdir()
    (tmp_path / "notackpt" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ModelError, match="not a diffusers checkpoint"):
        resolve(str(tmp_path / "notackpt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="not a diffusers checkpoint"):
        resolve(str(tmp_path / "empty"))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    with pytest.raises(ModelError, match="no weight files"):
        resolve(str(tmp_path / "noweights"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_random_init_is_the_same_model_on_every_device(tiny_adapter, dtype):
    """A GPU backend checked against a CPU reference must run the same weights: random-init
    configs draw their numbers on the CPU whatever the target device."""
    cpu = dict(tiny_adapter.load(dtype, "cpu").state_dict())
    gpu = tiny_adapter.load(dtype, "cuda").state_dict()
    assert cpu.keys() == gpu.keys()
    for k, v in gpu.items():
        assert v.is_cuda and torch.equal(v.cpu(), cpu[k]), k


@pytest.mark.parametrize("name, groups", [("wan-tiny", [1, 4, 4, 4]), ("wan-ti2v-tiny", [1, 4, 4, 4]),
                                          ("wan-shapes", [1, 1, 1, 1])])
def test_frame_groups_are_the_one_shot_decode_bit_for_bit(name, groups):
    """Latent frame by latent frame (1 pixel frame, then 4; pixel-space: 1 each), concatenated: exactly
    diffusers' AutoencoderKLWan.decode of the un-normalised latents (fp32 CPU), the seeded tiny VAEs
    of Wan 2.1 and Wan 2.2 (2x2 pixel patches)."""
    adapter = get_adapter(name)
    z = torch.randn((1, adapter.latent_channels, len(groups), 4, 6), generator=torch.Generator().manual_seed(0))
    decode_groups, _ = adapter.frame_decoder()
    parts = list(decode_groups(z))
    assert [p.shape[2] for p in parts] == groups
    vae, _ = adapter.vae()
    if vae is None:
        want = z.clamp(-1, 1)
    else:
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        with torch.inference_mode():
            want = vae.decode(z * std + mean, return_dict=False)[0]
    assert torch.equal(torch.cat(parts, dim=2), want)
    assert torch.equal(adapter.decoder()[0](z), want)


@pytest.mark.gpu
def test_frame_groups_on_the_gpu_are_the_one_shot_decode():
    """The served decode (bf16 on CUDA): the same calls in the same order as vae.decode, so the same
    bits."""
    adapter = get_adapter("wan-tiny")
    z = torch.randn((1, 16, 5, 8, 12), generator=torch.Generator().manual_seed(0))
    decode_groups, desc = adapter.frame_decoder("cuda", torch.bfloat16)
    got = torch.cat(list(decode_groups(z)), dim=2)
    vae, _ = adapter.vae_on("cuda", torch.bfloat16)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).cuda()
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).cuda()
    with torch.inference_mode():
        want = vae.decode((z.cuda() * std + mean).to(torch.bfloat16), return_dict=False)[0].float()
    assert "bfloat16 on cuda" in desc and got.shape[2] == 17
    assert torch.equal(got, want)
