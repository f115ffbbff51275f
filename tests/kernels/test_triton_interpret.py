"""The torch-fp8 backend's Triton kernels on the CPU, through Triton's interpreter, against their
pure-torch references (:mod:`trt_sora.kernels.reference`) at small shapes.

The GPU tests (test_triton_gpu.py) hold the compiled kernels to the same references; these run
the kernels' own index and masking arithmetic, ragged tiles included, where no GPU is. The
interpreter must be chosen before Triton is imported (its language library is decorated at
import), so :func:`test_kernels_under_the_interpreter` runs this file again in a fresh process with
``TRITON_INTERPRET=1``; there, the ``interp`` tests below run and the runner is skipped.

One fix of the interpreter's own. It rounds fp32 -> FP8 E4M3 half-up on the truncated mantissa
and lets a mantissa carry spill into the exponent (31.6 becomes 16), and it truncates fp32 -> bf16,
where the GPU's ``cvt.rn`` rounds to nearest even: the ``t`` fixture swaps those conversions for
ml_dtypes' (round to nearest even, as the GPU and torch do), so FP8 outputs compare bit for bit.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
ml_dtypes = pytest.importorskip("ml_dtypes")

from khelpers import (  # noqa: E402
    RESIDUAL_NORM_VARIANTS,
    assert_operands_match,
    assert_qkv_epilogue_matches,
    bits,
    residual_norm_inputs,
    run_attention,
)

from trt_sora.kernels import reference as ref  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_the_interpreter's process")


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    # started in this folder, not the checkout's root (which -m would put first on sys.path): the
    # package comes from the environment, as in this process (tests/mutations.py relies on it)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         cwd=Path(__file__).resolve().parent, env=env, capture_output=True, text=True, timeout=600)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout and " error" not in res.stdout, tail


@pytest.fixture(scope="module")
def t():
    """``triton_ops`` with the interpreter's FP8 conversion fixed (see the module docstring)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from trt_sora.kernels import triton_ops

    original = interpreter._convert_float
    dtypes = {tl.float32: np.float32, tl.float16: np.float16, tl.bfloat16: ml_dtypes.bfloat16}
    narrow = {tl.float8e4nv: (ml_dtypes.float8_e4m3fn, np.uint8), tl.bfloat16: (ml_dtypes.bfloat16, np.uint16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype in narrow and input_dtype in dtypes and input_dtype != output_dtype:
            x = np.frombuffer(input.tobytes(), dtype=dtypes[input_dtype]).astype(np.float32)
            to, raw = narrow[output_dtype]
            return x.astype(to).view(raw).reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_convert_float", convert)
    yield triton_ops
    mp.undo()


def _bf16_close(a, b):
    """At most one bf16 step (2^-7 relative at the bottom of a binade), or within 2^-8 of the largest
    reference value: an error that scales with the largest terms, as a reordered sum's does."""
    b = b.float()
    torch.testing.assert_close(a.float(), b, rtol=2 ** -7, atol=2 ** -8 * b.abs().max().item())


def _fp8_close(a, b, scale, max_mismatch):
    """FP8 codes at ``scale``: at most one E4M3 step (2^-3 relative) apart, or within 2^-6 of the
    largest value, and different in at most ``max_mismatch`` of the elements."""
    da, db = a.float() * scale, b.float() * scale
    torch.testing.assert_close(da, db, rtol=2 ** -3, atol=2 ** -6 * db.abs().max().item())
    assert (bits(a) != bits(b)).float().mean().item() <= max_mismatch


@interp
def test_interpreter_fp8_rounding_is_the_gpus(t):
    """The fixed conversion: torch's E4M3 rounding at ties and mantissa carries."""
    x = torch.tensor([168.0, 176.0, 31.6458, -31.7917, 127.75, 0.0013, -448.0, 1000.0]).to(torch.bfloat16)
    sc = torch.tensor(1.0)
    assert torch.equal(bits(t.quantize(x, sc)), bits(ref.quantize(x, sc)))


# Tolerances: the interpreter takes each reduction (LayerNorm and RMS statistics) in numpy's order
# and rounds a*b+c twice where the GPU fuses it; the reference takes torch's order. That moves an
# fp32 value by a few ulps of the largest terms, which can move its bf16 or FP8 rounding by one step
# at a boundary: outputs are held to one step of their format (see _bf16_close, _fp8_close).
@interp
@pytest.mark.parametrize("c", [64, 80, 100])
@pytest.mark.parametrize("variant", RESIDUAL_NORM_VARIANTS)
def test_residual_norm_quant(t, variant, c):
    # rows of 64 channels (one segment), 64 + 16 (two, none masked: Wan 14B's 4,096 + 1,024) and 64 + 36 (the
    # second segment of 64 masked past the row)
    x, kw, sc = residual_norm_inputs(variant, 2, 37, c, torch.Generator().manual_seed(3))
    xa, ya = t.residual_norm_quant(x, **kw)
    xb, yb = ref.residual_norm_quant(x, **kw)
    _bf16_close(xa, xb)
    if "act_scale" in kw:
        _fp8_close(ya, yb, sc, max_mismatch=0.08)
    else:
        _bf16_close(ya, yb)


@interp
@pytest.mark.parametrize("variant", ["residual_gate_mod", "gated_add"])
def test_per_token_modulation_reads_each_rows_own_vectors(t, variant):
    """Wan 2.2 TI2V: the AdaLN vectors are per token, [B, S, C] views of one [B, S, 6, C] tensor
    (row stride 6C), as the fused block slices them; every row must read its own."""
    g = torch.Generator().manual_seed(5)
    b, s, c = 2, 37, 100  # two segments of the row, 64 + 64 (masked past 100)
    x = torch.randn(b, s, c, generator=g).to(torch.bfloat16)
    r = torch.randn(b, s, c, generator=g).to(torch.bfloat16)
    gate, ms, mh = (torch.randn(b, s, 6, c, generator=g) * 0.3).unbind(-2)[:3]
    assert gate.stride() == (s * 6 * c, 6 * c, 1)
    sc = torch.tensor(6.0 / 448)
    if variant == "gated_add":
        _bf16_close(t.gated_add(x, r, gate), (x.float() + r.float() * gate).to(torch.bfloat16))
        return
    kw = dict(branch=r, gate=gate, mod_scale=ms, mod_shift=mh, act_scale=sc)
    xa, ya = t.residual_norm_quant(x, **kw)
    xb, yb = ref.residual_norm_quant(x, **kw)
    _bf16_close(xa, xb)
    _fp8_close(ya, yb, sc, max_mismatch=0.08)


@interp
def test_elementwise_kernels(t):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(3, 50, 64, generator=g) * 3).to(torch.bfloat16)
    sc = torch.tensor(9.0 / 448)
    _fp8_close(t.gelu_quant(h, sc), ref.gelu_quant(h, sc), sc, max_mismatch=0.05)
    _bf16_close(t.gelu_quant(h, None), ref.gelu_quant(h, None))
    assert torch.equal(bits(t.quantize(h, sc)), bits(ref.quantize(h, sc)))  # one division, one rounding
    gate = torch.randn(3, 64, generator=g)
    want = (h.float() + (h * 0.5).float() * gate[:, None]).to(torch.bfloat16)
    _bf16_close(t.gated_add(h, h * 0.5, gate), want)
    o = torch.randn(2, 4, 37, 32, generator=g).transpose(1, 2).contiguous().transpose(1, 2).to(torch.bfloat16)
    assert torch.equal(t.heads_to_tokens(o), ref.heads_to_tokens(o))  # a copy
    assert torch.equal(bits(t.heads_to_tokens(o, sc)), bits(ref.heads_to_tokens(o, sc)))
    x = torch.randn(5000, generator=g).to(torch.bfloat16)
    assert torch.equal(t.abs_scaled(x, torch.tensor(0.25)), x.float().abs() * 0.25)  # a power of two: exact


@pytest.fixture(scope="module")
def qkv_case():
    """150 tokens (a full 128-token tile and a ragged one), 2 heads of 64."""
    qkv, wq, wk, cos, sin = ref.example_qkv(1, 150, 2, 64, seed=1, device="cpu")
    return qkv, wq, wk, cos, sin, 2


@interp
def test_qkv_epilogue_bf16_and_8bit(t, qkv_case):
    qkv, wq, wk, cos, sin, h = qkv_case
    torch.testing.assert_close(t.rms_stats(qkv), ref.rms_stats(qkv), rtol=1e-5, atol=0)  # 128-term sums
    assert_qkv_epilogue_matches(t, qkv, wq, wk, cos, sin, h)  # the GPU test's bounds


@interp
def test_qkv_epilogue_rounds_int8_half_away_from_zero(t):
    """Q at exact half steps of its INT8 scale (the block's max 127 makes the scale 1, and 1 / 1 is exact) rounds
    away from zero, the reference's rule, not to even: 2.5 -> 3, -2.5 -> -3, 0.5 -> 1, -0.5 -> -1."""
    s, h, d = 128, 1, 16
    q = torch.zeros(1, s, d)
    q[0, 0, 0] = 127.0
    q[0, 1, :4] = torch.tensor([2.5, -2.5, 0.5, -0.5])
    kv = torch.randn(1, s, 2 * d, generator=torch.Generator().manual_seed(6))
    qkv = torch.cat([q, kv], -1).to(torch.bfloat16)
    ones, rstd = torch.ones(d, dtype=torch.bfloat16), torch.ones(s, 2)
    q8, qs = t.qkv_rmsnorm_rope(qkv, ones, ones, None, None, h, fp8=True, rstd=rstd)[:2]
    assert qs[0, 0, 0].item() == 1.0
    assert q8[0, 0, 1, :4].tolist() == [3, -3, 1, -1]
    assert torch.equal(q8, ref.qkv_rmsnorm_rope(qkv, ones, ones, None, None, h, fp8=True, rstd=rstd)[0])


@interp
@pytest.mark.parametrize("heads,d", [(3, 16), (5, 128)])
def test_qkv_epilogue_on_widths_not_a_multiple_of_the_rms_chunk(t, heads, d):
    """Q and K widths of 48 and 640 channels (the RMS pass reads 64 and 512 at a time): the statistics
    sum Q's channels and K's alone, so the 8-bit operands are the reference's."""
    qkv, wq, wk, cos, sin = ref.example_qkv(1, 20, heads, d, seed=2, device="cpu")
    torch.testing.assert_close(t.rms_stats(qkv), ref.rms_stats(qkv), rtol=1e-5, atol=0)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads, fp8=True)
    ref8 = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads, fp8=True)
    assert_operands_match(ops8, ref8, qkv.shape[1])
    assert (ops8[0].int() - ref8[0].int()).abs().max() <= 2


