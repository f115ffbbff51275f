"""The calibration stage end to end on wan-tiny (CPU): stats, report, manifest, hooks, errors, CLI."""
from __future__ import annotations

import json
import re

import pytest
from run_folders import write_preset

torch = pytest.importorskip("torch")

from trt_sora.calibrate.run import ALL_METHODS, ReportOptions, calibrate  # noqa: E402
from trt_sora.calibrate.stats import CalibStats  # noqa: E402
from trt_sora.config.recipe import CalibConfig, CalibMethod  # noqa: E402
from trt_sora.errors import CalibrationError, ConfigError, ShapeError  # noqa: E402

NUM_STEPS = 2


ONE = {"batch": 1, "latent_frames": 2, "latent_height": 4, "latent_width": 4, "text_len": 8}
TWO = {"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 6}


def _preset(path, *, prompt_set="video_prompts_v1", num_prompts=2, shapes=(ONE, TWO)):
    return write_preset(path, *shapes, prompt_set=prompt_set, num_prompts=num_prompts, num_steps=NUM_STEPS)


@pytest.fixture(scope="module")
def small_preset(tmp_path_factory):
    """1 prompt, 2 steps, one shape: 4 forwards."""
    return _preset(tmp_path_factory.mktemp("preset") / "one.yaml", num_prompts=1, shapes=(ONE,))


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, tiny_adapter, tiny_model):
    """Full run with report: 2 prompts x 2 shapes x 2 steps x 2 branches, comparison on 1 held-out prompt."""
    d = tmp_path_factory.mktemp("calib")
    preset = _preset(d / "p.yaml")
    events = []
    res = calibrate(tiny_adapter, CalibConfig(method=CalibMethod.PERCENTILE), d / "out", model=tiny_model,
                    preset=str(preset), progress=lambda *a: events.append(a),
                    report_options=ReportOptions(eval_prompts=1, sensitivity="both"))
    return res, events


def test_artifacts_and_manifest(e2e, tiny_adapter):
    res, events = e2e
    out = res.stats_path.parent
    assert res.stats_path.is_file() and res.report_path.is_file()
    assert {p.name for p in (out / "figures").glob("*.png")} >= {"drift.png", "histograms.png", "cfg.png",
                                                                 "sensitivity.png"}
    m = json.loads((out / "manifest.json").read_text())
    assert m["stage"] == "calibrate" and m["results"]["method"] == "percentile"
    assert m["inputs"]["model"]["model_hash"] == tiny_adapter.spec.model_hash()
    assert not list(out.parent.glob(".out.tmp-*"))  # staged dir renamed away
    # progress: the calibration phase reaches its total, then the evaluation phase
    cal = [e for e in events if e[0] == "calibrate"]
    assert cal[-1][1] == cal[-1][2] == (2 + 1) * NUM_STEPS * 2  # shape 1: 2 chunks of 1, shape 2: 1 chunk of 2
    assert any(e[0] == "evaluate" and e[1] == e[2] for e in events)


def test_stats_round_trip_and_per_step(e2e, tiny_adapter, tiny_model):
    res, _ = e2e
    loaded = CalibStats.load(res.stats_path)
    assert set(loaded.sites) == set(res.stats.sites)  # safetensors sorts keys
    for s in res.stats.amax:
        assert torch.equal(loaded.amax[s], res.stats.amax[s])
    md = loaded.metadata
    assert md.method == "percentile" and md.model_hash == tiny_adapter.spec.model_hash()
    assert md.num_steps == NUM_STEPS and len(md.timesteps) == NUM_STEPS and md.timesteps[0] > md.timesteps[-1]
    assert md.branches == ["cond", "uncond"] and len(md.shapes) == 2 and md.seed == 0
    linears = [n for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear)]
    for site in linears + ["blocks.0.attn1.q", "blocks.1.attn2.v"]:
        assert site in loaded.amax, site
        g, c = loaded.amax_per_step[site], loaded.count_per_step[site]
        assert g.shape == (NUM_STEPS, 2) and bool((g > 0).all()) and bool((c > 0).all())
        assert set(loaded.method_amax[site]) == set(ALL_METHODS) - {"percentile"}
        assert site in loaded.histograms
    # weights: per-output-channel amax = max |W| per row
    w = dict(tiny_model.named_modules())["blocks.0.ffn.net.2"].weight
    assert torch.equal(loaded.amax["blocks.0.ffn.net.2.weight"], w.abs().amax(dim=1))
    # minmax >= percentile and the chosen amax is percentile's
    for site in linears:
        assert float(loaded.method_amax[site]["minmax"]) >= float(loaded.amax[site]) > 0


