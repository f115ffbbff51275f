"""The one sampler (trt_sora.sampling): CFG math against a hand-written Euler loop, split vs batched
CFG, hook labels, records, errors; and the defaults every stage takes from the model."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trt_sora.errors import CalibrationError, ConfigError, ShapeError  # noqa: E402
from trt_sora.sampling import SamplingSettings, gaussian_noise, sample  # noqa: E402


def _scheduler(shift=3.0):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)


def _toy(inputs):
    """A velocity that depends on every input: x, t and the text embedding (per batch row)."""
    x, t, e = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    return 0.3 * x + (t / 1000.0).view(-1, 1, 1, 1, 1) + e.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)


def _reference_loop(noise, e_c, e_u, steps, g, shift):
    """Flow-matching Euler with CFG written out: x <- x + (sigma_{i+1} - sigma_i) (v_u + g (v_c - v_u))."""
    s = _scheduler(shift)
    s.set_timesteps(steps)
    x = noise.double()
    for i, t in enumerate(s.timesteps):
        ts = t.double().expand(x.shape[0])
        v_c = _toy({"hidden_states": x, "timestep": ts, "encoder_hidden_states": e_c.double()})
        v_u = _toy({"hidden_states": x, "timestep": ts, "encoder_hidden_states": e_u.double()})
        x = x + (float(s.sigmas[i + 1]) - float(s.sigmas[i])) * (v_u + g * (v_c - v_u))
    return x


@pytest.fixture
def toy_inputs():
    noise = gaussian_noise((2, 3, 2, 4, 4), seed=5)
    g = torch.Generator().manual_seed(1)
    return noise, torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)


@pytest.mark.parametrize("cfg", ["split", "batched"])
def test_matches_hand_written_euler_cfg(toy_inputs, cfg):
    noise, e_c, e_u = toy_inputs
    st = SamplingSettings(num_steps=7, guidance_scale=4.0, shift=2.0)
    res = sample(_toy, noise, e_c, e_u, scheduler=_scheduler(2.0), settings=st, cfg=cfg)
    ref = _reference_loop(noise, e_c, e_u, 7, 4.0, 2.0)
    assert res.latents.dtype == torch.float32 and res.latents.shape == noise.shape
    torch.testing.assert_close(res.latents.double(), ref, rtol=1e-5, atol=1e-5)
    assert [r.step for r in res.steps] == list(range(7))
    assert res.steps[0].sigma > res.steps[-1].sigma > res.steps[-1].sigma_next == 0.0


def test_hook_labels_every_call_and_records(toy_inputs):
    noise, e_c, e_u = toy_inputs
    st = SamplingSettings(num_steps=3, guidance_scale=5.0, shift=3.0)
    seen, entered = [], []

    class Ctx:
        def __init__(self, call):
            self.call = call

        def __enter__(self):
            entered.append(self.call.step)

        def __exit__(self, *exc):
            return False

    def hook(call):
        seen.append((call.step, call.branch, round(call.timestep, 3), tuple(call.inputs["hidden_states"].shape)))
        return Ctx(call)

    res = sample(_toy, noise, {"encoder_hidden_states": e_c}, {"encoder_hidden_states": e_u},
                 scheduler=_scheduler(), settings=st, cfg="split", hook=hook, keep=("latents", "velocity"))
    ts = [round(float(t), 3) for t in _timesteps(3)]
    assert seen == [(i, b, ts[i], (2, 3, 2, 4, 4)) for i in range(3) for b in ("cond", "uncond")]
    assert entered == [0, 0, 1, 1, 2, 2]
    torch.testing.assert_close(res.steps[-1].latents, res.latents)
    assert res.steps[1].velocity.shape == noise.shape

    seen.clear()
    sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=st, cfg="batched", hook=hook)
    assert [(s[0], s[1], s[3][0]) for s in seen] == [(i, "cond+uncond", 4) for i in range(3)]


def _timesteps(n):
    s = _scheduler()
    s.set_timesteps(n)
    return s.timesteps


def test_no_guidance_runs_the_cond_branch_only(toy_inputs):
    noise, e_c, _ = toy_inputs
    calls = []
    res = sample(lambda i: calls.append(1) or _toy(i), noise, e_c, None, scheduler=_scheduler(),
                 settings=SamplingSettings(num_steps=4, guidance_scale=1.0, shift=3.0), cfg="batched")
    assert len(calls) == 4
    torch.testing.assert_close(res.latents.double(), _reference_loop(noise, e_c, e_c, 4, 1.0, 3.0), rtol=1e-5,
                               atol=1e-5)


def test_errors_name_the_step_and_branch(toy_inputs):
    noise, e_c, e_u = toy_inputs
    st = SamplingSettings(num_steps=3, guidance_scale=5.0, shift=3.0)
    with pytest.raises(ConfigError, match="uncond"):
        sample(_toy, noise, e_c, None, scheduler=_scheduler(), settings=st)
    with pytest.raises(ConfigError, match="cfg='both'"):
        sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=st, cfg="both")
    with pytest.raises(ConfigError, match="keep"):
        sample(_toy, noise, e_c, e_u, scheduler=_scheduler(), settings=st, keep=("inputs",))

    def nan_at_step_2(inputs):
        if float(inputs["timestep"][0]) < 500:
            raise CalibrationError("site 'x' saw NaN")
        return _toy(inputs)

    with pytest.raises(CalibrationError, match=r"saw NaN \[at denoising step 2/3 .*branch 'cond', run 7\]"):
        sample(nan_at_step_2, noise, e_c, e_u, scheduler=_scheduler(), settings=st, label="run 7")
    with pytest.raises(ShapeError, match="step 0/3"):
        sample(lambda i: _toy(i)[..., :-1], noise, e_c, e_u, scheduler=_scheduler(), settings=st)
    with pytest.raises(ConfigError, match="num_steps"):
        SamplingSettings(num_steps=0, guidance_scale=1.0, shift=1.0)
    for bad in (float("nan"), float("inf")):  # would only surface as NaN frames after every step ran
        with pytest.raises(ConfigError, match="guidance_scale=.* finite"):
            SamplingSettings(num_steps=1, guidance_scale=bad, shift=1.0)
        with pytest.raises(ConfigError, match="shift=.* finite"):
            SamplingSettings(num_steps=1, guidance_scale=1.0, shift=bad)


def test_wan_tiny_split_and_batched_agree(tiny_adapter, tiny_model):
    from trt_sora.sampling import adapter_call

    enc = tiny_adapter.text_encoder()
    e_c, e_u = enc(["a cat"], 8), enc([""], 8)
    noise = gaussian_noise((1, tiny_adapter.latent_channels, 2, 4, 4), seed=3)
    st = tiny_adapter.sampling
    out = {cfg: sample(adapter_call(tiny_adapter, tiny_model), noise, e_c, e_u,
                       scheduler=tiny_adapter.scheduler(st.shift), settings=st, cfg=cfg).latents
           for cfg in ("split", "batched")}
    torch.testing.assert_close(out["split"], out["batched"], rtol=1e-4, atol=1e-4)
    assert not torch.equal(out["split"], noise)


# -- the defaults are the deployment settings --------------------------------------------------------
@pytest.mark.parametrize("model, expected", [("wan-shapes", (20, 4.0, 2.0)), ("wan2.1-t2v-1.3b", (50, 5.0, 3.0)),
                                             ("wan2.1-t2v-14b", (50, 5.0, 5.0))])
def test_model_sampling_settings(model, expected):
    from trt_sora.models import get_adapter

    st = get_adapter(model).sampling
    assert (st.num_steps, st.guidance_scale, st.shift) == expected


def test_samples_calibration_and_parity_default_to_the_model_settings():
    """What users run is what calibration and parity run with every shipped recipe (no shortening
    knob set), and what the model's own sampler runs."""
    from trt_sora.calibrate.data import load_preset
    from trt_sora.calibrate.trajectories import calibration_sampling
    from trt_sora.config import list_recipes, load_recipe
    from trt_sora.models import get_adapter
    from trt_sora.models.moving_shapes.sample import SampleConfig
    from trt_sora.sampling import resolve_sampling

    adapter = get_adapter("wan-shapes")
    model = adapter.sampling
    assert (SampleConfig().steps, SampleConfig().guidance_scale, SampleConfig().shift) == \
        (model.num_steps, model.guidance_scale, model.shift)
    preset = load_preset(adapter.spec.defaults["calib_preset"])
    for name in list_recipes():
        recipe = load_recipe(name)
        settings, note = calibration_sampling(adapter, preset, recipe.calibration)
        assert settings == model and "the model's sampling settings" in note, name
        settings, note = resolve_sampling(adapter, "the recipe", num_steps=recipe.parity.loop_steps,
                                          guidance_scale=recipe.parity.guidance_scale)
        assert settings == model and "the model's sampling settings" in note, name


