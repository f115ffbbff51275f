"""The torch-fp8 kernels' math on the CPU: scales, quantization, K smoothing, FP8 attention accuracy."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trt_sora.calibrate.fake_quant import fake_quant_fp8_e4m3  # noqa: E402
from trt_sora.kernels import reference as ref  # noqa: E402


def test_quantize_matches_the_qdq_fake_quant_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-3, 2, 48)
    amax = torch.tensor(7.5)
    got = ref.quantize(x, ref.dequant_scale(amax)).float() * ref.dequant_scale(amax)
    assert torch.equal(got, fake_quant_fp8_e4m3(x, amax))
    per_row = x.abs().amax(1)
    got_rows = ref.quantize(x, ref.dequant_scale(per_row)[:, None]).float() * ref.dequant_scale(per_row)[:, None]
    assert torch.equal(got_rows, fake_quant_fp8_e4m3(x, per_row, axis=0))
    assert ref.dequant_scale(torch.tensor(0.0)).item() == 1.0  # zeros stay zeros, no NaN


def test_block_quant_maps_each_block_amax_onto_448():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 150, 16, generator=g)
    x[:, :, 64:128] *= 50.0  # one loud block must not crush the others' resolution
    blocks = torch.nn.functional.pad(x, (0, 0, 0, 42)).view(2, 3, 3, 64, 16).abs().amax((3, 4))
    for fmt, qmax, tol in (("fp8", 448.0, 0.04), ("int8", 127.0, 0.01)):
        q, s = ref.block_quant(x, 64, fmt)
        assert s.shape == (2, 3, 3)
        torch.testing.assert_close(s, blocks / qmax)
        assert q.float().abs().amax().item() == qmax
        deq = q.float() * s.repeat_interleave(64, 2)[:, :, :150, None]
        assert (deq - x).norm() / x.norm() < tol  # E4M3: 3 mantissa bits; INT8: 7 bits over each block


def _biased_qkv(s=512, d=64, h=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, s, d, generator=g)
    k = torch.randn(1, h, s, d, generator=g) + 4.0 * torch.randn(1, h, 1, d, generator=g)  # per-channel K bias
    v = torch.randn(1, h, s, d, generator=g)
    return q, k, v


def test_fp8_attention_with_k_smoothing_tracks_fp32_attention():
    q, k, v = _biased_qkv()
    want = ref.attention(q, k, v)
    q8, qs = ref.block_quant(q, 128)
    k_mean = k.mean(2, keepdim=True)
    k8, ks = ref.block_quant(k - k_mean, 128)
    vs = ref.dequant_scale(v.abs().amax(2))
    v8 = ref.quantize(v, vs[:, :, None, :])
    got = ref.attention_fp8(q8, qs, k8, ks, v8, vs)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.999
    # without smoothing the bias eats K's range: strictly worse
    k8b, ksb = ref.block_quant(k, 128)
    worse = ref.attention_fp8(q8, qs, k8b, ksb, v8, vs)
    cos_b = torch.nn.functional.cosine_similarity(worse.flatten(), want.flatten(), dim=0)
    assert (1 - cos_b) > 1.5 * (1 - cos)
    # FP8 logits instead of INT8: the error Sage-style INT8 QK avoids
    q8f, qsf = ref.block_quant(q, 128, "fp8")
    k8f, ksf = ref.block_quant(k - k_mean, 128, "fp8")
    fp8_qk = ref.attention_fp8(q8f, qsf, k8f, ksf, v8, vs)
    assert 1 - torch.nn.functional.cosine_similarity(fp8_qk.flatten(), want.flatten(), dim=0) > 1.5 * (1 - cos)


def test_qkv_epilogue_matches_the_plugin_oracle():
    """RMSNorm across heads + RoPE (BF16 path) equals plugins/fused_qkv_attention's reference up to
    the attention call, and the FP8 path dequantizes back to it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "fqa_ref", Path(__file__).parents[2] / "plugins" / "fused_qkv_attention" / "reference.py")
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    g = torch.Generator().manual_seed(3)
    b, s, h, d = 2, 70, 2, 32
    qkv = torch.randn(b, s, 3 * h * d, generator=g).to(torch.bfloat16)
    wq, wk = (1 + 0.1 * torch.randn(h * d, generator=g)).to(torch.bfloat16), torch.ones(h * d, dtype=torch.bfloat16)
    ang = torch.rand(s, d // 2, generator=g) * 6.28
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, 1e-6, fp8=False)
    qo, ko, vo = qkv.chunk(3, -1)
    qo = oracle.rope(oracle.rms_norm(qo, wq, 1e-6).unflatten(-1, (h, d)), cos, sin).transpose(1, 2)
    ko = oracle.rope(oracle.rms_norm(ko, wk, 1e-6).unflatten(-1, (h, d)), cos, sin).transpose(1, 2)
    torch.testing.assert_close(q.float(), qo.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k.float(), ko.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(v, vo.unflatten(-1, (h, d)).transpose(1, 2))
    q8, qs, k8, ks, v8, vs, k_mean = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, 1e-6, fp8=True)
    kd = k8.float() * ks.repeat_interleave(128, 2)[:, :, :s, None] + k_mean[:, :, None]
    assert (kd - k.float()).norm() / k.float().norm() < 0.05
    out = ref.attention_fp8(q8, qs, k8, ks, v8, vs)
    want = ref.attention(q, k, v)
    assert torch.nn.functional.cosine_similarity(out.flatten(), want.flatten(), dim=0) > 0.998