def test_step_ratios_match_the_recorded_trajectories(e2e, tiny_adapter, tiny_model):
    """Step caching's statistics: the calibration's per-row magnitude ratios (and their mean / std over
    rows) against numpy on the transformer outputs recomputed from each calibration trajectory's
    recorded latents (the same prompts, noise and conditioning the stage ran)."""
    import numpy as np

    from trt_sora.caching import StepRatios
    from trt_sora.calibrate.data import load_preset, prompts_for_preset
    from trt_sora.calibrate.trajectories import branch_inputs, calibration_sampling, chunks, noise
    from trt_sora.sampling import adapter_call, sample

    res, _ = e2e
    out = res.stats_path.parent
    assert res.manifest["outputs"]["step_ratios"] == "step_ratios.safetensors"
    got = StepRatios.load(out / "step_ratios.safetensors")
    preset = load_preset(str(out.parent / "p.yaml"))
    settings, _ = calibration_sampling(tiny_adapter, preset)
    prompts, encode = prompts_for_preset(preset), tiny_adapter.text_encoder(None)
    plan = [(shape, chunk) for shape in preset.shapes for chunk in chunks(prompts, shape.batch)]
    want: dict = {"cond": [], "uncond": []}
    for k, (shape, chunk) in enumerate(plan):
        seed = preset.seed * 1_000_003 + k
        cond, uncond = branch_inputs(tiny_adapter, encode, preset, [p.prompt for p in chunk], shape, uses_cfg=True,
                                     seed=seed, device="cpu")
        x0 = noise(tiny_adapter, shape, seed, "cpu")
        traj = sample(adapter_call(tiny_adapter, tiny_model), x0, cond, uncond,
                      scheduler=tiny_adapter.scheduler(settings.shift), settings=settings, keep=("latents",),
                      conditioner=tiny_adapter)
        entering = [x0] + [r.latents for r in traj.steps[:-1]]
        for b, c in (("cond", cond), ("uncond", uncond)):
            mags = []
            for x, r in zip(entering, traj.steps):
                with torch.no_grad():
                    v = tiny_adapter.forward(tiny_model, tiny_adapter.model_inputs(
                        x, torch.full((x.shape[0],), r.timestep), c)).double().numpy()
                mags.append(np.sqrt((v ** 2).sum(axis=1)).reshape(v.shape[0], -1).mean(axis=1))
            want[b].append(np.stack([np.ones_like(mags[0])] + [mags[i] / mags[i - 1] for i in range(1, len(mags))], 1))
    for b in ("cond", "uncond"):
        w = np.concatenate(want[b])
        assert w.shape == (4, NUM_STEPS) and not np.allclose(w[:, 1], 1.0)
        np.testing.assert_allclose(got.ratios[b], w, rtol=1e-4)
        np.testing.assert_allclose(got.mean(b), w.mean(axis=0), rtol=1e-4)
        np.testing.assert_allclose(got.std(b), w.std(axis=0), rtol=1e-3, atol=1e-6)
        assert res.manifest["results"]["step_ratios"][b]["mean"] == pytest.approx(list(w.mean(axis=0)), rel=1e-4)


