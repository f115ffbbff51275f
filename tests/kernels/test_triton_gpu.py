"""Triton kernels of the torch-fp8 backend against their pure-torch references (GPU only)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from khelpers import (  # noqa: E402
    RESIDUAL_NORM_VARIANTS,
    assert_operands_match,
    assert_qkv_epilogue_matches,
    residual_norm_inputs,
    run_attention,
)

from trt_sora.kernels import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu


def _tri():
    from trt_sora.kernels import triton_ops

    return triton_ops


def _deq_close(a, b, scale, max_mismatch=0.01):
    """FP8 outputs: equal but for rare one-step rounding flips (reduction order differs)."""
    da, db = a.float() * scale, b.float() * scale
    mism = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
    assert mism <= max_mismatch, mism
    assert ((da - db).abs() <= 0.13 * db.abs() + 1e-6).all()


@pytest.mark.parametrize("c", [64, 1536, 5120])
@pytest.mark.parametrize("variant", RESIDUAL_NORM_VARIANTS)
def test_residual_norm_quant(c, variant):
    t = _tri()
    x, kw, sc = residual_norm_inputs(variant, 2, 257, c, torch.Generator(device="cuda").manual_seed(c))
    xa, ya = t.residual_norm_quant(x, **kw)
    xb, yb = ref.residual_norm_quant(x, **kw)
    torch.testing.assert_close(xa.float(), xb.float(), atol=1e-5, rtol=8e-3)  # one bf16 ulp (FMA vs mul+add)
    if "act_scale" in kw:
        _deq_close(ya, yb, sc)
    else:
        torch.testing.assert_close(ya.float(), yb.float(), atol=0.02, rtol=0.01)


def test_elementwise_kernels():
    t = _tri()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(3, 1000, 384, device="cuda", generator=g) * 3).to(torch.bfloat16)
    sc = torch.tensor(9.0 / 448, device="cuda")
    _deq_close(t.gelu_quant(h, sc), ref.gelu_quant(h, sc), sc)
    torch.testing.assert_close(t.gelu_quant(h, None).float(), ref.gelu_quant(h, None).float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(t.quantize(h, sc).view(torch.uint8), ref.quantize(h, sc).view(torch.uint8))
    gate = torch.randn(3, 384, device="cuda", generator=g)
    torch.testing.assert_close(t.gated_add(h, h * 0.5, gate).float(),
                               (h.float() + (h * 0.5).float() * gate[:, None]).to(torch.bfloat16).float(),
                               atol=1e-5, rtol=8e-3)
    o = torch.randn(3, 4, 1000, 64, device="cuda", generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(t.heads_to_tokens(o).float(), ref.heads_to_tokens(o).float())
    _deq_close(t.heads_to_tokens(o, sc), ref.heads_to_tokens(o, sc), sc)


def _qkv_inputs(b=2, s=1000, h=4, d=128, seed=1):
    return (*ref.example_qkv(b, s, h, d, seed=seed), h)


def test_qkv_epilogue_bf16_and_8bit():
    assert_qkv_epilogue_matches(_tri(), *_qkv_inputs())


def _bytes(x):
    return x.view(torch.uint8) if x.element_size() == 1 else x


def test_epilogue_program_orders_give_identical_results():
    """The tile passes compute the same bits whichever grid axis runs fastest (heads or token blocks),
    for the bf16 and the 8-bit outputs, with a ragged last block and two batch rows."""
    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=2, s=1000, h=3)
    shipped = t.EPILOGUE_HEADS_FAST
    outs = {}
    try:
        for hf in (False, True):
            t.EPILOGUE_HEADS_FAST = hf
            outs[hf] = (t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
                        + t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True))
    finally:
        t.EPILOGUE_HEADS_FAST = shipped
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):  # V^T's padding too: zeros, read by the kernels
        assert torch.equal(_bytes(a), _bytes(b)), i


@pytest.mark.parametrize("k", [1536, 8960])
def test_fp8_gemm_fast_accumulation(k):
    """Both accumulations stay within bf16 output rounding of the fp32 product of the same FP8
    operands, and the fast flag reaches cuBLASLt (its results differ from the exact ones: no silent no-op)."""
    from trt_sora.kernels import ops

    g = torch.Generator(device="cuda").manual_seed(k)
    m, n = 2048, 1536
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    xs, ws = ref.dequant_scale(x.abs().amax()), ref.dequant_scale(w.abs().amax(1))
    x8, w8 = ref.quantize(x, xs), ref.quantize(w, ws[:, None])
    ws = ws.reshape(1, -1).contiguous()
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    want = (x8.float() * xs) @ (w8.float() * ws.reshape(-1, 1)).t() + bias.float()
    got = {fast: ops.linear_fp8(x8, w8, xs, ws, bias, None, fast) for fast in (False, True)}
    for fast, y in got.items():
        err = ((y.float() - want).norm() / want.norm()).item()
        assert err < 6e-3, (fast, err)
    assert not torch.equal(got[False], got[True])


@pytest.mark.parametrize("s", [1000, 4096, 32760])
def test_attention_8bit_vs_fp32(s):
    """Realistic K bias, head dim 128: cosine >= 0.999 against fp32 softmax attention."""
    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=1, s=s, h=2)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    o = t.attention_fp8(*t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True))
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    cos_ = torch.nn.functional.cosine_similarity(o.float().flatten(), want.flatten(), dim=0).item()
    assert cos_ >= 0.999, cos_
    sc = torch.tensor(float(want.abs().max()) / 448, device="cuda")
    o8 = t.attention_fp8(*t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True), out_scale=sc)
    _deq_close(o8, ref.quantize(o, sc), sc, max_mismatch=0.02)


@pytest.mark.parametrize("s", [100, 1000])
def test_attention_configs_give_identical_results(s):
    """The autotuner may pick any config (tile, warps, stages, PIPE), and K/V may come through TMA
    descriptors or pointer loads: each one must compute the same bits, with a ragged last key tile and
    with no full tile at all."""
    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=1, s=s, h=2)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    outs = []
    for tma, cfg in ((tma, cfg) for tma in (False, True) for cfg in t._attn_configs()):
        o = run_attention(t, ops8, cfg, tma=tma)
        assert not o.isnan().any()
        outs.append(o)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("b,s", [(1, 100), (1, 128), (1, 129), (2, 1000), (1, 4133)])
@pytest.mark.parametrize("stages,pingpong", [(2, 0), (3, 1), (4, 0), (4, 1)])
def test_warp_specialized_attention_equals_triton_kernel(b, s, stages, pingpong):
    """The Gluon kernel (producer warp, two consumer warpgroups, asynchronous products) computes the
    Triton kernel's bits, bf16 and FP8 output: ragged last tile, one tile, no full tile, a second query
    half past S, batch 2 (a key tile that runs into the next head's rows), ring depths, ping-pong on and off."""
    from trt_sora.kernels import gluon_attention as g

    if not g.available():
        pytest.skip("needs Gluon's warp specialization and SM 9.x")
    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=b, s=s, h=2)
    ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    want = t.attention_fp8(*ops, ws=False)
    assert torch.equal(g.attention_fp8_ws(*ops, config=(stages, 240, 24, pingpong)), want)
    sc = torch.tensor(float(want.float().abs().max()) / 448, device="cuda")
    want8 = t.attention_fp8(*ops, out_scale=sc, ws=False)
    got8 = g.attention_fp8_ws(*ops, out_scale=sc, config=(stages, 240, 24, pingpong))
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))


