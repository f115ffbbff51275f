"""The ``torch-fp8`` backend on the Wan variants beyond text-to-video: Wan 2.1 I2V (image tokens
through added K/V projections), Wan 2.2 TI2V (a timestep per latent frame: per-token modulation)
and each expert of the Wan 2.2 A14B pair, on tiny run folders exported, calibrated and quantized
with tests/run_folders.py's CI recipe (no engine: torch-fp8 reads the Q/DQ map and the stats, so
the GPU tests need no TensorRT).

CPU tests run the fused blocks through the pure-torch reference kernels against the fake-quant
runner (the Q/DQ graph's calibration in PyTorch fp32); ``gpu`` tests run the Triton kernels and
``torch._scaled_mm`` (skipped without a GPU).
"""
from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")

MODELS = {"i2v": "wan-i2v-tiny", "ti2v": "wan-ti2v-tiny", "pair": "wan-a14b-tiny"}
#: (model, expert or None, timestep of the call: the pair's high expert serves t >= 875; TI2V keeps
#: example_inputs' random timestep per frame)
CASES = {"i2v": ("i2v", None, 700.0), "ti2v": ("ti2v", None, None),
         "pair-high": ("pair", "high", 900.0), "pair-low": ("pair", "low", 300.0)}
POINT = {"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 9}

#: Cosine of the torch-fp8 output vs the fake-quant runner's. Both quantize the same sites at the
#: same scales; what differs is torch-fp8's bf16 activations between the GEMMs (the fake-quant model
#: runs fp32): one bf16 rounding (2^-9 relative, rms) per tensor, which grows to a relative L2 error
#: of about 1e-2 at the output of these models. 0.999 allows 4.5% (rel L2 = sqrt(2 (1 - cos))),
#: several times more; with the 8-bit self-attention (INT8 Q/K per block, FP8 P and V) 0.995, as wan-tiny's
#: test_cpu_blocks_match_the_fake_quant_runner. A block that drops the image attention or reads the
#: image tokens at the text K/V's scale fails them; one timestep for every frame fails the TI2V block
#: test below (tests/mutations.py).
MIN_COS = {False: 0.999, True: 0.995}


@pytest.fixture
def quant_run(request):
    """``quant_run(model key) -> EnginePipeline`` whose export, calibrate and quantize stages ran
    (tests/run_folders.py's quantized_run: the session's run folder of that family)."""
    from run_folders import quantized_run

    return lambda key: quantized_run(request, MODELS[key])


def _side(quant_run, case):
    """``(adapter, run folder of the model or expert, feeds)`` of one case."""
    import numpy as np

    from trt_sora.models import get_adapter
    from trt_sora.runfolder import RunFolder

    key, expert, t = CASES[case]
    pipe = quant_run(key)
    adapter = get_adapter(pipe.adapter.name)
    root = pipe.run_dir
    if expert:
        adapter, root = adapter.expert(expert), RunFolder(root).expert(expert).path
    feeds = adapter.example_inputs(POINT, seed=3)
    if t is not None:
        feeds["timestep"] = torch.full_like(feeds["timestep"], t)
    return adapter, root, {k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()}


def _fp8(adapter, root, **kw):
    from trt_sora.runners.fp8_runner import TorchFp8Runner

    return TorchFp8Runner(adapter, root / "quant" / "qdq_map.json", root / "calib" / "stats.safetensors",
                          **{"device": "cpu", **kw}).activate()


def _fake_quant(adapter, root):
    from trt_sora.runners import TorchFakeQuantRunner

    return TorchFakeQuantRunner(adapter, root / "quant" / "qdq_map.json",
                                root / "calib" / "stats.safetensors").activate()


def _planned_gemms(root) -> int:
    """Quantized GEMMs of the Q/DQ graph, read from ``qdq_map.json`` alone: every quantized linear site
    that is not fused into another (a fused Q/K/V or K/V group is one GEMM)."""
    qmap = json.loads((root / "quant" / "qdq_map.json").read_text())
    return sum(1 for e in qmap["sites"] if e.get("kind") == "linear" and not e.get("excluded")
               and "fused_into" not in e)


def _cos(a, b):
    a, b = torch.as_tensor(a).double().flatten(), torch.as_tensor(b).double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("fp8_attention", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_blocks_match_the_fake_quant_runner(quant_run, case, fp8_attention):
    from trt_sora.runners.fp8_runner import AttentionPolicy

    adapter, root, feeds = _side(quant_run, case)
    want = _fake_quant(adapter, root).infer(feeds)["sample"]
    r = _fp8(adapter, root, attention=AttentionPolicy(enabled=fp8_attention))
    got = r.infer(feeds)["sample"]
    assert got.shape == want.shape
    assert _cos(got, want) > MIN_COS[fp8_attention], case
    rep = r.report()
    assert rep["fp8_gemms_per_call"] == r.expected_gemms() == _planned_gemms(root) > 0
    assert rep["bf16_gemms_per_call"] == 0  # every block linear is quantized under rtx4090-fp8
    assert rep["fp8_attention_layers"] == (len(r.blocks) if fp8_attention else 0)


def test_i2v_blocks_fuse_the_image_kv_at_its_own_scale(quant_run):
    """Wan 2.1 I2V: one FP8 GEMM over add_k_proj + add_v_proj per block, reading the image tokens at
    their own calibrated scale (the max stats amax of both linears), not the text K/V's."""
    from trt_sora.calibrate.stats import CalibStats

    adapter, root, feeds = _side(quant_run, "i2v")
    stats = CalibStats.load(root / "calib" / "stats.safetensors")
    r = _fp8(adapter, root)
    for blk in r.blocks:
        assert blk.image_len == adapter.image_len and blk.kv_img.fp8
        names = [f"{blk.name}.attn2.add_{x}_proj" for x in "kv"]
        want = max(float(stats.amax[n].max()) for n in names) / 448.0
        assert blk.kv_img.act_scale.item() == pytest.approx(want, rel=1e-6)
        assert blk.kv_img.out_features == 2 * blk.kv2.in_features


def test_ti2v_block_modulates_each_token_by_its_own_frame(quant_run):
    """Wan 2.2 TI2V: one fused block against the fake-quant model's diffusers block on the same inputs,
    with a per-token timestep embedding [B, S, 6, C] that differs per latent frame (as the model makes
    it). On whole calls the per-frame difference is small in a random-weight model (its final
    modulation, outside the blocks, dominates), so the block is judged alone."""
    adapter, root, _ = _side(quant_run, "ti2v")
    fq, r = _fake_quant(adapter, root), _fp8(adapter, root)
    cfg = fq.model.config
    g = torch.Generator().manual_seed(0)
    b, f, h, w, c = 2, 3, 4, 6, cfg.num_attention_heads * cfg.attention_head_dim
    s = f * (h // 2) * (w // 2)
    x, enc = torch.randn(b, s, c, generator=g), torch.randn(b, 9, c, generator=g)
    temb = (torch.randn(b, f, 1, 6, c, generator=g) * 0.5).expand(b, f, s // f, 6, c).reshape(b, s, 6, c)
    rope = fq.model.rope(torch.zeros(b, cfg.in_channels, f, h, w))
    with torch.inference_mode():
        want = fq.model.blocks[0](x, enc, temb, rope)
        got = r.blocks[0](x.bfloat16(), enc.bfloat16(), temb, rope)
    assert _cos(got.float(), want) > MIN_COS[True]


@pytest.mark.parametrize("case", ["i2v", "ti2v", "pair"])
def test_check_on_torch_fp8_passes_on_the_cpu(quant_run, tmp_path, case):
    """`check --backend torch-fp8 --device cpu` runs every parity level of the variant's run folder with
    the fused blocks (a pair: both experts, switched at the boundary) and passes its gates."""
    from trt_sora.parity import check_artifacts

    pipe = quant_run(case)
    run = tmp_path / "run"
    shutil.copytree(pipe.run_dir, run)
    rep = check_artifacts(run, pipe.recipe, backend="torch-fp8", device="cpu")
    assert rep["passed"], rep["failed"]
    ran = rep["candidate"]["device"]
    assert rep["backend"] == "torch-fp8" and rep["candidate"]["executed"]
    assert ran["fp8_gemms_per_call"] > 0 and ran["fp8_attention_layers"] > 0
    if case == "pair":
        assert set(rep["candidate"]["experts"]) == {"high", "low"}
        assert {c.get("expert") for c in rep["comparisons"] if c["level"].startswith("qdq[")} == {"high", "low"}


def test_generate_on_the_pair_through_torch_fp8(quant_run):
    """`generate` on the pair served by torch-fp8 (two runners, each its own plan; unverified: on the
    CPU no SM can vouch, and this run folder has no check): the high-noise expert serves the steps
    above the boundary, the low-noise one the rest, and the clip is the ONNX Runtime Q/DQ graph's
    within FP8 noise."""
    import trt_sora.runtime as rt
    from trt_sora.runners.fp8_runner import TorchFp8Runner
    from trt_sora.serve.quality import compare_clips

    pipe = quant_run("pair")
    sr = rt.load(pipe.run_dir, backend="torch-fp8", device="cpu", force=True, warmup=False)
    (experts,) = sr._runners
    assert {e: type(r) for e, r in experts.runners.items()} == {"high": TorchFp8Runner, "low": TorchFp8Runner}
    assert experts.runners["high"].plan.keys() == experts.runners["low"].plan.keys()
    assert experts.runners["high"].plan != experts.runners["low"].plan  # each expert its own calibration
    (clip,) = rt.generate(sr, "a cat walks", seed=9)
    assert clip.metadata["experts"]["steps"] == {"high": [0, 1, 2, 3], "low": [4, 5]}
    assert experts.calls["high"] > 0 and experts.calls["low"] > 0
    (ort,) = rt.generate(rt.load(pipe.run_dir, backend="ort", force=True, warmup=False), "a cat walks", seed=9)
    # the bar of tests/runtime/test_generate_families.py: FP8 arithmetic on both sides, 40 dB worst frame
    assert compare_clips(ort.frames, clip.frames)["worst_psnr_db"] > 40.0


# -- GPU: the Triton kernels and torch._scaled_mm ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_graphs_replay_eager_exactly_and_track_bf16(quant_run, case):
    """On the GPU: CUDA-graph replay is bit-identical to the eager call, the FP8 output tracks the BF16
    PyTorch model (cosine) and the fake-quant runner, and every planned GEMM ran in FP8."""
    from trt_sora.runners.registry import OpenOptions, get_backend

    adapter, root, feeds = _side(quant_run, case)
    want = _fake_quant(adapter, root).infer(feeds)["sample"]
    bf16 = get_backend("torch").open(root, {}, adapter, OpenOptions(device="cuda", dtype="bf16")).infer(feeds)
    eager = _fp8(adapter, root, device="cuda", cuda_graphs=False)
    graph = _fp8(adapter, root, device="cuda", cuda_graphs=True)
    a = eager.infer(feeds)["sample"]
    b1, b2 = graph.infer(feeds)["sample"], graph.infer(feeds)["sample"]
    assert (b1 == a).all() and (b2 == a).all() and graph.report()["cuda_graphs"] == 1
    assert _cos(a, want) > MIN_COS[True] and _cos(a, bf16["sample"]) > 0.99
    assert eager.report()["fp8_gemms_per_call"] == eager.expected_gemms() == _planned_gemms(root)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["i2v", "ti2v", "pair"])
def test_gpu_check_on_torch_fp8_then_load_serves_it(quant_run, tmp_path, case):
    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    pipe = quant_run(case)
    run = tmp_path / "run"
    shutil.copytree(pipe.run_dir, run)
    rep = check_artifacts(run, pipe.recipe, backend="torch-fp8", device="cuda")
    assert rep["passed"], rep["failed"]
    sr = rt.load(run, backend="torch-fp8", warmup=False)
    if case == "pair":
        (clip,) = rt.generate(sr, "a cat walks", seed=9)
        assert clip.metadata["experts"]["steps"] == {"high": [0, 1, 2, 3], "low": [4, 5]}