def test_hooks_removed(e2e, tiny_model):
    from trt_sora.models.wan import WanExportAttnProcessor

    for _, m in tiny_model.named_modules():
        assert not m._forward_pre_hooks
        proc = getattr(m, "processor", None)
        if proc is not None:
            assert isinstance(proc, WanExportAttnProcessor) and proc.observer is None


def _parse_table(text, heading):
    sec = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in sec.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    return head, [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def test_report_comparison_table(e2e):
    res, _ = e2e
    text = res.report_path.read_text()
    head, rows = _parse_table(text, "Calibrator comparison")
    assert head == ["method", "FP8 cosine", "FP8 max-abs", "FP8 PSNR (dB)", "INT8 cosine", "INT8 max-abs",
                    "INT8 PSNR (dB)"]
    methods = {r[0].split()[0] for r in rows}
    assert methods == set(ALL_METHODS)
    for r in rows:
        vals = [float(v) for v in r[1:]]
        cos_fp8, mx_fp8, psnr_fp8, cos_i8, mx_i8, psnr_i8 = vals
        assert 0.99 < cos_fp8 <= 1.0 and 0.99 < cos_i8 <= 1.0
        assert 0 < mx_fp8 < 1 and 0 < mx_i8 < 1
        assert 20 < psnr_fp8 < 200 and 20 < psnr_i8 < 200
    assert re.search(r"PSNR peak = [0-9.]+ \(reference final latent max - min\)", text)
    # the table holds what the evaluation measured
    ev = res.evaluation
    row = next(r for r in ev["comparison"] if r["method"] == "minmax" and r["format"] == "int8")
    table_row = next(r for r in rows if r[0].startswith("minmax"))
    assert float(table_row[4]) == pytest.approx(row["cosine"], abs=1e-6)
    # default exclusions respected: these are not fake-quantized in the comparison
    for s in ("proj_out", "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1"):
        assert s in ev["excluded_sites"] and s not in ev["quantized_sites"]
    assert "blocks.0.attn1.to_q" in ev["quantized_sites"]


def test_report_sensitivity_and_skip_list(e2e):
    import yaml

    res, _ = e2e
    text = res.report_path.read_text()
    _, rows = _parse_table(text, "Sensitivity ranking")
    groups = {r[1].strip("`") for r in rows}
    assert {"attn1.qkv", "attn2.kv", "ffn.up", "ffn.down", "blocks.0", "blocks.1"} <= groups
    rel = [float(r[6]) for r in rows]
    assert rel == sorted(rel, reverse=True)
    snippet = text.split("```yaml", 1)[1].split("```", 1)[0]
    data = yaml.safe_load(snippet)
    assert isinstance(data["quantization"]["exclude"], list)
    from trt_sora.config.recipe import QuantConfig

    QuantConfig(exclude=tuple(data["quantization"]["exclude"]))  # adoptable as is
    for heading in ("Drift over denoising steps", "Outlier layers", "CFG branch differences", "Per-layer summary"):
        assert f"## {heading}" in text
    head, rows = _parse_table(text, "Per-layer summary")
    sqnr = head.index("FP8 SQNR (dB)")
    assert all(float(r[sqnr]) > 10 for r in rows if r[1] == "y")


def test_report_per_step_view_and_tradeoff(e2e, tiny_adapter, tiny_model):
    """Per-step sensitivity at the calibration's own steps, each window of steps quantized alone, and the
    quality-vs-speed table: its FLOP shares are the linears' (2 x tokens x in x out), its "all steps" row is
    the fully quantized run, and the recommendation names one of its options."""
    res, _ = e2e
    ev = res.evaluation
    steps = ev["eval"]["num_steps"]
    assert [r["step"] for r in ev["per_step"]] == list(range(steps))
    assert all(a["sigma"] > b["sigma"] for a, b in zip(ev["per_step"], ev["per_step"][1:]))
    assert all(-1 <= r["call_cosine"] <= 1 and r["contribution_db"] > 0 for r in ev["per_step"])
    covered = [s for w in ev["step_windows"] for s in range(*w["steps"])]
    assert covered == list(range(steps))
    flops = {}  # one forward at the evaluation shape: 2 x tokens x in x out per linear
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: flops.__setitem__(n, 2 * a[0].numel() * m.out_features))
             for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        tiny_adapter.forward(tiny_model, tiny_adapter.example_inputs(ev["eval"]["shape"], seed=0))
    for h in hooks:
        h.remove()
    want = sum(flops[s] for s in ev["quantized_sites"]) / sum(flops.values())
    assert 0 < want < 1 and ev["linear_flops"]["quantized_fraction"] == pytest.approx(want, rel=1e-9)
    rows = {t["option"]: t for t in ev["tradeoff"]}
    full = rows["all steps, every quantized linear"]
    assert full["psnr_db"] == pytest.approx(ev["skip"]["all_quantized"]["psnr_db"])
    assert full["fp8_linear_flop_fraction"] == pytest.approx(ev["linear_flops"]["quantized_fraction"])
    step_aware = [t for t in ev["tradeoff"] if "unquantized_steps" in t.get("recipe", {})]
    assert len(step_aware) == 1
    lo, hi = step_aware[0]["recipe"]["unquantized_steps"]
    assert step_aware[0]["fp8_linear_flop_fraction"] == pytest.approx(
        full["fp8_linear_flop_fraction"] * (steps - (hi - lo)) / steps)
    text = res.report_path.read_text()
    assert "## Per-step sensitivity" in text and "## Quality vs speed" in text
    rec = text.split("Recommended: **", 1)[1].split("**", 1)[0]
    assert rec in rows
    assert (res.report_path.parent / "figures" / "per_step.png").is_file()


