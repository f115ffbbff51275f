"""``torch-fp8`` on HunyuanVideo 1.5 (trt_sora/models/hunyuan_fp8.py): the fused dual-stream blocks run the
Q/DQ graph's calibration (same sites, scales, exclusions), attend over video + both text streams + image
tokens with the key mask, and pass ``check --backend torch-fp8``.

CPU tests run the blocks with the pure-torch reference kernels (``trt_sora.kernels.ops`` dispatches off
CUDA); ``gpu`` tests run the Triton kernels, ``torch._scaled_mm`` and CUDA graphs (skipped without a GPU).
The tiny model's per-head QK norm weights are random here: the random init makes them ones, which would
hide a norm applied with another stream's weights.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from run_folders import RECIPE, quantized_run

torch = pytest.importorskip("torch")

MODEL = "hunyuan-tiny"
POINT = {"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 9, "text_len_2": 5}
QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


@pytest.fixture
def run(request):
    """export -> calibrate -> quantize of hunyuan-tiny (tests/run_folders.py's quantized_run: the session's
    run folder; the GPU tests read only calib/ and quant/, which need no TensorRT-RTX, SM 9.0)."""
    return quantized_run(request, MODEL).run_dir


def _model(dtype="fp32"):
    from trt_sora.models import get_adapter

    m = get_adapter(MODEL).load(dtype)
    g = torch.Generator().manual_seed(7)
    for name, mod in m.named_modules():
        if name.endswith(QK_NORMS):
            mod.weight.data = (1 + 0.3 * torch.randn(mod.weight.shape, generator=g)).to(mod.weight.dtype)
    return m


def _runner(run, device="cpu", **kw):
    from trt_sora.runners.fp8_runner import TorchFp8Runner

    return TorchFp8Runner(MODEL, run / "quant" / "qdq_map.json", run / "calib" / "stats.safetensors",
                          device=device, model=_model(), **kw).activate()


def _fake_quant(run, device="cpu"):
    from trt_sora.runners import TorchFakeQuantRunner

    return TorchFakeQuantRunner(MODEL, run / "quant" / "qdq_map.json", run / "calib" / "stats.safetensors",
                                device=device, model=_model()).activate()


def _feeds(seed=4, *, all_keys=False, point=POINT):
    """The adapter's example inputs (both text streams padded, the first sample's ByT5 stream fully masked,
    no image: its tokens masked); ``all_keys``: every key valid (full masks, image tokens given)."""
    from trt_sora.models import get_adapter

    f = get_adapter(MODEL).example_inputs(point, seed=seed)
    if all_keys:
        for m in ("encoder_attention_mask", "encoder_attention_mask_2"):
            f[m] = torch.ones_like(f[m])
        f["image_embeds"] = torch.randn(f["image_embeds"].shape, generator=torch.Generator().manual_seed(seed))
    return {k: v.numpy() for k, v in f.items()}


def _err(a, b) -> float:
    """``1 - cosine``."""
    a, b = torch.as_tensor(a).double().flatten(), torch.as_tensor(b).double().flatten()
    return 1.0 - float(a @ b / (a.norm() * b.norm()))


def _gemm_sites(qmap) -> tuple[list[str], set[str]]:
    """The Q/DQ graph's quantized GEMMs (a fused site once) and the module paths they compute."""
    sites = [e for e in qmap["sites"] if e.get("kind") == "linear" and not e.get("excluded") and "fused_into" not in e]
    return [e["site"] for e in sites], {m for e in sites for m in (e.get("members") or [e["site"]])}


def test_every_planned_gemm_runs_once_in_fp8(run):
    """The plan is the map's quantized linears; one call launches one FP8 GEMM per site of the Q/DQ graph
    (fused Q/K/V once per stream, nothing for the last block's dead text stream) and BF16 GEMMs exactly for
    the blocks' linears the map excludes (the AdaLN modulations)."""
    qmap = json.loads((run / "quant" / "qdq_map.json").read_text())
    gemms, members = _gemm_sites(qmap)
    r = _runner(run)
    assert set(r.plan) == members
    r.infer(_feeds())
    rep = r.report()
    excluded = [e for e in qmap["sites"] if e.get("kind") == "linear" and e.get("excluded")
                and e["site"].startswith("transformer_blocks.") and "fused_into" not in e]
    assert rep["fp8_gemms_per_call"] == len(gemms) == r.expected_gemms() == 13
    assert rep["bf16_gemms_per_call"] == len(excluded) == 4
    # the example inputs mask keys (padding, no image): every layer still runs 8-bit attention (key lengths)
    assert (rep["fp8_attention_layers"], rep["bf16_attention_layers"], rep["attention_keys_padded"]) == (2, 0, True)


