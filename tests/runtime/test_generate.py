"""trt_sora.runtime.generate: prompts -> clips over a loaded artifact, against diffusers' WanPipeline;
the clip files; the diffusers drop-in and ready pipeline (the issue's defects)."""
import json

import numpy as np
import pytest

from trt_sora.errors import ConfigError, ShapeError


@pytest.fixture(scope="module")
def runner(checked_run):
    import trt_sora.runtime as rt

    return rt.load(checked_run, backend="ort")


def test_clip_and_metadata_say_how_it_was_made(runner, checked_run):
    import trt_sora.runtime as rt

    (clip,) = rt.generate(runner, "a red kite over a beach", seed=3)
    assert clip.frames.dtype == np.uint8 and clip.frames.shape == (9, 32, 48, 3)  # first bucket's opt point
    m = clip.metadata
    # the run folder knows its sampling settings (export manifest) and its text encoder
    rec = json.loads((checked_run / "export" / "manifest.json").read_text())["results"]["model"]
    assert rec["sampling"] == {"num_steps": 4, "guidance_scale": 5.0, "shift": 3.0} and rec["text_encoder"] == "hash"
    assert m["sampling"] == rec["sampling"] and m["sampling_source"] == "recorded in export/manifest.json"
    assert m["text_encoder"] == "hash" and m["cfg"] == "batched" and m["batch"]["call_batch"] == 2
    assert m["scheduler"] == {"class": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}
    assert "AutoencoderKLWan" in m["decoder"] and m["checked"]["passed"] is True
    assert m["negative_prompt"] is None and m["unconditional"] == "the model's negative prompt ''"
    assert m["latent"] == {"latent_frames": 3, "latent_height": 4, "latent_width": 6}
    json.dumps(m)  # JSON-safe


def test_matches_diffusers_wan_pipeline(runner):
    """Independent reference: diffusers' own WanPipeline loop (split CFG) with the runtime as its
    transformer, the same noise and embeddings, decoded by the same VAE."""
    import torch

    import trt_sora.runtime as rt
    from trt_sora.sampling import gaussian_noise

    (clip,) = rt.generate(runner, ["a cat walks"], seed=11, cfg="split", steps=3, guidance=4.0)
    pipe = rt.diffusers_pipeline(runner)  # the ready pipeline: artifact text encoder, VAE, defaults
    noise = gaussian_noise((1, 16, 3, 4, 6), 11)
    frames = pipe("a cat walks", latents=noise, num_inference_steps=3, guidance_scale=4.0, output_type="np").frames
    assert pipe.transformer.calls == 6  # 3 steps x 2 branches
    ref = np.rint(np.asarray(frames[0]) * 255).astype(np.int16)
    # the pipeline un-normalises latents as x / (1 / std) + mean and rounds (x / 2 + 0.5) * 255: one level
    assert np.abs(ref - clip.frames.astype(np.int16)).max() <= 1
    assert torch.is_tensor(noise)


def test_batching_does_not_change_a_clip(runner):
    import trt_sora.runtime as rt

    both = rt.generate(runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0)  # no CFG: 2 clips a call
    assert [c.metadata["batch"]["clips"] for c in both] == [2, 2] and both[0].metadata["cfg"] == "none"
    alone = rt.generate(runner, ["a dog runs"], seed=6, guidance=1.0)[0]
    assert alone.metadata["batch"]["clips"] == 1
    np.testing.assert_array_equal(alone.latents, both[1].latents)
    np.testing.assert_array_equal(alone.frames, both[1].frames)
    assert not np.array_equal(both[0].frames, both[1].frames)


def test_bad_requests_are_typed(runner):
    import trt_sora.runtime as rt

    with pytest.raises(ShapeError, match="num_frames 10"):
        rt.generate(runner, "x", num_frames=10)
    with pytest.raises(ShapeError, match="no bucket"):
        rt.generate(runner, "x", num_frames=81, height=480, width=832)
    with pytest.raises(ConfigError, match="one seed per prompt"):
        rt.generate(runner, ["a", "b"], seed=[1])
    with pytest.raises(ConfigError, match="steps"):
        rt.generate(runner, "x", steps=0)
    with pytest.raises(ConfigError, match="did you mean 'seed'"):
        rt.ClipRequest.from_dict({"prompt": "x", "seeed": 1})