@pytest.mark.parametrize("grid,tile,window", [((5, 16, 30), (1, 8, 16), (1, 1, 1)),   # ragged edge tiles
                                              ((21, 8, 16), (1, 8, 16), (2, 0, 0)),   # one tile per frame
                                              ((9, 30, 52), (3, 8, 16), (1, 1, 1))])  # 3-frame tiles, 14k tokens
def test_block_sparse_attention_vs_the_masked_reference(grid, tile, window):
    """The kernel's sparse path (TMA and pointer loads, every config, bf16 and FP8 out) against fp32 attention
    over the same mask: cosine >= 0.999; the same bits across loads; with every tile listed, the dense kernel's
    bits; the mask matters (far from dense attention)."""
    import math

    from trt_sora.sparse import kernel_blocks, token_mask

    t = _tri()
    s, h = math.prod(grid), 2
    qkv, wq, wk, cos, sin, _ = _qkv_inputs(b=1, s=s, h=h)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    mask = torch.from_numpy(token_mask(grid, tile, window, 1, order="tile")).cuda()
    blocks = tuple(torch.from_numpy(a).cuda() for a in kernel_blocks(grid, tile, window, 1))
    want = ref.heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask)).float().flatten()
    dense = ref.heads_to_tokens(ref.attention(q, k, v)).float().flatten()
    o = t.attention_fp8(*ops8, blocks=blocks, tma=True)
    assert torch.equal(o, t.attention_fp8(*ops8, blocks=blocks, tma=False))
    cos_ = torch.nn.functional.cosine_similarity
    assert cos_(o.float().flatten(), want, dim=0).item() >= 0.999
    assert cos_(o.float().flatten(), dense, dim=0).item() < 0.99
    sc = torch.tensor(float(want.abs().max()) / 448, device="cuda")
    _deq_close(t.attention_fp8(*ops8, blocks=blocks, out_scale=sc), ref.quantize(o, sc), sc, max_mismatch=0.02)
    full = tuple(torch.from_numpy(a).cuda() for a in kernel_blocks(grid, tile, (99, 99, 99)))
    assert torch.equal(t.attention_fp8(*ops8, blocks=full, tma=True), t.attention_fp8(*ops8, tma=True))