def test_a_kernel_without_key_lengths_runs_masked_calls_in_bf16(run):
    """cuDNN's FP8 attention has no key mask: a call with masked keys runs BF16 attention, one without
    runs it in 8 bits."""
    from trt_sora.runners.fp8_runner import AttentionPolicy

    r = _runner(run, attention=AttentionPolicy(enabled=True, kernel="cudnn-fp8"))
    for all_keys, want in ((False, (0, 2)), (True, (2, 0))):
        r.infer(_feeds(all_keys=all_keys))
        rep = r.report()
        assert (rep["fp8_attention_layers"], rep["bf16_attention_layers"]) == want, all_keys


def _outputs(runner, feeds) -> tuple:
    """``(sample, block 0's context output)``: the text stream the next block reads (its error reaches
    the sample only through that block's keys and values)."""
    got = {}

    def keep(_m, _a, out) -> None:  # returns None: the block's output stays as it is
        got["c"] = out[1]

    hook = runner.model.transformer_blocks[0].register_forward_hook(keep)
    try:
        return runner.infer(feeds)["sample"], got["c"].float()
    finally:
        hook.remove()


def test_planned_linears_outside_the_blocks_run_in_fp8(run):
    """A recipe that quantizes the token refiner and the ByT5 projection (excluded by default): those
    linears become FP8 GEMMs too, each launched once per call."""
    from trt_sora.runners.fp8_runner import SitePlan, TorchFp8Runner, fp8_plan

    plan = fp8_plan(run / "quant" / "qdq_map.json", run / "calib" / "stats.safetensors")
    extra = ["context_embedder.proj_in", "context_embedder.token_refiner.refiner_blocks.0.ff.net.2",
             "context_embedder_2.linear_1"]
    r = TorchFp8Runner(MODEL, None, plan={**plan, **{m: SitePlan(m, 4.0) for m in extra}}, device="cpu",
                       model=_model()).activate()
    out = r.infer(_feeds())["sample"]
    assert r.report()["fp8_gemms_per_call"] == 13 + len(extra) and np.isfinite(out).all()


@pytest.mark.parametrize("all_keys", [False, True])
def test_cpu_blocks_match_the_fake_quant_runner(run, all_keys):
    """Fused blocks (8-bit attention, over the valid keys where some are masked) and the unfused rung vs
    the fp32 fake-quant model of the same map, on the sample and on the text stream block 0 hands on.
    Their error is bf16's: the fp32 model is 1 - cos ~ 1e-5 from the fake-quant one (FP8 costs little on
    this model), the bf16 model ~1e-4 (bf16 activations), and torch-fp8 may not add more than half of
    that again. A wrong scale, modulation, norm or mask costs more."""
    from trt_sora.runners import TorchRunner
    from trt_sora.runners.fp8_runner import AttentionPolicy

    feeds = _feeds(all_keys=all_keys)
    want = _outputs(_fake_quant(run), feeds)
    bf16 = _outputs(TorchRunner(MODEL, dtype="bf16", model=_model("bf16")).activate(), feeds)
    floor = [_err(b, w) for b, w in zip(bf16, want)]
    assert all(1e-6 < f < 1e-3 for f in floor), floor
    for attention in (False, True):
        r = _runner(run, attention=AttentionPolicy(enabled=attention))
        got = _outputs(r, feeds)
        assert all(_err(g, w) < 1.5 * f for g, w, f in zip(got, want, floor)), [_err(g, w) for g, w in zip(got, want)]
        assert r.report()["fp8_attention_layers"] == (2 if attention else 0)
    g = _runner(run, mode="gemm")
    assert _err(g.infer(feeds)["sample"], want[0]) < 1.5 * floor[0]
    assert g.report()["fp8_gemms_per_call"] == len(g.plan) == 21


