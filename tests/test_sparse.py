"""Sparse attention's pattern, reference, mass measurement and plan against brute-force definitions."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trt_sora.config import SparseAttentionConfig, from_dict
from trt_sora.errors import ArtifactError, ConfigError
from trt_sora.sparse import (
    AttentionMass,
    MassRecorder,
    SparsePlan,
    kernel_blocks,
    masked_attention,
    outside_mass,
    plan_sparse,
    token_mask,
)

CASES = [((3, 5, 6), (1, 2, 4), (0, 1, 1), 1), ((2, 4, 4), (2, 2, 2), (0, 0, 0), 0),
         ((4, 3, 7), (2, 2, 3), (1, 0, 1), 0), ((5, 4, 4), (1, 4, 4), (1, 0, 0), 2)]


def _brute_mask(grid, tile, window, global_frames):
    """The module docstring's definition, pair by pair, with its own tile order."""
    tokens = list(itertools.product(*(range(n) for n in grid)))
    tcoord = {t: tuple(a // b for a, b in zip(t, tile)) for t in tokens}
    ordered = sorted(tokens, key=lambda t: (tcoord[t], t))
    vol = math.prod(tile)
    block_of = {t: i // vol for i, t in enumerate(ordered)}
    tiles_in: dict[int, set] = {}
    frames_in: dict[int, set] = {}
    for t in tokens:
        tiles_in.setdefault(block_of[t], set()).add(tcoord[t])
        frames_in.setdefault(block_of[t], set()).add(t[0])
    raster = {t: i for i, t in enumerate(tokens)}
    m = np.zeros((len(tokens),) * 2, bool)
    for a in tokens:
        for b in tokens:
            bi, bj = block_of[a], block_of[b]
            near = any(all(abs(x - y) <= w for x, y, w in zip(ta, tb, window))
                       for ta in tiles_in[bi] for tb in tiles_in[bj])
            m[raster[a], raster[b]] = near or min(frames_in[bj]) < global_frames
    return m


@pytest.mark.parametrize("grid,tile,window,global_frames", CASES)
def test_token_mask_matches_the_definition(grid, tile, window, global_frames):
    got = token_mask(grid, tile, window, global_frames)
    want = _brute_mask(grid, tile, window, global_frames)
    assert np.array_equal(got, want)
    assert 0 < got.mean() < 1  # the cases are sparse, so a mask of all True would fail


def _qkv(s, *, b=2, h=3, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, dtype=dtype) * 2 for _ in range(3)]


def test_masked_attention_is_dense_when_the_window_covers_everything():
    grid = (3, 4, 6)
    q, k, v = _qkv(math.prod(grid), dtype=torch.float32)
    mask = torch.from_numpy(token_mask(grid, (1, 2, 2), (2, 3, 5)))
    assert bool(mask.all())
    assert torch.equal(masked_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v))


def test_masked_attention_matches_a_per_row_softmax():
    grid = (3, 5, 6)
    q, k, v = _qkv(math.prod(grid))
    m = token_mask(grid, (1, 2, 4), (0, 1, 1), 1)
    got = masked_attention(q, k, v, torch.from_numpy(m))
    want = torch.empty_like(got)
    for i in range(m.shape[0]):
        keys = torch.from_numpy(np.flatnonzero(m[i]))
        logits = q[:, :, i:i + 1] @ k[:, :, keys].transpose(-1, -2) / math.sqrt(q.shape[-1])
        want[:, :, i] = (torch.softmax(logits, -1) @ v[:, :, keys])[:, :, 0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # fp64: only rounding in another order


def test_outside_mass_matches_a_direct_sum():
    grid = (3, 4, 4)
    q, k, _ = _qkv(math.prod(grid), dtype=torch.float32)
    windows = [(0, 0, 0), (1, 1, 1), (0, 1, 0)]
    masks = [torch.from_numpy(token_mask(grid, (1, 2, 2), w)) for w in windows]
    got = outside_mass(q, k, masks, chunk=7)  # chunks that do not divide S
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), -1).numpy()
    for g, m in zip(got, masks):
        want = np.mean([[[p[b, h, i][~m[i].numpy()].sum() for i in range(p.shape[2])] for h in range(p.shape[1])]
                        for b in range(p.shape[0])])
        assert abs(g - want) < 1e-6  # fp32 softmax vs fp64
    assert got[1] < got[0]  # a wider window leaves out less


@pytest.mark.parametrize("grid,tile,window", [((4, 16, 16), (1, 8, 16), (1, 0, 0)),
                                              ((3, 10, 20), (1, 8, 16), (0, 1, 1)),
                                              ((5, 9, 7), (2, 8, 16), (1, 1, 0))])
