"""The 8-bit attention kernel in CuTe DSL (``nvidia-cutlass-dsl``), SM 9.0a: the schedule FlashAttention-3
runs, on the operands of :func:`trt_sora.kernels.triton_ops.attention_fp8` (INT8 Q K^T per 128-token block,
FP8 P V, V^T in the P V operand's key order).

One CTA holds 128 query rows (one Q scale block) and three warpgroups:

- warp 0 of the first loads Q once, then K and V^T tiles of 128 keys (one K scale block each) into a ring of
  ``stages`` buffers through TMA, each tile on its own mbarrier pipeline (K first: the next Q K^T can start
  before its V lands);
- the other two each own 64 rows: Q K^T on the INT8 tensor cores (int32), the online softmax in fp32 (the
  magic-number int32 -> fp32, the scales folded into one FMA, EX2), P packed to FP8 in registers (the A
  operand of the register-sourced FP8 WGMMA, no shared-memory round trip: V^T's key order puts every value
  in the lane that owns it), then O += P V^T.

Options of :class:`Attention8` change the schedule, not the math:

- ``overlap`` (intra-warpgroup): tile j's Q K^T and tile j-1's P V are issued together; the softmax of j
  runs while P V of j-1 is on the tensor cores;
- ``lookahead``: Q K^T runs one tile ahead into a second accumulator, so the softmax of j runs while Q K^T
  of j+1 is on the tensor cores and P V of j follows at once (the softmax works in place: fp32 in the int32
  registers);
- ``pingpong`` (inter-warpgroup): two named barriers take turns, so one warpgroup's GEMMs run while the
  other's softmax does;
- ``lazy_rescale``: O's rescale is skipped where no row of a warp has a new max (exact), and the wait for
  P V sits in both arms of that branch. Without it ptxas moves the wait above the softmax's EX2s, so the
  softmax does not overlap P V after all (``benchmarks/cute_sass.py`` shows where each wait lands);
- ``early_pack`` (overlap): P of tile j-1 is packed to FP8 after Q K^T of tile j is issued, in the shadow of
  the wait for it, not at the end of j-1's step (the same bits);
- ``split_sum``: each row's sum of P in four chains (as its max), not one chain of 32 dependent FADDs.
- ``int_max``: each row's max over the int32 products (3-input integer max steps), the magic adds after it
  (the same max, the same bits); they no longer all stand before the first EX2.

:data:`SCHEDULE` (overlap + lazy_rescale + early_pack + split_sum + int_max, 2 stages) is the fastest
measured inside a model call (benchmarks/README.md).

The kernel compiles for ``sm_90a`` without a GPU (``CUTE_DSL_ARCH=sm_90a``): nothing here imports the DSL
until a kernel is built (:func:`available`, :func:`attention_fp8`).
"""
import importlib.util
import math
from functools import cache
from types import SimpleNamespace

from trt_sora.errors import BackendMissingError, ConfigError

#: Keys per tile and query rows per CTA: the INT8 operands' scale block.
TILE = 128
LOG2_448 = 8.807354922057604
#: ``trace``: the CTAs of head 0 with query blocks 0..TRACE_CTAS-1 record, in lane 0 of each consumer warp,
#: the SM clock at TRACE_EVENTS points of each of their first TRACE_TILES key tiles (:func:`attention_fp8`).
TRACE_CTAS, TRACE_TILES = 4, 64
TRACE_EVENTS = ("start", "k_landed", "qk_done", "softmax_done", "pv_done", "end")
#: ``trace``'s int64 tensor: traced CTAs, their 8 consumer warps, key tiles, events.
TRACE_SHAPE = (TRACE_CTAS, 8, TRACE_TILES, len(TRACE_EVENTS))
#: ``ablate``: work a traced overlap step leaves out, to see what each costs (the output is wrong by design):
#: ``exp`` P's EX2s become an FMUL each (the MUFU idle but for the two alphas; the loop otherwise the same),
#: ``pv`` the P V products (and P's pack, which then has no reader). Not Q K^T: the softmax's max over a
#: product that no longer changes leaves the loop, and the registers spill.
ABLATIONS = ("exp", "pv")
#: The magic number that turns an int32 (|x| < 2**22) into fp32 by one add and a bit cast.
MAGIC_I = 0x4B400000
MAGIC_F = 12582912.0


def p_operand_source(c: int, h: int, k: int) -> tuple[int, int]:
    """Where P V's FP8 A operand finds its value: register (k, r, h) of K chunk ``c`` (k < 4, h < 2; lane q holds
    the keys at positions 32c + 16h + 4q + k of V^T) comes from the Q K^T accumulator's value (e, r, n) of the
    same lane (key 8n + 2q + e), returned as ``(e, n)``. With V^T in :func:`reference.vt_key_order` both name
    the same key, so P needs no shuffle between lanes."""
    return k % 2, 4 * c + 2 * h + k // 2


#: The DSL this kernel was written and measured with.
PIP = "pip install nvidia-cutlass-dsl==4.8.1"


