"""generate / batch / serve on the new families' tiny run folders (tests/run_folders.py): Wan 2.2 A14B
(two experts), Wan 2.1 I2V, Wan 2.2 TI2V and HunyuanVideo 1.5.

Every clip comes from the run folder's checked candidate (the FP8 Q/DQ graph in ONNX Runtime,
through ``trt_sora.runtime.generate``) and is compared with the family's own diffusers pipeline
(``WanPipeline``, ``WanImageToVideoPipeline``, ``HunyuanVideo15Pipeline``) driving the PyTorch fp32
model(s) from the same noise and embeddings: another sampler, another CFG, another expert switch,
another image encoding (the pipeline's VAE path and mask) and, for HunyuanVideo, diffusers' own
attention processors instead of the export rewrites. The only piece not diffusers' is what a
random-weight model has no real weights for: the hash text encoder and the seeded stand-in for
CLIP's image tokens, fed to both sides.

The bar, MIN_PSNR_DB = 40 dB on the worst uint8 frame (peak 255): rounding both clips to uint8
alone caps the PSNR near 56 dB (two roundings, error variance 1/6 level^2), and FP8 Q/DQ costs
the rest (measured on the CPU: pair 56 dB at its 6 steps; at the 2 steps below I2V 46, TI2V 52
text / 55 image, HunyuanVideo 50 dB). A clip made wrongly lands below it: the pair with its
experts swapped measures 29 dB, I2V with another image 34 dB, TI2V with another image 22 dB,
HunyuanVideo with the quoted (ByT5) text dropped 37 dB. The torch backend through ``generate``
matches the same pipelines to one grey level (the conditioning code paths agree; only the
backend's arithmetic differs).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_sora.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.trt_rtx

MIN_PSNR_DB = 40.0
PROMPT = "a cat walks"
STEPS = 2  # of the one-model families (their run folders sample 4); the pair runs its 6 to cross its boundary


def _worst_psnr(ref01, frames) -> float:
    """Worst-frame PSNR (peak 255) of uint8 ``frames`` against a diffusers ``output_type="np"`` clip."""
    from trt_sora.serve.quality import compare_clips

    return compare_clips(np.rint(np.asarray(ref01) * 255).astype(np.uint8), frames)["worst_psnr_db"]


_RUNNERS: dict = {}


def _load(run_fixture, backend="ort"):
    """The run folder loaded on ``backend`` (one per module: ONNX Runtime sessions take a while to build)."""
    import trt_sora.runtime as rt

    key = (str(run_fixture[0].run_dir), backend)
    if key not in _RUNNERS:
        _RUNNERS[key] = rt.load(run_fixture[0].run_dir, backend=backend, warmup=False)
    return _RUNNERS[key]


def _image(h, w) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // w, y * 255 // h, 255 - x * 255 // w], -1).astype(np.uint8)


def _embeds(adapter, text_len=16):
    enc = adapter.text_encoder()
    return {"prompt_embeds": enc([PROMPT], text_len).float(),
            "negative_prompt_embeds": adapter.negative_conditioning(enc, 1, {"text_len": text_len})[
                "encoder_hidden_states"]}


def _noise(adapter, frames_lat, h_lat, w_lat, seed):
    from trt_sora.sampling import gaussian_noise

    return gaussian_noise((1, adapter.latent_channels, frames_lat, h_lat, w_lat), seed)


# -- Wan 2.2 A14B: the expert pair ------------------------------------------------------------------
def _wan_pipeline(transformer, vae, scheduler, **kw):
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer, **kw)


def test_pair_switches_experts_at_the_boundary_and_matches_wan_pipeline(pair_run):
    from diffusers import FlowMatchEulerDiscreteScheduler

    import trt_sora.runtime as rt

    pipe, _ = pair_run
    runner = rt.load(pipe.run_dir, backend="ort", warmup=False)  # its own: the expert runners get wrapped
    served = {}  # what each expert's runner really executed: the timesteps of its calls
    for e, sub in runner._runners[0].runners.items():
        def record(feeds, _infer=sub.infer, _e=e, **kw):
            served.setdefault(_e, []).append(float(np.asarray(feeds["timestep"]).max()))
            return _infer(feeds, **kw)
        sub.infer = record
    (clip,) = rt.generate(runner, PROMPT, seed=3)
    assert clip.frames.shape == (9, 32, 48, 3) and clip.metadata["sampling"]["num_steps"] == 6

    # the reference: diffusers' WanPipeline with the two PyTorch experts, Wan 2.2's release boundary 0.875 and
    # guidance 4.0 / 3.0; forward hooks record which transformer it ran at which timestep
    a = pipe.adapter
    experts = {e: a.expert(e).load() for e in ("high", "low")}
    ran = []
    for e, m in experts.items():
        m.register_forward_pre_hook(lambda _m, _a, kw, _e=e: ran.append((_e, float(kw["timestep"].flatten()[0]))),
                                    with_kwargs=True)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=12.0)
    call = dict(latents=_noise(a, 3, 4, 6, 3), num_inference_steps=6, guidance_scale=4.0, guidance_scale_2=3.0,
                num_frames=9, height=32, width=48, output_type="np", **_embeds(a))
    ref = _wan_pipeline(experts["high"], a.vae()[0], sched, transformer_2=experts["low"],
                        boundary_ratio=0.875)(**call).frames[0]
    steps = sorted({t for _, t in ran}, reverse=True)  # one timestep per step, two calls (cond, uncond) each
    want = {e: [steps.index(t) for x, t in ran[::2] if x == e] for e in ("high", "low")}
    assert want["high"] and want["low"] and max(want["high"]) + 1 == min(want["low"])  # it does switch, once
    assert clip.metadata["experts"] == {"boundary_timestep": 875.0, "steps": want}
    for e in ("high", "low"):  # both CFG branches in one call: one runner call per step
        np.testing.assert_allclose(served[e], [steps[i] for i in want[e]], rtol=1e-6)
    assert _worst_psnr(ref, clip.frames) >= MIN_PSNR_DB
    swapped = _wan_pipeline(experts["low"], a.vae()[0], sched, transformer_2=experts["high"],
                            boundary_ratio=0.875)(**call).frames[0]
    assert _worst_psnr(swapped, clip.frames) < MIN_PSNR_DB  # the bar tells the right switch from a wrong one
    # the ready pipeline over the run folder (#15's helper): the pair's boundary and low-noise guidance
    ready = rt.diffusers_pipeline(runner)(PROMPT, latents=call["latents"], output_type="np").frames[0]
    assert np.abs(np.rint(ready * 255) - clip.frames).max() <= 1


# -- image-to-video ----------------------------------------------------------------------------------
def _i2v_pipeline(adapter, model, **kw):
    """diffusers' WanImageToVideoPipeline whose CLIP step is the family's image-token encoder (a random-
    weight model has no CLIP); the VAE encoding, mask and concatenation are the pipeline's."""
    from diffusers import WanImageToVideoPipeline

    class Reference(WanImageToVideoPipeline):
        def encode_image(self, image, device=None):
            x = torch.from_numpy(np.asarray(image, np.float32)).permute(2, 0, 1)[None] / 127.5 - 1
            return adapter.image_encoder()[0](x)

    return Reference(tokenizer=None, text_encoder=None, vae=adapter.vae()[0], scheduler=adapter.scheduler(),
                     transformer=model, **kw)