def test_warp_specialized_attention_refuses_without_hopper_and_gluon():
    """Where Gluon or an SM 9.x GPU is missing (this CPU box), the Gluon kernel says so and names the fix
    instead of failing inside Triton."""
    from trt_sora.errors import BackendMissingError
    from trt_sora.kernels import gluon_attention as g

    if g.available():
        pytest.skip("this machine can run the kernel")
    q8 = torch.zeros(1, 1, 128, 128, dtype=torch.int8)
    with pytest.raises(BackendMissingError, match="ws=False"):
        g.attention_fp8_ws(q8, None, q8, None, q8, None)


def test_wide_key_tiles_refuse_what_the_kernel_does_not_run():
    """Keys per tile: 128 or 256, the wider for dense attention on the Triton kernel only; anything else is
    refused with the choices before a launch."""
    pytest.importorskip("triton")
    from trt_sora.errors import ConfigError
    from trt_sora.kernels import triton_ops as t

    x = torch.zeros(1, 1, 128, 128, dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"\(128, 256\) keys per tile"):
        t.attention_fp8(x, x, x, x, x, x, block_n=192)
    for kw in ({"ws": True}, {"key_len": x}, {"blocks": (x, x, x)}):
        with pytest.raises(ConfigError, match="dense attention only"):
            t.attention_fp8(x, x, x, x, x, x, block_n=256, **kw)


