"""The ``torch-fp8`` backend executes the Q/DQ graph's calibration: same sites, scales, exclusions.

CPU tests run the backend's blocks with the pure-torch reference kernels (the wiring and scale
math); ``gpu`` tests run the Triton kernels and ``torch._scaled_mm`` (skipped without a GPU).
"""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trt_sora.calibrate.fake_quant import fake_quant_fp8_e4m3  # noqa: E402
from trt_sora.sm import parse_sm  # noqa: E402


def _runner(run, device="cpu", **kw):
    from trt_sora.runners.fp8_runner import TorchFp8Runner

    return TorchFp8Runner("wan-tiny", run / "quant" / "qdq_map.json", run / "calib" / "stats.safetensors",
                          device=device, **kw).activate()


def _feeds(seed=0, batch=2, t=700.0):
    from trt_sora.models import get_adapter

    point = {"batch": batch, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 9}
    f = get_adapter("wan-tiny").example_inputs(point, seed=seed)
    f["timestep"] = torch.full((batch,), t)
    return {k: v.numpy() for k, v in f.items()}


def _cos(a, b):
    a, b = torch.as_tensor(a).double().flatten(), torch.as_tensor(b).double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def test_backend_quantizes_exactly_the_qdq_map_sites(base_run):
    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.models.wan_fp8 import Gemm

    qmap = json.loads((base_run / "quant" / "qdq_map.json").read_text())
    stats = CalibStats.load(base_run / "calib" / "stats.safetensors")
    quantized = set()
    for e in qmap["sites"]:
        if e.get("kind") == "linear" and not e.get("excluded") and "fused_into" not in e:
            quantized.update(e.get("members") or [e["site"]])
    r = _runner(base_run)
    assert set(r.plan) == quantized
    # independent of site_amaxes: the input scale is the max stats amax over every linear reading the tensor
    by_tensor: dict[str, list[str]] = {}
    for e in qmap["sites"]:
        if e.get("kind") == "linear" and not e.get("excluded") and "fused_into" not in e:
            by_tensor.setdefault(e["tensor"], []).extend(e.get("members") or [e["site"]])
    for members in by_tensor.values():
        want = max(float(stats.amax[m].max()) for m in members)
        for m in members:
            assert r.plan[m].act_amax == pytest.approx(want, rel=0, abs=0)
    gemms = {n: m for n, m in r.model.named_modules() if isinstance(m, Gemm)}
    blk = r.blocks[0]
    assert blk.qkv.fp8 and blk.ff2.fp8
    assert blk.qkv.act_scale.item() == pytest.approx(r.plan["blocks.0.attn1.to_q"].act_amax / 448.0, rel=1e-7)
    r.infer(_feeds())
    rep = r.report()
    assert rep["fp8_gemms_per_call"] == r.expected_gemms() == sum(int(g.fp8) for g in gemms.values()) > 0
    assert rep["bf16_gemms_per_call"] == sum(int(not g.fp8) for g in gemms.values())
    assert rep["fp8_attention_layers"] == len(r.blocks) and rep["bf16_attention_layers"] == 0


#: Each GEMM of a fused block and the diffusers linears it computes (stacked on N when several).
GEMM_SITES = {"qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "out1": ("attn1.to_out.0",),
              "q2": ("attn2.to_q",), "kv2": ("attn2.to_k", "attn2.to_v"), "out2": ("attn2.to_out.0",),
              "ff1": ("ffn.net.0.proj",), "ff2": ("ffn.net.2",)}