@interp
def test_qkv_epilogue_passes_normed_qk_through(t, qkv_case):
    """No RoPE, unit statistics and weights (a family whose Q/K arrive normalized per head, HunyuanVideo):
    the 8-bit operands hold Q and K as given, the kernels' as the reference's."""
    qkv, _, _, _, _, h = qkv_case
    c, s = qkv.shape[-1] // 3, qkv.shape[1]
    ones, rstd = torch.ones(c, dtype=torch.bfloat16), torch.ones(s, 2)
    q8, qs, k8, ks, vt8, vs = t.qkv_rmsnorm_rope(qkv, ones, ones, None, None, h, fp8=True, rstd=rstd)
    rq8, rqs, rk8, rks, rv8, rvs, k_mean = ref.qkv_rmsnorm_rope(qkv, ones, ones, None, None, h, fp8=True, rstd=rstd)
    torch.testing.assert_close(qs, rqs, rtol=1e-6, atol=0)
    assert (q8.int() - rq8.int()).abs().max() <= 1 and (k8.int() - rk8.int()).abs().max() <= 2
    assert torch.equal(bits(ref.vt_natural(vt8, s)), bits(rv8))
    q = qkv[..., :c].unflatten(-1, (h, -1)).transpose(1, 2).float()
    deq = q8.float() * qs.repeat_interleave(128, dim=2)[:, :, :s, None]
    torch.testing.assert_close(deq, q, rtol=0, atol=qs.max().item() / 2)  # INT8 rounding of Q itself