def test_a_shortened_trajectory_is_named_as_such():
    import dataclasses

    from trt_sora.calibrate.data import load_preset
    from trt_sora.calibrate.trajectories import calibration_sampling
    from trt_sora.config import load_recipe
    from trt_sora.models import get_adapter
    from trt_sora.sampling import resolve_sampling

    adapter = get_adapter("wan-shapes")
    recipe = load_recipe("rtx4090-fp8")
    cal = dataclasses.replace(recipe.calibration, num_steps=6)
    settings, note = calibration_sampling(adapter, load_preset("moving-shapes"), cal)
    assert settings.num_steps == 6 and "SHORTER than users sample" in note and "model: 20" in note
    settings, note = resolve_sampling(adapter, "the recipe", num_steps=4)
    assert settings.num_steps == 4 and "SHORTER" in note


def test_unconditional_branch_is_the_models(tiny_adapter):
    """wan-shapes samples with the zero embedding as its unconditional (MODEL_CARD.md); Wan encodes its
    negative prompt. Calibration (presets name no negative prompt) and parity use the model's."""
    from trt_sora.calibrate.data import load_preset
    from trt_sora.models import get_adapter

    shapes = get_adapter("wan-shapes")
    z = shapes.negative_conditioning(lambda *a: pytest.fail("zeros need no encoder"), 2, {"text_len": 16})
    z = z["encoder_hidden_states"]
    assert z.shape == (2, 16, 384) and not z.any()
    enc = tiny_adapter.text_encoder()
    neg = tiny_adapter.negative_conditioning(enc, 2, {"text_len": 8})["encoder_hidden_states"]
    torch.testing.assert_close(neg, enc(["", ""], 8))
    assert load_preset("moving-shapes").negative_prompt is None