def test_hooks_see_real_activations(tiny_adapter, tiny_model, small_preset, tmp_path):
    """Step-0 cond abs-max of one linear and one attention site == a manual capture of the same forward."""
    from trt_sora.calibrate.data import load_preset, prompts_for_preset
    from trt_sora.models.wan import WanExportAttnProcessor

    res = calibrate(tiny_adapter, CalibConfig(method="minmax"), tmp_path / "o", model=tiny_model,
                    preset=str(small_preset), report=False)
    preset = load_preset(str(small_preset))
    shape = preset.shapes[0]
    prompt = prompts_for_preset(preset)[0].prompt
    enc = tiny_adapter.text_encoder()
    g = torch.Generator().manual_seed(0)  # calibrate's noise seed for the first trajectory
    noise = torch.randn(1, tiny_adapter.latent_channels, shape.latent_frames, shape.latent_height,
                        shape.latent_width, generator=g)
    sched = tiny_adapter.scheduler(preset.shift)
    sched.set_timesteps(preset.num_steps)
    t = sched.timesteps[0].float().reshape(1)
    seen = {}
    mods = dict(tiny_model.named_modules())
    h = mods["blocks.1.ffn.net.2"].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("lin", a[0].abs().max()))
    attn = mods["blocks.0.attn2"]
    old = attn.processor
    attn.processor = WanExportAttnProcessor(
        observer=lambda site, x: seen.__setitem__(site, x.abs().max()) if site == "k" else None)
    try:
        with torch.no_grad():
            tiny_adapter.forward(tiny_model, {"hidden_states": noise, "timestep": t,
                                              "encoder_hidden_states": enc([prompt], shape.text_len)})
    finally:
        h.remove()
        attn.processor = old
    st = res.stats
    assert float(st.amax_per_step["blocks.1.ffn.net.2"][0, 0]) == pytest.approx(float(seen["lin"]), rel=1e-6)
    assert float(st.amax_per_step["blocks.0.attn2.k"][0, 0]) == pytest.approx(float(seen["k"]), rel=1e-6)
    assert st.metadata.timesteps[0] == pytest.approx(float(t))


