"""8-bit flash attention for Hopper in Gluon, warp-specialized: the schedule of FlashAttention-3 on the
arithmetic of :func:`trt_sora.kernels.triton_ops.attention_fp8` (INT8 Q K^T, FP8 P V, one scale per
128-token Q / K tile, fp32 online softmax in the log2 domain; the same bits, the GPU tests check it).

One CTA takes 128 query rows of one (batch, head) and runs three partitions:

* a producer warp (24 registers) that issues every TMA copy: both halves of Q, then each key tile's
  K and V^T into a ring of ``STAGES`` shared-memory slots, each slot with a ready and an empty mbarrier;
* two consumer warpgroups (240 registers each), 64 query rows apiece, sharing every K / V tile (half the
  shared-memory and L2 traffic of a 64-row CTA). Each issues tile j's Q K^T and tile j-1's P V
  asynchronously and runs tile j's softmax while that P V is on the tensor cores (FA3's intra-warpgroup
  overlap). With ping-pong (on by default) the two take turns through a pair of mbarriers to issue their
  products, so one's softmax runs against the other's tensor-core work (FA3's inter-warpgroup schedule).

No CTA-wide barrier in the loop: the consumers wait on mbarriers only, and release a slot with one
mbarrier arrive each. Three details keep the overlap in the SASS (offline ptxas): ``P`` crosses the loop
in fp32 and becomes FP8 right before its product (an FP8 loop-carried tensor is one byte per register,
190 shuffles a tile); the next K scale is loaded one tile ahead (the softmax would stall on it); and the
release of tile j-2's V slot is issued at tile j's start, so nothing after the P V wait makes ptxas hoist
that wait above the softmax. ``P`` reaches the P V product in V^T's key order
(:func:`trt_sora.kernels.reference.vt_key_order`), the softmax's registers as they are. FP8 output goes
through a layout change to 16-byte row pieces per thread (the accumulator's layout stores 1-2 bytes at a
time, which costs more than the change); bf16 output, 4 bytes a store, is stored from the accumulator's layout.

With V^T in its key order ptxas moves P's 32 FP8 conversions from before this warpgroup's turn into it,
and the Triton kernel is then the faster one (benchmarks/README.md); so the Triton kernel is the default
(``triton_ops.ATTN_WS``) and this one is selectable, the same bits.

Needs Triton's Gluon (Triton >= 3.5) and SM 9.x; :func:`available` says whether this process can run it.
"""
from __future__ import annotations

import math

import torch

from trt_sora.sm import HOPPER_SM, device_sm

try:  # Gluon ships with Triton >= 3.4; without it the Triton kernel serves every GPU
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["BLOCK_M", "CONFIG", "attention_fp8_ws", "available"]

BLOCK_M = 128  #: query rows per CTA (two consumer warpgroups of 64)
#: (ring slots, consumer registers, producer registers, ping-pong) of the launch.
CONFIG = (3, 240, 24, 1)