def test_parity_loop_reads_precomputed_prompt_embeddings(tmp_path):
    """`check --text-embeddings`: the loop's conditioning from a file equals the encoder's; a file
    without the held-out prompts is refused with the fix."""
    from trt_sora.errors import ModelError
    from trt_sora.models import get_adapter
    from trt_sora.models.text import save_embeddings
    from trt_sora.parity.loop import loop_inputs

    shapes = get_adapter("wan-shapes")
    point = {"batch": 2, "latent_frames": 9, "latent_height": 32, "latent_width": 32, "text_len": 16}
    prompts = shapes.heldout_prompts()[:3]
    f = tmp_path / "heldout.safetensors"
    enc = shapes.text_encoder()
    # the loop encodes its batch of 2 prompts in one call: the file's rows for them come from the same
    # call (another batch size may take the encoder's matmuls in another order, and move the last bits)
    save_embeddings(prompts, torch.cat([enc(prompts[:2], 16), enc(prompts[2:], 16)]), f)
    want = loop_inputs(shapes, point, seed=3)
    got = loop_inputs(shapes, point, seed=3, text_encoder=str(f))
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # given prompts win over the model's held-out ones (one caption per clip in the benchmarks)
    mine = loop_inputs(shapes, point, seed=3, prompts=prompts[2:])
    assert torch.equal(mine[0], want[0])
    assert torch.equal(mine[1]["encoder_hidden_states"], enc(prompts[2:] * 2, 16))  # the loop's batch of 2
    assert not torch.equal(mine[1]["encoder_hidden_states"], want[1]["encoder_hidden_states"])
    save_embeddings(prompts[1:], shapes.text_encoder()(prompts[1:], 16), f)
    with pytest.raises(ModelError, match="no precomputed embedding"):
        loop_inputs(shapes, point, seed=3, text_encoder=str(f))