@pytest.fixture(scope="module")
def ref_minmax(tiny_adapter, tiny_model, small_preset, tmp_path_factory):
    return calibrate(tiny_adapter, CalibConfig(method="minmax"), tmp_path_factory.mktemp("ref") / "o",
                     model=tiny_model, preset=str(small_preset), report=False).stats


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_deterministic(method, tiny_adapter, tiny_model, small_preset, tmp_path, ref_minmax):
    """Each method's run gives the same amax as the reference run's ``amax_<method>`` (same seed, same data)."""
    ref = ref_minmax
    st = calibrate(tiny_adapter, CalibConfig(method=method), tmp_path / method, model=tiny_model,
                   preset=str(small_preset), report=False).stats
    assert st.metadata.method == method and st.sites == ref.sites  # same in-memory order
    for site in ref.sites:
        want = ref.amax[site] if method == "minmax" or site.endswith(".weight") else ref.method_amax[site][method]
        assert torch.equal(st.amax[site], want), site
        if site in ref.amax_per_step:
            assert torch.equal(st.amax_per_step[site], ref.amax_per_step[site])


# -- bad inputs ------------------------------------------------------------------------------------

def test_unknown_method(tiny_adapter, tiny_model, small_preset, tmp_path):
    with pytest.raises(ConfigError, match=r"minmaks.*did you mean.*minmax"):
        calibrate(tiny_adapter, CalibConfig(method="minmaks"), tmp_path / "o", model=tiny_model,
                  preset=str(small_preset), report=False)
    assert not (tmp_path / "o").exists()


def test_missing_prompts_file(tiny_adapter, tiny_model, tmp_path):
    p = _preset(tmp_path / "p.yaml", prompt_set=str(tmp_path / "nope.jsonl"))
    with pytest.raises(CalibrationError, match="not found"):
        calibrate(tiny_adapter, CalibConfig(), tmp_path / "o", model=tiny_model, preset=str(p), report=False)


