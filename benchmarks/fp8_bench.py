"""torch-fp8 backend on one GPU, side by side in one run (the benchmark of issue #11).

Parts (``--parts``):

* ``attention``: self-attention at Wan 14B 480p x 81 (1 x 40 heads x 32,760 tokens x 128): our
  8-bit kernel (INT8 QK^T, FP8 PV) with K/V through TMA descriptors and with pointer loads (and
  their autotune timings), its QKV epilogue (per launch, by warps), cuDNN and flash BF16 SDPA;
  TFLOP/s and cosine vs fp32 attention on inputs with a per-channel K bias. For an A/B against an
  older kernel in the same run, put it beside this file first (it travels to the device untracked):
  ``git show REV:trt_sora/kernels/triton_ops.py > benchmarks/_prev_triton_ops.py``.
* ``cudnn_attention``: our 8-bit Triton kernel vs cuDNN's fused FP8 SDPA (per-tensor FP8 Q, K, V; needs
  ``nvidia-cudnn-frontend``) alone at the same size: each kernel's TFLOP/s with bf16 and FP8 output, each
  path from the fused QKV, cosine vs fp32, and cuDNN against its emulation (``reference.sdpa_fp8``).
* ``fa4_attention``: FlashAttention-4's CuTe DSL forward (``flash-attn-4``; on SM 9.0 its BF16 FA3-schedule
  kernel, FP8 being SM 10.x only there) as a peer at the same size, beside our 8-bit kernel and cuDNN BF16 SDPA:
  TFLOP/s, cosine vs fp32, its JIT compile time. ``--fa4-site DIR``: its wheels installed with pip ``--target``.
* ``gemm``: the FP8 GEMMs of one Wan 14B / 1.3B block at 480p x 81 (32,760 tokens): ``_scaled_mm``
  with row-wise weight scales, exact (fp32 promotion) vs fast accumulation: time, TFLOP/s, and the
  relative error of each against the fp32 product of the same FP8 operands, beside the error FP8
  quantization itself puts into the product (vs the bf16 operands).
* ``attention_in_model``: why the attention kernel is slower inside a 14B call than alone: the
  kernel's time per layer in a profiled call, then the kernel alone on block 0's captured inputs
  and on the synthetic ones (bf16 and FP8 output), 40 layers' epilogue + attention back to back, the
  autotuner's pick, and the SM clock / power nvidia-smi saw during each phase; ``--attention-kernel
  int8-cute``: the same for the CuTe DSL kernel.
* ``models``: one transformer call of Wan 1.3B / 14B (or any Wan variant: ``wan2.1-i2v-14b``,
  ``wan2.2-ti2v-5b``, ``wan2.2-t2v-a14b`` as its high-noise expert; or HunyuanVideo 1.5:
  ``hunyuanvideo-1.5-480p-t2v``, whose padded text and absent image tokens are masked keys: its 8-bit
  attention runs over the valid keys (a key length per sample); ``--all-keys`` makes every key valid;
  random weights, real sizes, 81 frames) per resolution and batch: eager BF16
  (cuDNN SDPA), ``torch.compile`` BF16 (diffusers' regional compilation),
  and the torch-fp8 ladder: FP8 GEMMs (eager quantize) -> + fused quantization -> + 8-bit
  attention -> + CUDA graph (GEMMs with fast accumulation, as the recipes ship; rung
  ``fp8_fused_attn8_graph_exactacc``: the full rung with exact accumulation;
  ``fp8_fused_attn8_graph_otherkernel``: with the 8-bit attention kernel that is not the default, the
  warp-specialized Gluon one on SM 9.x; ``fp8_fused_attn8_cudnn`` / ``fp8_fused_attn8_graph_cudnn``: with
  cuDNN's FP8 SDPA, eager with its profiler split, and graphed; a failure there is recorded, not fatal;
  ``fp8_fused_attn8_cute`` / ``fp8_fused_attn8_graph_cute``: the same with our CuTe DSL kernel (SM 9.0);
  any rung + ``_prev``: that rung with benchmarks/_prev_triton_ops.py's Triton kernels
  (:func:`prev_kernels`), for an A/B in one process;
  ``fp8_fused_attn8_graph_sparse``: the full rung with block-sparse self-attention, once per window of
  ``--sparse-windows`` (rung ``fp8_fused_attn8_graph_sparse_F-H-W``; every layer and step, the first
  ``--sparse-global-frames`` latent frames global), with its block density and its speed-up and cosine
  against the dense full rung of the same run).
  Median of ``--iters`` calls after warm-up, cosine vs eager BF16, what the backend reports it ran, and a profiler split
  (GEMM / attention / other) of the BF16 and the full FP8 call with achieved TFLOP/s against the measured ceilings.

    python benchmarks/fp8_bench.py --parts attention,models --models wan2.1-t2v-1.3b,wan2.1-t2v-14b \
        --sizes 480p --batches 1,2 --iters 10 --out benchmarks/results/h200_fp8_bench.json

``--points 480p:2,720p:1`` picks size:batch pairs instead of the product; each model is built once
and shared by all its points. Wan 14B at 720p with sparse attention beside the dense full rung:

    python benchmarks/fp8_bench.py --parts models --models wan2.1-t2v-14b --points 720p:1 --iters 5 \
        --eager-iters 1 --no-profile --rungs fp8_fused_attn8_graph,fp8_fused_attn8_graph_sparse \
        --sparse-windows 4-2-2,2-2-2 --out x.json

``--device cpu`` with a tiny model and a small ``--sizes HxW`` runs the models part on the CPU's reference
kernels (a dry run of the wiring: no timings worth reading). HunyuanVideo 1.5 at 480p (32,760 video tokens,
as Wan 14B's call):

    python benchmarks/fp8_bench.py --parts models --models hunyuanvideo-1.5-480p-t2v --points 480p:1 \
        --iters 10 --out benchmarks/results/h200_fp8_bench_hunyuan.json   # and again with --all-keys

The plan (input amax per site) comes from one BF16 forward over the benchmark input with the
recipe's default exclusions and the Q/DQ graph's grouping (fused QKV, one scale for every
cross-attention K/V reading the text), so the FP8 path quantizes the sites a real artifact would.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"480p": (480, 832), "720p": (720, 1280)}  # pixels; TI2V's 16x VAE makes 720p its 704 x 1280
CEILING = {"fp8_tflops": 1450.0, "bf16_tflops": 790.0}  # _scaled_mm / bf16 mm at 8192^3 on our H200


def cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def fp32_heads(q, k, v):
    """Four heads spread over ``q`` [B, H, S, D] (0, 10, 20, 30 of 40) and fp32 attention on them [B, S, 4, D]:
    what the attention benches score cosines against (all 40 heads at 32,760 tokens would take minutes)."""
    from trt_sora.kernels import reference as ref

    h = q.shape[1]
    heads = list(range(0, h, max(1, h // 4)))[:4]
    return heads, ref.attention(q[:, heads], k[:, heads], v[:, heads]).transpose(1, 2)


def attention_tflops(ms: dict, s: int, h: int, d: int) -> dict:
    """TFLOP/s (4 S^2 D H per attention) of each entry's list of times in ms, one decimal."""
    return {k: [round(4.0 * s * s * d * h / (m * 1e-3) / 1e12, 1) for m in v] for k, v in ms.items()}