def test_every_gemm_reads_its_input_at_the_plans_scale(base_run):
    """Every FP8 GEMM of every block: its input scale is the calibration's (max stats amax over the
    linears it computes, / 448), and the FP8 codes its fused producer wrote dequantize, at that
    scale, to the input the fake-quant model gives the same linear. A producer that quantizes with
    another GEMM's scale (e.g. GELU's output at the FFN-up input's) keeps the scale table right but
    rescales the codes by the ratio of the two scales."""
    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.runners import TorchFakeQuantRunner

    stats = CalibStats.load(base_run / "calib" / "stats.safetensors")
    fq = TorchFakeQuantRunner("wan-tiny", base_run / "quant" / "qdq_map.json", stats)
    fq.activate()
    r = _runner(base_run)
    want_in, got_in = {}, {}
    fq_mods = dict(fq.model.named_modules())
    for blk in r.blocks:
        for attr, sites in GEMM_SITES.items():
            gemm, names = getattr(blk, attr), [f"{blk.name}.{s}" for s in sites]
            assert gemm.fp8, f"{blk.name}.{attr} runs in BF16"
            want_scale = max(float(stats.amax[n].max()) for n in names) / 448.0
            assert gemm.act_scale.item() == pytest.approx(want_scale, rel=1e-6), f"{blk.name}.{attr}"
            gemm.register_forward_pre_hook(lambda m, a, k=names[0]: got_in.__setitem__(k, (a[0], m.act_scale)))
            fq_mods[names[0]].register_forward_pre_hook(lambda m, a, k=names[0]: want_in.__setitem__(k, a[0]))
    feeds = _feeds(seed=3)
    fq.infer(feeds)
    r.infer(feeds)
    assert set(got_in) == set(want_in) == {f"{b.name}.{s[0]}" for b in r.blocks for s in GEMM_SITES.values()}
    for k, (x, scale) in got_in.items():
        assert x.dtype == torch.float8_e4m3fn, f"{k}: the producer did not quantize its output"
        got = x.double() * scale.double()
        # the fake-quant model's input as that linear's Q/DQ sees it (clipped and rounded at its scale)
        want = fake_quant_fp8_e4m3(want_in[k].float(), scale.float() * 448.0).double().reshape(got.shape)
        # E4M3 rounds each value to within 2^-4 of itself (3 mantissa bits) and bf16 activations add
        # 2^-8: the relative L2 error of a correctly scaled input stays well below 0.1, while a code
        # written at another GEMM's scale is off by |1 - ratio of the scales| (0.54 on wan-tiny's FFN).
        rel = float((got - want).norm() / want.norm())
        assert rel < 0.1, f"{k}: FP8 input off the fake-quant model's by {rel:.3f} (relative L2)"


def test_fast_accumulation_reaches_every_fp8_gemm(base_run):
    from trt_sora.models.wan_fp8 import Gemm

    for fast in (False, True):
        r = _runner(base_run, fast_accum=fast)
        gemms = [m for m in r.model.modules() if isinstance(m, Gemm) and m.fp8]
        assert len(gemms) == r.expected_gemms() > 0 and {m.fast_accum for m in gemms} == {fast}
        assert r.report()["gemm_fast_accum"] is False  # the CPU reference kernels accumulate in fp32


@pytest.mark.parametrize("with_stats_weight_amax", [False, True])
def test_weight_prequantization_round_trip(with_stats_weight_amax):
    from trt_sora.models.wan_fp8 import Gemm

    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g) * torch.logspace(-2, 1, 48)[:, None]
    w_amax = w.abs().amax(1) * 0.8 if with_stats_weight_amax else None
    gemm = Gemm(w, torch.randn(48, generator=g), 3.0, w_amax, {})
    want = fake_quant_fp8_e4m3(w, w.abs().amax(1) if w_amax is None else w_amax, axis=0)
    assert torch.equal(gemm.dequantized_weight(), want)
    assert gemm.w8.dtype == torch.float8_e4m3fn and gemm.act_scale.item() == pytest.approx(3.0 / 448.0)
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    y = gemm(x).float()
    want_y = fake_quant_fp8_e4m3(x.float(), torch.tensor(3.0)) @ want.t() + gemm.bias.float()
    torch.testing.assert_close(y, want_y, atol=0.02 * want_y.abs().max().item(), rtol=0.02)


@pytest.mark.parametrize("fp8_attention,min_cos", [(False, 0.999), (True, 0.995)])
def test_cpu_blocks_match_the_fake_quant_runner(base_run, fp8_attention, min_cos):
    from trt_sora.runners import TorchFakeQuantRunner
    from trt_sora.runners.fp8_runner import AttentionPolicy

    fq = TorchFakeQuantRunner("wan-tiny", base_run / "quant" / "qdq_map.json", base_run / "calib" / "stats.safetensors")
    fq.activate()
    r = _runner(base_run, attention=AttentionPolicy(enabled=fp8_attention))
    feeds = _feeds(seed=3)
    want = fq.infer(feeds)["sample"]
    got = r.infer(feeds)["sample"]
    assert _cos(got, want) > min_cos
    assert r.report()["fp8_attention_layers"] == (len(r.blocks) if fp8_attention else 0)
    # the unfused rung computes the same GEMMs
    g = _runner(base_run, mode="gemm")
    assert _cos(g.infer(feeds)["sample"], want) > 0.999
    assert g.report()["fp8_gemms_per_call"] == len(g.plan)