def test_i2v_needs_its_image_and_matches_the_i2v_pipeline(i2v_run, tmp_path):
    from PIL import Image

    import trt_sora.runtime as rt

    pipe, _ = i2v_run
    runner = _load(i2v_run)
    with pytest.raises(ConfigError, match="image-to-video: give the conditioning image"):
        rt.generate(runner, PROMPT)
    Image.fromarray(_image(64, 96)).save(tmp_path / "in.png")  # resized to the clip's 32x48, as diffusers does
    (clip,) = rt.generate(runner, PROMPT, seed=3, steps=STEPS, image=tmp_path / "in.png")
    assert clip.frames.shape == (9, 32, 48, 3)
    assert clip.metadata["image"]["source"] == str(tmp_path / "in.png")
    a = pipe.adapter
    image = Image.open(tmp_path / "in.png").convert("RGB").resize((48, 32), Image.LANCZOS)
    call = dict(latents=_noise(a, 3, 4, 6, 3), num_inference_steps=STEPS, guidance_scale=5.0, num_frames=9,
                height=32, width=48, output_type="np", **_embeds(a))
    model = a.load()
    ref = _i2v_pipeline(a, model)(image=image, **call).frames[0]
    assert _worst_psnr(ref, clip.frames) >= MIN_PSNR_DB
    (same,) = rt.generate(_load(i2v_run, "torch"), PROMPT, seed=3, steps=STEPS, image=np.asarray(image))
    assert np.abs(same.frames.astype(int) - np.rint(ref * 255)).max() <= 1  # the same conditioning, exactly