def test_fused_sparse_self_attention_matches_the_cpu_reference():
    """``ops.self_attention`` with a sparse seam (tile order, block-sparse kernel) on CUDA against the same call
    on the CPU reference kernels."""
    from trt_sora.kernels import ops
    from trt_sora.sparse import tile_sparse

    grid, tile, h = (6, 16, 24), (2, 8, 8), 4
    qkv, wq, wk, cos, sin, _ = _qkv_inputs(b=1, s=6 * 16 * 24, h=h)
    got = ops.self_attention(qkv, wq, wk, cos, sin, h, 1e-6, fp8=True,
                             sparse=tile_sparse(grid, tile, (1, 0, 1), 0, "cuda")).float().cpu()
    want = ops.self_attention(*(x.cpu() for x in (qkv, wq, wk, cos, sin)), h, 1e-6, fp8=True,
                              sparse=tile_sparse(grid, tile, (1, 0, 1), 0, "cpu")).float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() >= 0.999


@pytest.mark.parametrize("s,lens", [(1000, (1000, 700, 512, 77)), (4133, (4133, 3968))])
def test_attention_with_key_lengths(s, lens):
    """Key lengths (= S, ragged, tile-aligned, no full tile): the epilogue's operands are the reference's
    (the dense test's bounds), the valid rows track fp32 attention under the key mask (cosine >= 0.999),
    every config and TMA / pointer loads give the same bits, garbage in the padding changes no valid
    row's bits, lengths of S are the dense kernel's bits, and the Gluon kernel refuses key lengths."""

    from trt_sora.errors import ConfigError

    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=len(lens), s=s, h=2)
    key_len = torch.tensor(lens, dtype=torch.int32, device="cuda")
    valid = ref.key_valid(key_len, s)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=key_len)
    q8, qs, k8, ks, vt8, vs = ops8
    assert_operands_match(ops8, ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=key_len), s)
    o = t.attention_fp8(*ops8, key_len=key_len)
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    want = ref.heads_to_tokens(torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=valid[:, None, None, :])).float()
    for i, n in enumerate(lens):
        c = torch.nn.functional.cosine_similarity(o[i, :n].float().flatten(), want[i, :n].flatten(), dim=0).item()
        assert c >= 0.999, (i, c)
    for tma, cfg in ((tma, cfg) for tma in (False, True) for cfg in t._attn_configs()):
        assert torch.equal(run_attention(t, ops8, cfg, tma=tma, key_len=key_len), o), (tma, cfg)
    junk = torch.where(valid[..., None], qkv, (60 * torch.randn_like(qkv, dtype=torch.float32) - 30).to(qkv.dtype))
    oj = t.attention_fp8(*t.qkv_rmsnorm_rope(junk, wq, wk, cos, sin, h, fp8=True, key_len=key_len), key_len=key_len)
    rows = valid[..., None].expand_as(o)
    assert torch.equal(oj[rows], o[rows])
    full = torch.full_like(key_len, s)
    dense = t.attention_fp8(*t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True), ws=False)
    assert torch.equal(t.attention_fp8(*t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True, key_len=full),
                                       key_len=full), dense)
    with pytest.raises(ConfigError, match="ws=False"):
        t.attention_fp8(*ops8, key_len=key_len, ws=True)


