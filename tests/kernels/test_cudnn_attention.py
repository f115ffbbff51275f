"""cuDNN's FP8 SDPA as the second 8-bit attention kernel: its pure-torch emulation against fp32 attention
and the INT8 recipe (CPU), the typed error without the frontend, and the kernel against the emulation (GPU)."""
from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

from trt_sora.kernels import ops  # noqa: E402
from trt_sora.kernels import reference as ref  # noqa: E402


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _qkv(s: int, h: int = 2, device: str = "cpu", seed: int = 0):
    """bf16 Q, K, V [1, H, S, 128] of one Wan-like layer (per-channel K bias) and the layer's inputs."""
    inputs = ref.example_qkv(1, s, h, seed=seed, device=device)
    qkv, wq, wk, cos, sin = inputs
    return ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, 1e-6, fp8=False), inputs


def test_operands_are_per_tensor_fp8_of_smoothed_k():
    (q, k, v), _ = _qkv(300)
    q8, k8, v8, qd, kd, vd = ref.sdpa_fp8_operands(q, k, v)
    ks = k.float() - k.float().mean(2, keepdim=True)
    for x8, d, x in ((q8, qd, q.float()), (k8, kd, ks), (v8, vd, v.float())):
        assert x8.dtype == ref.FP8 and d.shape == (1, 1, 1, 1)
        assert d.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-6)
        assert x8.float().abs().max().item() == 448.0  # the amax element lands on the top code
        err = (x8.float() * d - x).abs()
        assert (err <= x.abs() / 16 + d * 2.0 ** -9).all()  # E4M3: half a step of 3 mantissa bits
    assert (k8.float() * kd).mean(2).abs().max() < 0.05 * kd.item() * 448  # the bias is gone


def test_emulation_follows_the_cudnn_graph_step_by_step():
    """The FP8 SDPA graph's nodes in their order: Q K^T, * attn_scale, * descale_q, * descale_k, softmax
    against the row max, P * scale_s to FP8, P V, * descale_s, * descale_v, / row sum, * scale_o to FP8."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 64, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    q8, k8, v8, qd, kd, vd = ref.sdpa_fp8_operands(q, k, v)
    sc = torch.tensor(0.004)
    s = ((q8.float() @ k8.float().transpose(-1, -2)) * 128 ** -0.5) * qd * kd
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
    p8 = (e * 448.0).clamp(max=448).to(ref.FP8)
    o = (p8.float() @ v8.float()) * (1 / 448.0) * vd / e.sum(-1, keepdim=True)
    want = (o / sc).clamp(-448, 448).to(ref.FP8).transpose(1, 2).reshape(1, 64, 256)
    got = ref.sdpa_fp8(q8, k8, v8, qd, kd, vd, out_scale=sc)
    assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01  # rare order-of-rounding flips


def test_emulation_vs_fp32_and_the_int8_recipe():
    """Per-tensor FP8 Q K^T (3 mantissa bits on the logits) costs about twice the error of INT8 per
    128-token block: the cuDNN kernel's recipe misses the 0.999 cosine the INT8 one reaches."""
    (q, k, v), (qkv, wq, wk, cs, sn) = _qkv(2048)
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    cudnn_bf16 = ref.sdpa_fp8(*ref.sdpa_fp8_operands(q, k, v))
    int8 = ref.heads_to_tokens(ref.attention_fp8(*ref.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, 2, 1e-6)[:6]))
    c_fp8, c_int8 = _cos(cudnn_bf16.float(), want), _cos(int8.float(), want)
    assert cudnn_bf16.dtype == torch.bfloat16 and cudnn_bf16.shape == (1, 2048, 256)
    assert 0.997 < c_fp8 < 0.999 < c_int8
    # FP8 Q K^T alone: the same P V on exact logits is much closer
    q8, k8, v8, qd, kd, vd = ref.sdpa_fp8_operands(q, k, v)
    exact_qk = ref.sdpa_fp8(q.float() / qd, (k.float() - k.float().mean(2, keepdim=True)) / kd, v8, qd, kd, vd)
    assert 1 - _cos(exact_qk.float(), want) < 0.6 * (1 - c_fp8)