def test_ti2v_text_and_image_modes_match_the_pipelines(ti2v_run):
    import trt_sora.runtime as rt

    pipe, _ = ti2v_run
    runner = _load(ti2v_run)
    a = pipe.adapter
    call = dict(latents=_noise(a, 3, 4, 6, 3), num_inference_steps=STEPS, guidance_scale=5.0, num_frames=9,
                height=64, width=96, output_type="np", **_embeds(a))
    model = a.load()
    (text,) = rt.generate(runner, PROMPT, seed=3, steps=STEPS)  # 48-channel latents, 16x VAE: 9 frames of 64x96
    assert text.frames.shape == (9, 64, 96, 3) and text.latents.shape == (48, 3, 4, 6)
    ref = _wan_pipeline(model, a.vae()[0], a.scheduler(), expand_timesteps=True)(**call).frames[0]
    assert _worst_psnr(ref, text.frames) >= MIN_PSNR_DB
    # the ready pipeline over the run folder: per-token timesteps reach the graph as one per latent frame
    ready = rt.diffusers_pipeline(runner)(PROMPT, latents=call["latents"], num_inference_steps=STEPS,
                                          output_type="np").frames[0]
    assert np.abs(np.rint(ready * 255) - text.frames).max() <= 1
    image = _image(64, 96)
    (img,) = rt.generate(runner, PROMPT, seed=3, steps=STEPS, image=image)
    from PIL import Image

    ref = _i2v_pipeline(a, model, expand_timesteps=True)(image=Image.fromarray(image), **call).frames[0]
    assert _worst_psnr(ref, img.frames) >= MIN_PSNR_DB
    assert img.metadata["image"]["encoding"].startswith("first latent frame from")