def bench_ms(fn, iters=20) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=max(100, iters * 10), return_mode="median")


# -- attention -----------------------------------------------------------------------------------------------
def attention_inputs(b: int, s: int, h: int, d: int = 128, seed: int = 0):
    """``(qkv, wq, wk, cos, sin)`` of one self-attention layer on cuda
    (:func:`trt_sora.kernels.reference.example_qkv`)."""
    from trt_sora.kernels.reference import example_qkv

    return example_qkv(b, s, h, d, seed=seed)


def attention_part(s=32760, h=40, d=128) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trt_sora.kernels import triton_ops as t

    qkv, wq, wk, cs, sn = attention_inputs(1, s, h, d)
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    flops = 4.0 * s * s * d * h
    out = {"tokens": s, "heads": h, "head_dim": d, "flops": flops}
    tuner = t._attn_fp8_kernel
    for tag, tma in (("", True), ("_pointer", False)):  # K/V tiles through TMA descriptors, or pointer loads
        out[f"ours{tag}_8bit_ms"] = bench_ms(lambda: t.attention_fp8(*ops8, tma=tma))
        out[f"autotune{tag}"] = {"best": str(getattr(tuner, "best_config", None)),
                                 "timings_ms": {str(k): [float(x) for x in v] if isinstance(v, (list, tuple))
                                                else float(v)
                                                for k, v in (getattr(tuner, "configs_timings", None) or {}).items()}}
    out["tma_equals_pointer"] = torch.equal(t.attention_fp8(*ops8, tma=True), t.attention_fp8(*ops8, tma=False))
    out["default_kernel"] = t.attention_kernel(qkv.device)  # what attention_fp8 launches without tma / ws
    out["default_8bit_ms"] = bench_ms(lambda: t.attention_fp8(*ops8))
    try:  # A/B against the previous commit's kernel in the same run, when the bench carries it
        from benchmarks import _prev_triton_ops as prev
    except ImportError:
        prev = None
    if prev is not None:  # on its own epilogue's operands: the V^T layout may differ between commits
        ops_prev = prev.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
        out["prev_8bit_ms"] = bench_ms(lambda: prev.attention_fp8(*ops_prev))
        out["prev_autotune_best"] = str(getattr(prev._attn_fp8_kernel, "best_config", None))
    out["ours_epilogue_8bit_ms"] = bench_ms(lambda: t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True))
    rstd = t.rms_stats(qkv)
    out["epilogue_rms_ms"] = bench_ms(lambda: t.rms_stats(qkv))
    shipped = dict(t.EPILOGUE_WARPS), t.EPILOGUE_HEADS_FAST
    sweep, results = {}, {}
    for heads_fast in (False, True):  # program order of the tile passes: token blocks or heads fastest
        t.EPILOGUE_HEADS_FAST = heads_fast
        results[heads_fast] = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True, rstd=rstd)
        for post in (8, 16):  # warps of the tile pass and the K/V pass
            for kv in (8, 16):
                t.EPILOGUE_WARPS.update(post=post, kv=kv)
                sweep[f"heads_fast{int(heads_fast)}_post{post}_kv{kv}"] = bench_ms(
                    lambda: t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True, rstd=rstd))
        t.EPILOGUE_WARPS.update(shipped[0])
    t.EPILOGUE_HEADS_FAST = shipped[1]
    out["epilogue_without_rms_ms_by_order_and_warps"] = sweep
    def bits(outs):  # the 8-bit operands as bytes (V^T with its padding: zeros the kernels read)
        return [x.view(torch.uint8) if x.element_size() == 1 else x for x in outs]

    out["epilogue_orders_bit_identical"] = all(torch.equal(x, y) for x, y in zip(bits(results[False]),
                                                                                  bits(results[True])))
    out["ours_epilogue_bf16_ms"] = bench_ms(lambda: t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False))
    for name, be in (("cudnn_bf16", SDPBackend.CUDNN_ATTENTION), ("flash_bf16", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                out[f"{name}_ms"] = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        except RuntimeError as exc:
            out[f"{name}_ms"] = None
            out[f"{name}_error"] = str(exc).splitlines()[0]
    for key in [k for k in out if k.endswith("_ms") and "epilogue" not in k and out[k]]:
        out[key.replace("_ms", "_tflops")] = flops / (out[key] * 1e-3) / 1e12
    o8 = t.attention_fp8(*ops8).float().view(1, s, h, d)
    heads, want = fp32_heads(q, k, v)
    out["cosine_vs_fp32"] = cos(o8[:, :, heads], want)
    if prev is not None:
        out["prev_cosine_vs_fp32"] = cos(prev.attention_fp8(*ops_prev).float().view(1, s, h, d)[:, :, heads], want)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        bf = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out["cudnn_bf16_cosine_vs_fp32"] = cos(bf[:, heads].transpose(1, 2).float(), want)
    return out


def cudnn_attention_part(s=32760, h=40, d=128) -> dict:
    """Our 8-bit Triton kernel vs cuDNN's FP8 SDPA (per-tensor FP8 Q, K, V) alone on one Wan 14B layer:
    time and TFLOP/s of each kernel (bf16 and FP8 output) and of each path from the fused QKV (epilogue +
    quantization + kernel), cosine vs fp32 attention on 4 heads, and cuDNN against its emulation. A cuDNN
    failure is recorded with the versions; the Triton rows still come back."""
    from trt_sora.kernels import cudnn_attention as ca
    from trt_sora.kernels import reference as ref
    from trt_sora.kernels import triton_ops as t

    qkv, wq, wk, cs, sn = attention_inputs(1, s, h, d)
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)
    flops = 4.0 * s * s * d * h
    heads, want = fp32_heads(q, k, v)  # [1, S, 4, D] fp32
    sc = torch.tensor(float(want.abs().max()) / 448, device="cuda")  # a to_out input scale
    out = {"tokens": s, "heads": h, "head_dim": d, "flops": flops, "cudnn": ca.versions(), "cosine_heads": heads}

    def four(o, scale=None):  # [1, S, H*D] (FP8 at scale) -> the cosine heads, fp32
        o = o.float() * (scale if scale is not None else 1.0)
        return o.view(1, s, h, d)[:, :, heads]

    def row(name, kernel_ms, path_ms, o_bf16, o_fp8):
        out[name] = {"kernel_ms": kernel_ms, "kernel_tflops": flops / (kernel_ms * 1e-3) / 1e12,
                     "kernel_fp8_out_ms": bench_ms(o_fp8), "path_from_qkv_ms": path_ms,
                     "cosine_vs_fp32": cos(four(o_bf16()), want),
                     "cosine_fp8_out_vs_fp32": cos(four(o_fp8(), sc), want)}
        out[name]["kernel_fp8_out_tflops"] = flops / (out[name]["kernel_fp8_out_ms"] * 1e-3) / 1e12
        print(name, json.dumps(out[name]), flush=True)

    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    row("triton_int8", bench_ms(lambda: t.attention_fp8(*ops8)),
        bench_ms(lambda: t.attention_fp8(*t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True), out_scale=sc)),
        lambda: t.attention_fp8(*ops8), lambda: t.attention_fp8(*ops8, out_scale=sc))
    try:
        opc = ref.sdpa_fp8_operands(q, k, v)
        out["cudnn_quantize_ms"] = bench_ms(lambda: ref.sdpa_fp8_operands(q, k, v))
        path = lambda: ca.attention(*t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False), sc)  # noqa: E731
        row("cudnn_fp8", bench_ms(lambda: ca.attention_fp8(*opc)), bench_ms(path),
            lambda: ca.attention_fp8(*opc), lambda: ca.attention_fp8(*opc, out_scale=sc))
        got = four(ca.attention_fp8(*opc))
        emu = torch.cat([ref.sdpa_fp8(*(x[:, i:i + 1] for x in opc[:3]), *opc[3:]).float()
                         for i in heads], dim=-1).view(1, s, len(heads), d)  # one head at a time: memory
        out["cudnn_fp8"]["cosine_vs_emulation"] = cos(got, emu)
        out["cudnn_fp8"]["emulation_cosine_vs_fp32"] = cos(emu, want)
        out["cudnn_fp8"]["speedup_kernel_fp8_out_vs_triton"] = (out["triton_int8"]["kernel_fp8_out_ms"]
                                                                / out["cudnn_fp8"]["kernel_fp8_out_ms"])
    except Exception as exc:  # noqa: BLE001 - the first device run learns the API; keep the Triton rows
        import traceback

        out["cudnn_error"] = f"{type(exc).__name__}: {exc}"
        out["cudnn_traceback"] = traceback.format_exc()[-3000:]
        print("cudnn_fp8 failed:", out["cudnn_error"], out["cudnn"], flush=True)
    return out


