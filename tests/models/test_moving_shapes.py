"""wan-shapes: dataset determinism, probe on ground truth, and the trained model on held-out captions."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trt_sora.models import moving_shapes  # noqa: E402
from trt_sora.models.moving_shapes import data, probe  # noqa: E402


def test_dataset_is_deterministic_by_seed():
    spec = data.all_caption_specs("train")[17]
    a = data.render_clip(data.sample_clip_spec(spec, 123))
    b = data.render_clip(data.sample_clip_spec(spec, 123))
    c = data.render_clip(data.sample_clip_spec(spec, 124))
    assert a.shape == (3, data.NUM_FRAMES, data.HEIGHT, data.WIDTH)
    assert a.dtype == torch.float32 and a.min() >= -1 and a.max() <= 1
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    batch1 = data.sample_batch_specs(8, seed=5, split="heldout")
    batch2 = data.sample_batch_specs(8, seed=5, split="heldout")
    assert batch1 == batch2


def test_splits_are_disjoint():
    train = data.all_caption_specs("train")
    heldout = data.all_caption_specs("heldout")
    assert train and heldout
    assert not {s.combo for s in train} & {s.combo for s in heldout}
    assert {s.combo for s in heldout} == set(data.HELDOUT_COMBOS)
    train_caps = set(data.train_captions())
    assert not train_caps & {s.caption() for s in heldout}
    assert not train_caps & {s.caption(data.HELDOUT_TEMPLATE) for s in data.all_caption_specs()}
    assert all(c.seed < data.HELDOUT_SEED_START for c in data.sample_batch_specs(64, seed=0, split="train"))
    assert all(c.seed >= data.HELDOUT_SEED_START for c in data.sample_batch_specs(64, seed=0, split="heldout"))
    # every word of a held-out combo is seen in training, only the combination is new
    for colour, shape, motion in data.HELDOUT_COMBOS:
        assert any(s.colour == colour for s in train)
        assert any(s.shape == shape for s in train)
        assert any(s.motion == motion for s in train)


def test_caption_round_trip():
    for spec in data.all_caption_specs()[::37]:
        for template in (*data.TRAIN_TEMPLATES, data.HELDOUT_TEMPLATE):
            assert data.parse_caption(spec.caption(template)) == spec


def test_shapes_stay_inside_the_frame():
    for clip in data.sample_batch_specs(200, seed=3, split="train"):
        dx, dy = data.MOTIONS[clip.caption_spec.motion]
        for f in (0, data.NUM_FRAMES - 1):
            x = clip.x0 + dx * clip.speed * f
            y = clip.y0 + dy * clip.speed * f
            assert clip.size / 2 <= x <= data.WIDTH - clip.size / 2
            assert clip.size / 2 <= y <= data.HEIGHT - clip.size / 2


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_probe_reads_ground_truth(split):
    clips = data.sample_batch_specs(300, seed=11, split=split)
    results = probe.probe_batch(data.render_batch(clips))
    matches = [r.matches(c.caption_spec) for r, c in zip(results, clips)]
    assert all(m["colour"] for m in matches)
    assert all(m["motion"] for m in matches)
    assert sum(m["background"] for m in matches) / len(matches) >= 0.95
    assert sum(m["shape"] for m in matches) / len(matches) >= 0.9


def test_probe_rejects_a_static_clip():
    clip = data.render_clip(data.sample_clip_spec(data.all_caption_specs()[0], 1))
    static = clip[:, :1].expand_as(clip)
    assert probe.probe_clip(static).motion is None  # no foreground at all: the shape never moves


def test_shipped_weights_are_small_and_load():
    from diffusers import WanTransformer3DModel

    weights = moving_shapes.WEIGHTS_DIR / "diffusion_pytorch_model.safetensors"
    assert weights.stat().st_size < 20 * 2**20
    log = json.loads((moving_shapes.WEIGHTS_DIR / "train_log.json").read_text())
    assert log["steps"] > 0 and log["final_loss"] < 0.05
    from trt_sora.models import frame_embed
    from trt_sora.models.moving_shapes import sample

    model = sample.load_transformer()
    assert isinstance(model.patch_embedding, frame_embed.FrameEmbeddedConv3d)  # the trained absolute-time anchor
    assert model.patch_embedding.frame_weight.abs().amax() > 0
    assert isinstance(model, WanTransformer3DModel)
    assert model.config.in_channels == moving_shapes.LATENT_CHANNELS
    assert model.config.text_dim == moving_shapes.TEXT_DIM
    x = torch.zeros(1, 3, moving_shapes.LATENT_FRAMES, moving_shapes.LATENT_HEIGHT, moving_shapes.LATENT_WIDTH)
    out = model(x, torch.tensor([500.0]), torch.zeros(1, moving_shapes.TEXT_LEN, moving_shapes.TEXT_DIM)).sample
    assert out.shape == x.shape and torch.isfinite(out).all()


TEST_STEPS = 12
# one held-out (colour, shape, motion) combo per motion direction, held-out seed
HELDOUT_PROBE_SPECS = [
    data.CaptionSpec("red", "circle", "moves up", "plain", "black"),
    data.CaptionSpec("purple", "square", "slides left", "striped", "gray"),
    data.CaptionSpec("yellow", "circle", "slides right", "checkered", "blue"),
    data.CaptionSpec("white", "square", "moves down", "plain", "green"),
]


@pytest.fixture(scope="module")
def heldout_results():
    """Generate the held-out clips once (CPU, ~1-2 min on 2 cores) and probe them."""
    from trt_sora.models.moving_shapes import sample, text

    if not text.is_available():
        pytest.skip(f"text encoder package missing: {text.PIP}")
    clips = sample.generate(
        [s.caption() for s in HELDOUT_PROBE_SPECS],
        sample.SampleConfig(steps=TEST_STEPS, seed=data.HELDOUT_SEED_START),
    )
    assert clips.shape == (len(HELDOUT_PROBE_SPECS), 3, data.NUM_FRAMES, data.HEIGHT, data.WIDTH)
    assert torch.isfinite(clips).all()
    results = probe.probe_batch(clips)
    report = [(s.caption(), r.colour, r.background, r.motion) for s, r in zip(HELDOUT_PROBE_SPECS, results)]
    return results, report


def test_generated_clips_on_heldout_captions_match_colour_and_background(heldout_results):
    results, report = heldout_results
    for spec, r in zip(HELDOUT_PROBE_SPECS, results):
        m = r.matches(spec)
        assert m["colour"] and m["background"], report


def test_generated_clips_on_heldout_captions_move_as_captioned(heldout_results):
    # chance is 1 of 4 per clip; the shipped weights get 94 % of 120 held-out H200 clips right
    # (MODEL_CARD.md); the test allows one miss of the four
    results, report = heldout_results
    passed = sum(r.passes(s) for s, r in zip(HELDOUT_PROBE_SPECS, results))
    assert passed >= len(HELDOUT_PROBE_SPECS) - 1, report


FLIP = {"moves up": "moves down", "moves down": "moves up", "slides left": "slides right",
        "slides right": "slides left"}


def test_direction_word_decides_the_prediction_at_high_noise():
    """The model reads the *sign* of the motion from the caption.

    At sigma 0.95 the trajectory is not yet visible in the noisy clip, so the
    caption must decide it: the flow-matching loss on ground-truth clips with the
    opposite direction word is clearly higher than with the right one. (The
    run-3 weights, without the frame embedding, were sign-blind: +0.15 % here;
    the shipped ones: about +20 %.)
    """
    import dataclasses

    from trt_sora.models.moving_shapes import sample, text

    if not text.is_available():
        pytest.skip(f"text encoder package missing: {text.PIP}")
    model = sample.load_transformer()
    # 8 captions, every motion word among them (the first 16 measure +21 %, these 8 +19 %)
    specs = data.all_caption_specs("train")[::45][:8]
    assert {s.motion for s in specs} == set(FLIP)
    x0 = data.render_batch([data.sample_clip_spec(s, 1000 + i) for i, s in enumerate(specs)])
    right = text.encode([s.caption() for s in specs], text.TEXT_LEN)
    wrong = text.encode([dataclasses.replace(s, motion=FLIP[s.motion]).caption() for s in specs], text.TEXT_LEN)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    sigma = 0.95
    xt = (1 - sigma) * x0 + sigma * noise
    t = torch.full((len(specs),), sigma * 1000)
    losses = {}
    with torch.no_grad():
        for name, emb in (("right", right), ("wrong", wrong)):
            pred = model(hidden_states=xt, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]
            losses[name] = float(((pred - (noise - x0)) ** 2).mean())
    assert losses["wrong"] > 1.05 * losses["right"], losses