def available(device=None) -> bool:
    """True where the DSL is installed and ``device`` (default: the current CUDA device) is SM 9.0."""
    try:
        require(device)
    except (BackendMissingError, ConfigError):
        return False
    return True


def require(device=None) -> None:
    """Typed errors where this kernel cannot run: :class:`BackendMissingError` naming the install command when
    the DSL is missing; :class:`ConfigError` on a GPU that is not SM 9.0 (its code is ``sm_90a``)."""
    import torch

    if importlib.util.find_spec("cutlass") is None:
        raise BackendMissingError(f"attention kernel 'int8-cute' needs NVIDIA's CuTe DSL; install it with: {PIP} "
                                  "(or the cute extra), or use the default kernel 'int8'")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) != (9, 0):
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no GPU"
        raise ConfigError(f"attention kernel 'int8-cute' runs on SM 9.0 (H100 / H200) only, not on {name}; "
                          "use torch_fp8.attention_kernel: int8")


def takes(q8) -> bool:
    """Whether this kernel runs attention on ``q8`` [B, H, S, D] (head dim 128, on a CUDA device); the
    ``int8`` kernel runs the rest (narrow heads of tiny models, key lengths, sparse tiles)."""
    return q8.is_cuda and q8.shape[-1] == TILE


def version() -> str | None:
    """The installed DSL's version (None without it)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return None


def _kernel_class():
    """The kernel class, defined on first use (it needs the DSL)."""
    import cuda.bindings.driver as cuda  # noqa: F401  (the stream type of the launch)
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass import Float32, Int32, const_expr, pipeline
    from cutlass.cute.nvgpu import cpasync, warpgroup

    K_MAJOR = cute.nvgpu.OperandMajorMode.K

    def smem_layout(dtype, stages):
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dtype)
        shape = (TILE, TILE) if stages is None else (TILE, TILE, stages)
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    def gemm(tiled_mma, acc, a, b, zero_init):
        """acc (+)= a b over the K modes of the fragments, issued as one WGMMA group (not waited)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in range(cute.size(a.shape[2])):  # a plain helper (not jit): Python unrolls it
            cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    def take_turn(wg):
        """Wait for warpgroup wg's turn (``pingpong``): named barrier 1 + wg, completed by the other
        warpgroup's :func:`pass_turn` (or, for warpgroup 0's first turn, its own arrive at start)."""
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=256)

    def pass_turn(wg):
        """Hand the turn from warpgroup wg to the other one."""
        cute.arch.barrier_arrive(barrier_id=2 - wg, number_of_threads=256)

    def row_reduce(t, r, op):
        """``op`` over row r of an accumulator-shaped fragment ``t`` (its values (e, r, n)) and the quad's other
        lanes: four chains, then a tree. Exact for max in any order, and a quarter of the latency of one chain
        that the warp waits through before its first EX2."""
        part = [t[(e, r, n), 0, 0] for n in range(2) for e in range(2)]
        for n in range(2, cute.size(t.shape[0][2])):  # a plain helper (not jit): Python unrolls it
            for e in range(2):
                k = 2 * (n % 2) + e
                part[k] = op(part[k], t[(e, r, n), 0, 0])
        return quad_reduce(op(op(part[0], part[1]), op(part[2], part[3])), op)

    def quad_reduce(x, op):
        """``op`` over the four lanes of a quad (they share a row of the accumulator)."""
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
        return op(x, cute.arch.shuffle_sync_bfly(x, offset=2))

    class Attention8:
        def __init__(self, stages: int = 2, overlap: bool = False, pingpong: bool = False,
                     out_fp8: bool = False, lookahead: bool = False, lazy_rescale: bool = False,
                     early_pack: bool = False, split_sum: bool = False, int_max: bool = False,
                     trace: bool = False, ablate: tuple = (),
                     mma_regs: int = 240, load_regs: int = 24):
            self.stages, self.overlap, self.pingpong, self.out_fp8 = stages, overlap, pingpong, out_fp8
            self.lookahead, self.lazy_rescale = lookahead, lazy_rescale
            self.trace, self.early_pack, self.split_sum, self.int_max = trace, early_pack, split_sum, int_max
            self.ablate = ablate
            self.mma_regs, self.load_regs = mma_regs, load_regs

        @cute.jit
        def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mQS: cute.Tensor,
                     mKS: cute.Tensor, mVS: cute.Tensor, mO: cute.Tensor, qk_scale: Float32, mOSC: cute.Tensor,
                     mTrace: cute.Tensor, stream: cuda.CUstream):
            """mQ, mK [BH, S, D] int8; mVt [BH, D, S_pad] fp8; mQS, mKS [BH, nblk] fp32 (one per 128 tokens);
            mVS [BH, D]; mO [B, S, H, D/2] int32 (bf16 pairs) or int16 (``out_fp8``: E4M3 pairs); qk_scale:
            D**-0.5 * log2(e); mOSC [1]: the FP8 output's scale (unread for bf16); mTrace int64
            :data:`TRACE_SHAPE` (``trace``; else unread)."""
            # (rows, D, BH) views: TMA tiles of (128, 128) at (block, 0, bh)
            q3 = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
            k3 = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 2, 0]))
            v3 = cute.make_tensor(mVt.iterator, cute.select(mVt.layout, mode=[1, 2, 0]))
            sQ_layout = smem_layout(cutlass.Int8, None)
            sK_layout = smem_layout(cutlass.Int8, self.stages)
            sV_layout = smem_layout(cutlass.Float8E4M3FN, self.stages)
            tma_q, tq = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q3, sQ_layout,
                                                   (TILE, TILE))
            tma_k, tk = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k3,
                                                   cute.select(sK_layout, mode=[0, 1]), (TILE, TILE))
            tma_v, tv = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), v3,
                                                   cute.select(sV_layout, mode=[0, 1]), (TILE, TILE))
            mma_qk = sm90.make_trivial_tiled_mma(cutlass.Int8, cutlass.Int8, K_MAJOR, K_MAJOR, Int32,
                                                 (2, 1, 1), (64, TILE))
            mma_pv = sm90.make_trivial_tiled_mma(cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, K_MAJOR, K_MAJOR,
                                                 Float32, (2, 1, 1), (64, TILE),
                                                 a_source=warpgroup.OperandSource.RMEM)
            stages = self.stages

            @cute.struct
            class Storage:
                bar_q: cute.struct.MemRange[cutlass.Int64, 2]
                bar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                bar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sQ: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(sK_layout)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(sV_layout)], 1024]

            seqlen = mQ.shape[1]
            grid = (cute.ceil_div(seqlen, TILE), mQ.shape[0], 1)
            self.kernel(tq, tk, tv, tma_q, tma_k, tma_v, mQS, mKS, mVS, mO, qk_scale, mOSC, mTrace, sQ_layout,
                        sK_layout,
                        sV_layout, mma_qk, mma_pv, Storage).launch(grid=grid, block=[384, 1, 1], stream=stream,
                                                                   min_blocks_per_mp=1)

        @cute.kernel
        def kernel(self, tq: cute.Tensor, tk: cute.Tensor, tv: cute.Tensor, tma_q: cute.CopyAtom,
                   tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, mQS: cute.Tensor, mKS: cute.Tensor,
                   mVS: cute.Tensor, mO: cute.Tensor, qk_scale: Float32, mOSC: cute.Tensor,
                   mTrace: cute.Tensor, sQ_layout: cute.ComposedLayout,
                   sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, mma_qk: cute.TiledMma,
                   mma_pv: cute.TiledMma, Storage: cutlass.Constexpr):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            m_block, bh, _ = cute.arch.block_idx()
            if warp == 0:
                for atom in (tma_q, tma_k, tma_v):
                    cpasync.prefetch_descriptor(atom)
            storage = cutlass.utils.SmemAllocator().allocate(Storage)
            group = lambda n: pipeline.CooperativeGroup(pipeline.Agent.Thread, n)  # noqa: E731
            q_bytes = TILE * TILE
            pipe_q = pipeline.PipelineTmaAsync.create(barrier_storage=storage.bar_q.data_ptr(), num_stages=1,
                                                      producer_group=group(1), consumer_group=group(8),
                                                      tx_count=q_bytes, defer_sync=True)
            pipe_k = pipeline.PipelineTmaAsync.create(barrier_storage=storage.bar_k.data_ptr(),
                                                      num_stages=self.stages, producer_group=group(1),
                                                      consumer_group=group(8), tx_count=q_bytes, defer_sync=True)
            pipe_v = pipeline.PipelineTmaAsync.create(barrier_storage=storage.bar_v.data_ptr(),
                                                      num_stages=self.stages, producer_group=group(1),
                                                      consumer_group=group(8), tx_count=q_bytes, defer_sync=True)
            pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            seqlen = tq.shape[0]
            n_tiles = cute.ceil_div(seqlen, TILE)
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            if warp < 4:
                cute.arch.setmaxregister_decrease(self.load_regs)
                if warp == 0:
                    self.load(tq, tk, tv, tma_q, tma_k, tma_v, sQ, sK, sV, pipe_q, pipe_k, pipe_v, m_block, bh,
                              n_tiles)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                tidx, _, _ = cute.arch.thread_idx()
                self.mma(tidx - 128, sQ, sK, sV, pipe_q, pipe_k, pipe_v, mQS, mKS, mVS, mO, qk_scale, mOSC,
                         mTrace, mma_qk, mma_pv, m_block, bh, seqlen, n_tiles)

        @cute.jit
        def load(self, tq, tk, tv, tma_q, tma_k, tma_v, sQ, sK, sV, pipe_q, pipe_k, pipe_v, m_block, bh,
                 n_tiles):
            gQ = cute.local_tile(tq[None, None, bh], (TILE, TILE), (m_block, 0))
            gK = cute.local_tile(tk[None, None, bh], (TILE, TILE), (None, 0))
            gV = cute.local_tile(tv[None, None, bh], (TILE, TILE), (0, None))
            sq, gq = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
            sk, gk = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
            sv, gv = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, gk[None, 0], sk[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, gq, sq, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, gv[None, 0], sv[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
            for j in cutlass.range(1, n_tiles, unroll=1):
                pipe_k.producer_acquire(state)
                cute.copy(tma_k, gk[None, j], sk[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(state)
                cute.copy(tma_v, gv[None, j], sv[None, state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state))
                state.advance()
            pipe_v.producer_tail(state)

        @cute.jit
        def mma(self, tidx, sQ, sK, sV, pipe_q, pipe_k, pipe_v, mQS, mKS, mVS, mO, qk_scale, mOSC, mTrace,
                mma_qk, mma_pv, m_block, bh, seqlen, n_tiles):
            """A consumer warpgroup's 64 rows: its fragments, then the key tiles in the schedule's order, then
            the epilogue."""
            wg = cute.arch.make_warp_uniform(tidx // 128)
            wg_layout = cute.make_layout(2, stride=128)
            wg_qk = mma_qk.get_slice(wg_layout(wg))
            wg_pv = mma_pv.get_slice(wg_layout(wg))
            thr_qk = mma_qk.get_slice(tidx)
            thr_pv = mma_pv.get_slice(tidx)
            tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((TILE, TILE)))
            # V^T [D, keys] is P V's B operand (N = D, K = keys), K-major
            f = SimpleNamespace(
                wg=wg, pipe_k=pipe_k, pipe_v=pipe_v, mma_qk=mma_qk, mma_pv=mma_pv,
                tSrQ=wg_qk.make_fragment_A(wg_qk.partition_A(sQ)), tSrK=wg_qk.make_fragment_B(wg_qk.partition_B(sK)),
                tOrV=wg_pv.make_fragment_B(wg_pv.partition_B(sV)), tOrP=tOrP,
                acc_o=cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE, TILE)), Float32),
                acc_s=cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Int32),
                s_f=cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Float32),
                p_f=cute.make_rmem_tensor_like(tOrP, Float32),
                cS=thr_qk.partition_C(cute.make_identity_tensor((TILE, TILE))),
                row_max=cute.make_rmem_tensor((2,), Float32), row_sum=cute.make_rmem_tensor((2,), Float32),
                alpha=cute.make_rmem_tensor((2,), Float32), qsc=mQS[bh, m_block] * qk_scale, mKS=mKS, bh=bh,
                seqlen=seqlen, n_tiles=n_tiles,
                tr=(mTrace, (bh == 0) & (m_block < TRACE_CTAS) & (tidx % 32 == 0), m_block, tidx // 32))
            f.row_max.fill(-1.0e30)
            f.row_sum.fill(0.0)
            f.acc_o.fill(0.0)
            if const_expr(self.pingpong):
                if wg == 0:
                    cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_q.consumer_wait(q_state)
            if const_expr(self.lookahead):
                self.tiles_lookahead(f, thr_qk)
            elif const_expr(self.overlap):
                self.tiles_overlap(f)
            else:
                self.tiles_in_order(f)
            self.epilogue(f.acc_o, f.row_sum, thr_pv, mVS, mO, mOSC, m_block, bh, seqlen)

        @cute.jit
        def tile_softmax(self, f, acc, s_f, j, c, masked: cutlass.Constexpr):
            """The softmax of key tile j (:meth:`softmax`); ``c`` its logits' scale (:meth:`tile_scale`)."""
            self.softmax(acc, s_f, f.cS, f.row_max, f.row_sum, f.alpha, c, j * TILE, f.seqlen, masked)

        @cute.jit
        def tile_scale(self, f, j):
            """Q's and key tile j's scales times D**-0.5 log2(e). Each step reads it first, before its waits, so
            the global load's latency hides behind the Q K^T instead of standing in front of the first EX2."""
            return f.qsc * f.mKS[f.bh, j]

        @cute.jit
        def first_qk(self, f, acc, state):
            """Q K^T of the first key tile into ``acc``, waited for, its K buffer released (``state`` not
            advanced): the head of the overlapped schedules."""
            f.pipe_k.consumer_wait(state)
            gemm(f.mma_qk, acc, f.tSrQ, f.tSrK[None, None, None, state.index], True)
            warpgroup.wait_group(0)
            f.pipe_k.consumer_release(state)

        @cute.jit
        def tiles_in_order(self, f):
            """Each tile's Q K^T, softmax and P V in turn (``pingpong``: the GEMMs in the warpgroups' turns); the
            last tile, the only ragged one, peeled."""
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            self.turn_wait(f.wg)
            for j in cutlass.range(f.n_tiles - 1, unroll=1):
                state = self.in_order_step(f, j, state, False)
            state = self.in_order_step(f, f.n_tiles - 1, state, True)
            self.turn_pass(f.wg)

        @cute.jit
        def in_order_step(self, f, j, state, masked: cutlass.Constexpr):
            c = self.tile_scale(f, j)
            f.pipe_k.consumer_wait(state)
            gemm(f.mma_qk, f.acc_s, f.tSrQ, f.tSrK[None, None, None, state.index], True)
            self.turn_pass(f.wg)
            warpgroup.wait_group(0)
            f.pipe_k.consumer_release(state)
            self.tile_softmax(f, f.acc_s, f.s_f, j, c, masked)
            self.rescale(f.acc_o, f.alpha)
            self.pack_p(f.s_f, f.p_f, f.tOrP)
            f.pipe_v.consumer_wait(state)
            self.turn_wait(f.wg)
            gemm(f.mma_pv, f.acc_o, f.tOrP, f.tOrV[None, None, None, state.index], False)
            warpgroup.wait_group(0)
            f.pipe_v.consumer_release(state)
            state.advance()
            return state

        @cute.jit
        def tiles_overlap(self, f):
            """Tile j's Q K^T beside tile j-1's P V; the softmax of j while P V of j-1 runs."""
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            c = self.tile_scale(f, 0)
            self.first_qk(f, f.acc_s, state)
            self.tile_softmax(f, f.acc_s, f.s_f, 0, c, True)
            if const_expr(not self.early_pack):
                self.pack_p(f.s_f, f.p_f, f.tOrP)
            v_state = state.clone()
            for j in cutlass.range(1, f.n_tiles - 1, unroll=1):
                state, v_state = self.overlap_step(f, j, state, v_state, False)
            if f.n_tiles > 1:
                state, v_state = self.overlap_step(f, f.n_tiles - 1, state, v_state, True)
            if const_expr(self.early_pack):
                self.pack_p(f.s_f, f.p_f, f.tOrP)
            f.pipe_v.consumer_wait(v_state)
            gemm(f.mma_pv, f.acc_o, f.tOrP, f.tOrV[None, None, None, v_state.index], False)
            warpgroup.wait_group(0)
            f.pipe_v.consumer_release(v_state)

        @cute.jit
        def overlap_step(self, f, j, state, v_state, masked: cutlass.Constexpr):
            self.mark(f.tr, j, 0)
            c = self.tile_scale(f, j)
            state.advance()
            f.pipe_k.consumer_wait(state)
            self.mark(f.tr, j, 1)
            self.turn_wait(f.wg)
            gemm(f.mma_qk, f.acc_s, f.tSrQ, f.tSrK[None, None, None, state.index], True)
            if const_expr(self.early_pack):  # P of j-1 packed while Q K^T of j runs
                self.pack_p(f.s_f, f.p_f, f.tOrP)
            f.pipe_v.consumer_wait(v_state)
            if const_expr("pv" not in self.ablate):
                gemm(f.mma_pv, f.acc_o, f.tOrP, f.tOrV[None, None, None, v_state.index], False)
            self.turn_pass(f.wg)
            warpgroup.wait_group(0 if "pv" in self.ablate else 1)
            self.mark(f.tr, j, 2)
            f.pipe_k.consumer_release(state)
            self.tile_softmax(f, f.acc_s, f.s_f, j, c, masked)
            self.mark(f.tr, j, 3)
            self.rescale(f.acc_o, f.alpha, 0)  # once P V of j-1 is done
            self.mark(f.tr, j, 4)
            f.pipe_v.consumer_release(v_state)
            if const_expr(not self.early_pack):
                self.pack_p(f.s_f, f.p_f, f.tOrP)
            v_state.advance()
            self.mark(f.tr, j, 5)
            return state, v_state

        @cute.jit
        def mark(self, tr, j, event: cutlass.Constexpr):
            """``trace``: the SM clock at ``event`` of key tile j, in the traced CTAs' lane 0 of each warp; ``tr``
            (the trace tensor, whether this lane traces, its CTA's query block, its warp)."""
            if const_expr(self.trace):
                m_trace, traced, m_block, warp = tr
                t = cute.arch.clock64()
                out = cute.make_tensor(m_trace.iterator, m_trace.layout)
                if traced & (j < TRACE_TILES):
                    out[m_block, warp, j, event] = t

        @cute.jit
        def tiles_lookahead(self, f, thr_qk):
            """Q K^T one tile ahead into a second accumulator (:meth:`lookahead_step`). Every step but the last
            issues the next Q K^T, so the WGMMA groups outstanding at each wait are the same on every path
            (ptxas serializes the products where it cannot tell)."""
            acc_b = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, TILE)), Int32)
            acc_a, n_tiles = f.acc_s, f.n_tiles
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            v_state = state.clone()
            self.first_qk(f, acc_a, state)
            step = self.lookahead_step
            args = (f.pipe_k, f.pipe_v, f.mma_qk, f.mma_pv, f.tSrQ, f.tSrK, f.tOrV, f.tOrP, f.p_f, f.acc_o, f.cS,
                    f.row_max, f.row_sum, f.alpha, f.qsc, f.mKS, f.bh, f.seqlen, f.tr)
            pairs = (n_tiles - 1) // 2
            for jj in cutlass.range(pairs, unroll=1):
                state, v_state = step(acc_a, acc_b, 2 * jj, state, v_state, *args, True)
                state, v_state = step(acc_b, acc_a, 2 * jj + 1, state, v_state, *args, True)
            if n_tiles - 2 * pairs == 2:
                state, v_state = step(acc_a, acc_b, n_tiles - 2, state, v_state, *args, True)
                state, v_state = step(acc_b, acc_a, n_tiles - 1, state, v_state, *args, False)
            else:
                state, v_state = step(acc_a, acc_b, n_tiles - 1, state, v_state, *args, False)
            warpgroup.wait_group(0)
            f.pipe_v.consumer_release(v_state)

        @cute.jit
        def lookahead_step(self, s_cur, s_next, j, k_state, v_state, pipe_k, pipe_v, mma_qk, mma_pv, tSrQ, tSrK,
                           tOrV, tOrP, p_f, acc_o, cS, row_max, row_sum, alpha, qsc, mKS, bh, seqlen, tr,
                           has_next: cutlass.Constexpr):
            """Tile j, its Q K^T in ``s_cur`` (done): Q K^T of j+1 into ``s_next`` first (``has_next``), then the
            softmax of j (in place: the fp32 values in the int32 registers) while it and P V of j-1 run, then
            O's rescale and P's packing once P V of j-1 is done, then P V of j. Returns the K and V pipeline
            states. Its values come as arguments, not in the fragments' namespace: the tracer loses a
            namespace's values across the staged branches around the steps. ``trace``: its marks stand before
            the next Q K^T's K wait, after it, before and after the softmax, after O's rescale, and after the
            wait for the next Q K^T (so the last phase is P's pack, P V's issue and that wait)."""
            self.mark(tr, j, 0)
            c = qsc * mKS[bh, j]  # first, as in tile_scale
            if const_expr(has_next):
                k_state.advance()
                pipe_k.consumer_wait(k_state)
                self.mark(tr, j, 1)
                gemm(mma_qk, s_next, tSrQ, tSrK[None, None, None, k_state.index], True)
            self.mark(tr, j, 2)
            s_f = cute.recast_tensor(s_cur, Float32)
            self.softmax(s_cur, s_f, cS, row_max, row_sum, alpha, c, j * TILE, seqlen, not has_next)
            self.mark(tr, j, 3)
            self.rescale(acc_o, alpha, 1 if has_next else 0)  # once P V of j-1 is done: O and P are free
            self.mark(tr, j, 4)
            if j > 0:
                pipe_v.consumer_release(v_state)
                v_state.advance()
            self.pack_p(s_f, p_f, tOrP)
            pipe_v.consumer_wait(v_state)
            gemm(mma_pv, acc_o, tOrP, tOrV[None, None, None, v_state.index], False)
            if const_expr(has_next):
                warpgroup.wait_group(1)  # Q K^T of j+1 done
                self.mark(tr, j, 5)
                pipe_k.consumer_release(k_state)
            return k_state, v_state

        @cute.jit
        def softmax(self, acc_s, s_f, cS, row_max, row_sum, alpha, c, key0, seqlen, masked: cutlass.Constexpr):
            """acc_s (int32 Q K^T) -> s_f = 448 * exp2(c * s - m_new) per row; m and l updated, ``alpha`` the
            factor on O of each of the thread's two rows.
            ``masked`` (the last tile, the only one that can be ragged): keys at or past ``seqlen`` get -1e30
            before the max. The other tiles leave the test out (ptxas would predicate it into
            every tile's softmax)."""
            if const_expr(self.int_max and not masked):
                self.softmax_int_max(acc_s, s_f, row_max, row_sum, alpha, c)
                return
            s_f.store((acc_s.load() + MAGIC_I).bitcast(Float32).reshape(s_f.shape))
            if const_expr(masked):
                if key0 + TILE > seqlen:
                    for i in cutlass.range_constexpr(cute.size(s_f)):
                        if key0 + cS[i][1] >= seqlen:
                            s_f[i] = Float32(-1.0e30)
            for r in cutlass.range_constexpr(2):
                mx = row_reduce(s_f, r, cute.arch.fmax)
                self.row_exps(s_f, r, c, cute.arch.fmax(row_max[r], (mx - MAGIC_F) * c), row_max, row_sum, alpha)

        @cute.jit
        def softmax_int_max(self, acc_s, s_f, row_max, row_sum, alpha, c):
            """:meth:`softmax` of an unmasked tile with ``int_max``: each row's max over the int32 products (the
            magic add is monotonic and exact, so the same max), and the magic adds after it, where the EX2s
            leave the integer pipe idle; before, all 64 adds and 64 max steps stood in front of the first EX2."""
            mx = [row_reduce(acc_s, r, cutlass.max) for r in range(2)]
            s_f.store((acc_s.load() + MAGIC_I).bitcast(Float32).reshape(s_f.shape))
            for r in cutlass.range_constexpr(2):
                self.row_exps(s_f, r, c, cute.arch.fmax(row_max[r], Float32(mx[r]) * c), row_max, row_sum, alpha)

        def row_exps(self, s_f, r, c, m_new, row_max, row_sum, alpha):
            """Row r of s_f (fp32 of the magic-offset products) -> 448 * exp2(c * s - m_new) in place, their sum
            into l (in four chains with ``split_sum``, as the max), ``alpha`` = exp2(m_old - m_new). A plain helper
            (not jit): Python unrolls it."""
            neg = MAGIC_F * c + m_new - LOG2_448
            sums = [Float32(0.0)] * (4 if self.split_sum else 1)
            for n in range(cute.size(s_f.shape[0][2])):
                for e in range(2):
                    x = s_f[(e, r, n), 0, 0] * c - neg
                    p = x * Float32(0.0078125) if "exp" in self.ablate else cute.math.exp2(x, fastmath=True)
                    s_f[(e, r, n), 0, 0] = p
                    k = (2 * (n % 2) + e) % len(sums)
                    sums[k] = sums[k] + p
            total = sums[0] if len(sums) == 1 else (sums[0] + sums[1]) + (sums[2] + sums[3])
            alpha[r] = cute.math.exp2(row_max[r] - m_new, fastmath=True)
            row_sum[r] = row_sum[r] * alpha[r] + total
            row_max[r] = m_new

        @cute.jit
        def rescale(self, acc_o, alpha, pending: cutlass.Constexpr = None):
            """acc_o *= alpha per row, after ``warpgroup.wait_group(pending)`` where P V is in flight (``pending``
            not None). ``lazy_rescale``: skipped when no row of the warp has a new max (every alpha exactly 1:
            the product would change nothing), a warp-uniform branch with the wait in both arms. There ptxas
            keeps the wait after the softmax's EX2s; a wait standing alone in the softmax's block it moves
            above them, so the softmax no longer overlaps P V (the SASS of the overlap schedule)."""
            if const_expr(self.lazy_rescale):
                changed = (alpha[0] != Float32(1.0)) or (alpha[1] != Float32(1.0))
                if cute.arch.vote_any_sync(changed):
                    self.wait(pending)
                    self.scale_rows(acc_o, alpha)
                else:
                    self.wait(pending)
            else:
                self.wait(pending)
                self.scale_rows(acc_o, alpha)

        @cute.jit
        def wait(self, pending: cutlass.Constexpr):
            if const_expr(pending is not None):
                warpgroup.wait_group(pending)

        @cute.jit
        def scale_rows(self, acc_o, alpha):
            for r in cutlass.range_constexpr(2):
                for n in cutlass.range_constexpr(cute.size(acc_o.shape[0][2])):
                    for e in cutlass.range_constexpr(2):
                        acc_o[(e, r, n), 0, 0] = acc_o[(e, r, n), 0, 0] * alpha[r]

        @cute.jit
        def turn_wait(self, wg):
            """pingpong: wait for this warpgroup's turn on the tensor cores (:func:`take_turn`)."""
            if const_expr(self.pingpong):
                take_turn(wg)

        @cute.jit
        def turn_pass(self, wg):
            """pingpong: hand the tensor cores to the other warpgroup (:func:`pass_turn`)."""
            if const_expr(self.pingpong):
                pass_turn(wg)

        @cute.jit
        def pack_p(self, s_f, p_f, tOrP):
            """P (the Q K^T accumulator's layout) -> the FP8 A operand of P V (:func:`p_operand_source`)."""
            for c in cutlass.range_constexpr(TILE // 32):
                for h in cutlass.range_constexpr(2):
                    for r in cutlass.range_constexpr(2):
                        for k in cutlass.range_constexpr(4):
                            e, n = p_operand_source(c, h, k)
                            p_f[(k, r, h), 0, c] = s_f[(e, r, n), 0, 0]
            tOrP.store(p_f.load().to(cutlass.Float8E4M3FN))

        @cute.jit
        def epilogue(self, acc_o, row_sum, thr_pv, mVS, mO, mOSC, m_block, bh, seqlen):
            """o = acc / l * v_scale[d] -> ``mO`` [B, S, H, D/2] of packed pairs (d, d+1): bf16x2 as int32, or
            with ``out_fp8`` E4M3 of bf16(o) / osc (saturated) as int16; rows past ``seqlen`` not stored."""
            heads = mO.shape[2]
            b = bh // heads
            h = bh - b * heads
            cO = thr_pv.partition_C(cute.make_identity_tensor((TILE, TILE)))
            pair = cute.make_rmem_tensor((2,), Float32)
            inv = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                inv[r] = 1.0 / quad_reduce(row_sum[r], lambda x, y: x + y)
            for r in cutlass.range_constexpr(2):
                row = m_block * TILE + cO[(0, r, 0), 0, 0][0]
                if row < seqlen:
                    for n in cutlass.range_constexpr(cute.size(acc_o.shape[0][2])):
                        d = cO[(0, r, n), 0, 0][1]
                        for e in cutlass.range_constexpr(2):
                            pair[e] = acc_o[(e, r, n), 0, 0] * inv[r] * mVS[bh, d + e]
                        bf = pair.load().to(cutlass.BFloat16)
                        if const_expr(self.out_fp8):
                            q = bf.to(Float32) / mOSC[0]  # as the Triton kernel: a division, not a reciprocal
                            pair.store(q)
                            for e in cutlass.range_constexpr(2):
                                pair[e] = cute.arch.fmax(cute.arch.fmin(pair[e], Float32(448.0)), Float32(-448.0))
                            mO[b, row, h, d // 2] = pair.load().to(cutlass.Float8E4M3FN).bitcast(cutlass.Int16)[0]
                        else:
                            mO[b, row, h, d // 2] = bf.bitcast(Int32)[0]

    return Attention8


@cache
def _kernel_type():
    return _kernel_class()


_COMPILED: dict = {}

#: The schedule :func:`attention_fp8` runs where its caller names none (``int8-cute`` inside a model call):
#: the fastest measured (benchmarks/README.md). A benchmark may set it to time another in a model.
SCHEDULE = {"stages": 2, "overlap": True, "pingpong": False, "lookahead": False, "lazy_rescale": True,
            "early_pack": True, "split_sum": True, "int_max": True}


def _dl(t, dynamic_dim: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=dynamic_dim)


def _checked(schedule: dict, trace, ablate) -> tuple[dict, tuple]:
    """:func:`attention_fp8`'s schedule (over :data:`SCHEDULE`) and ablations, refused before any import of the
    DSL where the kernel cannot run them, with the fix named."""
    unknown = sorted(set(schedule) - set(SCHEDULE))
    if unknown:
        raise TypeError(f"unknown CuTe attention schedule options {unknown}; known: {sorted(SCHEDULE)}")
    opts = SCHEDULE | schedule
    tr = trace is not None
    if tr and (tuple(trace.shape) != TRACE_SHAPE or not (opts["overlap"] or opts["lookahead"])):
        raise ValueError(f"trace takes an int64 tensor {TRACE_SHAPE} and the overlap or lookahead schedule; got "
                         f"{tuple(trace.shape)}, overlap={opts['overlap']}, lookahead={opts['lookahead']}")
    ablate = tuple(sorted(set(ablate)))
    if ablate and (set(ablate) - set(ABLATIONS) or not tr or opts["lookahead"] or not opts["overlap"]):
        raise ValueError(f"ablate takes names of {ABLATIONS} with trace= and the overlap schedule (it leaves work "
                         f"out, so the output is wrong: a timing tool); got ablate={ablate}, traced={tr}, "
                         f"overlap={opts['overlap']}, lookahead={opts['lookahead']}")
    return opts, ablate


def attention_fp8(q8, q_scale, k8, k_scale, vt8, v_scale, *, out_scale=None, head_dim: int | None = None,
                  trace=None, ablate: tuple = (), **schedule):
    """:func:`trt_sora.kernels.triton_ops.attention_fp8` (dense, head dim 128) on this kernel: the same
    operands -> [B, S, H*D] bf16, or FP8 at ``out_scale`` (a one-element fp32 tensor on the device).
    ``schedule``: Attention8's options (the keys of :data:`SCHEDULE`, whose values stand where not given).
    The first call of each schedule and output type compiles it (about 2 s). ``trace``: an int64 tensor
    :data:`TRACE_SHAPE` on the device that the overlap or lookahead schedule's
    traced CTAs fill with SM clocks (``benchmarks/cute_attention.py``'s ``trace_phases`` reads it).
    ``ablate``: names of :data:`ABLATIONS` a traced overlap schedule leaves out (its output is then wrong)."""
    opts, ablate = _checked(schedule, trace, ablate)
    tr = trace is not None
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch

    b, h, s, d = q8.shape
    if d != TILE:
        raise ValueError(f"the CuTe attention kernel takes head dim {TILE}, got {d}")
    fp8 = out_scale is not None
    o = torch.empty((b, s, h, d), device=q8.device, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    qk_scale = 1.0 / math.sqrt(head_dim or d) * 1.4426950408889634
    args = (_dl(q8.view(b * h, s, d), 2), _dl(k8.view(b * h, s, d), 2), _dl(vt8.view(b * h, d, -1), 2),
            _dl(q_scale.reshape(b * h, -1), 1), _dl(k_scale.reshape(b * h, -1), 1), _dl(v_scale.reshape(b * h, d), 1),
            _dl(o.view(torch.int16 if fp8 else torch.int32), 3),
            _dl((out_scale if fp8 else v_scale).reshape(-1)[:1], 0))
    targ = _dl(trace if tr else q_scale.reshape(-1)[:1].view(torch.int32), 3 if tr else 0)
    key = (*sorted(opts.items()), fp8, tr, ablate)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    if key not in _COMPILED:
        kern = _kernel_type()(**opts, out_fp8=fp8, trace=tr, ablate=ablate)
        _COMPILED[key] = cute.compile(kern, *args[:-1], qk_scale, args[-1], targ, stream)
    _COMPILED[key](*args[:-1], qk_scale, args[-1], targ, stream)
    return o.view(b, s, h * d)
