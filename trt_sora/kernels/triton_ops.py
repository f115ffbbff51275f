"""Triton kernels of the ``torch-fp8`` backend (CUDA, SM >= 89 for FP8).

Each public function computes what its namesake in :mod:`trt_sora.kernels.reference` computes
(same scale convention, same bf16 rounding points); the GPU tests hold them to it. Integer
offsets are int64 wherever a product of sizes can pass 2**31 (an FFN hidden state of a 720p
batch-2 call has 2.1e9 elements).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trt_sora.kernels import gluon_attention
from trt_sora.kernels.reference import FP8, FP8_MAX
from trt_sora.sm import HOPPER_SM, device_sm

SCALE_BLOCK = 128  # tokens per Q / K quantization block = the attention kernel's default key tile
_SB = tl.constexpr(SCALE_BLOCK)
#: Keys per tile :func:`attention_fp8` takes (``block_n``): the scale block, or two of them (one K scale per
#: 128-key group of the tile; dense attention only).
ATTN_BLOCK_N = (128, 256)
#: Warps of the fused-QKV epilogue's three launches (per-token RMS, per-head tile pass, K/V quantization).
EPILOGUE_WARPS = {"rms": 4, "post": 8, "kv": 8}
#: The epilogue's tile passes launch the heads of one token block together (see :func:`_token_tile`).
EPILOGUE_HEADS_FAST = True

__all__ = ["SCALE_BLOCK", "abs_scaled", "attention_fp8", "attention_kernel", "gated_add",
           "gelu_quant", "heads_to_tokens", "kv_descriptors", "qkv_rmsnorm_rope", "quantize", "residual_norm_quant",
           "rms_stats"]


@triton.jit
def _q8(x, s):
    """fp32 ``x / s`` saturated to +-448, rounded to E4M3."""
    return tl.minimum(tl.maximum(x / s, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def _qi8(x, s):
    """fp32 ``x / s`` (as ``x`` times the scalar ``1 / s``) rounded half away from zero, saturated to +-127, int8:
    the half added away from zero, then the conversion's truncation (four instructions an element, not a division
    and two roundings)."""
    y = x * (1.0 / s)
    y = y + tl.where(y >= 0, 0.5, -0.5)
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)


# -- residual + LayerNorm + modulation + quantize ---------------------------------------------------
def _vec_strides(*vecs) -> tuple[int, int]:
    """``(batch, token)`` element strides shared by the fp32 AdaLN vectors: [B, C] per sample (token
    stride 0) or [B, S, C] per token (Wan 2.2 TI2V), any row strides, channels contiguous."""
    given = [v for v in vecs if v is not None]
    strides = {(v.stride(0), v.stride(1) if v.dim() == 3 else 0) for v in given}
    if len(strides) > 1 or any(v.stride(-1) != 1 or v.dtype != torch.float32 for v in given):
        raise ValueError("the AdaLN vectors of one kernel must be fp32 views with the same row strides and "
                         f"contiguous channels, got strides {sorted(strides)}")
    return strides.pop() if strides else (0, 0)


#: Most warps of a ``residual_norm_quant`` program (one row): 4 at 5,120 channels (Wan 14B), with the row as two
#: segments, is the fastest of 4 / 8 / 16 in all three forms of a Wan block (benchmarks/epilogue_bench.py;
#: benchmarks/README.md, session 27).
NORM_MAX_WARPS = 4


@triton.jit
def _ld(P, m):
    """fp32 of ``P``'s elements, masked by ``m`` (0 outside) or, ``m`` None, all of them."""
    if m is None:
        v = tl.load(P)
    else:
        v = tl.load(P, mask=m, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _st(P, v, m):
    if m is None:
        tl.store(P, v)
    else:
        tl.store(P, v, mask=m)


@triton.jit
def _rnq_in(X, R, G, XO, offs, vec, m, HAS_R: tl.constexpr, HAS_G: tl.constexpr):
    """One segment of the row: ``x``, or the new residual ``bf16(x + r (* g))`` (stored) in fp32."""
    x = _ld(X + offs, m)
    if HAS_R:
        r = _ld(R + offs, m)
        if HAS_G:
            r = r * _ld(G + vec, m)
        xb = (x + r).to(tl.bfloat16)
        _st(XO + offs, xb, m)
        x = xb.to(tl.float32)
    return x


@triton.jit
def _rnq_out(Y, W, BI, MS, MH, SC, y, cols, offs, vec, m, HAS_W: tl.constexpr, HAS_MOD: tl.constexpr,
             QUANT: tl.constexpr):
    """One segment of the normed row: affine, modulation, bf16, FP8 at SC (QUANT), stored."""
    if HAS_W:
        y = y * _ld(W + cols, m) + _ld(BI + cols, m)
    if HAS_MOD:
        y = y * (1.0 + _ld(MS + vec, m)) + _ld(MH + vec, m)
    yb = y.to(tl.bfloat16)
    if QUANT:
        _st(Y + offs, _q8(yb.to(tl.float32), tl.load(SC)), m)
    else:
        _st(Y + offs, yb, m)


@triton.jit
def _res_norm_quant_kernel(X, R, G, W, BI, MS, MH, XO, Y, SC, S, C, eps, VB, VS,
                           HAS_R: tl.constexpr, HAS_G: tl.constexpr, HAS_W: tl.constexpr, HAS_MOD: tl.constexpr,
                           QUANT: tl.constexpr, SEG_A: tl.constexpr, SEG_B: tl.constexpr):
    """One row of C channels as two power-of-two segments, [SEG_A] (all valid) and [SEG_B] (masked past C;
    SEG_B = 0: none), so no lane works on a channel past C (5,120 = 4,096 + 1,024: none masked)."""
    t, b = tl.program_id(0), tl.program_id(1).to(tl.int64)  # token t of sample b
    row = (b * S + t) * C
    vrow = b * VB + t * VS  # this row's AdaLN vectors: per sample (VS = 0) or per token
    ca = tl.arange(0, SEG_A)
    xa = _rnq_in(X, R, G, XO, row + ca, vrow + ca, None, HAS_R, HAS_G)
    tot = tl.sum(xa)  # scalars: the two segments' layouts never meet
    if SEG_B > 0:
        cb = SEG_A + tl.arange(0, SEG_B)
        mb = cb < C
        xb = _rnq_in(X, R, G, XO, row + cb, vrow + cb, mb, HAS_R, HAS_G)
        tot += tl.sum(xb)
    mean = tot / C
    da = xa - mean
    sq = tl.sum(da * da)
    if SEG_B > 0:
        db = tl.where(mb, xb - mean, 0.0)
        sq += tl.sum(db * db)
    rstd = tl.rsqrt(sq / C + eps)
    _rnq_out(Y, W, BI, MS, MH, SC, da * rstd, ca, row + ca, vrow + ca, None, HAS_W, HAS_MOD, QUANT)
    if SEG_B > 0:
        _rnq_out(Y, W, BI, MS, MH, SC, db * rstd, cb, row + cb, vrow + cb, mb, HAS_W, HAS_MOD, QUANT)


def _segments(c: int) -> tuple[int, int]:
    """``(SEG_A, SEG_B)`` of a row of ``c``: the largest power of two <= c, and the rest's next power of two."""
    a = 1 << (c.bit_length() - 1)
    return a, (triton.next_power_of_2(c - a) if c > a else 0)


def residual_norm_quant(x, *, branch=None, gate=None, weight=None, bias=None, mod_scale=None, mod_shift=None,
                        eps: float = 1e-6, act_scale=None):
    """See :func:`trt_sora.kernels.reference.residual_norm_quant` (same arguments and results)."""
    b, s, c = x.shape
    y = torch.empty((b, s, c), device=x.device, dtype=FP8 if act_scale is not None else torch.bfloat16)
    xo = torch.empty_like(x) if branch is not None else x
    dummy = x
    vb, vs = _vec_strides(gate, mod_scale, mod_shift)
    seg_a, seg_b = _segments(c)
    _res_norm_quant_kernel[(s, b)](
        x, branch if branch is not None else dummy, gate if gate is not None else dummy,
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        mod_scale if mod_scale is not None else dummy, mod_shift if mod_shift is not None else dummy,
        xo, y, act_scale if act_scale is not None else dummy, s, c, eps, vb, vs,
        HAS_R=branch is not None, HAS_G=gate is not None, HAS_W=weight is not None, HAS_MOD=mod_scale is not None,
        QUANT=act_scale is not None, SEG_A=seg_a, SEG_B=seg_b, num_warps=min(NORM_MAX_WARPS, max(4, seg_a // 256)))
    return xo, y


# -- gated residual add ------------------------------------------------------------------------------
@triton.jit
def _gated_add_kernel(X, R, G, Y, S, C, N, GB, GS, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    row = offs // C
    b = row // S
    g = tl.load(G + b * GB + (row - b * S) * GS + offs % C, mask=m, other=0.0)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(R + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x + r * g).to(tl.bfloat16), mask=m)


def gated_add(x, branch, gate):
    """``bf16(x + branch * gate)``: [B, S, C] bf16, ``gate`` [B, C] or per token [B, S, C] fp32; one pass."""
    b, s, c = x.shape
    y = torch.empty_like(x)
    n = x.numel()
    gb, gs = _vec_strides(gate)
    _gated_add_kernel[(triton.cdiv(n, 4096),)](x, branch, gate, y, s, c, n, gb, gs, BLOCK=4096,
                                               num_warps=8)
    return y


# -- GELU + quantize / plain quantize ----------------------------------------------------------------
_GELU_K1 = tl.constexpr(-2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e))
_GELU_K3 = tl.constexpr(-2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e) * 0.044715)


@triton.jit
def _act_quant_kernel(X, Y, SC, N, GELU: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh z) = x / (1 + e^-2z), z = sqrt(2 / pi) (x + 0.044715 x^3): one exp2, one division
        u = x * (_GELU_K1 + _GELU_K3 * (x * x))  # -2 z log2(e)
        r = tl.rsqrt(1.0 + tl.exp2(u))  # >= 1: no range fix-ups, unlike a division
        x = (x * r * r).to(tl.bfloat16).to(tl.float32)
    if QUANT:
        tl.store(Y + offs, _q8(x, tl.load(SC)), mask=m)
    else:
        tl.store(Y + offs, x.to(tl.bfloat16), mask=m)


def _act_quant(h, act_scale, gelu: bool):
    h = h.contiguous()
    y = torch.empty(h.shape, device=h.device, dtype=FP8 if act_scale is not None else torch.bfloat16)
    n = h.numel()
    block = 4096
    _act_quant_kernel[(triton.cdiv(n, block),)](h, y, act_scale if act_scale is not None else h, n, GELU=gelu,
                                                QUANT=act_scale is not None, BLOCK=block, num_warps=8)
    return y


def gelu_quant(h, act_scale):
    """``GELU_tanh(h)`` -> FP8 at ``act_scale`` (bf16 when None); one pass over ``h``."""
    return _act_quant(h, act_scale, True)


def quantize(x, act_scale):
    """``x`` (bf16, any shape) -> FP8 at the scalar ``act_scale``; one pass."""
    return _act_quant(x, act_scale, False)


# -- [B, H, S, D] -> [B, S, H*D] (+ quantize) -----------------------------------------------------------
@triton.jit
def _heads_to_tokens_kernel(O, Y, SC, S, H, s_b, s_h, s_s, D: tl.constexpr, BLOCK_S: tl.constexpr,
                            QUANT: tl.constexpr):
    _, _, b, h, rows, in_s, row64 = _token_tile(S, H, BLOCK_S, False)
    d = tl.arange(0, D)
    rm = in_s[:, None]
    x = tl.load(O + b.to(tl.int64) * s_b + h * s_h + rows.to(tl.int64)[:, None] * s_s + d[None, :], mask=rm,
                other=0.0).to(tl.float32)
    yp = Y + row64[:, None] * (H * D) + h * D + d[None, :]
    if QUANT:
        tl.store(yp, _q8(x.to(tl.bfloat16).to(tl.float32), tl.load(SC)), mask=rm)
    else:
        tl.store(yp, x.to(tl.bfloat16), mask=rm)


def heads_to_tokens(o, act_scale=None):
    """[B, H, S, D] (any strides, last dim contiguous) -> [B, S, H*D] bf16 or FP8 at ``act_scale``."""
    b, h, s, d = o.shape
    if o.stride(3) != 1:
        o = o.contiguous()
    y = torch.empty((b, s, h * d), device=o.device, dtype=FP8 if act_scale is not None else torch.bfloat16)
    _heads_to_tokens_kernel[(triton.cdiv(s, 64), b * h)](
        o, y, act_scale if act_scale is not None else o, s, h, o.stride(0), o.stride(1), o.stride(2), D=d,
        BLOCK_S=64, QUANT=act_scale is not None, num_warps=4)
    return y


# -- fused-QKV epilogue: split + RMSNorm across heads + RoPE + quantize --------------------------------
@triton.jit
def _rms_kernel(QKV, RSTD, S, C, eps, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """1 / rms over all heads of Q and of K for BLOCK_S tokens: RSTD [B*S, 2]."""
    t = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rm = t < S
    rows = tl.program_id(1) * S + t
    base = QKV + rows.to(tl.int64)[:, None] * (3 * C)
    cols = tl.arange(0, BLOCK_C)
    sq = tl.zeros([BLOCK_S], tl.float32)
    sk = tl.zeros([BLOCK_S], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        m = rm[:, None] & (c0 + cols < C)[None, :]  # a last chunk past C would read K (for Q) or V (for K)
        q = tl.load(base + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        k = tl.load(base + C + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        sq += tl.sum(q * q, 1)
        sk += tl.sum(k * k, 1)
    tl.store(RSTD + rows.to(tl.int64) * 2, tl.rsqrt(sq / C + eps), mask=rm)
    tl.store(RSTD + rows.to(tl.int64) * 2 + 1, tl.rsqrt(sk / C + eps), mask=rm)


@triton.jit
def _token_tile(S, H, BLOCK_S: tl.constexpr, HEADS_FAST: tl.constexpr):
    """This program's tile in a grid of (token blocks, B*H): ``(token block, batch x head, batch, head,
    its tokens [BLOCK_S], which of them are < S, their rows of a [B*S, ...] tensor as int64)``.
    HEADS_FAST: the grid is (B*H, blocks), so the programs launched together are the heads of one
    token block: they share its RoPE table tile and RMS statistics in L2 and read whole token rows of
    ``qkv``."""
    if HEADS_FAST:
        pid_s, bh = tl.program_id(1), tl.program_id(0)
    else:
        pid_s, bh = tl.program_id(0), tl.program_id(1)
    b = bh // H
    t = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    return pid_s, bh, b, bh % H, t, t < S, (b * S + t).to(tl.int64)


@triton.jit
def _i8_scale(a):
    """The INT8 scale of a tile of magnitudes ``a`` [M, N]: its max / 127 (1 for an all-zero tile)."""
    s = tl.max(tl.max(a, 1), 0) / 127.0
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _rope_tile(CS, pos, rm, D: tl.constexpr, BLOCK_S: tl.constexpr, ROPE: tl.constexpr):
    """``(cos of the even lanes, sin of the odd lanes)`` [BLOCK_S, D // 2] at token positions ``pos``, from the
    compact table ``CS`` [S, D // 2, 2] (:func:`_rope_table`): one [BLOCK_S, D] fp32 load per tile, shared by
    Q and K, instead of a cos and a sin tile for each. Zeros (never used) without RoPE."""
    if ROPE:
        d = tl.arange(0, D)
        cs = tl.load(CS + pos[:, None] * D + d[None, :], mask=rm[:, None], other=0.0)
        ce, so = tl.split(tl.reshape(cs, (BLOCK_S, D // 2, 2)))
    else:
        ce = tl.zeros([BLOCK_S, D // 2], tl.float32)
        so = ce
    return ce, so


@triton.jit
def _norm_rope_tile(QKV, RSTD, W, ce, so, row64, rm, col0, h, which: tl.constexpr, C, D: tl.constexpr,
                    BLOCK_S: tl.constexpr, ROPE: tl.constexpr):
    """One head's [BLOCK_S, D] tile of Q (``which`` 0) or K (1): RMSNorm (bf16 rounding as
    diffusers), interleaved-pair RoPE with the tile's ``ce``/``so`` (:func:`_rope_tile`; bf16 rounding),
    as fp32. Rows past S load as zeros and stay zeros."""
    d = tl.arange(0, D)
    x = tl.load(QKV + row64[:, None] * (3 * C) + col0 + h * D + d[None, :], mask=rm[:, None], other=0.0)
    r = tl.load(RSTD + row64 * 2 + which, mask=rm, other=0.0)
    w = tl.load(W + h * D + d).to(tl.float32)
    x = (x.to(tl.float32) * r[:, None] * w[None, :]).to(tl.bfloat16).to(tl.float32)
    if ROPE:
        e, o = tl.split(tl.reshape(x, (BLOCK_S, D // 2, 2)))
        e2 = (e * ce - o * so).to(tl.bfloat16).to(tl.float32)
        o2 = (e * so + o * ce).to(tl.bfloat16).to(tl.float32)
        x = tl.reshape(tl.join(e2, o2), (BLOCK_S, D))
    return x


@triton.jit
def _qkv_post_kernel(QKV, RSTD, WQ, WK, CS, QO, KO, VO, QS, KSUM, VMAX, S, H, nblk, KLEN,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, ROPE: tl.constexpr, Q8_OUT: tl.constexpr,
                     HEADS_FAST: tl.constexpr, KEYS: tl.constexpr):
    """Per (token block, batch x head): Q normalized + roped (INT8 per block, or bf16), K the same
    (bf16 path) or its partial per-channel sums (8-bit path: K is quantized once its mean is known),
    V copied (bf16 path) or its partial per-channel amax. KEYS: only tokens before ``KLEN[b]`` count
    in the Q scale, K sums and V amax (8-bit path)."""
    pid_s, bh, b, h, t, rm, row64 = _token_tile(S, H, BLOCK_S, HEADS_FAST)
    C = H * D
    d = tl.arange(0, D)
    ce, so = _rope_tile(CS, t.to(tl.int64), rm, D, BLOCK_S, ROPE)
    q = _norm_rope_tile(QKV, RSTD, WQ, ce, so, row64, rm, 0, h, 0, C, D, BLOCK_S, ROPE)
    k = _norm_rope_tile(QKV, RSTD, WK, ce, so, row64, rm, C, h, 1, C, D, BLOCK_S, ROPE)
    v = tl.load(QKV + row64[:, None] * (3 * C) + 2 * C + h * D + d[None, :], mask=rm[:, None], other=0.0)
    out = (bh.to(tl.int64) * S + t)[:, None] * D + d[None, :]
    if Q8_OUT:
        km = (t < (tl.load(KLEN + b) if KEYS else S))[:, None]  # padding past the key length: in no scale or sum
        # K's sums and V's amax first: K and V then die before Q is quantized (183 registers, not 254: ptxas -v)
        part = (bh * nblk + pid_s).to(tl.int64) * D + d
        tl.store(KSUM + part, tl.sum(tl.where(km, k, 0.0), 0))
        tl.store(VMAX + part, tl.max(tl.where(km, tl.abs(v.to(tl.float32)), 0.0), 0))
        s = _i8_scale(tl.where(km, tl.abs(q), 0.0))
        tl.store(QS + bh * nblk + pid_s, s)
        tl.store(QO + out, _qi8(q, s), mask=rm[:, None])
    else:
        tl.store(QO + out, q.to(tl.bfloat16), mask=rm[:, None])
        tl.store(KO + out, k.to(tl.bfloat16), mask=rm[:, None])
        tl.store(VO + out, v, mask=rm[:, None])


@triton.jit
def _vt_order(x):
    """The columns of ``x`` [M, N] (N a multiple of 16) in V^T's key order,
    :func:`trt_sora.kernels.reference.vt_key_order`: P in the FP8 P V operand's own register layout
    (no shuffles between the softmax and the product), and V^T as the epilogue stores it."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [M, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [M, N])


@triton.jit
def _kv_quant_kernel(QKV, RSTD, WK, CS, KMEAN, K8, KS, VS, VT8, S, S_pad, H, nblk, KLEN, D: tl.constexpr,
                     BLOCK_S: tl.constexpr, ROPE: tl.constexpr, HEADS_FAST: tl.constexpr, KEYS: tl.constexpr):
    """K (recomputed from ``qkv``: cheaper than a bf16 round trip) minus its mean -> INT8 per block;
    V -> FP8 per channel, stored transposed [D, S_pad] in the P V product's key order, padding zeros
    (KEYS: zeros from ``KLEN[b]`` on, K and V alike)."""
    pid_s, bh, b, h, t, rm, row64 = _token_tile(S, H, BLOCK_S, HEADS_FAST)
    C = H * D
    d = tl.arange(0, D)
    ce, so = _rope_tile(CS, t.to(tl.int64), rm, D, BLOCK_S, ROPE)
    k = _norm_rope_tile(QKV, RSTD, WK, ce, so, row64, rm, C, h, 1, C, D, BLOCK_S, ROPE)
    km = t < (tl.load(KLEN + b) if KEYS else S)
    k = tl.where(km[:, None], k - tl.load(KMEAN + bh * D + d)[None, :], 0.0)
    s = _i8_scale(tl.abs(k))
    tl.store(K8 + (bh.to(tl.int64) * S + t)[:, None] * D + d[None, :], _qi8(k, s), mask=rm[:, None])
    tl.store(KS + bh * nblk + pid_s, s)
    v = tl.load(QKV + row64[:, None] * (3 * C) + 2 * C + h * D + d[None, :], mask=km[:, None], other=0.0)
    v8 = _q8(v.to(tl.float32), tl.load(VS + bh * D + d)[None, :])  # zeros past S: the padding is read
    tl.store(VT8 + bh.to(tl.int64) * D * S_pad + d[:, None] * S_pad + t[None, :], _vt_order(tl.trans(v8)))


def _rope_table(cos, sin):
    """fp32 [S, D // 2, 2]: ``cos[:, 0::2]`` and ``sin[:, 1::2]`` interleaved, the only lanes the
    interleaved-pair rotation reads (half the bytes of ``cos`` and ``sin``, one load per tile)."""
    return torch.stack((cos[:, 0::2], sin[:, 1::2]), dim=-1).float().contiguous()


def rms_stats(qkv, eps: float = 1e-6):
    """See :func:`trt_sora.kernels.reference.rms_stats`: [B, S, 3C] bf16 -> [B*S, 2] fp32."""
    return _rstd(qkv, eps)


def _rstd(qkv, eps):
    b, s, c3 = qkv.shape
    c = c3 // 3
    rstd = torch.empty((b * s, 2), device=qkv.device, dtype=torch.float32)
    _rms_kernel[(triton.cdiv(s, 16), b)](qkv, rstd, s, c, eps, BLOCK_S=16, BLOCK_C=min(512, triton.next_power_of_2(c)),
                                         num_warps=EPILOGUE_WARPS["rms"])
    return rstd


def qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads: int, eps: float = 1e-6, *, fp8: bool = True, rstd=None,
                     key_len=None):
    """Fused-QKV epilogue; see :func:`trt_sora.kernels.reference.qkv_rmsnorm_rope`.

    ``qkv`` [B, S, 3C] bf16 contiguous; ``cos``/``sin`` [S, D] fp32 or None (no RoPE).
    Returns BF16 ``(q, k, v)`` [B, H, S, D] when ``fp8`` is False, else the attention kernel's
    operands ``(q8 [B,H,S,D] int8, q_scale [B,H,nblk], k8 [B,H,S,D] int8, k_scale, vt8
    [B,H,D,S_pad] fp8, v_scale [B,H,D])`` with blocks of :data:`SCALE_BLOCK` tokens (V stored
    token-contiguous for the PV tensor-core product, keys in :func:`~trt_sora.kernels.reference.vt_key_order`,
    the padding zeros; :func:`~trt_sora.kernels.reference.vt_natural` undoes both).
    Three launches: per-token RMS statistics (skipped when ``rstd`` [B*S, 2] is given: taken over
    more heads than ``qkv`` holds, Ulysses), the per-head tile pass, K/V quantization.
    ``key_len`` [B] int32 on the device (8-bit path): tokens from it on are padding, as the reference's.
    """
    b, s, c3 = qkv.shape
    c = c3 // 3
    d = c // heads
    dev = qkv.device
    nblk = triton.cdiv(s, SCALE_BLOCK)
    hf = EPILOGUE_HEADS_FAST
    grid = (b * heads, nblk) if hf else (nblk, b * heads)
    pw = EPILOGUE_WARPS["post"]
    rope = cos is not None
    cs = _rope_table(cos, sin) if rope else qkv  # never read without RoPE
    rstd = _rstd(qkv, eps) if rstd is None else rstd
    if not fp8:
        q, k, v = (torch.empty((b, heads, s, d), device=dev, dtype=torch.bfloat16) for _ in range(3))
        _qkv_post_kernel[grid](qkv, rstd, wq, wk, cs, q, k, v, rstd, rstd, rstd, s, heads, nblk, rstd, D=d,
                               BLOCK_S=SCALE_BLOCK, ROPE=rope, Q8_OUT=False, HEADS_FAST=hf, KEYS=False, num_warps=pw)
        return q, k, v
    q8 = torch.empty((b, heads, s, d), device=dev, dtype=torch.int8)
    qs = torch.empty((b, heads, nblk), device=dev, dtype=torch.float32)
    ksum = torch.empty((b, heads, nblk, d), device=dev, dtype=torch.float32)
    vmax = torch.empty((b, heads, nblk, d), device=dev, dtype=torch.float32)
    keys = key_len is not None
    klen = key_len if keys else qs  # unread without key lengths
    _qkv_post_kernel[grid](qkv, rstd, wq, wk, cs, q8, q8, q8, qs, ksum, vmax, s, heads, nblk, klen, D=d,
                           BLOCK_S=SCALE_BLOCK, ROPE=rope, Q8_OUT=True, HEADS_FAST=hf, KEYS=keys, num_warps=pw)
    # deterministic two-stage reduction (no atomics)
    k_mean = ksum.sum(dim=2) / (key_len.float()[:, None, None] if keys else s)
    v_scale = vmax.amax(dim=2) / FP8_MAX
    v_scale = torch.where(v_scale > 0, v_scale, torch.ones_like(v_scale))
    s_pad = nblk * SCALE_BLOCK
    k8 = torch.empty((b, heads, s, d), device=dev, dtype=torch.int8)
    ks = torch.empty((b, heads, nblk), device=dev, dtype=torch.float32)
    vt8 = torch.empty((b, heads, d, s_pad), device=dev, dtype=FP8)
    _kv_quant_kernel[grid](qkv, rstd, wk, cs, k_mean, k8, ks, v_scale, vt8, s, s_pad, heads, nblk, klen, D=d,
                           BLOCK_S=SCALE_BLOCK, ROPE=rope, HEADS_FAST=hf, KEYS=keys, num_warps=EPILOGUE_WARPS["kv"])
    return q8, qs, k8, ks, vt8, v_scale


# -- 8-bit flash attention ----------------------------------------------------------------------------------
def _attn_configs(block_n: int = SCALE_BLOCK):
    """The autotuner's configs for key tiles of ``block_n``. 128: query tile x warps x PIPE (3 stages). A 64-row
    tile on one warpgroup needs about half the registers of a 128-row tile on two, so two CTAs share an SM and
    one's softmax (special-function unit) runs while another's tensor-core products do: the overlap that FA3
    gets from ping-pong scheduling. PIPE issues the next key tile's Q K^T before this tile's softmax in source
    order (FA3's intra-warpgroup order); Triton 3.6 still waits on that product right after issuing it (SASS:
    ``WARPGROUP.DEPBAR.LE gsb0, 0x0``), so nothing overlaps within a CTA, yet it is faster on 128-row tiles and
    is kept there. Every config computes bit-identical results (same key tiles, same per-row arithmetic in the
    same order), so the choice never changes numbers. Tried and dropped (benchmarks/README.md has the timings):
    an exponential in packed f16 pairs; three CTAs per SM at 168 registers and 2 stages; 64-row tiles with PIPE;
    the row sums as a tensor-core product P8 @ ones (no faster, and the FP8 products' accumulation loses part of
    a long key sum); skipping the rescale of tiles where no row max moved (the block-wide test costs more than
    the multiplies).

    A wider tile runs without PIPE (with it, 128 rows spill at 255 registers): 64 rows at 1, 2 or 3 ring stages
    (shared memory allows two CTAs per SM at 1 stage, one at 2 or 3), or 128 rows on two warpgroups sharing
    each K / V tile at 2 stages (one CTA per SM)."""
    if block_n != SCALE_BLOCK:
        return [triton.Config({"BLOCK_M": bm, "PIPE": False}, num_warps=w, num_stages=st)
                for bm, w, st in ((64, 4, 1), (64, 4, 2), (64, 4, 3), (128, 8, 2))]
    return [triton.Config({"BLOCK_M": bm, "PIPE": pipe}, num_warps=w, num_stages=3)
            for bm, pipe, w in ((64, False, 4), (128, True, 8))]


_ATTN_CONFIGS = {bn: _attn_configs(bn) for bn in ATTN_BLOCK_N}


def _configs_of_block_n(configs, named_args, **kw):
    """The autotuner's prune: the configs of this launch's key tile."""
    return _ATTN_CONFIGS[kw["BLOCK_N"]]


@triton.jit
def _attn_tile(qk_i32, c, m_i, l_i, acc, vt):
    """One full key tile: online softmax of ``qk_i32 * c`` (log2 domain) and ``acc += P V``.
    int32 -> fp32 by the magic-number add (exact, |acc| < 2**22 for D <= 256; no I2F on the
    special-function unit); its offset 1.5 * 2**23 is folded into the one FMA to the log2 domain,
    then EX2, row max / sum, FP8 pack of 448 * p. A wide tile (G scale blocks, ``c`` [G]) is seen as
    [BLOCK_M, G, 128]: a row max per group times its scale, still one FMA per element."""
    LOG2_448: tl.constexpr = 8.807354922057604
    raw = (qk_i32 + 0x4B400000).to(tl.float32, bitcast=True)  # = qk + 12582912, exactly
    BM: tl.constexpr = raw.shape[0]
    BN: tl.constexpr = raw.shape[1]
    if BN == _SB:
        m_new = tl.maximum(m_i, (tl.max(raw, 1) - 12582912.0) * c)
        p = tl.math.exp2(raw * c - (12582912.0 * c + m_new - LOG2_448)[:, None])  # 448 * softmax numerator
    else:
        raw3 = tl.reshape(raw, [BM, BN // _SB, _SB])
        c3 = c[None, :, None]
        m_new = tl.maximum(m_i, tl.max((tl.max(raw3, 2) - 12582912.0) * c[None, :], 1))
        p = tl.reshape(tl.math.exp2(raw3 * c3 - (12582912.0 * c3 + m_new[:, None, None] - LOG2_448)), [BM, BN])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(_vt_order(p.to(tl.float8e4nv)), tl.trans(vt), acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _k_tile(K8, kp, bh, n0, S, KL, D: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, MASK: tl.constexpr,
            KEYS: tl.constexpr):
    """K [BLOCK_N, D] int8 of the key tile at token ``n0``: through the tensor descriptor (rows past S
    come back as zeros), or a pointer load (masked past the key length ``KL`` when MASK). KEYS: a tile
    wholly past ``KL`` is read at row S, out of bounds, so TMA fetches nothing."""
    if TMA:
        if KEYS:
            n0 = tl.where(n0 < KL, n0, S)
        return K8.load([bh, n0, 0]).reshape(BLOCK_N, D)
    elif MASK:
        return tl.load(kp + n0 * D, mask=((n0 + tl.arange(0, BLOCK_N)) < KL)[:, None], other=0)
    else:
        return tl.load(kp + n0 * D)


@triton.jit
def _v_tile(VT8, vp, bh, n0, D: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, S_pad=0,
            MASK: tl.constexpr = False):
    """V^T [D, BLOCK_N] fp8 of the key tile at token ``n0``, keys in :func:`_vt_order` (the padding past S
    holds zeros: a key of the ragged tile can sit at any position of its group). MASK: a wide ragged tile
    runs past ``S_pad``: zeros there (TMA's fill; the pointer load masked)."""
    if TMA:
        return VT8.load([bh, 0, n0]).reshape(D, BLOCK_N)
    elif MASK:
        return tl.load(vp + n0, mask=(n0 + tl.arange(0, BLOCK_N) < S_pad)[None, :], other=0.0)
    else:
        return tl.load(vp + n0)


@triton.jit
def _k_scales(KSB, t, nblk, qsc, BLOCK_N: tl.constexpr):
    """Key tile t's K scale times ``qsc``: a scalar for a tile of one scale block, else [BLOCK_N // 128]
    (blocks past the last clamped to it: their keys are masked)."""
    if BLOCK_N == _SB:
        return qsc * tl.load(KSB + t)
    else:
        return qsc * tl.load(KSB + tl.minimum(t * (BLOCK_N // _SB) + tl.arange(0, BLOCK_N // _SB), nblk - 1))


@triton.autotune(configs=[c for cs in _ATTN_CONFIGS.values() for c in cs],
                 key=["D", "S_LOG2", "TMA", "SPARSE", "KEYS", "BLOCK_N"],
                 prune_configs_by={"early_config_prune": _configs_of_block_n})
@triton.jit
def _attn_fp8_kernel(Q8, QS, K8, KS, VT8, VS, O, OSC, S, S_pad, H, nblk, qk_scale, S_LOG2, KIDX, KCNT, KRAG, KSTRIDE,
                     KLEN, D: tl.constexpr, OUT_FP8: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                     SPARSE: tl.constexpr, KEYS: tl.constexpr, BLOCK_M: tl.constexpr, PIPE: tl.constexpr):
    """One (query tile of BLOCK_M rows, batch x head); key tiles of BLOCK_N = the scale block (each K tile
    has one scale) or, dense only, a multiple of it (:data:`ATTN_BLOCK_N`); each query tile lies inside one Q
    scale block. TMA: ``K8``/``VT8``
    are tensor descriptors (zero-filled past S), else pointers. SPARSE: only the full key tiles
    ``KIDX[qb, :KCNT[qb]]`` of the query's 128-row block ``qb``, and the ragged last one when ``KRAG[qb]``.
    KEYS: the keys of batch element b end at ``KLEN[b]`` (padding after it); tiles past it are skipped and
    the tile it ends in is masked as the ragged last one."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    mm = offs_m < S
    qkb = bh.to(tl.int64) * S * D
    q = tl.load(Q8 + qkb + offs_m[:, None] * D + d[None, :], mask=mm[:, None], other=0)
    qsc = tl.load(QS + bh * nblk + (pid_m * BLOCK_M) // _SB) * qk_scale
    KSB = KS + bh * nblk
    if TMA:  # K8 / VT8 are tensor descriptors
        kp, vp = K8, VT8
    else:
        kp = K8 + qkb + offs_n[:, None] * D + d[None, :]
        vp = VT8 + bh.to(tl.int64) * D * S_pad + d[:, None] * S_pad + offs_n[None, :]
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max in the log2 domain (finite: no inf - inf)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if KEYS:
        kl = tl.load(KLEN + b)
    else:
        kl = S
    n_full = kl // BLOCK_N
    if SPARSE:  # the listed key tiles only (ascending; the ragged last one below)
        qb = (pid_m * BLOCK_M) // BLOCK_N
        for jj in range(0, tl.load(KCNT + qb)):
            j = tl.load(KIDX + qb * KSTRIDE + jj)
            qk = tl.dot(q, tl.trans(_k_tile(K8, kp, bh, j * BLOCK_N, S, kl, D, BLOCK_N, TMA, False, False)))
            m_i, l_i, acc = _attn_tile(qk, qsc * tl.load(KS + bh * nblk + j), m_i, l_i, acc,
                                       _v_tile(VT8, vp, bh, j * BLOCK_N, D, BLOCK_N, TMA))
    elif PIPE:  # tile j+1's Q K^T issued before tile j's softmax (Triton waits on it at once); last tile masked
        qk = tl.dot(q, tl.trans(_k_tile(K8, kp, bh, 0, S, kl, D, BLOCK_N, TMA, True, KEYS)))
        for j in range(0, n_full):
            qk_next = tl.dot(q, tl.trans(_k_tile(K8, kp, bh, (j + 1) * BLOCK_N, S, kl, D, BLOCK_N, TMA, True, KEYS)))
            m_i, l_i, acc = _attn_tile(qk, _k_scales(KSB, j, nblk, qsc, BLOCK_N), m_i, l_i, acc,
                                       _v_tile(VT8, vp, bh, j * BLOCK_N, D, BLOCK_N, TMA))
            qk = qk_next
    else:
        for j in range(0, n_full):
            qk = tl.dot(q, tl.trans(_k_tile(K8, kp, bh, j * BLOCK_N, S, kl, D, BLOCK_N, TMA, False, False)))
            m_i, l_i, acc = _attn_tile(qk, _k_scales(KSB, j, nblk, qsc, BLOCK_N), m_i, l_i, acc,
                                       _v_tile(VT8, vp, bh, j * BLOCK_N, D, BLOCK_N, TMA))
    if n_full * BLOCK_N < kl:  # the ragged last block: keys past S (or KLEN) are masked out of the softmax
        LOG2_448: tl.constexpr = 8.807354922057604
        nm = (n_full * BLOCK_N + offs_n) < kl
        if SPARSE:  # a ragged tile outside the pattern: every key masked, the tile adds exactly nothing
            nm = nm & (tl.load(KRAG + (pid_m * BLOCK_M) // BLOCK_N) != 0)
        if SPARSE or not PIPE:
            qk = tl.dot(q, tl.trans(_k_tile(K8, kp, bh, n_full * BLOCK_N, S, kl, D, BLOCK_N, TMA, True, False)))
        c = _k_scales(KSB, n_full, nblk, qsc, BLOCK_N)
        if BLOCK_N > _SB:  # one scale per key
            c = tl.reshape(tl.broadcast_to(c[:, None], [BLOCK_N // _SB, _SB]), [BLOCK_N])[None, :]
        sc = (qk + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        sc = tl.where(nm[None, :], sc * c, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.math.exp2(sc - (m_new - LOG2_448)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _v_tile(VT8, vp, bh, n_full * BLOCK_N, D, BLOCK_N, TMA, S_pad, BLOCK_N > _SB)
        acc = tl.dot(_vt_order(p.to(tl.float8e4nv)), tl.trans(vt), acc * alpha[:, None])
    vs = tl.load(VS + bh * D + d)
    o = acc / l_i[:, None] * vs[None, :]
    out = O + (b * S + offs_m).to(tl.int64)[:, None] * (H * D) + h * D + d[None, :]
    if OUT_FP8:
        tl.store(out, _q8(o.to(tl.bfloat16).to(tl.float32), tl.load(OSC)), mask=mm[:, None])
    else:
        tl.store(out, o.to(tl.bfloat16), mask=mm[:, None])


#: Key/value tiles through TMA tensor descriptors (Hopper+) instead of pointer loads: same bits.
ATTN_TMA = True
#: On SM 9.x with Gluon, the warp-specialized kernel (:mod:`trt_sora.kernels.gluon_attention`) by default: same
#: bits. Off: with V^T in the P V operand's key order the Triton kernel is the faster of the two for FP8
#: output, what the model runs (benchmarks/README.md).
ATTN_WS = False


def kv_descriptors(k8, vt8, block_n: int = SCALE_BLOCK):
    """TMA descriptors of the attention kernel's K [B, H, S, D] and V^T [B, H, D, S_pad] as [B*H, S, D] and
    [B*H, D, S_pad] (V^T's padding is the epilogue's zeros: its key order puts keys of the ragged tile past
    S), one key tile of ``block_n`` keys per block."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, s, d = k8.shape
    s_pad = vt8.shape[-1]
    return (TensorDescriptor(k8, [b * h, s, d], [s * d, d, 1], [1, block_n, d]),
            TensorDescriptor(vt8, [b * h, d, s_pad], [d * s_pad, s_pad, 1], [1, d, block_n]))


def attention_kernel(device=None) -> str:
    """Which 8-bit attention kernel :func:`attention_fp8` launches on ``device`` by default: ``"gluon-ws"``
    (the warp-specialized kernel, SM 9.x with Gluon) or ``"triton"``."""
    return "gluon-ws" if ATTN_WS and gluon_attention.available(device) else "triton"


def attention_fp8(q8, q_scale, k8, k_scale, vt8, v_scale, *, out_scale=None, tma: bool | None = None,
                  ws: bool | None = None, blocks=None, key_len=None, head_dim: int | None = None,
                  block_n: int = SCALE_BLOCK):
    """Softmax attention on 8-bit operands -> [B, S, H*D] token-major (``to_out``'s input layout):
    INT8 Q K^T and FP8 P V on tensor cores (SageAttention2's 8-bit recipe), fp32 online softmax.

    ``q8``/``k8`` [B, H, S, D] int8, scales [B, H, S/128] (one per 128-token tile); ``vt8``
    [B, H, D, S_pad] fp8, ``v_scale`` [B, H, D]. Output bf16, or FP8 at ``out_scale`` (the
    ``to_out`` linear's static input scale). ``ws``: the warp-specialized Gluon kernel, the same bits
    (default: :func:`attention_kernel`). ``tma``, an option of the Triton kernel (so a given ``tma`` picks
    it): key/value tiles through tensor descriptors (default :data:`ATTN_TMA` on SM >= 9.0).
    ``blocks``: block-sparse attention, ``(kidx, kcnt, ragged)`` int32 on the device as
    :func:`trt_sora.sparse.kernel_blocks` gives them (the Triton kernel: skipped key tiles are never loaded).
    ``key_len`` [B] int32 >= 1 on the device: only the keys before it are attended, the operands made with
    the same ``key_len`` (:func:`qkv_rmsnorm_rope`); the Triton kernel, tiles past it never loaded.
    ``head_dim``: the heads' width for the softmax scale when the operands carry zero channels past it.
    ``block_n``: keys per tile of the Triton kernel, one of :data:`ATTN_BLOCK_N` (wider than 128: dense attention
    only; the online softmax's steps every ``block_n`` keys, the same math with its sums in another order).
    """
    _check_block_n(block_n, ws or blocks is not None or key_len is not None)
    if key_len is not None and (ws or blocks is not None):
        from trt_sora.errors import ConfigError

        raise ConfigError("key lengths run on the dense Triton attention kernel only: pass ws=False and no "
                          "sparse blocks, or pad no keys")
    if blocks is not None or key_len is not None or block_n != SCALE_BLOCK:
        ws = False
    if ws is None:
        ws = tma is None and attention_kernel(q8.device) == "gluon-ws"
    if ws:
        return gluon_attention.attention_fp8_ws(q8, q_scale, k8, k_scale, vt8, v_scale, out_scale=out_scale)
    b, h, s, d = q8.shape
    if d < MIN_HEAD_DIM:
        return _attention_narrow_heads(q8, q_scale, k8, k_scale, vt8, v_scale, out_scale=out_scale, tma=tma,
                                       blocks=blocks, key_len=key_len, block_n=block_n)
    s_pad = vt8.shape[-1]
    o = torch.empty((b, s, h * d), device=q8.device, dtype=FP8 if out_scale is not None else torch.bfloat16)
    qk_scale = 1.0 / math.sqrt(head_dim or d) * 1.4426950408889634
    if tma is None:
        tma = ATTN_TMA and device_sm(q8.device) >= HOPPER_SM
    k_arg, v_arg = kv_descriptors(k8, vt8, block_n) if tma else (k8, vt8)
    grid = lambda meta: (triton.cdiv(s, meta["BLOCK_M"]), b * h)  # noqa: E731
    kidx, kcnt, krag = blocks if blocks is not None else (q_scale, q_scale, q_scale)  # unread when dense
    _attn_fp8_kernel[grid](q8, q_scale, k_arg, k_scale, v_arg, v_scale, o, out_scale if out_scale is not None else o,
                           s, s_pad, h, q_scale.shape[-1], qk_scale, max(1, s).bit_length(), kidx, kcnt, krag,
                           kidx.shape[-1] if blocks is not None else 0, key_len if key_len is not None else q_scale,
                           D=d, OUT_FP8=out_scale is not None, BLOCK_N=block_n, TMA=tma,
                           SPARSE=blocks is not None, KEYS=key_len is not None)
    return o


def _check_block_n(block_n: int, not_dense: bool) -> None:
    if block_n not in ATTN_BLOCK_N or (block_n != SCALE_BLOCK and not_dense):
        from trt_sora.errors import ConfigError

        raise ConfigError(f"the Triton attention kernel takes {ATTN_BLOCK_N} keys per tile, wider than "
                          f"{SCALE_BLOCK} for dense attention only (no ws, sparse blocks or key lengths); got "
                          f"block_n={block_n}: pick one of those")


#: The INT8 Q K^T's smallest reduction width on tensor cores: narrower heads (tiny test models) are padded.
MIN_HEAD_DIM = 32


def _attention_narrow_heads(q8, q_scale, k8, k_scale, vt8, v_scale, **kw):
    """:func:`attention_fp8` for heads narrower than :data:`MIN_HEAD_DIM`: zero channels appended to Q, K and
    V leave Q K^T and P V unchanged; the output keeps each head's first ``d`` channels."""
    b, h, s, d = q8.shape
    pad = MIN_HEAD_DIM - d
    vt = torch.zeros((b, h, MIN_HEAD_DIM, vt8.shape[-1]), device=vt8.device, dtype=vt8.dtype)
    vt[:, :, :d] = vt8
    o = attention_fp8(F.pad(q8, (0, pad)), q_scale, F.pad(k8, (0, pad)), k_scale, vt,
                      F.pad(v_scale, (0, pad), value=1.0), ws=False, head_dim=d, **kw)
    return o.view(b, s, h, MIN_HEAD_DIM)[..., :d].reshape(b, s, h * d)


# -- calibration: |x| scaled onto [0, 1) for the histogram ------------------------------------------------
@triton.jit
def _abs_scaled_kernel(X, SC, U, N, NB, BLOCK: tl.constexpr, REPLICAS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    u = tl.abs(tl.load(X + offs, mask=m, other=0.0).to(tl.float32)) * tl.load(SC)
    if REPLICAS > 1:  # the bin's centre in replica (offs % REPLICAS): floor(u' * NB * REPLICAS) = r * NB + bin
        b = tl.minimum(tl.maximum(u * NB, 0.0), NB - 1.0).to(tl.int32)
        u = ((offs % REPLICAS).to(tl.int32) * NB + b).to(tl.float32) + 0.5
        u = u / (NB * REPLICAS)
    tl.store(U + offs, u, mask=m)


def abs_scaled(x, scale, num_bins: int = 0, replicas: int = 1):
    """fp32 ``|x| * scale`` of any-dtype ``x`` (flattened) in one pass: what
    :func:`trt_sora.calibrate.histogram.batch_counts` feeds ``histc`` (``scale`` a device fp32 0-d power of
    two, so the product is exact). Replaces an fp32 copy, an ``abs`` and a multiply (28 bytes moved per
    element for a bf16 input) by one read and one write (6 bytes).

    ``replicas`` > 1: instead, the centre of the element's bin in ``num_bins * replicas`` bins, replica
    ``index % replicas``, so neighbouring elements of one bin count at different addresses (``histc``'s
    shared-memory atomics serialize on one address); the replicas' counts sum to the plain histogram."""
    x = x.reshape(-1)
    u = torch.empty(x.numel(), device=x.device, dtype=torch.float32)
    if x.numel():
        _abs_scaled_kernel[(triton.cdiv(x.numel(), 4096),)](x, scale, u, x.numel(), num_bins, BLOCK=4096,
                                                            REPLICAS=replicas, num_warps=8)
    return u