def test_clip_files(runner, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.runtime import video

    (clip,) = rt.generate(runner, "a red kite", seed=1, steps=2)
    mp4 = video.write_clip(clip.frames, tmp_path / "c.mp4", clip.fps, scale=2)
    back = video.read_video(mp4)
    assert back.shape == (9, 64, 96, 3)
    up = clip.frames.repeat(2, 1).repeat(2, 2).astype(np.float64)
    assert 10 * np.log10(255 ** 2 / np.mean((back - up) ** 2)) > 30  # H.264 at crf 18
    gif = video.read_video(video.write_clip(clip.frames, tmp_path / "c.gif", clip.fps))
    assert gif.shape == clip.frames.shape
    from PIL import Image

    sheet = np.asarray(Image.open(video.write_clip(clip.frames, tmp_path / "c.png", clip.fps)))
    assert sheet.shape == (32, 9 * 48 + 8 * 2, 3)
    np.testing.assert_array_equal(sheet[:, 50:98], clip.frames[1])
    np.testing.assert_array_equal(np.load(video.write_clip(clip.frames, tmp_path / "c.npy", clip.fps)), clip.frames)
    with pytest.raises(ConfigError, match="unknown suffix"):
        video.write_clip(clip.frames, tmp_path / "c.avi", clip.fps)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.gif", "c.mp4", "c.npy", "c.png"]  # no temp files


def test_drop_in_in_stock_wan_pipeline_from_a_saved_checkpoint(runner, tmp_path):
    """A tiny saved WanPipeline (UMT5 text encoder + tokenizer, VAE, wan-tiny's transformer weights):
    ``WanPipeline.from_pretrained(root, transformer=rt.as_diffusers_transformer(runner))``, unchanged."""
    import torch
    from diffusers import WanPipeline

    import trt_sora.runtime as rt
    from trt_sora.config import load_recipe
    from trt_sora.metrics import frame_metrics

    root = _save_tiny_pipeline(tmp_path / "pipe")
    kw = dict(height=32, width=48, num_frames=9, num_inference_steps=4, guidance_scale=5.0, output_type="np",
              max_sequence_length=16)
    want = WanPipeline.from_pretrained(root)("a red kite over a beach", generator=torch.Generator().manual_seed(3),
                                             **kw).frames
    pipe = WanPipeline.from_pretrained(root, transformer=rt.as_diffusers_transformer(runner))
    got = pipe("a red kite over a beach", generator=torch.Generator().manual_seed(3), **kw).frames
    assert pipe.transformer.calls == 8
    to = lambda v: np.transpose(np.asarray(v), (0, 4, 1, 2, 3)) * 2 - 1  # noqa: E731
    assert frame_metrics(to(want), to(got))["worst_psnr_db"] >= load_recipe("rtx4090-fp8").parity.frames.min_psnr_db


def _save_tiny_pipeline(root):
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from trt_sora.models import get_adapter

    adapter = get_adapter("wan-tiny")
    words = "<pad> </s> <unk> a red kite over beach cat dog walks runs".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    te = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=adapter.text_dim, d_kv=16, d_ff=64, num_layers=1,
                                     num_heads=2, relative_attention_num_buckets=8, pad_token_id=0,
                                     eos_token_id=1)).eval()
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    tr = WanTransformer3DModel(**dict(adapter.spec.config))
    tr.load_state_dict(adapter.load("fp32", "cpu").state_dict())  # the weights the artifact was exported from
    pipe = WanPipeline(tokenizer=fast, text_encoder=te, vae=vae, scheduler=adapter.scheduler(), transformer=tr)
    pipe.save_pretrained(root)
    return root