@interp
def test_attention_configs_match_fp32_attention_and_each_other(t, qkv_case):
    """Both autotuner configs (64-row and 128-row query tiles, PIPE): the same bits, bf16 and FP8
    output, and cosine >= 0.999 against fp32 softmax attention (a per-channel K bias in the inputs)."""

    qkv, wq, wk, cos, sin, h = qkv_case
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    q8, qs, k8, ks, vt8, vs = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    b, _, s, d = q8.shape
    osc = torch.tensor(float(want.abs().max()) / 448)
    outs = {}
    for fp8 in (False, True):
        for cfg in t._attn_configs():
            o = run_attention(t, (q8, qs, k8, ks, vt8, vs), cfg, out_scale=osc if fp8 else None)
            outs.setdefault(fp8, []).append(o)
    for fp8, (a, b_) in outs.items():
        assert torch.equal(bits(a), bits(b_)), fp8
    o = outs[False][0].float()
    assert not o.isnan().any()
    assert torch.nn.functional.cosine_similarity(o.flatten(), want.flatten(), dim=0).item() >= 0.999
    _fp8_close(outs[True][0], ref.quantize(outs[False][0], osc), osc, max_mismatch=0.05)


@interp
@pytest.mark.parametrize("s", [150, 300, 700])
def test_wide_key_tiles_track_fp32_attention(t, s):
    """256-key tiles (two K scale blocks each, K's second block scaled 3x so a tile's groups differ): its
    configs the same bits, cosine >= 0.999 against fp32 attention over the dequantized operands and >= 0.9995
    against the 8-bit reference (the online softmax quantizes P against a running max): no full tile (150),
    a ragged tile past V^T's padding (300), full and ragged tiles (700)."""

    qkv, wq, wk, cos, sin = ref.example_qkv(1, s, 2, 64, seed=3, device="cpu")
    q8, qs, k8, ks, vt8, vs = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, 2, fp8=True)
    ks[..., 1::2] *= 3.0
    # 64 and 128 rows; the stages do not change the interpreter's run
    outs = [run_attention(t, (q8, qs, k8, ks, vt8, vs), cfg, block_n=256) for cfg in t._attn_configs(256)[::3]]
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    o = outs[0].float()
    assert not o.isnan().any()
    deq = lambda x8, sc: x8.float() * sc.repeat_interleave(128, dim=2)[:, :, :s, None]  # noqa: E731
    want = ref.heads_to_tokens(ref.attention(deq(q8, qs), deq(k8, ks), ref.vt_natural(vt8, s).float() * vs[:, :, None]))
    mine = ref.heads_to_tokens(ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, s), vs))
    cos_ = lambda a, b: torch.nn.functional.cosine_similarity(a.flatten(), b.float().flatten(), dim=0).item()  # noqa: E731
    assert cos_(o, want) >= 0.999 and cos_(o, mine) >= 0.9995, (cos_(o, want), cos_(o, mine))