def test_padded_text_streams_give_the_unpadded_output(run):
    """Padding in both text streams (random values under a zero mask) changes nothing: the same prompt
    without its padding gives the same video (a mask dropped anywhere - joint attention, refiner - reads
    the padded tokens)."""
    point = {**POINT, "batch": 1}
    padded = _feeds(seed=11, point=point)
    padded["encoder_attention_mask_2"][:, :3] = 1.0  # the ByT5 stream holds 3 of its 5 tokens
    n, n2 = (int(padded[m].sum()) for m in ("encoder_attention_mask", "encoder_attention_mask_2"))
    assert n < POINT["text_len"] and n2 == 3
    bare = dict(padded)
    for m, e, k in (("encoder_attention_mask", "encoder_hidden_states", n),
                    ("encoder_attention_mask_2", "encoder_hidden_states_2", n2)):
        bare[m], bare[e] = padded[m][:, :k], padded[e][:, :k]
    r = _runner(run)
    a, b = r.infer(padded)["sample"], r.infer(bare)["sample"]
    assert r.report()["attention_keys_padded"]  # the image tokens stay masked
    assert r.report()["fp8_attention_layers"] == 2  # the valid keys first, a key length per sample
    # the same sums over the valid keys, up to bf16 rounding of the output
    assert np.abs(a - b).max() <= 2.0 ** -7 * np.abs(b).max()


def _block_case(s=96, n=12):
    """Block 0 of the tiny model with QK norm weights near 2, video and context Q/K/V for 2 samples
    (``s`` video, ``n`` context tokens) and RoPE tables: ``(block, qkv, qkv_c, (cos, sin))``."""
    from trt_sora.models import get_adapter
    from trt_sora.models.hunyuan_fp8 import FusedHunyuanBlock

    blk = FusedHunyuanBlock(get_adapter(MODEL).load().transformer_blocks[0], "transformer_blocks.0", {}, {})
    g = torch.Generator().manual_seed(0)
    for t in ("nq", "nk", "nq_c", "nk_c"):
        getattr(blk, t).copy_(2.0 + 0.5 * torch.randn(getattr(blk, t).shape, generator=g))
    c = blk.ones.numel()
    qkv, qkv_c = (torch.randn(2, k, 3 * c, generator=g).to(torch.bfloat16) for k in (s, n))
    ang = torch.rand(s, c // blk.heads // 2, generator=g) * 6.28
    return blk, qkv, qkv_c, (ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1))


def test_8bit_attention_reads_the_normed_qk_as_they_are():
    """With every key valid, the block's 8-bit joint attention is its BF16 one up to 8-bit rounding (the
    kernels' operands take the per-head normed, rotated Q/K unchanged: unit statistics and weights). QK
    norm weights near 2 make the logits large enough that a rescaled Q/K (a norm taken again over all
    heads) changes the softmax."""
    blk, qkv, qkv_c, cs = _block_case()
    n = qkv_c.shape[1]
    outs = []
    for fp8 in (False, True):
        blk.fp8_attention = fp8
        outs.append(blk._attention(qkv, qkv_c, torch.ones(2, n, dtype=torch.bool), cs))
    # INT8 Q/K per 128-token block and FP8 V/P: 1 - cos ~ 1e-3 (reference kernels' tests); a norm taken
    # again over all heads: ~0.4
    assert _err(outs[1].float(), outs[0].float()) < 2e-3


def test_8bit_attention_over_masked_keys_is_the_masked_bf16_attention():
    """Context keys masked at the start, in the middle and at the end (image, ByT5 and MLLM padding): the
    block's 8-bit joint attention (valid context tokens first, a key length, outputs put back) is its BF16
    attention under the key mask up to 8-bit rounding on every valid row, garbage in the masked tokens
    changes none of those rows' bits, and the mask matters (all keys give another answer)."""
    from trt_sora.models.hunyuan_fp8 import valid_first

    blk, qkv, qkv_c, cs = _block_case()
    s, n = qkv.shape[1], qkv_c.shape[1]
    keys = torch.ones(2, n, dtype=torch.bool)
    keys[:, :3] = False
    keys[0, 6:8] = False
    keys[1, 9:] = False
    slot, key_len = valid_first(keys, s)
    assert slot[0].tolist() == [7, 8, 9, 0, 1, 2, 10, 11, 3, 4, 5, 6] and key_len.tolist() == [s + 7, s + 6]
    rows = torch.nn.functional.pad(keys, (s, 0), value=True)

    def attend(fp8, ctx, k):
        blk.fp8_attention = fp8
        return blk._attention(qkv, ctx, k, cs)[rows].float()

    want = attend(False, qkv_c, keys)
    got = attend(True, qkv_c, keys)
    assert _err(got, want) < 2e-3  # 8-bit rounding (the all-keys bound)
    junk = torch.where(keys[..., None], qkv_c, (40 * torch.randn(qkv_c.shape) + 9).to(torch.bfloat16))
    assert torch.equal(attend(True, junk, keys), got)
    assert _err(attend(False, qkv_c, torch.ones_like(keys)), want) > 1e-2