def test_moving_shapes_sampler_runs_the_drop_in():
    """The issue's defect: ``moving_shapes.sample`` with the runtime drop-in died with a bare
    StopIteration (it read the dtype from ``next(transformer.parameters())``). Same clip as the model."""
    import torch

    from trt_sora.models import get_adapter
    from trt_sora.models.moving_shapes import sample as ms
    from trt_sora.runners.torch_runner import TorchRunner
    from trt_sora.runtime import as_diffusers_transformer

    adapter = get_adapter("wan-shapes")
    model = adapter.load("fp32", "cpu")
    runner = TorchRunner(adapter, model=model).activate()
    runner.model_config = dict(adapter.spec.config)
    emb = torch.randn(1, 16, 384, generator=torch.Generator().manual_seed(0))
    cfg = ms.SampleConfig(steps=1, seed=4)
    got = ms.sample(as_diffusers_transformer(runner), emb, cfg)
    want = ms.sample(model, emb, cfg)
    assert got.shape == (1, 3, 9, 32, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_ready_pipeline_for_the_default_model_needs_no_workarounds():
    """wan-shapes in a WanPipeline: pixel space (no VAE, scale 1), MiniLM text states (not UMT5),
    16 text tokens, the zero embedding as its unconditional branch. The adapter's pipeline takes a
    plain caption and gives the model card's sampler's clip."""
    import torch

    from trt_sora.models import get_adapter
    from trt_sora.models.moving_shapes import sample as ms
    from trt_sora.models.moving_shapes import text
    from trt_sora.sampling import gaussian_noise

    adapter = get_adapter("wan-shapes")
    model = ms.load_transformer()
    caption = "a red circle moves up over a plain black background"
    pipe = adapter.diffusers_pipeline(model, encode=adapter.text_encoder(), scheduler=adapter.scheduler(),
                                      defaults={"num_frames": 9, "height": 32, "width": 32, "max_sequence_length": 16,
                                                "num_inference_steps": 1, "guidance_scale": 4.0})
    noise = gaussian_noise((1, 3, 9, 32, 32), 5)
    got = pipe(caption, latents=noise, output_type="pt").frames  # [B, F, C, H, W] in [0, 1]
    want = ms.sample(model, text.encode([caption]), ms.SampleConfig(steps=1, seed=5))  # [B, C, F, H, W] in [-1, 1]
    torch.testing.assert_close(got.permute(0, 2, 1, 3, 4) * 2 - 1, want, rtol=0, atol=2e-5)


def test_a_prompt_longer_than_the_text_dims_is_refused_or_cut_on_request(runner):
    """The hash encoder keeps ``text_len`` words: one word more is refused naming the limit; with
    ``truncate`` the clip is the clip of the first ``text_len`` words, and its metadata says so."""
    import trt_sora.runtime as rt
    from trt_sora.runtime.generate import ClipRequest, generator_for

    gen = generator_for(runner)
    limit = gen.default_point["text_len"]
    words = [f"w{i}" for i in range(limit + 1)]
    assert gen.resolve(ClipRequest(" ".join(words[:-1]))).truncated == {}
    with pytest.raises(ConfigError, match=rf"prompt has {limit + 1} tokens; hash's text_len at this size is "
                                          rf"{limit}: shorten it, or ask to cut it"):
        rt.generate(runner, " ".join(words), steps=1)
    with pytest.raises(ConfigError, match=rf"negative_prompt has {limit + 1} tokens"):
        gen.resolve(ClipRequest("a cat", negative_prompt=" ".join(words)))
    cut = rt.generate(runner, " ".join(words), steps=2, seed=4, truncate=True)[0]
    kept = rt.generate(runner, " ".join(words[:-1]), steps=2, seed=4)[0]
    assert cut.metadata["truncated"] == {"text_len": [limit + 1, limit]} and "truncated" not in kept.metadata
    np.testing.assert_array_equal(cut.frames, kept.frames)


def test_token_counts_are_what_the_encoders_keep():
    """Each encoder's count is the number of positions it fills when nothing is cut (HunyuanVideo 1.5's
    stand-in: both streams, read from its masks)."""
    from trt_sora.models.hunyuan import HunyuanTextEncoder
    from trt_sora.models.text import HashTextEncoder

    prompts = ["a cat, walking.", 'a sign saying "OPEN 24h" at night', "x"]
    h = HashTextEncoder(8)
    for p, n in zip(prompts, h.token_counts(prompts)):
        assert int((h([p], 32).abs().sum(-1) > 0).sum()) == n["text_len"]
    hy = HunyuanTextEncoder(8, 4)
    out = hy(prompts, 32, 32)
    for i, n in enumerate(hy.token_counts(prompts)):
        assert int(out["encoder_attention_mask_2"][i].sum()) == n["text_len_2"]
        assert n["text_len"] >= int(out["encoder_attention_mask"][i].sum())
    assert [n["text_len_2"] for n in hy.token_counts(prompts)] == [0, 9, 0]


def test_on_frames_gets_each_clips_frames_group_by_group(runner):
    """Two clips in one call group (no CFG): each clip's frames come as Wan's VAE decodes them (1 pixel
    frame, then 4 a latent frame), named by the request's index, before the next clip's; together
    they are the clip."""
    import trt_sora.runtime as rt

    seen = []
    clips = rt.generate(runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0,
                        on_frames=lambda i, f: seen.append((i, f)))
    assert clips[0].metadata["batch"]["clips"] == 2
    assert [(i, f.shape[0]) for i, f in seen] == [(0, 1), (0, 4), (0, 4), (1, 1), (1, 4), (1, 4)]
    assert all(f.dtype == np.uint8 for _, f in seen)
    for i, clip in enumerate(clips):
        np.testing.assert_array_equal(np.concatenate([f for j, f in seen if j == i]), clip.frames)


def test_an_mp4_is_encoded_while_its_clip_decodes(runner, tmp_path, monkeypatch):
    """``out=``: each clip's groups reach ffmpeg as they are decoded (the writer is fed before the
    next group is made), the file equals the whole-clip writer's on the returned frames, the metadata
    names the overlapped stage; another format is written after the clip."""
    import trt_sora.runtime as rt
    from trt_sora.runtime import video

    events = []
    feed = video.Mp4Writer.write
    monkeypatch.setattr(video.Mp4Writer, "write", lambda w, f: (events.append(("mp4", w.path.name, len(f))),
                                                                feed(w, f))[1])
    clips = rt.generate(runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0, scale=2,
                        out=[tmp_path / "a.mp4", tmp_path / "b.gif"],
                        on_frames=lambda i, f: events.append(("group", i, len(f))))
    assert events[:7] == [("mp4", "a.mp4", 1), ("group", 0, 1), ("mp4", "a.mp4", 4), ("group", 0, 4),
                          ("mp4", "a.mp4", 4), ("group", 0, 4), ("group", 1, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4", "b.gif"]  # no temp files
    video.write_mp4(clips[0].frames, tmp_path / "whole.mp4", clips[0].fps, scale=2)
    np.testing.assert_array_equal(video.read_video(tmp_path / "a.mp4"), video.read_video(tmp_path / "whole.mp4"))
    assert video.read_video(tmp_path / "b.gif").shape == (9, 64, 96, 3)
    sa, sb = clips[0].metadata["seconds"], clips[1].metadata["seconds"]
    assert "decode" not in sa and sa["decode_and_encode"] >= sa["encode_finish"] >= 0
    assert f"preset {video.DEFAULT_PRESET}" in clips[0].metadata["tail"] and "tail" not in clips[1].metadata
    assert sb["decode"] > 0 and sb["write"] > 0 and sb["total"] > sb["decode"] + sb["write"]


def test_each_request_is_resolved_once_when_written_to_files(runner, tmp_path, monkeypatch):
    """``out=``: an MP4's frame count comes from the resolution the run makes (prompts tokenised once a
    clip), for streamed and written-after clips alike."""
    import collections

    import trt_sora.runtime as rt
    from trt_sora.runtime.generate import Generator

    calls = collections.Counter()
    resolve = Generator.resolve
    monkeypatch.setattr(Generator, "resolve", lambda self, req: (calls.update([req.prompt]), resolve(self, req))[1])
    clips = rt.generate(runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0,
                        out=[tmp_path / "a.mp4", tmp_path / "b.gif"])
    assert calls == {"a cat walks": 1, "a dog runs": 1}
    assert clips[0].frames.shape[0] == 9 and "decode_and_encode" in clips[0].metadata["seconds"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4", "b.gif"]


def test_a_decode_that_fails_leaves_no_mp4(runner, tmp_path):
    import trt_sora.runtime as rt

    def fail(i, frames):
        if frames.shape[0] == 4:
            raise RuntimeError("the decoder ran out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        rt.generate(runner, "a cat walks", seed=5, guidance=1.0, out=tmp_path / "a.mp4", on_frames=fail)
    assert list(tmp_path.iterdir()) == []


def test_the_decoder_runs_where_and_in_the_dtype_it_is_asked(runner):
    """A GPU generator decodes in bf16 on its device; the same copy-on-place path on the CPU: a bf16
    copy of the VAE, the fp32 one every stage shares untouched, frames within bf16's error of fp32."""
    import torch

    from trt_sora.metrics import compare
    from trt_sora.runtime.generate import generator_for

    adapter = generator_for(runner).adapter
    z = torch.randn(1, adapter.latent_channels, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    ref, desc = adapter.decoder()
    low, low_desc = adapter.decoder("cpu", torch.bfloat16)
    a, b = ref(z), low(z)
    assert next(adapter.vae()[0].parameters()).dtype == torch.float32 and "bfloat16 on cpu" in low_desc
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    m = compare(a, b, peak=2.0)
    assert 25.0 <= m["psnr_db"] < 200 and m["cosine"] > 0.99, m  # bf16, so not the same bits
    assert generator_for(runner).device == "cpu" and runner.device == "cpu"


@pytest.mark.gpu
def test_a_gpu_runner_encodes_samples_and_decodes_on_the_gpu(checked_run, runner):
    """torch on CUDA: the decoder is the bf16 copy on the GPU, and the clip agrees with the CPU one
    (ONNX Runtime, fp32 decode) to within bf16 numerics."""
    import torch

    import trt_sora.runtime as rt
    from trt_sora.metrics import compare
    from trt_sora.runtime.generate import generator_for

    gpu = rt.load(checked_run, backend="torch", device="cuda")
    clip = rt.generate(gpu, "a red kite", seed=2, steps=2)[0]
    gen = generator_for(gpu)
    assert gen.device.startswith("cuda") and "bfloat16 on cuda" in gen.decoder_description
    assert clip.metadata["decoder"] == gen.decoder_description and torch.cuda.max_memory_allocated() > 0
    cpu = rt.generate(runner, "a red kite", seed=2, steps=2)[0]
    m = compare(cpu.frames.astype("float32"), clip.frames.astype("float32"), peak=255.0)
    assert m["psnr_db"] >= 25.0, m