@interp
def test_block_sparse_attention_skips_exactly_the_masked_key_tiles(t):
    """The kernel's sparse path over :func:`trt_sora.sparse.kernel_blocks` (a ragged last tile, tiles that
    straddle the grid's rows) against fp32 attention over the same mask, both configs the same bits; with
    every tile listed it is the dense kernel, bit for bit."""
    from trt_sora.sparse import kernel_blocks, token_mask

    grid, tile, window = (6, 8, 13), (1, 8, 16), (0, 0, 0)
    s, h = 624, 2
    qkv, wq, wk, cos, sin = ref.example_qkv(1, s, h, 64, seed=2, device="cpu")
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    mask = torch.from_numpy(token_mask(grid, tile, window, order="tile"))
    assert 0.3 < mask.float().mean() < 0.9
    blocks = tuple(torch.from_numpy(a) for a in kernel_blocks(grid, tile, window))
    outs = [run_attention(t, ops8, cfg, blocks=blocks) for cfg in t._attn_configs()]
    assert torch.equal(outs[0], outs[1])
    got = outs[0].float().flatten()
    masked = ref.heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask)).float().flatten()
    dense = ref.heads_to_tokens(ref.attention(q, k, v)).float().flatten()
    cos_ = torch.nn.functional.cosine_similarity
    assert cos_(got, masked, dim=0).item() >= 0.999
    assert cos_(got, dense, dim=0).item() < 0.99  # the mask changes the answer: skipping is not a no-op
    full = tuple(torch.from_numpy(a) for a in kernel_blocks(grid, tile, (3, 1, 1)))
    for cfg in t._attn_configs():
        assert torch.equal(run_attention(t, ops8, cfg, blocks=full), run_attention(t, ops8, cfg))


