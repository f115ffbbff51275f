"""Device dispatch: Triton kernels on CUDA, the pure-torch references elsewhere (CPU tests).

Both paths take and return the same tensors, so a block written against these functions runs
on the GPU at speed and on the CPU as its own specification.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trt_sora.config.recipe import KEY_LENGTH_KERNELS, AttentionKernel
from trt_sora.errors import ConfigError
from trt_sora.kernels import cute_attention
from trt_sora.kernels import reference as ref

__all__ = ["ATTENTION_KERNELS", "cross_attention", "gated_add", "gelu_quant", "linear_fp8", "quantize",
           "residual_norm_quant", "sdpa_fp8_tensor", "self_attention", "sdpa_bf16", "heads_to_tokens"]


#: The 8-bit self-attention kernels (:class:`~trt_sora.config.recipe.AttentionKernel`): ``int8`` (Triton,
#: the default), ``int8-cute`` (its operands on the CuTe DSL kernel, :mod:`.cute_attention`) and ``cudnn-fp8``
#: (cuDNN's fused FP8 SDPA, :mod:`.cudnn_attention`).
ATTENTION_KERNELS = tuple(k.value for k in AttentionKernel)


def _tri(x: torch.Tensor):
    if x.is_cuda:
        from trt_sora.kernels import triton_ops

        return triton_ops
    return None


def residual_norm_quant(x, **kw):
    t = _tri(x)
    return (t or ref).residual_norm_quant(x, **kw)


def gated_add(x, branch, gate):
    """``bf16(x + branch * gate)``; [B, S, C] with ``gate`` [B, C] or per token [B, S, C] fp32 (the FFN residual)."""
    t = _tri(x)
    if t:
        return t.gated_add(x, branch, gate)
    return (x.float() + branch.float() * ref.per_row(gate)).to(x.dtype)


def gelu_quant(h, act_scale):
    t = _tri(h)
    return (t or ref).gelu_quant(h, act_scale)


def quantize(x, act_scale):
    """FP8 at ``act_scale`` (None: unchanged)."""
    if act_scale is None:
        return x
    t = _tri(x)
    return t.quantize(x, act_scale) if t else ref.quantize(x, act_scale)


def heads_to_tokens(o, act_scale=None):
    t = _tri(o)
    return (t or ref).heads_to_tokens(o, act_scale)


def cross_attention(q, wq, k, v, heads: int, eps: float, act_scale=None, ctx2=None):
    """Queries ``q`` [B, S, C] (RMSNorm with ``wq`` applied here) over a short context's normed keys and values
    [B, L, C] (and over ``ctx2``'s, Wan I2V's image tokens, each with its own softmax; the two bf16 outputs added
    in bf16, diffusers' order): [B, S, C] bf16, FP8 at ``act_scale``. cuDNN BF16 SDPA on [B, H, S, D] views (why
    not a fused Triton kernel: benchmarks/README.md, "Session 27")."""
    def split(t):
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)

    qn = split(F.rms_norm(q, (q.shape[-1],), wq, eps))
    att = sdpa_bf16(qn, split(k), split(v))
    if ctx2 is None:
        return heads_to_tokens(att, act_scale)
    y = heads_to_tokens(att) + heads_to_tokens(sdpa_bf16(qn, *map(split, ctx2)))
    return quantize(y, act_scale) if act_scale is not None else y


def sdpa_bf16(q, k, v):
    """BF16 attention [B, H, S, D]; cuDNN's fused kernel on CUDA (the fastest; benchmarks/README.md)."""
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def _rows(x, idx):
    """``x[:, idx]`` for any dtype (FP8 gathered as bytes)."""
    if x.element_size() == 1:
        return x.view(torch.uint8)[:, idx].view(x.dtype)
    return x[:, idx]


def sdpa_fp8_tensor(q, k, v, out_scale=None):
    """bf16 Q, K, V [B, H, S, D] -> attention [B, S, H*D] with per-tensor FP8 operands (FP8 at ``out_scale``,
    else bf16): cuDNN's FP8 SDPA on CUDA, its pure-torch emulation elsewhere."""
    if q.is_cuda:
        from trt_sora.kernels import cudnn_attention

        return cudnn_attention.attention(q, k, v, out_scale)
    return ref.sdpa_fp8(*ref.sdpa_fp8_operands(q, k, v), out_scale=out_scale)