def test_empty_prompt_set(tiny_adapter, tiny_model, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    p = _preset(tmp_path / "p.yaml", prompt_set=str(tmp_path / "empty.jsonl"))
    with pytest.raises(CalibrationError, match="empty"):
        calibrate(tiny_adapter, CalibConfig(), tmp_path / "o", model=tiny_model, preset=str(p), report=False)


def test_nan_activation_names_layer_step_branch(tiny_adapter, tiny_model, small_preset, tmp_path):
    mod = dict(tiny_model.named_modules())["blocks.1.ffn.net.0.proj"]
    calls = {"n": 0}

    def poison(m, args):
        calls["n"] += 1
        if calls["n"] == 2:  # step 0, uncond branch
            return (torch.full_like(args[0], float("nan")),)
        return None

    h = mod.register_forward_pre_hook(poison)  # runs before calibrate's own hooks
    try:
        with pytest.raises(CalibrationError, match=r"blocks\.1\.ffn\.net\.0\.proj.*NaN.*step 0/2.*'uncond'"):
            # nearest rounding: no GPTQ probe forward before the trajectories (the hook counts their calls)
            calibrate(tiny_adapter, CalibConfig(weight_rounding="nearest"), tmp_path / "o", model=tiny_model,
                      preset=str(small_preset), report=False)
    finally:
        h.remove()
    assert not (tmp_path / "o").exists()
    assert not any(m._forward_pre_hooks for m in tiny_model.modules() if m is not mod)


def test_forward_that_changes_shape(tiny_adapter, tiny_model, small_preset, tmp_path):
    from trt_sora.models.wan import WanAdapter

    class Shrinking(WanAdapter):
        calls = 0

        def forward(self, model, inputs):
            Shrinking.calls += 1
            out = super().forward(model, inputs)
            return out[..., :-1] if Shrinking.calls > 2 else out

    with pytest.raises(ShapeError, match=r"shape .* at denoising step 1"):
        calibrate(Shrinking(tiny_adapter.spec), CalibConfig(weight_rounding="nearest"), tmp_path / "o",
                  model=tiny_model, preset=str(small_preset), report=False)  # nearest: no GPTQ probe forward


# -- CLI -------------------------------------------------------------------------------------------

def test_cli(tmp_path, small_preset, capsys):
    from trt_sora.cli import main

    out = tmp_path / "cli"
    rc = main(["calibrate", "--recipe", "rtx4090-fp8", "--model", "wan-tiny", "--method", "ema",
               "--preset", str(small_preset), "--out", str(out), "--no-report"])
    assert rc == 0
    st = CalibStats.load(out / "stats.safetensors")
    assert st.metadata.method == "ema" and st.metadata.preset == "one"
    printed = capsys.readouterr().out
    assert str(out / "stats.safetensors") in printed and "weight rounding: gptq: " in printed
    rc = main(["calibrate", "--recipe", "rtx4090-fp8", "--model", "wan-tiny", "--preset", "no-such-preset",
               "--out", str(tmp_path / "bad"), "--no-report"])
    assert rc == 2


def test_attention_mass_is_measured_over_the_calibration_trajectories(tiny_adapter, tiny_model, small_preset,
                                                                       tmp_path):
    """With sparse attention calibrated, the stage records the mass outside each candidate per layer and step
    over its own trajectories (the recorder on the same trajectory gives the same numbers), lists the file
    in the manifest and shows it in the report."""
    import numpy as np

    from trt_sora.calibrate.data import load_preset, prompts_for_preset
    from trt_sora.calibrate.trajectories import branch_inputs, calibration_sampling, noise
    from trt_sora.config import SparseAttentionConfig
    from trt_sora.sampling import adapter_call, sample
    from trt_sora.sparse import MASS_FILE, AttentionMass, MassRecorder

    sparse = SparseAttentionConfig(enabled=True, tile=(1, 1, 1), candidates=((0, 0, 0), (0, 1, 1), (1, 1, 1)),
                                   dense_steps=1)
    res = calibrate(tiny_adapter, CalibConfig(), tmp_path / "out", model=tiny_model, preset=str(small_preset),
                    report_options=ReportOptions(eval_prompts=1, sensitivity="none"), sparse=sparse)
    assert res.manifest["outputs"]["attention_mass"] == MASS_FILE
    got = AttentionMass.load(tmp_path / "out" / MASS_FILE)
    assert got.layers == ("blocks.0", "blocks.1") and got.steps == (0, 1)
    assert "## Sparse attention: attention mass" in res.report_path.read_text()
    preset = load_preset(str(small_preset))
    settings, _ = calibration_sampling(tiny_adapter, preset)
    shape, prompt = preset.shapes[0], prompts_for_preset(preset)[0]
    cond, uncond = branch_inputs(tiny_adapter, tiny_adapter.text_encoder(None), preset, [prompt.prompt], shape,
                                 uses_cfg=True, seed=0, device="cpu")
    x0 = noise(tiny_adapter, shape, 0, "cpu")
    rec, sites = MassRecorder(sparse, settings.num_steps), tiny_adapter.sparse_attention_sites(tiny_model)
    grid = tiny_adapter.token_grid(x0.shape)
    sample(adapter_call(tiny_adapter, tiny_model), x0, cond, uncond, scheduler=tiny_adapter.scheduler(settings.shift),
           settings=settings, conditioner=tiny_adapter, hook=lambda call: rec.at(sites, grid, call.step))
    want = rec.result().mass
    assert np.all(want[..., 0] > want[..., 1]) and np.all(want[..., 2] == 0)  # (1, 1, 1) covers the 2x2x2 grid
    np.testing.assert_allclose(got.mass, want, rtol=1e-6, atol=1e-9)
    assert res.manifest["results"]["attention_mass"]["from_step"] == 1