def test_hunyuan_two_text_streams_match_the_hunyuan_pipeline(hunyuan_run):
    """HunyuanVideo15Pipeline with diffusers' own attention processors and the pipeline's sigmas; the prompt
    quotes text, so the ByT5 glyph stream and its mask carry tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    import trt_sora.runtime as rt

    pipe, _ = hunyuan_run
    a = pipe.adapter
    prompt = 'a sign that says "OPEN" in a window'
    (clip,) = rt.generate(_load(hunyuan_run), prompt, seed=3, steps=STEPS)
    assert clip.frames.shape == (9, 64, 96, 3) and clip.metadata["text_len"] == 16
    m = a.load()
    m.set_attn_processor({n: AttnProcessor2_0() if ".token_refiner." in f".{n}" else HunyuanVideo15AttnProcessor2_0()
                          for n in m.attn_processors})
    enc = a.text_encoder()
    c, u = enc([prompt], 16, 8), enc([""], 16, 8)  # the bucket's text_len / text_len_2
    assert c["encoder_attention_mask_2"].sum() == 5 and u["encoder_attention_mask_2"].sum() == 0
    ref_pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=m, vae=a.vae()[0],
                                      scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=None,
                                      tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=6.0))
    names = {"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_attention_mask",
             "prompt_embeds_2": "encoder_hidden_states_2", "prompt_embeds_mask_2": "encoder_attention_mask_2"}
    ref = ref_pipe(latents=_noise(a, 3, 4, 6, 3), num_inference_steps=STEPS, num_frames=9, height=64, width=96,
                   output_type="np", **{k: c[v] for k, v in names.items()},
                   **{f"negative_{k}": u[v] for k, v in names.items()}).frames[0]
    assert _worst_psnr(ref, clip.frames) >= MIN_PSNR_DB


# -- the CLI and batch on every family ----------------------------------------------------------------
FAMILIES = {"pair_run": None, "i2v_run": "required", "ti2v_run": "optional", "hunyuan_run": None}


@pytest.mark.parametrize("fixture", list(FAMILIES))
def test_batch_on_every_family(fixture, request, tmp_path):
    """Batch jobs (`trt-sora batch` for I2V, its function otherwise): one line per job (an image path
    relative to the jobs file where the model takes one), clips equal to generate()'s; a line the model
    cannot run is recorded failed with its typed error; a changed image redoes its clip on resume."""
    from PIL import Image

    import trt_sora.runtime as rt
    from trt_sora.cli import main
    from trt_sora.serve.batch import BatchConfig, run_batch

    run = request.getfixturevalue(fixture)
    runner = _load(run)
    f, h, w = rt.Generator(runner).default_size
    Image.fromarray(_image(h, w)).save(tmp_path / "in.png")
    image = FAMILIES[fixture]
    good = {"id": "good", "prompt": PROMPT, "seed": 4, "steps": 2, **({"image": "in.png"} if image else {})}
    bad = {"id": "bad", "prompt": PROMPT, **({} if image == "required" else {"image": "in.png"} if image is None
                                              else {"num_frames": 10})}
    (tmp_path / "jobs.jsonl").write_text("\n".join(json.dumps(j) for j in (good, bad)))
    out = tmp_path / "out"
    args = ["batch", "--run", str(run[0].run_dir), "--backend", "ort", "--prompts", str(tmp_path / "jobs.jsonl"),
            "--out", str(out), "--formats", "npy", "--no-progress"]

    def batch():
        return 0 if run_batch(runner, tmp_path / "jobs.jsonl", out, BatchConfig(formats=("npy",))).ok else 1

    assert (main(args) if fixture == "i2v_run" else batch()) == 1  # one job failed
    rec = json.loads((out / "clips" / "good.json").read_text())
    want = rt.generate(runner, PROMPT, seed=4, steps=2, image=str(tmp_path / "in.png") if image else None)[0]
    np.testing.assert_array_equal(np.load(out / "clips" / "good.npy"), want.frames)
    assert rec["frames"]["shape"] == [f, h, w, 3]
    err = json.loads((out / "clips" / "bad.json").read_text())["error"]["message"]
    assert {"required": "give the conditioning image", None: "takes no conditioning image",
            "optional": "num_frames 10"}[image] in err
    if fixture == "i2v_run":  # a changed image is a changed job: resume redoes exactly that clip
        assert batch() == 1 and json.loads((out / "summary.json").read_text())["skipped"] == 1
        Image.fromarray(255 - _image(h, w)).save(tmp_path / "in.png")
        assert batch() == 1 and json.loads((out / "summary.json").read_text())["generated"] == 1


def test_generate_cli_takes_the_image(i2v_run, tmp_path, capsys):
    from PIL import Image

    from trt_sora.cli import main

    run = str(i2v_run[0].run_dir)
    Image.fromarray(_image(32, 48)).save(tmp_path / "in.png")
    assert main(["generate", "--run", run, "--backend", "ort", PROMPT, "-o", str(tmp_path / "c.npy")]) == 2
    assert "--image PATH" in capsys.readouterr().err
    assert main(["generate", "--run", run, "--backend", "ort", PROMPT, "--image", str(tmp_path / "in.png"),
                 "--steps", "2", "-o", str(tmp_path / "c.npy")]) == 0
    assert np.load(tmp_path / "c.npy").shape == (9, 32, 48, 3)
    assert json.loads((tmp_path / "c.npy.json").read_text())["image"]["source"] == str(tmp_path / "in.png")
    assert main(["generate", "--run", run, "--backend", "ort", PROMPT, "--image", str(tmp_path / "nope.png"),
                 "-o", str(tmp_path / "d.npy")]) == 2


def test_ls_shows_the_pair_as_one_run(pair_run, capsys):
    from trt_sora.cli import main

    root = pair_run[0].run_dir.parent.parent
    assert main(["ls", str(root), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["run"] == str(pair_run[0].run_dir) and run["experts"] == ["high", "low"]
    assert run["parity"] == "passed" and run["recipe"] == "rtx4090-fp8" and run["bytes"]["engine"] > 0


# -- serve ------------------------------------------------------------------------------------------
def test_serve_runs_the_expert_pair_over_http(pair_run):
    """A request on the pair through `trt-sora serve`'s app on 127.0.0.1: the clip switched experts at the
    boundary and is bit-identical to generate()'s; an image for this text-to-video model is a 400."""
    import io

    from http_helpers import HANG, http_server

    import trt_sora.runtime as rt
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig
    from trt_sora.serve.server import make_app

    runner = _load(pair_run)
    metrics = ServerMetrics()
    engine = Engine(runner, ServeConfig(warmup_steps=1, max_wait_s=0.05), metrics=metrics)
    engine.start(block=True)
    with http_server(make_app(engine, metrics)) as http:
        status, body = http.json("POST", "/v1/jobs", {"prompt": PROMPT, "seed": 9})
        assert status == 202, body
        view = http.wait_done(body["id"])
        assert view["status"] == "done", view
        assert view["metadata"]["experts"]["steps"] == {"high": [0, 1, 2, 3], "low": [4, 5]}
        status, raw, _ = http("GET", f"/v1/jobs/{body['id']}/result?format=npy")
        assert status == 200
        np.testing.assert_array_equal(np.load(io.BytesIO(raw)), rt.generate(runner, PROMPT, seed=9)[0].frames)
        status, raw, _ = http("POST", "/v1/jobs", {"prompt": PROMPT, "image": "/etc/passwd"})
        assert status == 400 and b"data URL" in raw
    assert engine.drain(HANG)
    engine.close()