def test_vt_key_order_puts_each_lanes_p_operand_in_its_own_accumulator_registers():
    """PTX ISA fragments: the Q K^T accumulator (wgmma / mma C layout) gives lane q of a quad the key
    columns 8c + 2q + {0, 1} (c < 4) of every 32; the FP8 A operand of the P V product (k32) gives it
    operand positions 4q + i and 16 + 4q + i (i < 4). Read in V^T's key order, each lane's operand
    positions hold exactly its own accumulator keys (no shuffles), in register order, and V^T stored
    in that order is a permutation of each group of 16 keys."""
    n = 256
    order = ref.vt_key_order(n)
    assert torch.equal(order.sort().values, torch.arange(n))
    assert torch.equal(order // 16, torch.arange(n) // 16)  # keys stay in their group (and tile)
    for base in range(0, n, 32):
        for q in range(4):
            acc = [base + 8 * c + 2 * q + e for c in range(4) for e in range(2)]  # register order
            operand = [base + 16 * half + 4 * q + i for half in range(2) for i in range(4)]
            assert order[operand].tolist() == acc, (base, q)
    g = torch.Generator().manual_seed(3)
    vt8 = ref.quantize(torch.randn(2, 3, 8, 48, generator=g), 0.01)
    order48 = ref.vt_key_order(48)
    nat = ref.vt_natural(vt8, 40)
    assert nat.shape == (2, 3, 40, 8)
    assert torch.equal(nat.float(), vt8.float()[..., order48.argsort()][..., :40].transpose(-1, -2))
    # P V over keys: the same 48-term sum in either order. In float64 a reordered sum of terms below
    # |p| * |v| <= 448 differs by at most 48 * 448 * 2^-52 ~ 5e-12; a wrong key order moves it by O(1).
    p = torch.rand(5, 48, generator=g, dtype=torch.float64)
    vt = vt8.double()[0, 0]
    keys = vt[:, order48.argsort()]
    torch.testing.assert_close(p[:, order48] @ vt.T, p @ keys.T, rtol=0, atol=1e-9)


def _padded_case(s=300, valid=(300, 170), h=2, d=64, seed=3):
    """Two samples of ``s`` tokens, the second valid up to ``valid[1]``; its padding replaced by loud garbage
    (50x the values, a K bias of its own) in a copy: ``(qkv, padded qkv, wq, wk, cos, sin, key_len)``."""
    qkv, wq, wk, cos, sin = ref.example_qkv(2, s, h, d, seed=seed, device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    junk = qkv.clone()
    n = valid[1]
    junk[1, n:] = (50 * torch.randn(s - n, qkv.shape[-1], generator=g) + 20).to(torch.bfloat16)
    return qkv, junk, wq, wk, cos, sin, torch.tensor(valid, dtype=torch.int32)


def _attend(qkv, wq, wk, cos, sin, key_len, h=2):
    ops8 = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=key_len)
    return ref.attention_fp8(*ops8[:6], key_len=key_len)


def test_fp8_attention_with_key_lengths_tracks_masked_fp32_attention():
    """Key lengths [300, 170] (a ragged tile ends each): cosine >= 0.999 against fp32 SDPA with the
    boolean key mask on the valid tokens' rows (the padded tokens' queries saturate at their block's
    valid scale: their rows are no one's), and the mask matters (dense attention is far off)."""
    qkv, _, wq, wk, cos, sin, key_len = _padded_case()
    got = _attend(qkv, wq, wk, cos, sin, key_len)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, 2, fp8=False)
    mask = (torch.arange(q.shape[2])[None] < key_len[:, None].long())[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    cos_ = torch.nn.functional.cosine_similarity
    for i, n in enumerate(key_len.tolist()):
        assert cos_(got[i, :, :n].flatten(), want[i, :, :n].flatten(), dim=0) >= 0.999, i
    n = int(key_len[1])
    assert cos_(ref.attention(q, k, v)[1, :, :n].flatten(), want[1, :, :n].flatten(), dim=0) < 0.9


def test_padded_keys_never_change_the_valid_tokens():
    """Garbage in the padding gives the valid tokens' outputs bit for bit (K's mean, V's scale and
    the Q/K block scales are taken over the valid tokens only), and the sample without its padding
    gives them up to the K mean's sum over another count of zeros (one fp32 rounding)."""
    qkv, junk, wq, wk, cos, sin, key_len = _padded_case()
    a = _attend(qkv, wq, wk, cos, sin, key_len)
    b = _attend(junk, wq, wk, cos, sin, key_len)
    n = int(key_len[1])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1, :, :n], b[1, :, :n])
    bare = _attend(qkv[1:, :n], wq, wk, cos[:n], sin[:n], key_len[1:])
    torch.testing.assert_close(b[1:, :, :n], bare, rtol=0, atol=1e-6 * bare.abs().max().item())