def test_emulation_fp8_output_at_the_consumer_scale():
    (q, k, v), _ = _qkv(500)
    ops_ = ref.sdpa_fp8_operands(q, k, v)
    bf16 = ref.sdpa_fp8(*ops_).float()
    sc = torch.tensor(bf16.abs().max().item() / 448)
    o8 = ref.sdpa_fp8(*ops_, out_scale=sc)
    assert o8.dtype == ref.FP8
    assert _cos(o8.float() * sc, bf16) > 0.999  # two FP8 roundings of one output, at different scales
    small = ref.sdpa_fp8(*ops_, out_scale=sc / 4)  # values past 448 * scale saturate, never NaN
    assert not small.float().isnan().any() and small.float().abs().max().item() == 448.0


def test_self_attention_selects_the_kernel():
    (q, k, v), (qkv, wq, wk, cs, sn) = _qkv(256)
    got = ops.self_attention(qkv, wq, wk, cs, sn, 2, 1e-6, fp8=True, kernel="cudnn-fp8")
    assert torch.equal(got, ref.sdpa_fp8(*ref.sdpa_fp8_operands(q, k, v)))
    int8 = ops.self_attention(qkv, wq, wk, cs, sn, 2, 1e-6, fp8=True)
    assert not torch.equal(got, int8) and _cos(got.float(), int8.float()) > 0.996
    with pytest.raises(ValueError, match="cudnn-fp8"):
        ops.self_attention(qkv, wq, wk, cs, sn, 2, 1e-6, fp8=True, kernel="cudnn")


def test_missing_frontend_is_a_typed_error_naming_the_install(monkeypatch):
    from trt_sora.errors import BackendMissingError
    from trt_sora.kernels import cudnn_attention

    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn -> ImportError
    with pytest.raises(BackendMissingError, match="pip install nvidia-cudnn-frontend==1.14.0"):
        cudnn_attention.require()
    assert "nvidia-cudnn-frontend" in cudnn_attention.versions()["error"]
    assert not cudnn_attention.available("cpu")


# -- GPU: cuDNN's kernel ---------------------------------------------------------------------------------------
def _cudnn():
    from trt_sora.kernels import cudnn_attention

    if not cudnn_attention.available("cuda"):
        pytest.skip(f"cuDNN FP8 SDPA unavailable here: {cudnn_attention.versions()}")
    return cudnn_attention


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1000, 4096, 32760])
def test_gpu_cudnn_matches_its_emulation(s):
    """The kernel computes the emulation's math up to its online softmax: cuDNN quantizes each key tile's
    probabilities against the running row max, the emulation against the row's final max, so the bf16
    outputs agree to cosine 0.999 (the 8-bit paths' own bar against fp32). Its FP8 output is the same
    result rounded once more at ``out_scale``: cosine 0.998 to its own bf16 output (E4M3's half step is
    2^-4 relative), and within the format's range."""
    c = _cudnn()
    (q, k, v), _ = _qkv(s, h=1 if s > 8192 else 2, device="cuda")  # the emulation holds S x S fp32 per head
    ops_ = ref.sdpa_fp8_operands(q, k, v)
    want = ref.sdpa_fp8(*ops_)
    got = c.attention(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert _cos(got.float(), want.float()) > 0.999
    sc = torch.tensor(want.float().abs().max().item() / 448, device="cuda")
    g8 = c.attention(q, k, v, sc)
    assert g8.dtype == ref.FP8 and g8.shape == want.shape
    assert _cos(g8.float() * sc, got.float()) > 0.998
    assert g8.float().abs().max().item() <= 448


@pytest.mark.gpu
def test_gpu_cudnn_vs_fp32_and_saturation():
    """Against fp32 on the K-bias data the kernel is as close as its emulation (below 0.999: FP8 Q K^T);
    an output scale too small saturates at 448 as the emulation does."""
    c = _cudnn()
    (q, k, v), _ = _qkv(16384, device="cuda")
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    emu = _cos(ref.sdpa_fp8(*ref.sdpa_fp8_operands(q, k, v)).float(), want)
    got = _cos(c.attention(q, k, v).float(), want)
    assert got > 0.997 and abs(got - emu) < 2e-4, (got, emu)
    sc = torch.tensor(want.abs().max().item() / 448 / 4, device="cuda")
    o8 = c.attention(q, k, v, sc).float()
    assert not o8.isnan().any() and o8.abs().max().item() == 448.0