def test_kernel_blocks_are_the_mask_at_128_keys(grid, tile, window):
    kidx, kcnt, ragged = kernel_blocks(grid, tile, window, 1)
    s = math.prod(grid)
    m = token_mask(grid, tile, window, 1, order="tile")
    nq, nfull = kidx.shape[0], s // 128
    assert nq == -(-s // 128)
    for i in range(nq):
        want = [j for j in range(-(-s // 128)) if m[i * 128, j * 128]]
        got = list(kidx[i, :kcnt[i]]) + ([nfull] if ragged[i] else [])
        assert got == want


def test_kernel_blocks_refuse_a_tile_off_the_kernel_block():
    with pytest.raises(ConfigError, match="multiple of 128"):
        kernel_blocks((2, 8, 8), (1, 4, 4), (1, 1, 1))


def _mass(worst_by_layer):
    cands = ((0, 1, 1), (1, 1, 1), (2, 2, 2))
    mass = np.array([[[0.9, 0.9, 0.9], row, row] for row in worst_by_layer], float)  # step 0 dense: ignored
    return AttentionMass(("blocks.0", "blocks.1", "blocks.2"), (0, 1, 2), cands, (1, 8, 16), 0, mass)


def test_plan_picks_the_narrowest_window_within_the_budget(tmp_path):
    mass = _mass([[0.2, 0.04, 0.0], [0.01, 0.0, 0.0], [0.3, 0.2, 0.1]])
    mass.save(tmp_path / "m.safetensors")
    mass = AttentionMass.load(tmp_path / "m.safetensors")
    cfg = SparseAttentionConfig(enabled=True, candidates=mass.candidates, mass_budget=0.05, dense_steps=1)
    plan, chosen = plan_sparse(cfg, [999.0, 500.0, 100.0], mass)
    assert [plan.window(f"blocks.{i}", 500.0) for i in range(3)] == [(1, 1, 1), (0, 1, 1), None]
    assert plan.dense_above == 749.5
    assert plan.window("blocks.1", 999.0) is None and plan.window("blocks.9", 500.0) is None
    assert chosen["source"] == "calibrated"
    plan, _ = plan_sparse(dataclasses.replace(cfg, dense_layers=("blocks.1",)), [999.0, 500.0, 100.0], mass)
    assert plan.window("blocks.1", 1.0) is None and plan.window("blocks.0", 1.0) == (1, 1, 1)
    plan, _ = plan_sparse(dataclasses.replace(cfg, dense_steps=0), [999.0, 500.0, 100.0], mass)
    assert plan.window("blocks.1", 999.0) is None  # step 0's mass (0.9) now counts: every layer dense
    assert SparsePlan.from_dict(plan.to_dict()) == plan


def test_a_recipe_window_covers_every_layer_but_the_dense_ones():
    cfg = SparseAttentionConfig(enabled=True, window=(0, 1, 1), dense_layers=("blocks.0",), dense_steps=3)
    plan, _ = plan_sparse(cfg, [999.0, 500.0, 100.0])
    assert plan.window("blocks.7", 100.0) is None  # every step dense
    plan, _ = plan_sparse(dataclasses.replace(cfg, dense_steps=1), [999.0, 500.0, 100.0])
    assert plan.window("blocks.0", 100.0) is None and plan.window("blocks.7", 100.0) == (0, 1, 1)
    assert plan.density(["blocks.0", "blocks.7"], (2, 8, 16)) == {"blocks.0": 1.0, "blocks.7": 0.5}
    assert plan.density(["blocks.7"], (2, 32, 64))["blocks.7"] < 0.5


def test_plan_names_the_fix_when_the_calibration_does_not_fit():
    cfg = SparseAttentionConfig(enabled=True)
    with pytest.raises(ArtifactError, match="trt-sora calibrate"):
        plan_sparse(cfg, [999.0, 1.0])
    with pytest.raises(ConfigError, match="re-run `trt-sora calibrate`"):
        plan_sparse(cfg, [999.0, 1.0], _mass([[0.0] * 3] * 3))  # other candidates


def test_mass_recorder_keeps_the_dense_output():
    grid = (2, 4, 4)
    cfg = SparseAttentionConfig(enabled=True, tile=(1, 2, 2), candidates=((0, 0, 0), (1, 1, 1)))

    class Site:
        sparse = None

    site = Site()
    rec = MassRecorder(cfg, 2)
    q, k, v = _qkv(math.prod(grid), dtype=torch.float32)
    with rec.at({"blocks.0": site}, grid, 1):
        out = site.sparse(q, k, v)
    assert site.sparse is None
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    got = rec.result()
    masks = [torch.from_numpy(token_mask(grid, (1, 2, 2), w)) for w in cfg.candidates]
    assert np.isnan(got.mass[0, 0]).all()
    assert np.allclose(got.mass[0, 1], outside_mass(q, k, masks), rtol=0, atol=1e-12)


def test_recipe_section_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="did you mean 'window'"):
        from_dict(SparseAttentionConfig, {"windw": [1, 1, 1]}, where="sparse_attention")
    with pytest.raises(ConfigError, match="tile distances"):
        SparseAttentionConfig(window=(1, -1, 1))
    with pytest.raises(ConfigError, match="mass_budget"):
        SparseAttentionConfig(mass_budget=0.0)


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_attention_in_tile_order_is_the_raster_masked_attention(fp8):
    """``ops.self_attention`` with a seam (tokens and RoPE rows in tile order, the output put back) against
    the epilogue and attention over the raster mask, without any permutation."""
    from trt_sora.kernels import ops
    from trt_sora.kernels import reference as ref
    from trt_sora.sparse import tile_sparse

    grid, h = (3, 4, 6), 2
    qkv, wq, wk, cos, sin = ref.example_qkv(1, math.prod(grid), h, 32, seed=4, device="cpu")
    seam = tile_sparse(grid, (1, 2, 4), (0, 1, 0), 0, "cpu")
    got = ops.self_attention(qkv, wq, wk, cos, sin, h, 1e-6, fp8=fp8, sparse=seam).float()
    if fp8:  # the block scales follow the token order, so the raster run quantizes other blocks: compare loosely
        q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, 1e-6, fp8=False)
        want = ref.heads_to_tokens(masked_attention(q.float(), k.float(), v.float(), seam.mask)).float()
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.995
    else:
        q, k, v = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, 1e-6, fp8=False)
        want = ref.heads_to_tokens(masked_attention(q, k, v, seam.mask)).float()
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -8)  # bf16 sums over keys in another order
    dense = ops.self_attention(qkv, wq, wk, cos, sin, h, 1e-6, fp8=fp8).float()
    assert F.cosine_similarity(dense.flatten(), want.flatten(), dim=0) < 0.99  # the mask matters here