def test_attention_policy_by_block_and_timestep(base_run):
    from trt_sora.runners.fp8_runner import AttentionPolicy

    pol = AttentionPolicy(exclude=("blocks.0",), timesteps=(200.0, 1000.0))
    r = _runner(base_run, attention=pol)
    r.infer(_feeds(t=700.0))
    assert (r.report()["fp8_attention_layers"], r.report()["bf16_attention_layers"]) == (len(r.blocks) - 1, 1)
    r.infer(_feeds(t=100.0))
    assert r.report()["fp8_attention_layers"] == 0
    assert AttentionPolicy.from_dict(pol.to_dict()) == pol


def test_attention_kernel_is_chosen_by_the_policy_and_reported(base_run):
    """``kernel="cudnn-fp8"`` reaches every block (on the CPU: its emulation) and the report's policy;
    the default stays the INT8 kernel; an unknown kernel is a typed error naming the choices."""
    from trt_sora.errors import ConfigError
    from trt_sora.runners.fp8_runner import AttentionPolicy

    feeds = _feeds(seed=5)
    int8 = _runner(base_run)
    cud = _runner(base_run, attention=AttentionPolicy(kernel="cudnn-fp8"))
    bf16 = _runner(base_run, attention=AttentionPolicy(enabled=False))
    a, b, want = (r.infer(feeds)["sample"] for r in (int8, cud, bf16))
    assert {blk.attention_kernel for blk in cud.blocks} == {"cudnn-fp8"}
    assert {blk.attention_kernel for blk in int8.blocks} == {"int8"}
    assert not (a == b).all() and _cos(b, want) > 0.99
    rep = cud.report()
    assert rep["attention_policy"]["kernel"] == "cudnn-fp8" and rep["fp8_attention_layers"] == len(cud.blocks)
    assert "kernel" not in int8.report()["attention_policy"]  # the default is not recorded: older reports match
    assert AttentionPolicy.from_dict(rep["attention_policy"]) == AttentionPolicy(kernel="cudnn-fp8")
    with pytest.raises(ConfigError, match="int8"):
        AttentionPolicy(kernel="cudnn")


def test_int8_cute_kernel_is_the_int8_math_and_recorded(base_run):
    """``kernel="int8-cute"`` (the CuTe DSL kernel on SM 9.0) computes what ``int8`` does: on the CPU both run
    the same reference, equal to the bit; the blocks and the report's policy carry the choice (the check's
    settings are the ones the runtime loads), and an artifact's policy reads back to it."""
    from trt_sora.runners.fp8_runner import AttentionPolicy

    feeds = _feeds(seed=7)
    int8 = _runner(base_run)
    cute = _runner(base_run, attention=AttentionPolicy(kernel="int8-cute"))
    assert (int8.infer(feeds)["sample"] == cute.infer(feeds)["sample"]).all()
    assert {blk.attention_kernel for blk in cute.blocks} == {"int8-cute"}
    rep = cute.report()
    assert rep["attention_policy"]["kernel"] == "int8-cute" and rep["fp8_attention_layers"] == len(cute.blocks)
    assert AttentionPolicy.from_dict(rep["attention_policy"]) == AttentionPolicy(kernel="int8-cute")


def test_int8_artifacts_are_refused_with_the_fix(base_run, tmp_path):
    from trt_sora.errors import ArtifactError
    from trt_sora.runners.fp8_runner import fp8_plan

    qmap = json.loads((base_run / "quant" / "qdq_map.json").read_text())
    for e in qmap["sites"]:
        if e.get("format"):
            e["format"] = "int8"
    with pytest.raises(ArtifactError, match="backend='ort'"):
        fp8_plan(qmap, base_run / "calib" / "stats.safetensors")