if HAVE_GLUON:
    LOG2_448 = gl.constexpr(8.807354922057604)


    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, r, bh, pid_m, S, n_tiles, D: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: Q's two halves, then K_t and V^T_t of every key tile t into slot t % STAGES once both
        consumers released it (K rows past S: the next head's keys, masked; past the end: zeros. V^T's
        padding: the epilogue's zeros)."""
        q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn = r
        HALF: gl.constexpr = BLOCK_M // 2
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * S + pid_m * BLOCK_M, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [bh * S + pid_m * BLOCK_M + HALF, 0], q_bar, q_smem.index(1))
        for t in range(n_tiles):
            s = t % STAGES
            ph = (t // STAGES) & 1
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bh * S + t * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [bh * D, t * BLOCK_N], v_ready.index(s), v_smem.index(s))


    @gluon.jit
    def _softmax(qk, c, m_i, l_i, n0, S, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Online softmax of one int32 key tile ``qk * c`` (log2 domain) -> (m_new, l_i, alpha, p): ``p`` =
        448 * the numerator, fp32; int32 -> fp32 by the magic-number add, exactly as the Triton kernel's
        ``_attn_tile``. MASKED: keys at ``n0 + i >= S`` drop out."""
        raw = (qk + 0x4B400000).to(gl.float32, bitcast=True)
        if MASKED:
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            sc = gl.where(gl.expand_dims(cols < S, 0), (raw - 12582912.0) * c, -1.0e30)
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            p = gl.exp2(sc - gl.expand_dims(m_new - LOG2_448, 1))
        else:
            m_new = gl.maximum(m_i, (gl.max(raw, 1) - 12582912.0) * c)
            p = gl.exp2(raw * c - gl.expand_dims(12582912.0 * c + m_new - LOG2_448, 1))
        alpha = gl.exp2(m_i - m_new)
        return m_new, l_i * alpha + gl.sum(p, 1), alpha, p


    @gluon.jit
    def _qk(r, q, j, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, qk_layout: gl.constexpr):
        """Issue key tile j's Q K^T (asynchronous) once its K slot is full."""
        q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn = r
        s = j % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        return warpgroup_mma(q, k_smem.index(s).permute((1, 0)),
                             gl.zeros([BLOCK_M, BLOCK_N], gl.int32, qk_layout), use_acc=False, is_async=True)


    @gluon.jit
    def _pv_operands(acc, alpha, p, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """Before tile j's P V: the accumulator rescaled to tile j's row max, and ``P`` as the FP8 A operand,
        its keys in V^T's order (``triton_ops._vt_order``): the accumulator's registers as they are, which
        ``assert_trivial`` checks at compile time."""
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p8 = p.to(gl.float8e4nv)
        M: gl.constexpr = p8.shape[0]
        N: gl.constexpr = p8.shape[1]
        p8 = gl.reshape(gl.permute(gl.reshape(p8, [M, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [M, N])
        return acc, gl.convert_layout(p8, p_layout, assert_trivial=True)


    @gluon.jit
    def _iter(r, q, j, p, alpha, c, c_next, m_i, l_i, acc, KSB, qsc, nblk, S, MASKED: gl.constexpr,
              WG: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
              BLOCK_N: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """Tile j's Q K^T issued, tile j-1's P V issued (its P ``p`` fp32, rescale ``alpha``), tile j's softmax
        while P V runs."""
        q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn = r
        sp = (j - 1) % STAGES
        if PINGPONG:  # both products issued in this warpgroup's turn, then the other's
            acc, p8 = _pv_operands(acc, alpha, p, o_layout, p_layout)
            mbarrier.wait(turn.index(WG), (j - 1) & 1)
            tok = _qk(r, q, j, STAGES, HALF, BLOCK_N, qk_layout)
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            pv = warpgroup_mma(p8, v_smem.index(sp).permute((1, 0)), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            mbarrier.arrive(v_empty.index((j + STAGES - 2) % STAGES), count=1, pred=j > 1)  # tile j-2's P V is done
        else:
            tok = _qk(r, q, j, STAGES, HALF, BLOCK_N, qk_layout)
            mbarrier.arrive(v_empty.index((j + STAGES - 2) % STAGES), count=1, pred=j > 1)  # tile j-2's P V is done
            acc, p8 = _pv_operands(acc, alpha, p, o_layout, p_layout)
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            pv = warpgroup_mma(p8, v_smem.index(sp).permute((1, 0)), acc, is_async=True)
        c_cur = c
        c = c_next
        c_next = qsc * gl.load(KSB + gl.minimum(j + 2, nblk - 1))
        qk = warpgroup_mma_wait(1, deps=(tok,))
        mbarrier.arrive(k_empty.index(j % STAGES), count=1)
        m_i, l_i, alpha, p = _softmax(qk, c_cur, m_i, l_i, j * BLOCK_N, S, MASKED, BLOCK_N, qk_layout)
        acc, p = warpgroup_mma_wait(0, deps=(pv, p))
        return p, alpha, c, c_next, m_i, l_i, acc


    @gluon.jit
    def _consumer(r, KS, VS, O, S, H, nblk, qk_scale, bh, pid_m, n_tiles, WG: gl.constexpr, D: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OUT_FP8: gl.constexpr,
                  QS, OSC, PINGPONG: gl.constexpr):
        """Consumer warpgroup WG: query rows ``pid_m * BLOCK_M + WG * BLOCK_M / 2`` onwards, every key tile, then
        the normalized rows stored token-major (bf16, or FP8 at ``OSC``)."""
        q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn = r
        HALF: gl.constexpr = BLOCK_M // 2
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        qsc = gl.load(QS + bh * nblk + (pid_m * BLOCK_M + WG * HALF) // BLOCK_N) * qk_scale
        KSB = KS + bh * nblk
        m_i = gl.full([HALF], -1.0e30, gl.float32, gl.SliceLayout(1, qk_layout))
        l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, qk_layout))
        acc = gl.zeros([HALF, D], gl.float32, o_layout)
        q = q_smem.index(WG)
        mbarrier.wait(q_bar, 0)
        if PINGPONG and WG == 1:
            mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 goes first
        n_full = S // BLOCK_N
        tok = _qk(r, q, 0, STAGES, HALF, BLOCK_N, qk_layout)
        qk = warpgroup_mma_wait(0, deps=(tok,))
        mbarrier.arrive(k_empty.index(0), count=1)
        c = qsc * gl.load(KSB)
        c_next = qsc * gl.load(KSB + gl.minimum(1, nblk - 1))
        if n_full > 0:
            m_i, l_i, alpha, p = _softmax(qk, c, m_i, l_i, 0, S, False, BLOCK_N, qk_layout)
        else:
            m_i, l_i, alpha, p = _softmax(qk, c, m_i, l_i, 0, S, True, BLOCK_N, qk_layout)
        c = c_next
        c_next = qsc * gl.load(KSB + gl.minimum(2, nblk - 1))
        for j in range(1, n_full):
            p, alpha, c, c_next, m_i, l_i, acc = _iter(r, q, j, p, alpha, c, c_next, m_i, l_i, acc, KSB, qsc, nblk, S,
                                                       False, WG, PINGPONG, STAGES, HALF, BLOCK_N, qk_layout, o_layout,
                                                       p_layout)
        if (n_full > 0) & (n_full < n_tiles):
            p, alpha, c, c_next, m_i, l_i, acc = _iter(r, q, n_full, p, alpha, c, c_next, m_i, l_i, acc, KSB, qsc, nblk,
                                                       S, True, WG, PINGPONG, STAGES, HALF, BLOCK_N, qk_layout,
                                                       o_layout, p_layout)
        acc, p8 = _pv_operands(acc, alpha, p, o_layout, p_layout)
        last = n_tiles - 1
        sl = last % STAGES
        mbarrier.arrive(v_empty.index((last + STAGES - 1) % STAGES), count=1, pred=last > 0)
        mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
        acc = warpgroup_mma(p8, v_smem.index(sl).permute((1, 0)), acc)
        mbarrier.arrive(v_empty.index(sl), count=1)
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        vs = gl.load(VS + bh * D + d)
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1) * gl.expand_dims(vs, 0)
        b = bh // H
        h = bh % H
        if OUT_FP8:  # 16-byte row pieces per thread: whole lines per store, not 1-2 bytes a store
            y = o.to(gl.bfloat16).to(gl.float32) / gl.load(OSC)
            st_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
            y = gl.convert_layout(gl.minimum(gl.maximum(y, -448.0), 448.0).to(gl.float8e4nv), st_layout)
        else:  # bf16 from the accumulator's layout, 4 bytes a store
            st_layout: gl.constexpr = o_layout
            y = o.to(gl.bfloat16)
        rows = pid_m * BLOCK_M + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, st_layout))
        out = O + gl.expand_dims((b * S + rows).to(gl.int64) * (H * D) + h * D, 1) + gl.expand_dims(cols, 0)
        gl.store(out, y, mask=gl.expand_dims(rows < S, 1))


    @gluon.jit
    def _attn_ws_kernel(q_desc, k_desc, v_desc, QS, KS, VS, O, OSC, S, H, nblk, qk_scale,
                        D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        OUT_FP8: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        PINGPONG: gl.constexpr):
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        HALF: gl.constexpr = BLOCK_M // 2
        q_smem = gl.allocate_shared_memory(gl.int8, [2, HALF, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        r = (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn)
        n_tiles = gl.cdiv(S, BLOCK_N)
        gl.warp_specialize([
            (_consumer, (r, KS, VS, O, S, H, nblk, qk_scale, bh, pid_m, n_tiles, 0, D, BLOCK_M, BLOCK_N, STAGES,
                         OUT_FP8, QS, OSC, PINGPONG)),
            (_consumer, (r, KS, VS, O, S, H, nblk, qk_scale, bh, pid_m, n_tiles, 1, D, BLOCK_M, BLOCK_N, STAGES,
                         OUT_FP8, QS, OSC, PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, r, bh, pid_m, S, n_tiles, D, BLOCK_M, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def available(device=None) -> bool:
    """Whether the warp-specialized kernel can run here: Gluon with warp specialization, and a CUDA
    device of compute capability 9.x (its TMA / wgmma / setmaxnreg code is Hopper's)."""
    if not HAVE_GLUON or not torch.cuda.is_available():
        return False
    return device_sm(device) // 10 == HOPPER_SM // 10


def attention_fp8_ws(q8, q_scale, k8, k_scale, vt8, v_scale, *, out_scale=None, config=None):
    """:func:`trt_sora.kernels.triton_ops.attention_fp8` through the warp-specialized Gluon kernel (same
    arguments and layouts, same result). ``config``: (ring slots, consumer registers, producer registers, ping-pong)."""
    if not available(q8.device):
        from trt_sora.errors import BackendMissingError

        raise BackendMissingError("the warp-specialized attention kernel needs Triton's Gluon with warp "
                                  "specialization (pip install 'triton>=3.5') and an SM 9.x GPU; "
                                  "triton_ops.attention_fp8(..., ws=False) runs the Triton kernel anywhere")
    stages, c_regs, p_regs, pingpong = config or CONFIG
    b, h, s, d = q8.shape
    s_pad = vt8.shape[-1]
    block_n = s_pad // q_scale.shape[-1]
    half = BLOCK_M // 2
    lay = gl.NVMMASharedLayout.get_default_for
    q_desc = TensorDescriptor(q8, [b * h * s, d], [d, 1], [half, d], lay([half, d], gl.int8))
    k_desc = TensorDescriptor(k8, [b * h * s, d], [d, 1], [block_n, d], lay([block_n, d], gl.int8))
    v_desc = TensorDescriptor(vt8, [b * h * d, s_pad], [s_pad, 1], [d, block_n], lay([d, block_n], gl.float8e4nv))
    o = torch.empty((b, s, h * d), device=q8.device, dtype=vt8.dtype if out_scale is not None else torch.bfloat16)
    _attn_ws_kernel[(-(-s // BLOCK_M), b * h)](
        q_desc, k_desc, v_desc, q_scale, k_scale, v_scale, o, out_scale if out_scale is not None else o, s, h,
        q_scale.shape[-1], 1.4426950408889634 / math.sqrt(d), D=d, BLOCK_M=BLOCK_M, BLOCK_N=block_n, STAGES=stages,
        OUT_FP8=out_scale is not None, CONSUMER_REGS=c_regs, PRODUCER_REGS=p_regs, PINGPONG=bool(pingpong),
        num_warps=4, maxnreg=168)  # 12 warps x 32 x 168 registers fill the register file; setmaxnreg moves them
    return o