@interp
def test_attention_with_key_lengths_attends_the_valid_keys_only(t):
    """Key lengths 300 (= S, a ragged tile), 256 (tile-aligned: a tile wholly past it), 100 (no full tile):
    the epilogue's operands are the reference's (scales over the valid tokens, zeros past them), both
    configs give the same bits, garbage in the padding leaves the valid rows' bits alone, the valid rows
    track fp32 attention under the key mask, and lengths of S are the dense kernel bit for bit."""
    s, h, d = 300, 2, 64
    qkv, wq, wk, cos, sin = ref.example_qkv(3, s, h, d, seed=4, device="cpu")
    key_len = torch.tensor([300, 256, 100], dtype=torch.int32)
    valid = ref.key_valid(key_len, s)
    junk = torch.where(valid[..., None], qkv, (60 * torch.randn(qkv.shape) - 30).to(torch.bfloat16))
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=key_len)
    q8, qs, k8, ks, vt8, vs = ops8
    # the reference's V^T holds zeros past each key length: so must the kernel's
    assert_operands_match(ops8, ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=key_len), s)
    assert not k8[~valid[:, None, :, None].expand_as(k8)].any()
    outs = [run_attention(t, ops8, cfg, key_len=key_len) for cfg in t._attn_configs()]
    assert torch.equal(outs[0], outs[1])
    ops_junk = t.qkv_rmsnorm_rope(junk, wq, wk, cos, sin, h, fp8=True, key_len=key_len)
    got = run_attention(t, ops_junk, t._attn_configs()[1], key_len=key_len)
    rows = valid[..., None].expand_as(got)
    assert torch.equal(got[rows], outs[0][rows])
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    want = ref.heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=valid[:, None, None, :])).float()
    # the reference on the kernel's operands: P rounds to FP8 against the running max there, the row's max
    # here (1.8% on the dense sample too); a softmax sum over padded keys (logit 0) is off by ~20%
    mine = ref.heads_to_tokens(ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, s), vs, key_len=key_len))
    for i, n in enumerate(key_len.tolist()):
        got_i = outs[0][i, :n].float()
        cos_ = torch.nn.functional.cosine_similarity(got_i.flatten(), want[i, :n].flatten(), dim=0)
        assert cos_.item() >= 0.999, (i, cos_)
        assert (got_i - mine[i, :n].float()).norm() / mine[i, :n].float().norm() < 0.03, i
    full = torch.full((3,), s, dtype=torch.int32)
    dense_ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    full_ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=full)
    for cfg in t._attn_configs():
        assert torch.equal(run_attention(t, full_ops, cfg, key_len=full), run_attention(t, dense_ops, cfg))


@pytest.mark.skipif(INTERPRETED, reason="plain Python: runs once, in the main process")
def test_norm_row_segments_cover_the_row_with_the_least_masking():
    from trt_sora.kernels.triton_ops import _segments

    # Wan 14B, Wan 1.3B, HunyuanVideo 1.5 / Wan 5B: two full segments; a power of two: one; else the rest masked
    assert [_segments(c) for c in (5120, 1536, 3072, 4096, 64, 100, 1)] == [
        (4096, 1024), (1024, 512), (2048, 1024), (4096, 0), (64, 0), (64, 64), (1, 0)]