# -- GPU: the Triton kernels and torch._scaled_mm ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True])
def test_gpu_backend_matches_fake_quant_and_graphs_replay_exactly(base_run, fast_accum):
    from trt_sora.runners import TorchFakeQuantRunner
    from trt_sora.runners.fp8_runner import AttentionPolicy

    fq = TorchFakeQuantRunner("wan-tiny", base_run / "quant" / "qdq_map.json", base_run / "calib" / "stats.safetensors")
    fq.activate()
    feeds = _feeds(seed=4)
    want = fq.infer(feeds)["sample"]
    for attn, min_cos in ((False, 0.999), (True, 0.995)):
        kw = dict(attention=AttentionPolicy(enabled=attn), fast_accum=fast_accum)
        eager = _runner(base_run, device="cuda", cuda_graphs=False, **kw)
        graph = _runner(base_run, device="cuda", cuda_graphs=True, **kw)
        a = eager.infer(feeds)["sample"]
        b1, b2 = graph.infer(feeds)["sample"], graph.infer(feeds)["sample"]
        assert _cos(a, want) > min_cos
        assert (b1 == a).all() and (b2 == a).all()
        assert graph.report()["cuda_graphs"] == 1
        assert eager.report()["fp8_gemms_per_call"] == eager.expected_gemms() > 0
        assert eager.report()["gemm_fast_accum"] is fast_accum


@pytest.mark.gpu
def test_gpu_report_counts_the_graph_that_replayed(base_run):
    """check's level order captures the qdq level's graph (8-bit attention off) after the loop's (on), then
    replays the loop's: the report must count the replayed graph, not the last one captured."""
    import dataclasses

    r = _runner(base_run, device="cuda")
    feeds, on = _feeds(seed=2), r.attention
    off = dataclasses.replace(on, enabled=False)
    seen = []
    for policy in (on, off, on, off):  # two captures, then two replays
        r.attention = policy
        r.infer(feeds)
        rep = r.report()
        seen.append((rep["fp8_attention_layers"], rep["bf16_attention_layers"]))
    n = len(r.blocks)
    assert r.report()["cuda_graphs"] == 2 and n > 0
    assert seen == [(n, 0), (0, n), (n, 0), (0, n)]


def test_runtime_refuses_torch_fp8_without_its_own_parity_report(checked_run):
    import trt_sora.runtime as rt
    from trt_sora.errors import ArtifactError

    with pytest.raises(ArtifactError, match="--backend torch-fp8"):
        rt.load(checked_run, backend="torch-fp8", device="cpu", warmup=False)


@pytest.mark.gpu
def test_gpu_check_on_torch_fp8_then_auto_serves_it(base_run, tmp_path):
    """`check --backend torch-fp8` runs the parity matrix on the real kernels and says what ran;
    `load(backend="auto")` then picks torch-fp8 on this GPU."""
    import shutil

    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    rep = check_artifacts(run, "rtx4090-fp8", backend="torch-fp8", device="cuda")
    assert rep["passed"], rep["failed"]
    ran = rep["candidate"]["device"]
    assert rep["candidate"]["executed"] and rep["backend"] == "torch-fp8"
    assert ran["fp8_gemms_per_call"] > 0 and ran["fp8_attention_layers"] == 2 and parse_sm(ran["sm"]) >= (8, 9)
    sr = rt.load(run, backend="auto")
    assert sr.backend == "torch-fp8"
    # the runtime runs the GEMM accumulation the check ran (the recipe's torch_fp8.gemm_fast_accum)
    assert ran["gemm_fast_accum"] is True
    assert {r.fast_accum for r in sr._runners} == {True}
    out = sr.infer(_feeds(seed=9))["sample"]
    assert out.shape == (2, 16, 3, 4, 6)


@pytest.mark.gpu
def test_gpu_cudnn_attention_kernel_in_the_runner(base_run):
    """The runner on cuDNN's FP8 SDPA (eager and CUDA graph) against BF16 attention, and what it reports."""
    from trt_sora.kernels import cudnn_attention
    from trt_sora.runners.fp8_runner import AttentionPolicy

    if not cudnn_attention.available("cuda"):
        pytest.skip(f"cuDNN FP8 SDPA unavailable here: {cudnn_attention.versions()}")
    feeds = _feeds(seed=6)
    want = _runner(base_run, device="cuda", attention=AttentionPolicy(enabled=False)).infer(feeds)["sample"]
    pol = AttentionPolicy(kernel="cudnn-fp8")
    eager = _runner(base_run, device="cuda", cuda_graphs=False, attention=pol)
    graph = _runner(base_run, device="cuda", cuda_graphs=True, attention=pol)
    a = eager.infer(feeds)["sample"]
    b1, b2 = graph.infer(feeds)["sample"], graph.infer(feeds)["sample"]
    assert _cos(a, want) > 0.99
    assert (b1 == a).all() and (b2 == a).all()
    rep = eager.report()
    assert rep["attention_kernel"] == "cudnn-fp8" and rep["cudnn"]["frontend"]