def test_keys_are_all_valid_only_without_any_mask():
    from trt_sora.models import get_adapter

    a = get_adapter(MODEL)
    full = {k: torch.as_tensor(v) for k, v in _feeds(all_keys=True).items()}
    assert a.attention_keys_all_valid(full)
    assert not a.attention_keys_all_valid({**full, "image_embeds": torch.zeros_like(full["image_embeds"])})
    for m in a.mask_inputs:
        one_pad = full[m].clone()
        one_pad[-1, -1] = 0.0
        assert not a.attention_keys_all_valid({**full, m: one_pad}), m


def test_check_torch_fp8_on_cpu_then_generate(run, tmp_path, capsys):
    """`trt-sora check --backend torch-fp8 --device cpu` passes on the tiny run folder and records what
    ran; generate through torch-fp8 (forced: a CPU report does not vouch for FP8 tensor cores) gives the
    clip the checked model's torch backend gives, within FP8's cost (the bar of test_generate_families)."""
    import trt_sora.runtime as rt
    from trt_sora.cli import main
    from trt_sora.config import dump_recipe, load_recipe
    from trt_sora.serve.quality import compare_clips

    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    r = load_recipe(RECIPE)
    recipe = tmp_path / "cheap.yaml"
    recipe.write_text(dump_recipe(dataclasses.replace(r, parity=dataclasses.replace(r.parity, num_samples=1,
                                                                                     loop_steps=2))))
    assert main(["check", "--run", str(folder), "--recipe", str(recipe), "--backend", "torch-fp8",
                 "--device", "cpu"]) == 0
    assert "13 FP8 GEMMs" in capsys.readouterr().out
    rep = json.loads((folder / "parity" / "report.json").read_text())
    ran = rep["candidate"]["device"]
    assert rep["passed"] and rep["backend"] == "torch-fp8" and ran["fp8_gemms_per_call"] == 13
    prompt = 'a sign that says "OPEN" in a window'
    (clip,) = rt.generate(rt.load(folder, backend="torch-fp8", device="cpu", force=True, warmup=False), prompt,
                          seed=3, steps=2)
    (ref,) = rt.generate(rt.load(folder, backend="torch", device="cpu", warmup=False), prompt, seed=3, steps=2)
    assert clip.frames.shape == ref.frames.shape == (9, 64, 96, 3)
    assert compare_clips(ref.frames, clip.frames)["worst_psnr_db"] >= 40.0


# -- GPU: the Triton kernels, torch._scaled_mm, CUDA graphs -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("all_keys", [False, True])
def test_gpu_graphs_replay_eager_exactly_and_stay_close_to_bf16(run, all_keys):
    from trt_sora.runners import TorchRunner
    from trt_sora.runners.fp8_runner import AttentionPolicy

    feeds = _feeds(seed=5, all_keys=all_keys)
    bf16 = TorchRunner(MODEL, dtype="bf16", device="cuda", model=_model("bf16").cuda()).activate()
    ref = bf16.infer(feeds)["sample"]
    want = _fake_quant(run, device="cuda").infer(feeds)["sample"]
    for fast_accum in (False, True):
        kw = dict(attention=AttentionPolicy(enabled=True), fast_accum=fast_accum)
        eager = _runner(run, device="cuda", cuda_graphs=False, **kw)
        graph = _runner(run, device="cuda", cuda_graphs=True, **kw)
        a = eager.infer(feeds)["sample"]
        b1, b2 = graph.infer(feeds)["sample"], graph.infer(feeds)["sample"]
        assert (b1 == a).all() and (b2 == a).all() and graph.report()["cuda_graphs"] == 1
        rep = eager.report()
        assert rep["fp8_gemms_per_call"] == eager.expected_gemms() == 13
        assert rep["fp8_attention_layers"] == 2 and rep["gemm_fast_accum"] is fast_accum
        assert _err(a, ref) < 1e-3 and _err(a, want) < 1e-3


@pytest.mark.gpu
def test_gpu_check_on_torch_fp8_then_serves_it(run, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts
    from trt_sora.sm import parse_sm

    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    rep = check_artifacts(folder, RECIPE, backend="torch-fp8", device="cuda")
    assert rep["passed"], rep["failed"]
    ran = rep["candidate"]["device"]
    assert ran["fp8_gemms_per_call"] == 13 and parse_sm(ran["sm"]) >= (8, 9)
    sr = rt.load(folder, backend="torch-fp8")
    (clip,) = rt.generate(sr, "a cat walks", seed=3, steps=2)
    assert clip.frames.shape == (9, 64, 96, 3)