def self_attention(qkv, wq, wk, cos, sin, heads: int, eps: float, *, fp8: bool, out_scale=None, seq=None,
                   sparse=None, rstd=None, kernel: str = "int8", key_len=None):
    """Fused-QKV output [B, S, 3C] -> attention output [B, S, C] token-major (``to_out``'s input):
    RMSNorm across heads on Q and K, RoPE, attention (FP8 with per-block Q/K scales and K
    smoothing when ``fp8``, else BF16 SDPA); FP8 at ``out_scale`` when given.

    ``seq`` (:class:`trt_sora.parallel.SeqShard`, Ulysses): ``qkv`` holds this rank's tokens; the
    per-token RMS statistics (over all heads) are taken here, then one all-to-all gives every rank
    all tokens of its heads, the epilogue and attention run on those, and a second all-to-all
    returns this rank's tokens with every head. ``cos``/``sin`` cover all tokens.

    ``sparse`` (:class:`trt_sora.sparse.TileSparse`): block-sparse attention; the tokens run in its tile
    order (``qkv`` rows and RoPE rows permuted, the output put back), the 8-bit kernel over its key
    tiles, the references over its mask.

    ``rstd`` [B*S, 2] fp32: the per-token RMS statistics to use instead of taking them (ones, with
    ``wq``/``wk`` ones and no RoPE: Q and K arrive normalized, a family whose norm is per head).

    ``kernel``: the 8-bit kernel when ``fp8`` (:data:`ATTENTION_KERNELS`; ``cudnn-fp8`` is dense only;
    ``int8-cute`` runs dense heads of 128 on the CuTe DSL kernel, anything else on the ``int8`` one).

    ``key_len`` [B] int32 on ``qkv``'s device (the ``int8`` kernel, dense, no Ulysses): the tokens from it
    on are padding, never attended as keys and in none of the 8-bit scales (their own output rows are not
    meaningful); the valid tokens must come first."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: use one of {ATTENTION_KERNELS}")
    t = _tri(qkv)
    k_ = t or ref
    if key_len is not None and not (fp8 and kernel in KEY_LENGTH_KERNELS and sparse is None and seq is None):
        raise ConfigError("key lengths run on the dense 'int8' attention kernel only: fp8=True without "
                          "sparse attention or Ulysses; run BF16 attention with a key mask otherwise")
    if sparse is not None:
        if fp8 and kernel != "int8":
            raise ValueError(f"sparse attention runs on the 'int8' kernel, not {kernel!r}")
        if seq is not None:
            raise ValueError("sparse attention under Ulysses is not supported; run it with ulysses=1")
        if rstd is not None:
            raise ValueError("sparse attention needs the fused QKV norm (no given RMS statistics)")
        qkv, cos, sin = _rows(qkv, sparse.perm), cos[sparse.perm], sin[sparse.perm]
    if seq is not None:
        b, s_loc = qkv.shape[:2]
        rstd = seq.all_gather_rows(k_.rms_stats(qkv, eps).view(b, s_loc, 2)).reshape(-1, 2).contiguous()
        qkv = seq.tokens_to_heads(qkv, groups=3)
        wq, wk = (w.view(seq.size, -1)[seq.rank].contiguous() for w in (wq, wk))
        heads //= seq.size
    if not fp8 or kernel == "cudnn-fp8":
        q, k, v = k_.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads, eps, fp8=False, rstd=rstd)
        if fp8:
            out = sdpa_fp8_tensor(q, k, v, out_scale)
        else:
            out = heads_to_tokens(sdpa_bf16(q, k, v) if sparse is None else sparse.attend_tile(q, k, v), out_scale)
    elif t:
        ops8 = t.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads, eps, fp8=True, rstd=rstd, key_len=key_len)
        if kernel == "int8-cute" and sparse is None and key_len is None and cute_attention.takes(ops8[0]):
            out = cute_attention.attention_fp8(*ops8, out_scale=out_scale)
        else:
            out = t.attention_fp8(*ops8, out_scale=out_scale, blocks=None if sparse is None else sparse.kernel_blocks,
                                  key_len=key_len)
    else:
        q8, qs, k8, ks, v8, vs, _ = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, heads, eps, fp8=True, rstd=rstd,
                                                         key_len=key_len)
        out = ref.heads_to_tokens(ref.attention_fp8(q8, qs, k8, ks, v8, vs, mask=None if sparse is None else
                                                    sparse.mask_tile, key_len=key_len), out_scale)
    if sparse is not None:
        return _rows(out, sparse.inv)
    return out if seq is None else seq.heads_to_tokens(out)


def linear_fp8(x8, w8, x_scale, w_scale, bias, rows_cache: dict | None = None, fast_accum: bool = False):
    """FP8 GEMM ``(x8 * x_scale) @ (w8 * w_scale[:, None]).T + bias`` -> bf16.

    ``x8`` [..., K] E4M3, ``w8`` [N, K] E4M3 (row-major, so ``w8.t()`` is the column-major operand
    cuBLASLt wants), ``x_scale`` fp32 scalar tensor, ``w_scale`` [1, N] fp32 (per output channel),
    ``bias`` [N] bf16 or None. On CUDA ``torch._scaled_mm`` with row-wise scales (tensor cores);
    elsewhere the same math dequantized in fp32. ``fast_accum``: cuBLASLt's FP8 fast accumulation
    (the tensor cores' own accumulator, without the periodic promotion to fp32; CUDA only).
    """
    lead, k = x8.shape[:-1], x8.shape[-1]
    x2 = x8.reshape(-1, k)
    if x8.is_cuda:
        m = x2.shape[0]
        sa = None if rows_cache is None else rows_cache.get(m)
        if sa is None:
            sa = x_scale.reshape(1, 1).expand(m, 1).contiguous()
            if rows_cache is not None:
                rows_cache[m] = sa
        y = torch._scaled_mm(x2, w8.t(), scale_a=sa, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16,
                             use_fast_accum=fast_accum)
    else:
        y = (x2.float() * x_scale) @ (w8.float() * w_scale.reshape(-1, 1)).t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(torch.bfloat16)
    return y.reshape(*lead, -1)