@pytest.mark.parametrize("d", [16])
def test_attention_on_heads_narrower_than_the_int8_dot(d):
    """Heads narrower than 32 channels (the tiny test models): the kernel pads them with zero channels and
    gives the 8-bit reference's result on the unpadded operands (up to the online softmax's running max,
    against which P is quantized), and tracks fp32 attention."""
    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=2, s=300, h=3, d=d)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    q8, qs, k8, ks, vt8, vs = ops8
    o = t.attention_fp8(*ops8).float()
    assert o.shape == (2, 300, 3 * d)
    mine = ref.heads_to_tokens(ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, 300), vs)).float()
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    cos_ = lambda a, b: torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()  # noqa: E731
    assert cos_(o, mine) >= 0.9995 and cos_(o, want) >= 0.999, (cos_(o, mine), cos_(o, want))


@pytest.mark.parametrize("b,s", [(1, 100), (1, 300), (2, 1000), (1, 4133)])
def test_wide_key_tiles(b, s):
    """256-key tiles (``block_n=256``): every config (64 and 128 rows, ring stages) and both loads the same
    bits; the 8-bit reference's result (up to the online softmax's running max) and fp32 attention's, bf16 and
    FP8 output; no tile past S, ragged tiles past V^T's padding, batch 2 (a tile running into the next head)."""


    t = _tri()
    qkv, wq, wk, cos, sin, h = _qkv_inputs(b=b, s=s, h=2)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    q8, qs, k8, ks, vt8, vs = ops8
    o = t.attention_fp8(*ops8, block_n=256)
    outs = [run_attention(t, ops8, cfg, block_n=256, tma=tma) for cfg in t._attn_configs(256) for tma in (True, False)]
    assert all(torch.equal(x, o) for x in outs)
    mine = ref.heads_to_tokens(ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, s), vs)).float()
    q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)
    want = ref.heads_to_tokens(ref.attention(q, k, v)).float()
    cos_ = lambda a, b: torch.nn.functional.cosine_similarity(a.float().flatten(), b.flatten(), dim=0).item()  # noqa: E731
    assert cos_(o, mine) >= 0.9995 and cos_(o, want) >= 0.999, (cos_(o, mine), cos_(o, want))
    sc = torch.tensor(float(o.float().abs().max()) / 448, device="cuda")
    o8 = t.attention_fp8(*ops8, block_n=256, out_scale=sc)
    _deq_close(o8, ref.quantize(o, sc), sc, max_mismatch=0.05)

