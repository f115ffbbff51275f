"""An experiment, not the shipped kernel: 8-bit flash attention for Hopper in Gluon, the same arithmetic
as :func:`trt_sora.kernels.triton_ops.attention_fp8` (INT8 Q K^T, FP8 P V, per-tile scales, fp32 online
softmax in the log2 domain) with the schedule Triton's compiler will not emit: asynchronous warpgroup MMAs.

    python benchmarks/gluon_attention.py --out gluon.json      # H100/H200: bits and speed vs the Triton kernel

Measured on the H200 (benchmarks/README.md): its output equals the Triton kernel's bit for bit, and it is
slower (29.6-30.2 ms vs 27.5-28.2 at 32,760 tokens x 40 heads; P in registers 34.5-36.2 ms), so the
package keeps the Triton kernel. What it shows: Triton 3.6 waits on every ``wgmma`` right after issuing
it (its SASS has ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each product), and here the P V really is in
flight through the softmax (``DEPBAR.LE 0x1``) - yet 7 CTA barriers per key tile (Gluon's lowering of the
TMA issue and mbarrier waits, plus the slot release) cost more than the overlap gains.

Triton waits on every ``wgmma`` right after issuing it, so the tensor cores idle through each
tile's softmax. Here tile j's Q K^T is waited on, while tile j-1's P V (issued just after it) runs
during tile j's softmax: FlashAttention-3's intra-warpgroup overlap. K and V tiles come through TMA
into a ring of ``STAGES`` shared-memory buffers, each with its own mbarrier, refilled as soon as
the product that read it has landed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

try:  # Triton >= 3.4 ships Gluon; older Triton keeps the portable kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

LOG2E = 1.4426950408889634

if HAVE_GLUON:
    @gluon.jit
    def _softmax(qk, c, m_i, l_i, n0, S, MASKED: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """Online softmax of one int32 key tile ``qk * c`` (log2 domain) -> (m_new, l_i, alpha, p):
        ``p`` = 448 * the softmax numerator, fp32. int32 -> fp32 by the magic-number add (exact for
        |qk| < 2**22), its offset folded into the one FMA. MASKED: keys at ``n0 + i >= S`` drop out."""
        LOG2_448: gl.constexpr = 8.807354922057604
        raw = (qk + 0x4B400000).to(gl.float32, bitcast=True)  # = qk + 12582912, exactly
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
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, t, bh, S, D: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LOAD_K, LOAD_V):
        """TMA of key tile ``t`` (K rows of head ``bh``) and/or its V^T columns into ring slot t % STAGES."""
        s = t % STAGES
        mbarrier.expect(k_bar.index(s), k_desc.block_type.nbytes, pred=LOAD_K)
        tma.async_copy_global_to_shared(k_desc, [bh * S + t * BLOCK_N, 0], k_bar.index(s), k_smem.index(s),
                                        pred=LOAD_K)
        mbarrier.expect(v_bar.index(s), v_desc.block_type.nbytes, pred=LOAD_V)
        tma.async_copy_global_to_shared(v_desc, [bh * D, t * BLOCK_N], v_bar.index(s), v_smem.index(s),
                                        pred=LOAD_V)

    @gluon.jit
    def _step(j, n_tiles, q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, k_desc, v_desc, KS, qsc, m_i, l_i, acc, p8,
              bh, S, nblk, MASKED: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, P_REG: gl.constexpr, qk_layout: gl.constexpr, o_layout: gl.constexpr):
        """Key tile j: issue its Q K^T, then tile j-1's P V (its P in ``p_smem[(j-1) % 2]``; a zero P at
        j = 0), wait for Q K^T, softmax while P V runs, store this tile's P, one barrier, wait for P V,
        rescale. After the barrier every warp is past tile j's Q K^T and tile j-2's P V, so their K and
        V slots are refilled there."""
        s = j % STAGES
        mbarrier.wait(k_bar.index(s), (j // STAGES) & 1)
        qk_tok = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)),
                               gl.zeros([BLOCK_M, BLOCK_N], gl.int32, qk_layout), use_acc=False, is_async=True)
        jp = gl.maximum(j - 1, 0)
        sp = jp % STAGES
        mbarrier.wait(v_bar.index(sp), (jp // STAGES) & 1)
        if P_REG:
            acc_tok = warpgroup_mma(p8, v_smem.index(sp).permute((1, 0)), acc, is_async=True)
        else:
            acc_tok = warpgroup_mma(p_smem.index((j + 1) % 2), v_smem.index(sp).permute((1, 0)), acc, is_async=True)
        qk = warpgroup_mma_wait(1, deps=(qk_tok,))
        c = qsc * gl.load(KS + bh * nblk + j)
        m_i, l_i, alpha, p = _softmax(qk, c, m_i, l_i, j * BLOCK_N, S, MASKED, BLOCK_N, qk_layout)
        if P_REG:
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p8.type.layout)
        else:
            p_smem.index(j % 2).store(p.to(gl.float8e4nv))
            fence_async_shared()
        gl.thread_barrier()
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j + STAGES, bh, S, D, BLOCK_N, STAGES,
                 j + STAGES < n_tiles, False)
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j - 2 + STAGES, bh, S, D, BLOCK_N, STAGES,
                 False, (j >= 2) & (j - 2 + STAGES < n_tiles))
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        return m_i, l_i, acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1), p8


    @gluon.jit
    def _attn_kernel(q_desc, k_desc, v_desc, QS, KS, VS, O, OSC, S, H, nblk, qk_scale,
                     D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     OUT_FP8: gl.constexpr, P_REG: gl.constexpr, num_warps: gl.constexpr):
        """One (query tile of BLOCK_M rows, batch x head). ``q_desc``/``k_desc``: int8 [B*H*S, D]
        (a ragged tile's rows past S belong to the next head: masked keys, unstored queries);
        ``v_desc``: fp8 V^T [B*H*D, S] (columns past S read as zeros)."""
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        qk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, D, 32])
        q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], v_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bar.index(i), count=1)
            mbarrier.init(v_bar.index(i), count=1)
        n_tiles = gl.cdiv(S, BLOCK_N)
        n_full = S // BLOCK_N
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [bh * S + pid_m * BLOCK_M, 0], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, i, bh, S, D, BLOCK_N, STAGES,
                     i < n_tiles, i < n_tiles)
        qsc = gl.load(QS + bh * nblk + (pid_m * BLOCK_M) // BLOCK_N) * qk_scale
        m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, gl.SliceLayout(1, qk_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, qk_layout))
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        p_smem.index(1).store(gl.zeros([BLOCK_M, BLOCK_N], gl.float8e4nv, qk_layout))  # tile -1: adds exactly zero
        fence_async_shared()
        gl.thread_barrier()
        p8 = gl.zeros([BLOCK_M, BLOCK_N], gl.float8e4nv, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_full):
            m_i, l_i, acc, p8 = _step(j, n_tiles, q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, k_desc, v_desc, KS,
                                      qsc, m_i, l_i, acc, p8, bh, S, nblk, False, D, BLOCK_M, BLOCK_N, STAGES, P_REG,
                                      qk_layout, o_layout)
        if n_full < n_tiles:  # the ragged last tile
            m_i, l_i, acc, p8 = _step(n_full, n_tiles, q_smem, k_smem, v_smem, p_smem, k_bar, v_bar, k_desc, v_desc,
                                      KS, qsc, m_i, l_i, acc, p8, bh, S, nblk, True, D, BLOCK_M, BLOCK_N, STAGES, P_REG,
                                      qk_layout, o_layout)
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // STAGES) & 1)
        if P_REG:
            acc = warpgroup_mma(p8, v_smem.index(last).permute((1, 0)), acc)
        else:
            acc = warpgroup_mma(p_smem.index((n_tiles - 1) % 2), v_smem.index(last).permute((1, 0)), acc)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bar.index(i))
            mbarrier.invalidate(v_bar.index(i))
        mbarrier.invalidate(q_bar)
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        vs = gl.load(VS + bh * D + d)
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1) * gl.expand_dims(vs, 0)
        b = bh // H
        h = bh % H
        out = O + gl.expand_dims((b * S + rows).to(gl.int64) * (H * D) + h * D, 1) + gl.expand_dims(d, 0)
        mask = gl.expand_dims(rows < S, 1)
        if OUT_FP8:
            sc = gl.load(OSC)
            y = o.to(gl.bfloat16).to(gl.float32) / sc
            gl.store(out, gl.minimum(gl.maximum(y, -448.0), 448.0).to(gl.float8e4nv), mask=mask)
        else:
            gl.store(out, o.to(gl.bfloat16), mask=mask)


#: (BLOCK_M, warps, stages, P in registers) of the Gluon kernel.
CONFIG = (64, 4, 2, 0)


def attention_fp8_hopper(q8, q_scale, k8, k_scale, vt8, v_scale, *, out_scale=None, config=None):
    """:func:`trt_sora.kernels.triton_ops.attention_fp8` on SM 9.x through the Gluon kernel (same
    arguments, same layouts, same per-row arithmetic). ``config``: (BLOCK_M, warps, stages, P in registers)."""
    block_m, warps, stages, p_reg = config or CONFIG
    b, h, s, d = q8.shape
    s_pad = vt8.shape[-1]
    block_n = s_pad // q_scale.shape[-1]
    qk_l = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.int8)
    q_desc = TensorDescriptor(q8, [b * h * s, d], [d, 1], [block_m, d],
                              gl.NVMMASharedLayout.get_default_for([block_m, d], gl.int8))
    k_desc = TensorDescriptor(k8, [b * h * s, d], [d, 1], [block_n, d], qk_l)
    v_desc = TensorDescriptor(vt8, [b * h * d, s], [s_pad, 1], [d, block_n],
                              gl.NVMMASharedLayout.get_default_for([d, block_n], gl.float8e4nv))
    o = torch.empty((b, s, h * d), device=q8.device, dtype=vt8.dtype if out_scale is not None else torch.bfloat16)
    _attn_kernel[(-(-s // block_m), b * h)](
        q_desc, k_desc, v_desc, q_scale, k_scale, v_scale, o, out_scale if out_scale is not None else o, s, h,
        q_scale.shape[-1], LOG2E / math.sqrt(d), D=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        OUT_FP8=out_scale is not None, P_REG=bool(p_reg), num_warps=warps)
    return o


def main() -> None:
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.fp8_bench import attention_inputs
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="64,4,2,0;64,4,2,1;128,8,2,0",
                    help="BLOCK_M,warps,stages,P-in-registers; semicolon-separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfgs = [tuple(int(x) for x in c.split(",")) for c in a.configs.split(";")]
    res = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "bits": [], "ms": {}}
    for b, s, h in ((1, 100, 2), (1, 128, 2), (2, 1000, 2), (1, 4133, 2)):  # ragged, one tile, batch 2, many
        ops = t.qkv_rmsnorm_rope(*attention_inputs(b, s, h, seed=1), h, fp8=True)
        want = t.attention_fp8(*ops)
        sc = torch.tensor(float(want.float().abs().max()) / 448, device="cuda")
        want8 = t.attention_fp8(*ops, out_scale=sc)
        res["bits"].append({"b": b, "s": s, **{str(c): torch.equal(attention_fp8_hopper(*ops, config=c), want) and
                                                torch.equal(attention_fp8_hopper(*ops, out_scale=sc, config=c)
                                                            .view(torch.uint8), want8.view(torch.uint8))
                                                for c in cfgs}})
    s, h, d = 32760, 40, 128
    qkv, wq, wk, cs, sn = attention_inputs(1, s, h, d)
    ops = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    for _ in range(2):
        res["ms"].setdefault("triton", []).append(bench(lambda: t.attention_fp8(*ops)))
        for c in cfgs:
            res["ms"].setdefault(str(c), []).append(bench(lambda: attention_fp8_hopper(*ops, config=c)))
    res["tflops"] = {k: [4.0 * s * s * d * h / (m * 1e-3) / 1e12 for m in v] for k, v in res["ms"].items()}
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    heads = [0, 10, 20, 30]
    want = ref.attention(q[:, heads], k[:, heads], v[:, heads]).transpose(1, 2).float()
    res["cosine_vs_fp32"] = {str(c): torch.nn.functional.cosine_similarity(
        attention_fp8_hopper(*ops, config=c).float().view(1, s, h, d)[:, :, heads].flatten(), want.flatten(),
        dim=0).item() for c in cfgs}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