def fa4_attention_part(s=32760, h=40, d=128, site: str | None = None, variants: bool = True) -> dict:
    """FlashAttention-4's CuTe DSL forward (``flash-attn-4``) as a measured peer on one Wan 14B layer: on SM 9.0
    it runs its FA3-schedule BF16 kernel (FP8 is SM 10.x only in FA4), beside our 8-bit Triton kernel and cuDNN's
    BF16 SDPA in the same process: time, TFLOP/s, cosine vs fp32 on 4 heads, the GPU's clock and power while each
    is timed (:class:`GpuSampler`). ``site``:
    a folder of pip ``--target`` installs (``.pth`` files processed). An import or compile failure is recorded;
    the other rows still come back. ``variants``: also FA4's knobs (:data:`FA4_VARIANTS`)."""
    import site as _site

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trt_sora.kernels import triton_ops as t

    if site:
        _site.addsitedir(site)
    qkv, wq, wk, cs, sn = attention_inputs(1, s, h, d)
    q, k, v = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=False)  # [1, H, S, D] bf16
    ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cs, sn, h, fp8=True)
    flops = 4.0 * s * s * d * h
    heads, want = fp32_heads(q, k, v)  # [1, S, 4, D] fp32
    out = {"tokens": s, "heads": h, "head_dim": d, "flops": flops, "cosine_heads": heads,
           "device": torch.cuda.get_device_name()}

    def row(name, fn, as_bshd):
        with GpuSampler() as gpu:
            ms = bench_ms(fn)
        o = as_bshd(fn()).float()
        out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "cosine_vs_fp32": cos(o[:, :, heads], want),
                     "gpu": gpu.summary()}
        print(name, json.dumps(out[name]), flush=True)

    row("ours_triton_int8_fp8", lambda: t.attention_fp8(*ops8), lambda o: o.view(1, s, h, d))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        row("cudnn_bf16", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
            lambda o: o.transpose(1, 2))
    qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # FA4 takes [B, S, H, D]
    try:
        import flash_attn.cute as fa4
        from flash_attn.cute import flash_attn_func

        out["fa4_version"] = getattr(fa4, "__version__", None)
        t0 = time.perf_counter()
        first = flash_attn_func(qb, kb, vb)
        torch.cuda.synchronize()
        out["fa4_first_call_s"] = time.perf_counter() - t0  # the CuTe DSL JIT compile
        out["fa4_returns"] = type(first).__name__

        def one():  # flash_attn_func returns (out, lse) or out
            r = flash_attn_func(qb, kb, vb)
            return r[0] if isinstance(r, (tuple, list)) else r

        row("fa4_cute_sm90_bf16", one, lambda o: o)
    except Exception as exc:  # noqa: BLE001 - a peer that does not run here is a result, not a crash
        import traceback

        out["fa4_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["fa4_traceback"] = traceback.format_exc()[-4000:]
        print("fa4 failed:", out["fa4_error"], flush=True)
        return out
    for name, kw in FA4_VARIANTS.items() if variants else ():  # which of FA3's features the speed comes from
        try:
            from flash_attn.cute.interface import _flash_attn_fwd

            row(f"fa4_{name}", lambda: _flash_attn_fwd(qb, kb, vb, **kw)[0], lambda o: o)
        except Exception as exc:  # noqa: BLE001 - a knob this build refuses is recorded, the others still run
            out[f"fa4_{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            print(f"fa4_{name} failed:", out[f"fa4_{name}"]["error"], flush=True)
    return out


#: FA4's SM 9.0 knobs (its private ``_flash_attn_fwd``; None: its heuristic): the softmax of one tile overlapped
#: with the next tile's Q K^T inside a warpgroup, P V from registers (RS) or shared memory, the tile shape.
FA4_VARIANTS = {"no_intra_wg_overlap": {"intra_wg_overlap": False}, "pv_from_smem": {"mma_pv_is_rs": False},
                "tile_128x128": {"tile_mn": (128, 128)}, "tile_128x176": {"tile_mn": (128, 176)},
                "tile_192x128": {"tile_mn": (192, 128)}}


GEMM_MODELS = {"14b": "wan2.1-t2v-14b", "1.3b": "wan2.1-t2v-1.3b"}
GEMM_PER_BLOCK = {"qkv": 1, "out": 3, "ffn_up": 1, "ffn_down": 1}  # out: self-attention out, cross q, cross out


def block_gemm_shapes(name: str) -> dict[str, tuple[int, int]]:
    """``{gemm: (K, N)}`` of one block's token GEMMs, from the model's config."""
    from trt_sora.models import get_adapter

    cfg = dict(get_adapter(name).spec.config)
    c, f = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    return {"qkv": (c, 3 * c), "out": (c, c), "ffn_up": (c, f), "ffn_down": (f, c)}


def gemm_part(m: int = 32760) -> dict:
    """Exact vs fast FP8 accumulation per block GEMM shape (see the module docstring)."""
    from trt_sora.kernels import ops
    from trt_sora.kernels.reference import dequant_scale, quantize

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for model, registry_name in GEMM_MODELS.items():
        for name, (k, n) in block_gemm_shapes(registry_name).items():
            x = torch.randn(m, k, device="cuda", generator=g)
            x[:, :8] *= 20.0  # a few outlier channels, as real activations have
            x = x.to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
            xs = dequant_scale(x.float().abs().amax())
            ws = dequant_scale(w.float().abs().amax(1))
            x8, w8 = quantize(x.float(), xs), quantize(w.float(), ws[:, None])
            ws = ws.reshape(1, -1).contiguous()
            rows = {}
            want = (x8[:4096].float() * xs) @ (w8.float() * ws.reshape(-1, 1)).t()  # fp32, same FP8 operands
            exact_bf16 = (x[:4096].float() @ w.float().t())
            r = {"m": m, "k": k, "n": n}
            for tag, fast in (("exact", False), ("fast", True)):
                fn = lambda: ops.linear_fp8(x8, w8, xs, ws, None, rows, fast)  # noqa: E731
                ms = bench_ms(fn)
                y = fn()[:4096].float()
                r[f"{tag}_ms"] = ms
                r[f"{tag}_tflops"] = 2.0 * m * k * n / (ms * 1e-3) / 1e12
                r[f"{tag}_rel_err_vs_fp32_same_operands"] = ((y - want).norm() / want.norm()).item()
                r[f"{tag}_rel_err_vs_bf16_operands"] = ((y - exact_bf16).norm() / exact_bf16.norm()).item()
            out[f"{model}_{name}"] = r
            print(json.dumps({f"{model}_{name}": r}), flush=True)
    for model in GEMM_MODELS:
        out[f"{model}_block_ms"] = {tag: sum(out[f"{model}_{g}"][f"{tag}_ms"] * n for g, n in GEMM_PER_BLOCK.items())
                                    for tag in ("exact", "fast")}
    return out


class GpuSampler:
    """nvidia-smi's SM clock (MHz), power (W) and temperature every 50 ms while inside ``with``."""

    def __init__(self):
        self.rows: list[list[float]] = []

    def __enter__(self):
        import subprocess
        import tempfile

        self._f = tempfile.TemporaryFile(mode="w+")
        try:
            self._p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=self._f)
        except OSError:
            self._p = None
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.terminate()
            self._p.wait()
            self._f.seek(0)
            for line in self._f:
                try:
                    self.rows.append([float(x) for x in line.split(",")])
                except ValueError:
                    pass
        self._f.close()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        cols = list(zip(*self.rows))
        return {"samples": len(self.rows), "sm_mhz_median": statistics.median(cols[0]), "sm_mhz_min": min(cols[0]),
                "power_w_median": statistics.median(cols[1]), "power_w_max": max(cols[1]),
                "temp_c_max": max(cols[2])}


def pixels(size: str) -> tuple[int, int]:
    """``(height, width)`` of a ``SIZES`` name or ``HxW`` (a small size for a CPU dry run)."""
    if size in SIZES:
        return SIZES[size]
    h, _, w = size.partition("x")
    if not (h.isdigit() and w.isdigit()):
        raise SystemExit(f"size {size!r}: use one of {', '.join(SIZES)} or HxW pixels (e.g. 64x128)")
    return int(h), int(w)


def call_inputs(adapter, size: str, batch: int, frames: int = 81, all_keys: bool = False,
                device: str = "cuda") -> tuple[dict, list]:
    """``(point, inputs)`` of one benchmark call: ``frames`` pixel frames (81: 21 latent) at ``size``
    (height rounded down to what the VAE and patch divide), text 512, timestep 700, on ``device``.
    ``all_keys``: every attention key a real token (full text masks, image tokens given), where a family
    masks some (HunyuanVideo: no padding for its 8-bit attention to skip)."""
    h, w = pixels(size)
    unit = adapter.vae_scale[1] * adapter.patch_size[1]
    point = {"batch": batch, "text_len": 512, **adapter.latent_size(frames, h // unit * unit, w)}
    feeds = adapter.example_inputs(point, dtype="bf16", device=device, seed=1)
    feeds["timestep"] = torch.full_like(feeds["timestep"], 700.0)  # TI2V: [B, latent_frames]
    if all_keys:
        for m in adapter.mask_inputs:
            feeds[m] = torch.ones_like(feeds[m])
        if "image_embeds" in feeds:
            feeds["image_embeds"] = torch.randn_like(feeds["image_embeds"])
    return point, [feeds[n] for n in adapter.input_names]


def bench_adapter(name: str):
    """The adapter of one benchmarked transformer: a pair of experts (Wan 2.2 A14B) is benchmarked as
    its high-noise expert (both experts have one architecture; each call runs one of them)."""
    from trt_sora.models import get_adapter

    adapter = get_adapter(name)
    return adapter.expert(adapter.experts[0]) if adapter.experts else adapter


def attention_in_model_part(name: str = "wan2.1-t2v-14b", kernel: str = "int8") -> dict:
    """See the module docstring (``attention_in_model``). ``kernel``: the 8-bit attention kernel
    (``int8``: Triton, ``int8-cute``: the CuTe DSL one) of the call and of the timings alone."""
    from trt_sora.kernels import cute_attention, ops
    from trt_sora.kernels import triton_ops as t
    from trt_sora.models import get_adapter
    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

    attend = cute_attention.attention_fp8 if kernel == "int8-cute" else t.attention_fp8
    marker = "cute_attention_kernel" if kernel == "int8-cute" else "attn_fp8"

    adapter = get_adapter(name)
    _, inputs = call_inputs(adapter, "480p", 1)
    model = adapter.load("bf16", "cuda")
    fwd = adapter.export_module(model)
    plan = calibrate_plan(model, fwd, inputs, adapter.quant_excludes)
    del fwd
    r = TorchFp8Runner(adapter, None, plan=plan, device="cuda", model=model,
                       attention=AttentionPolicy(enabled=True, kernel=kernel), cuda_graphs=False).activate()
    del model
    feeds_r = dict(zip(adapter.input_names, inputs))
    captured: dict = {}
    orig = ops.self_attention

    def grab(qkv, wq, wk, cos, sin, heads, eps, **kw):
        if not captured:
            captured.update(qkv=qkv.clone(), wq=wq, wk=wk, cos=cos.clone(), sin=sin.clone(), heads=heads, eps=eps,
                            out_scale=kw.get("out_scale"))
        return orig(qkv, wq, wk, cos, sin, heads, eps, **kw)

    ops.self_attention = grab
    try:
        r.infer(feeds_r)
    finally:
        ops.self_attention = orig
    out: dict = {"model": name, "kernel": kernel, "tokens": int(captured["qkv"].shape[1]), "heads": captured["heads"]}
    with GpuSampler() as smp:
        _, t_call, _ = timed_calls(lambda: r.infer(feeds_r)["sample"], 5, warmup=1)
    out["call_s"], out["gpu_during_calls"] = t_call, smp.summary()
    sp = profile_split(lambda: r.infer(feeds_r)["sample"])
    attn = [k for k in sp["top_kernels"] if marker in k[2]]
    out["in_model_attention_ms_per_layer"] = attn[0][0] / attn[0][1] if attn else None
    out["autotune_best"] = str(getattr(t._attn_fp8_kernel, "best_config", None))
    c = captured
    ops_model = t.qkv_rmsnorm_rope(c["qkv"], c["wq"], c["wk"], c["cos"], c["sin"], c["heads"], c["eps"], fp8=True)
    s_tok, heads = out["tokens"], out["heads"]
    ops_syn = t.qkv_rmsnorm_rope(*attention_inputs(1, s_tok, heads), heads, fp8=True)
    for tag, o8 in (("model_inputs", ops_model), ("synthetic_inputs", ops_syn)):
        for otag, osc in (("bf16_out", None), ("fp8_out", c["out_scale"])):
            with GpuSampler() as smp:
                ms = bench_ms(lambda: attend(*o8, out_scale=osc))  # noqa: B023
            out[f"alone_{tag}_{otag}_ms"] = ms
            out[f"gpu_alone_{tag}_{otag}"] = smp.summary()
    def forty(fn) -> tuple[float, dict]:
        """ms a call of ``fn`` run 40 times back to back (a call's layers), and what nvidia-smi saw."""
        with GpuSampler() as smp:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(40):
                fn()
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / 40, smp.summary()

    # as in the call: one layer's epilogue + attention; then the attention alone, no epilogue between
    out["sustained_40_layers_ms_per_layer"], out["gpu_sustained"] = forty(lambda: attend(
        *t.qkv_rmsnorm_rope(c["qkv"], c["wq"], c["wk"], c["cos"], c["sin"], heads, c["eps"], fp8=True),
        out_scale=c["out_scale"]))
    out["sustained_40_attention_only_ms_per_layer"], out["gpu_sustained_attention_only"] = forty(
        lambda: attend(*ops_model, out_scale=c["out_scale"]))
    flops = 4.0 * s_tok * s_tok * 128 * heads
    out.update({k.replace("_ms", "_tflops"): flops / (v * 1e-3) / 1e12 for k, v in list(out.items())
                if (k.endswith("_ms") or k.endswith("_ms_per_layer")) and isinstance(v, float)})
    r.deactivate()
    return out


# -- whole transformer calls ---------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_initialized():  # a CPU dry run never touches CUDA
        torch.cuda.synchronize()


def timed_calls(fn, iters: int, warmup: int = 2):
    for _ in range(warmup):
        y = fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        y = fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return y, statistics.median(times), times


def calibrate_plan(model, fwd, inputs, family_excludes):
    """Input amax of every linear the recipe's default policy quantizes, grouped like the Q/DQ graph."""
    from trt_sora.config.recipe import QuantConfig
    from trt_sora.runners.fp8_runner import SitePlan
    from trt_sora.site_policy import site_policy

    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and site_policy(name, QuantConfig(), family_excludes)[0]:
            hooks.append(m.register_forward_pre_hook(
                lambda _m, a, _n=name: amax.__setitem__(_n, max(amax.get(_n, 0.0), a[0].abs().max().item()))))
    with torch.inference_mode():
        fwd(*inputs)
    for hk in hooks:
        hk.remove()
    groups: dict[str, list[str]] = {}
    for n in amax:
        blk, _, rest = n.partition(".attn")
        key = n
        if rest[:1] == "1" and n.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v"):
            key = blk + ".attn1.qkv"
        elif rest[:1] == "2" and n.rsplit(".", 1)[1] in ("to_k", "to_v"):
            key = "text.kv"  # every block's cross K/V reads the one text tensor
        elif rest[:1] == "2" and n.rsplit(".", 1)[1] in ("add_k_proj", "add_v_proj"):
            key = "image.kv"  # Wan 2.1 I2V: and its image K/V the one image-token tensor
        groups.setdefault(key, []).append(n)
    plan = {}
    for members in groups.values():
        a = max(amax[m] for m in members)
        plan.update({m: SitePlan(m, a) for m in members})
    return plan


def profile_split(fn) -> dict:
    """GPU time of one call by kernel class (ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    kernels = []
    for ev in prof.key_averages():
        name = ev.key.lower()
        t_ms = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)) / 1e3
        kernels.append((round(t_ms, 3), ev.count, ev.key[:90]))
        if any(k in name for k in ("attn_fp8", "fmha", "flash", "cudnn", "attention", "sdpa")):
            split["attention"] += t_ms
        elif any(k in name for k in ("gemm", "xmma", "cutlass", "sm90", "_mm", "matmul", "nvjet")):
            split["gemm"] += t_ms
        else:
            split["other"] += t_ms
    split["top_kernels"] = sorted(kernels, reverse=True)[:24]
    return split


def model_flops(cfg, point, context_len: int) -> dict:
    """GEMM and attention FLOPs of one call: Wan (self- and cross-attention blocks) or a dual-stream model
    (HunyuanVideo 1.5: video and ``context_len`` context tokens through their own linears, one joint attention)."""
    c = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    if "ffn_dim" not in cfg:
        s = point["latent_frames"] * point["latent_height"] * point["latent_width"] // cfg["patch_size"] ** 2
        n, f = s + context_len, int(cfg["mlp_ratio"] * c)
        gemm = 2.0 * point["batch"] * cfg["num_layers"] * n * (4 * c * c + 2 * c * f)
        return {"gemm": gemm, "attention": 4.0 * point["batch"] * cfg["num_layers"] * n * n * c, "tokens": s}
    s = point["latent_frames"] * point["latent_height"] // 2 * point["latent_width"] // 2
    b, L, f = point["batch"], point["text_len"], cfg["ffn_dim"]
    gemm = 2.0 * b * cfg["num_layers"] * (s * c * 3 * c + s * c * c + s * c * c + L * c * 2 * c + s * c * c
                                          + 2 * s * c * f)
    attn = 4.0 * b * cfg["num_layers"] * (s * s * c + s * L * c)
    return {"gemm": gemm, "attention": attn, "tokens": s}


def sparse_rungs(rungs: list[str], windows: str, tile: str, global_frames: int) -> dict:
    """``{rung name: SparsePlan}``: ``fp8_fused_attn8_graph_sparse`` in ``rungs`` once per window of
    ``windows`` (``F-H-W`` tile distances, comma-separated), every layer and step sparse."""
    from trt_sora.sparse import SparsePlan

    if "fp8_fused_attn8_graph_sparse" not in rungs:
        return {}
    t = tuple(int(x) for x in tile.split("-"))
    return {f"fp8_fused_attn8_graph_sparse_{w}": SparsePlan(t, {"*": tuple(int(x) for x in w.split("-"))},
                                                           global_frames)
            for w in windows.split(",")}


def model_part(name: str, size: str, batch: int, iters: int, rungs: list[str], save=lambda res: None, *,
               model, profile: bool = True, frames: int = 81, all_keys: bool = False, device: str = "cuda",
               eager_iters: int | None = None, sparse: dict | None = None) -> dict:
    """One model x size x batch. ``model``: the random-init model (its weights are drawn on the CPU, ~110 s
    for 14B, so :func:`main` builds it once for every size and batch); every rung runs on a GPU copy of
    it; ``save(res)`` after each rung, so a run cut off by its time limit keeps what it measured.
    ``profile``: the profiler split of the eager and fused calls (one more call each). ``eager_iters``:
    timed eager calls (default ``iters``; 1: one warm-up). ``sparse``: :func:`sparse_rungs`' plans, run
    after the ladder with the full rung's options."""
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

    adapter = bench_adapter(name)
    model.to(device)  # an earlier point of the same model left it on the host (below)
    point, inputs = call_inputs(adapter, size, batch, frames, all_keys, device)
    context = sum(x.shape[1] for n, x in zip(adapter.input_names, inputs)
                  if n.startswith(("encoder_hidden_states", "image_embeds")))
    res = {"model": name, "size": size, "batch": batch, "point": point, "all_keys": all_keys,
           "flops": model_flops(dict(adapter.spec.config), point, context), "rungs": {}}
    fwd = adapter.export_module(model)
    # cuDNN first; a masked attention (HunyuanVideo's padded keys) falls back to memory-efficient
    cudnn = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def eager():
        with torch.inference_mode(), sdpa_kernel(cudnn):
            return fwd(*inputs)

    n_eager = eager_iters or iters
    y_ref, t, ts = timed_calls(eager, n_eager, warmup=1 if n_eager == 1 else 2)
    res["rungs"]["eager_bf16"] = {"s": t, "all_s": ts, "split_ms": profile_split(eager) if profile else None}
    plan = calibrate_plan(model, lambda *a: eager(), inputs, adapter.quant_excludes)
    res["quantized_sites"] = len(plan)
    save(res)
    if "compile_bf16" in rungs:
        compiled = copy.deepcopy(model)
        cfwd = adapter.export_module(compiled)

        def compiled_call():
            with torch.inference_mode(), sdpa_kernel(cudnn):
                return cfwd(*inputs)

        t0 = time.perf_counter()
        compiled.compile_repeated_blocks(fullgraph=True)
        y, t, ts = timed_calls(compiled_call, iters, warmup=3)
        res["rungs"]["compile_bf16"] = {"s": t, "all_s": ts, "cosine_vs_eager_bf16": cos(y, y_ref),
                                        "compile_and_warmup_s": time.perf_counter() - t0 - t * (iters + 3)}
        del compiled, cfwd
        torch.cuda.empty_cache()
        save(res)
    ladder = {"fp8_gemm": dict(mode="gemm", attention=AttentionPolicy(enabled=False), cuda_graphs=False),
              "fp8_fused": dict(mode="fused", attention=AttentionPolicy(enabled=False), cuda_graphs=False),
              "fp8_fused_attn8": dict(mode="fused", attention=AttentionPolicy(enabled=True), cuda_graphs=False),
              "fp8_fused_attn8_graph": dict(mode="fused", attention=AttentionPolicy(enabled=True), cuda_graphs=True),
              # the full rung with exact FP8 accumulation (every other rung: fast, as recipes ship it)
              "fp8_fused_attn8_graph_exactacc": dict(mode="fused", attention=AttentionPolicy(enabled=True),
                                                     cuda_graphs=True, fast_accum=False),
              # the full rung with the other 8-bit attention kernel (the warp-specialized Gluon one on SM 9.x)
              "fp8_fused_attn8_graph_otherkernel": dict(mode="fused", attention=AttentionPolicy(enabled=True),
                                                        cuda_graphs=True),
              # cuDNN's FP8 SDPA (per-tensor FP8 Q, K, V) as the 8-bit attention kernel: eager, then graphed
              "fp8_fused_attn8_cudnn": dict(mode="fused", attention=AttentionPolicy(kernel="cudnn-fp8"),
                                            cuda_graphs=False),
              "fp8_fused_attn8_graph_cudnn": dict(mode="fused", attention=AttentionPolicy(kernel="cudnn-fp8"),
                                                  cuda_graphs=True),
              # our CuTe DSL 8-bit kernel (the int8 operands; SM 9.0, nvidia-cutlass-dsl): eager, then graphed
              "fp8_fused_attn8_cute": dict(mode="fused", attention=AttentionPolicy(kernel="int8-cute"),
                                           cuda_graphs=False),
              "fp8_fused_attn8_graph_cute": dict(mode="fused", attention=AttentionPolicy(kernel="int8-cute"),
                                                 cuda_graphs=True)}
    # the same rungs with every Triton kernel of benchmarks/_prev_triton_ops.py (another commit's; see
    # epilogue_bench)
    ladder |= {f"{k}_prev": v for k, v in list(ladder.items())}
    from trt_sora.kernels import ops, triton_ops

    shipped_ws, shipped_tri = triton_ops.ATTN_WS, ops._tri
    plans = {rung: None for rung in ladder if rung in rungs} | dict(sparse or {})
    if plans and str(device).startswith("cuda"):
        # each rung rewrites its own copy of the model: the bf16 reference waits on the host, so a 14B rung
        # at 720p never holds two bf16 copies beside the FP8 one on an 80 GB card
        model.to("cpu")
        _release_gpu()
    y_dense = None
    try:  # each rung sets the kernels it runs; the shipped ones are back after the last, or a failure
        for rung, sparse_plan in plans.items():
            kw = ladder["fp8_fused_attn8_graph"] if sparse_plan is not None else ladder[rung]
            triton_ops.ATTN_WS = shipped_ws != rung.endswith("_otherkernel")
            ops._tri = prev_kernels(shipped_tri) if rung.endswith("_prev") else shipped_tri
            held = _gpu_gib()
            r = None
            try:
                r = TorchFp8Runner(adapter, None, plan=plan, device=device, model=copy.deepcopy(model),
                                   sparse=sparse_plan, **kw).activate()
                feeds_r = {n: x for n, x in zip(adapter.input_names, inputs)}
                call = lambda: r.infer(feeds_r)["sample"]  # noqa: E731
                y, t, ts = timed_calls(call, iters)
            except Exception as exc:  # noqa: BLE001 - an optional kernel (cuDNN FP8, CuTe) must not end the other rungs
                if not rung.removesuffix("_prev").endswith(("_cudnn", "_cute")):
                    raise
                from trt_sora.kernels import cudnn_attention, cute_attention

                res["rungs"][rung] = {"error": f"{type(exc).__name__}: {exc}", "cudnn": cudnn_attention.versions(),
                                      "cutlass_dsl": cute_attention.version()}
                print(rung, "failed:", res["rungs"][rung], flush=True)
                if r is not None:
                    r.deactivate()
                del r
                _release_gpu()
                save(res)
                continue
            rep = r.report()
            if profile and rung in ("fp8_fused", "fp8_fused_attn8", "fp8_fused_attn8_cudnn", "fp8_fused_attn8_cute"):
                rep["split_ms"] = profile_split(call)
            rep.update({"s": t, "all_s": ts, "cosine_vs_eager_bf16": cos(y, y_ref),
                        "expected_fp8_gemms": r.expected_gemms(), "gpu_gib_held_before_rung": held})
            if rung == "fp8_fused_attn8_graph":
                y_dense = y
            if sparse_plan is not None:
                rep.update(sparse_record(sparse_plan, adapter.token_grid(inputs[0].shape), y, y_dense, t,
                                         res["rungs"].get("fp8_fused_attn8_graph", {}).get("s")))
            if not r.cuda_graphs and rep["fp8_gemms_per_call"] != rep["expected_fp8_gemms"]:
                raise SystemExit(f"{rung}: ran {rep['fp8_gemms_per_call']} FP8 GEMMs, the plan needs "
                                 f"{rep['expected_fp8_gemms']}: a silent no-op")
            res["rungs"][rung] = rep
            r.deactivate()
            del r, call
            _release_gpu()
            save(res)
    finally:
        triton_ops.ATTN_WS, ops._tri = shipped_ws, shipped_tri
    del fwd
    torch.cuda.empty_cache()
    base = res["rungs"]["eager_bf16"]["s"]
    comp = res["rungs"].get("compile_bf16", {}).get("s")
    for v in res["rungs"].values():
        if "s" not in v:  # a rung that failed
            continue
        v["speedup_vs_eager_bf16"] = base / v["s"]
        if comp:
            v["speedup_vs_compile_bf16"] = comp / v["s"]
    fl = res["flops"]
    for rung in ("eager_bf16", "fp8_fused", "fp8_fused_attn8", "fp8_fused_attn8_cudnn"):
        sp = res["rungs"].get(rung, {}).get("split_ms")
        if sp:
            res["rungs"][rung]["achieved_tflops"] = {
                "gemm": fl["gemm"] / (sp["gemm"] * 1e-3) / 1e12 if sp["gemm"] else None,
                "attention": fl["attention"] / (sp["attention"] * 1e-3) / 1e12 if sp["attention"] else None}
    return res


def _release_gpu() -> None:
    """Free what the last rung left: reference cycles first (a runner's CUDA graphs), then the cache."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _gpu_gib() -> float | None:
    """GiB the caching allocator holds in tensors now (None without a GPU): a rung should start near 0."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def sparse_record(plan, grid, y, y_dense, s: float, dense_s: float | None) -> dict:
    """A sparse rung's pattern (window, block density at ``grid``) and, beside the dense full rung of the
    same run, its speed-up and output cosine."""
    rec = {"token_grid": list(grid), "window": list(plan.windows["*"]),
           "density": plan.density(["all"], grid)["all"]}
    if y_dense is not None and dense_s:
        rec.update(speedup_vs_dense_full_rung=dense_s / s, cosine_vs_dense_full_rung=cos(y, y_dense))
    return rec


def parse_schedule(text: str, known: dict) -> dict:
    """``"overlap=0,lookahead=1"`` -> {"overlap": False, "lookahead": True} over ``known``'s keys and types."""
    out = {}
    for item in text.split(","):
        k, _, v = item.partition("=")
        if k not in known:
            raise SystemExit(f"--cute-schedule: unknown key {k!r}; known: {sorted(known)}")
        out[k] = type(known[k])(int(v))
    return out


def set_cute_schedule(text: str) -> dict:
    """``--cute-schedule`` over trt_sora.kernels.cute_attention.SCHEDULE, the schedule every int8-cute call of this
    process then runs; returns it."""
    from trt_sora.kernels import cute_attention

    cute_attention.SCHEDULE = cute_attention.SCHEDULE | parse_schedule(text, cute_attention.SCHEDULE)
    return dict(cute_attention.SCHEDULE)


#: The torch-fp8 Triton kernels' launch settings ``--kernel-settings`` may set (trt_sora.kernels.triton_ops).
KERNEL_SETTINGS = ("NORM_MAX_WARPS", "EPILOGUE_WARPS")


def prev_triton_ops(required: bool = False):
    """benchmarks/_prev_triton_ops.py (``git show REV:trt_sora/kernels/triton_ops.py >
    benchmarks/_prev_triton_ops.py``): another commit's Triton kernels, or None where it is absent and not
    ``required``."""
    try:
        from benchmarks import _prev_triton_ops as prev
    except ImportError as exc:
        if required:
            raise SystemExit("this needs benchmarks/_prev_triton_ops.py (git show "
                             "REV:trt_sora/kernels/triton_ops.py > benchmarks/_prev_triton_ops.py)") from exc
        return None
    return prev


def prev_kernels(shipped_tri):
    """``ops._tri`` for the ``_prev`` rungs: :func:`prev_triton_ops` where the shipped module would run."""
    prev = prev_triton_ops(required=True)
    return lambda x: prev if shipped_tri(x) is not None else None


def set_kernel_settings(path: str) -> dict:
    """``--kernel-settings``: a JSON object of :data:`KERNEL_SETTINGS` (e.g. ``best`` of
    benchmarks/epilogue_bench.py's output) set on trt_sora.kernels.triton_ops for this process; returns them."""
    from trt_sora.kernels import triton_ops

    given = json.loads(Path(path).read_text())
    given = given.get("best", given)
    unknown = sorted(set(given) - set(KERNEL_SETTINGS))
    if unknown:
        raise SystemExit(f"--kernel-settings: unknown {unknown}; known: {list(KERNEL_SETTINGS)}")
    for name, value in given.items():
        current = getattr(triton_ops, name)
        setattr(triton_ops, name, current | value if isinstance(current, dict) else value)
    return {name: getattr(triton_ops, name) for name in KERNEL_SETTINGS}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="attention,models")
    ap.add_argument("--models", default="wan2.1-t2v-1.3b,wan2.1-t2v-14b")
    ap.add_argument("--sizes", default="480p")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rungs", default="compile_bf16,fp8_gemm,fp8_fused,fp8_fused_attn8,fp8_fused_attn8_graph")
    ap.add_argument("--points", default=None,
                    help="size:batch list (e.g. 480p:2,720p:1,720p:2) instead of every --sizes x --batches pair")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler splits (two calls per run)")
    ap.add_argument("--frames", type=int, default=81, help="pixel frames of a models call (Wan 2.2 TI2V ships 121)")
    ap.add_argument("--all-keys", action="store_true",
                    help="every attention key valid (full text masks, image tokens given); otherwise "
                         "HunyuanVideo's 8-bit attention runs over its valid keys")
    ap.add_argument("--eager-iters", type=int, default=None, help="timed eager BF16 calls (default: --iters)")
    ap.add_argument("--sparse-windows", default="4-2-2,2-2-2",
                    help="the sparse rung's windows (frames-rows-cols of tiles), one rung each")
    ap.add_argument("--sparse-tile", default="1-8-16", help="the sparse rung's tile (tokens: frames-rows-cols)")
    ap.add_argument("--sparse-global-frames", type=int, default=1, help="latent frames every query attends")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the models part on the reference kernels")
    ap.add_argument("--fa4-tokens", default="32760", help="fa4_attention: sequence lengths (480p x 81: 32760, "
                    "720p x 81: 75600)")
    ap.add_argument("--fa4-site", default=None,
                    help="fa4_attention: a folder of pip --target installs of flash-attn-4 and its CuTe DSL wheels")
    ap.add_argument("--attention-kernel", default="int8", choices=("int8", "int8-cute"),
                    help="attention_in_model: the 8-bit attention kernel of the call and of the timings alone")
    ap.add_argument("--cute-schedule", default=None,
                    help="the _cute rungs' CuTe kernel schedule, e.g. overlap=0,lookahead=1,lazy_rescale=1 "
                         "(trt_sora.kernels.cute_attention.SCHEDULE's keys; 0/1 or a stage count)")
    ap.add_argument("--kernel-settings", default=None,
                    help="a JSON file of triton_ops launch settings (NORM_MAX_WARPS, EPILOGUE_WARPS; or "
                         "epilogue_bench.py's output, its best ones) for every kernel of this run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.cute_schedule:
        set_cute_schedule(a.cute_schedule)
    settings = set_kernel_settings(a.kernel_settings) if a.kernel_settings else None
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    on_gpu = a.device.startswith("cuda")
    out = {"gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
           "ceilings": CEILING, "runs": [], **({"kernel_settings": settings} if settings else {})}
    if on_gpu:
        import triton

        out["triton"] = triton.__version__
    parts = set(a.parts.split(","))
    if "gemm" in parts:
        out["gemm"] = gemm_part()
    if "attention_in_model" in parts:
        out["attention_in_model"] = attention_in_model_part(kernel=a.attention_kernel)
        print(json.dumps(out["attention_in_model"]), flush=True)
    if "attention" in parts:
        out["attention"] = attention_part()
        print(json.dumps(out["attention"]), flush=True)
    if "cudnn_attention" in parts:
        out["cudnn_attention"] = cudnn_attention_part()
    if "fa4_attention" in parts:  # the knobs at the first length only
        out["fa4_attention"] = {n: fa4_attention_part(n, site=a.fa4_site, variants=i == 0)
                                for i, n in enumerate(int(x) for x in a.fa4_tokens.split(","))}
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1))
    if "models" in parts:
        for m in a.models.split(","):
            model = bench_adapter(m).load("bf16", a.device)  # once per model: every size and batch shares it
            points = ([(p.split(":")[0], int(p.split(":")[1])) for p in a.points.split(",")] if a.points else
                      [(sz, int(b)) for sz in a.sizes.split(",") for b in a.batches.split(",")])
            for sz, b in points:
                out["runs"].append({})

                def save(res):
                    out["runs"][-1] = res
                    if a.out:
                        Path(a.out).write_text(json.dumps(out, indent=1))

                rungs = a.rungs.split(",")
                r = model_part(m, sz, b, a.iters, rungs, save, model=model, profile=not a.no_profile,
                               frames=a.frames, all_keys=a.all_keys, device=a.device, eager_iters=a.eager_iters,
                               sparse=sparse_rungs(rungs, a.sparse_windows, a.sparse_tile, a.sparse_global_frames))
                print(json.dumps({k: r[k] for k in ("model", "size", "batch")} | {
                    k: {kk: v.get(kk) for kk in ("s", "speedup_vs_eager_bf16", "speedup_vs_compile_bf16",
                                                   "cosine_vs_eager_bf16", "fp8_gemms_per_call",
                                                   "fp8_attention_layers", "bf16_attention_layers",
                                                   "attention_keys_padded", "cuda_graphs", "density",
                                                   "speedup_vs_dense_full_rung")}
                    for k, v in r["rungs"].items()}), flush=True)
                if a.out:
                    Path(a.out).write_text(json.dumps(out, indent=1))
            del model
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
