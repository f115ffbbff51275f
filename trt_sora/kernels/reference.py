"""The math of every ``torch-fp8`` kernel in plain torch: the oracle of the GPU tests.

Scale convention everywhere (ONNX Q/DQ, as the quantize stage writes it): a *dequantization*
scale ``s = amax / 448`` in fp32 (``s = 1`` where ``amax == 0`` so zeros stay zeros),
``q = float8_e4m3fn(clamp(x / s, -448, 448))``, ``x ~= q * s``.

Shapes: ``B`` batch, ``S`` tokens, ``H`` heads, ``D`` head dim, ``C = H * D`` channels.
Activations are bf16 as in diffusers' bf16 Wan (norms and modulation in fp32, rounded to bf16
where diffusers rounds).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from trt_sora.formats import FP8_E4M3_MAX as FP8_MAX
from trt_sora.formats import INT8_MAX

FP8 = torch.float8_e4m3fn

__all__ = ["FP8", "FP8_MAX", "attention", "attention_fp8", "block_quant", "dequant_scale",
           "example_qkv", "gelu_quant", "heads_to_tokens", "key_valid", "per_row", "quantize", "quantize_int8",
           "qkv_rmsnorm_rope", "residual_norm_quant", "rms_norm", "rms_stats", "rope", "sdpa_fp8", "sdpa_fp8_operands",
           "vt_key_order", "vt_natural"]


def dequant_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in fp32, 1 where ``amax == 0``."""
    s = amax.float() / FP8_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to E4M3 (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def per_row(v: torch.Tensor) -> torch.Tensor:
    """An AdaLN vector against [B, S, C] rows: [B, C] (per sample) -> [B, 1, C]; [B, S, C] (per token) as is."""
    return v[:, None, :] if v.dim() == 2 else v


def residual_norm_quant(x: torch.Tensor, *, branch: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                        mod_scale: torch.Tensor | None = None, mod_shift: torch.Tensor | None = None,
                        eps: float = 1e-6, act_scale: torch.Tensor | None = None):
    """Residual add (optionally gated), LayerNorm over C, AdaLN modulation, FP8 quantize.

    Args:
        x: [B, S, C] bf16 residual stream.
        branch: [B, S, C] bf16 branch output added to ``x`` first (``x + branch * gate``, in fp32).
        gate / mod_scale / mod_shift: [B, C] fp32 per-sample AdaLN vectors, or [B, S, C] per token
            (Wan 2.2 TI2V's per-frame timesteps).
        weight / bias: [C] LayerNorm affine (fp32), or None.
        act_scale: fp32 scalar dequant scale of the consumer linear's input; None -> bf16 output.

    Returns ``(x_new, y)``: the updated residual [B, S, C] bf16 (``x`` itself without ``branch``)
    and ``bf16(LN(x_new) * (1 + mod_scale) + mod_shift)`` [B, S, C], FP8 when ``act_scale`` is given.
    """
    if branch is not None:
        add = branch.float() * per_row(gate) if gate is not None else branch.float()
        x = (x.float() + add).to(x.dtype)
    n = F.layer_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    if mod_scale is not None:
        n = n * (1 + per_row(mod_scale)) + per_row(mod_shift)
    y = n.to(x.dtype)
    return x, (quantize(y, act_scale) if act_scale is not None else y)


def gelu_quant(h: torch.Tensor, act_scale: torch.Tensor | None) -> torch.Tensor:
    """``GELU_tanh(h)`` rounded to ``h``'s dtype, then FP8 (None: stays bf16). Any shape."""
    y = F.gelu(h, approximate="tanh")
    return quantize(y, act_scale) if act_scale is not None else y


def rms_stats(qkv: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-token ``1 / rms`` of Q and of K over all heads: ``qkv`` [B, S, 3C] -> [B*S, 2] fp32."""
    q, k, _ = qkv.float().chunk(3, dim=-1)
    return torch.stack([torch.rsqrt(t.square().mean(-1) + eps) for t in (q, k)], -1).reshape(-1, 2)


def _rms(x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``x`` [B, S, C] * ``rstd`` [B, S, 1] * ``w`` [C], rounded to ``x``'s dtype (diffusers' RMSNorm)."""
    return (x.float() * rstd * w.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of ``x`` [..., C] over C with weight ``w`` [C], the statistics in fp32, rounded once to ``x``'s dtype."""
    return _rms(x, w, torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (Wan, HunyuanVideo): ``x`` [B, S, H, D]; ``cos``/``sin`` [S, D] fp32, pairs repeated."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, 0::2], sin[None, :, None, 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)



def quantize_int8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``round(x / scale)`` (half away from zero, as the kernels round) saturated to +-127, int8."""
    y = x.float() / scale
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def block_quant(x: torch.Tensor, block: int, fmt: str = "int8", *, scale_of: torch.Tensor | None = None):
    """Per-(b, h, block of ``block`` tokens) 8-bit: ``x`` [B, H, S, D] -> (q [B, H, S, D], s [B, H, nblk]);
    ``fmt`` ``"int8"`` (scale amax / 127) or ``"fp8"`` (amax / 448). ``scale_of``: the tensor whose block
    amax sets the scales (default ``x``; values of ``x`` past it saturate)."""
    b, h, s, d = x.shape
    nblk = -(-s // block)
    xp = F.pad(x.float(), (0, 0, 0, nblk * block - s)).view(b, h, nblk, block, d)
    sp = xp if scale_of is None else F.pad(scale_of.float(), (0, 0, 0, nblk * block - s)).view(b, h, nblk, block, d)
    amax = sp.abs().amax(dim=(3, 4))
    if fmt == "int8":
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
        q = quantize_int8(xp, scale[..., None, None])
    else:
        scale = dequant_scale(amax)
        q = quantize(xp, scale[..., None, None])
    return q.view(b, h, nblk * block, d)[:, :, :s], scale


def qkv_rmsnorm_rope(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, heads: int, eps: float = 1e-6, *, fp8: bool = True,
                     block: int = 128, rstd: torch.Tensor | None = None, key_len: torch.Tensor | None = None):
    """Fused-QKV epilogue. ``qkv`` [B, S, 3C] bf16 (Q, K, V on the last dim); ``wq``/``wk`` [C].

    Returns BF16 ``(q, k, v)`` [B, H, S, D] when ``fp8`` is False, else the 8-bit attention
    operands ``(q8, q_scale, k8, k_scale, v8, v_scale, k_mean)``: Q in INT8 per block of ``block``
    tokens; K minus its per-channel mean over the tokens (softmax is invariant to it: K smoothing)
    in INT8 per block; V in FP8 E4M3 per channel ``v_scale`` [B, H, D]; ``k_mean`` [B, H, D] fp32.
    INT8 rather than FP8 for Q and K (SageAttention's choice, same tensor-core rate on Hopper):
    FP8's 3 mantissa bits on the logits cost ~5x the error (cosine 0.9986 vs 0.9992 on 4k tokens).
    ``rstd`` [B*S, 2]: the RMS statistics (:func:`rms_stats`) when they were taken over more heads
    than ``qkv`` holds (Ulysses); None: taken here.
    ``key_len`` [B] int: tokens at or past it are padding (8-bit path only): their K and V become zeros,
    and K's mean, V's scale and every Q block scale are taken over the valid tokens alone, so
    padding never changes a valid token's result (the padded tokens' own query rows saturate).
    """
    b, s = qkv.shape[:2]
    r = (rms_stats(qkv, eps) if rstd is None else rstd).reshape(b, s, 2)
    q, k, v = qkv.chunk(3, dim=-1)
    q, k = _rms(q, wq, r[..., :1]), _rms(k, wk, r[..., 1:])
    q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    if cos is not None:
        q, k = rope(q, cos, sin), rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if not fp8:
        return q.contiguous(), k.contiguous(), v.contiguous()
    if key_len is not None:
        return _quant_valid(q, k, v, key_valid(key_len, s)[:, None, :, None], block)
    q8, qs = block_quant(q, block)
    k_mean = k.float().mean(dim=2)
    k8, ks = block_quant(k.float() - k_mean[:, :, None], block)
    vs = dequant_scale(v.float().abs().amax(dim=2))
    v8 = quantize(v, vs[:, :, None, :])
    return q8, qs, k8, ks, v8, vs, k_mean


def key_valid(key_len: torch.Tensor, s: int) -> torch.Tensor:
    """[B] key lengths -> [B, S] bool, True for the valid tokens (a prefix of each row)."""
    return torch.arange(s, device=key_len.device)[None] < key_len.to(torch.int64)[:, None]


def _quant_valid(q, k, v, valid, block: int):
    """:func:`qkv_rmsnorm_rope`'s 8-bit operands when ``valid`` [B, 1, S, 1] marks the valid tokens."""
    q8, qs = block_quant(q, block, scale_of=torch.where(valid, q.float(), 0.0))
    k_mean = torch.where(valid, k.float(), 0.0).sum(dim=2) / valid.sum(dim=2)
    k8, ks = block_quant(torch.where(valid, k.float() - k_mean[:, :, None], 0.0), block)
    vz = torch.where(valid, v.float(), 0.0)
    vs = dequant_scale(vz.abs().amax(dim=2))
    return q8, qs, k8, ks, quantize(vz, vs[:, :, None, :]), vs, k_mean


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 softmax attention, [B, H, S, D] -> [B, H, S, D] fp32 (the accuracy reference)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def attention_fp8(q8, q_scale, k8, k_scale, v8, v_scale, block: int = 128, mask=None,
                  key_len=None) -> torch.Tensor:
    """What the 8-bit kernel computes, up to its online-softmax order: dequantized INT8 Q/K per
    block, probabilities quantized as ``fp8(p * 448) / 448`` against the row max, FP8 V per channel.
    ``mask`` [S, S] bool (True: attend; :func:`trt_sora.sparse.token_mask`): the block-sparse kernel's
    keys. ``key_len`` [B] int (>= 1): only keys before it are attended (padding at the end). Returns
    [B, H, S, D] fp32."""
    s = q8.shape[2]
    qd = q8.float() * q_scale.repeat_interleave(block, dim=2)[:, :, :s, None]
    kd = k8.float() * k_scale.repeat_interleave(block, dim=2)[:, :, :s, None]
    logits = qd @ kd.transpose(-1, -2) / q8.shape[-1] ** 0.5
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if key_len is not None:
        logits = logits.masked_fill(~key_valid(key_len, s)[:, None, None, :], float("-inf"))
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    pq = (p * FP8_MAX).to(FP8).float() / FP8_MAX
    return (pq @ (v8.float() * v_scale[:, :, None, :])) / p.sum(-1, keepdim=True)


def sdpa_fp8_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Per-tensor FP8 E4M3 operands of :func:`sdpa_fp8` (cuDNN's FP8 flash attention) from bf16 Q, K, V
    [B, H, S, D]: K minus its per-channel mean over the tokens first (softmax is invariant to it).

    Returns ``(q8, k8, v8, q_descale, k_descale, v_descale)``, descales [1, 1, 1, 1] fp32 (``amax / 448``
    over the whole tensor, all heads), taken on the device without a host sync."""
    k = k.float() - k.float().mean(dim=2, keepdim=True)
    scales = [dequant_scale(t.abs().amax()).reshape(1, 1, 1, 1) for t in (q, k, v)]
    return (*(quantize(t, sc) for t, sc in zip((q, k, v), scales)), *scales)


def sdpa_fp8(q8, k8, v8, q_descale, k_descale, v_descale, out_scale=None) -> torch.Tensor:
    """What cuDNN's FP8 SDPA forward computes from :func:`sdpa_fp8_operands`, up to its online-softmax
    order: fp32 logits of the FP8 Q K^T, probabilities quantized as ``fp8(p * 448) / 448`` against the
    row max, FP8 P V, divided by the fp32 row sum; the output FP8 (Hopper's only output type) at
    ``out_scale`` (``to_out``'s input scale), or without one at V's scale (``|o| <= max |v|``: it cannot
    saturate) and returned in bf16. Returns [B, S, H*D] token-major."""
    d = q8.shape[-1]
    logits = (q8.float() @ k8.float().transpose(-1, -2)) * (d ** -0.5 * q_descale * k_descale)
    p = torch.exp(logits - logits.amax(-1, keepdim=True))
    o = (quantize(p, 1 / FP8_MAX).float() @ v8.float()) * (v_descale / FP8_MAX) / p.sum(-1, keepdim=True)
    o8 = quantize(o, v_descale if out_scale is None else out_scale).transpose(1, 2).flatten(2)
    return o8 if out_scale is not None else (o8.float() * v_descale.reshape(())).to(torch.bfloat16)


def vt_key_order(n: int) -> torch.Tensor:
    """The key held at each position of the kernels' V^T [B, H, D, S_pad] (``n`` a multiple of 16): in each
    group of 16, position ``4q + 2h + e`` holds key ``8h + 2q + e`` (q < 4; h, e < 2).

    It is the order in which the P V product finds P in the softmax's registers. The FP8 A operand of
    wgmma m64nNk32 (and mma m16n8k32) gives lane ``q`` of each quad the keys ``4q..4q+3`` and
    ``16+4q..19+4q`` of every 32; the Q K^T accumulator it comes from holds keys ``8c + 2q + {0, 1}``,
    c < 4. Read in this order, every lane already holds its own operand (no shuffles); V^T stored in
    the same order keeps the product the same sum over keys."""
    p = torch.arange(n)
    return p // 16 * 16 + p % 4 // 2 * 8 + p % 16 // 4 * 2 + p % 2


def vt_natural(vt8: torch.Tensor, s: int) -> torch.Tensor:
    """The kernels' V^T [B, H, D, S_pad] in key order (:func:`vt_key_order`) -> V [B, H, S, D]."""
    order = vt_key_order(vt8.shape[-1]).to(vt8.device)
    nat = torch.empty_like(vt8)
    nat[..., order] = vt8
    return nat[..., :s].transpose(-1, -2)


def heads_to_tokens(o: torch.Tensor, act_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H*D] in bf16, or FP8 at ``act_scale``."""
    y = o.transpose(1, 2).flatten(2).to(torch.bfloat16)
    return quantize(y, act_scale) if act_scale is not None else y


def example_qkv(b: int, s: int, h: int, d: int = 128, *, seed: int = 0, device: str = "cuda"):
    """``(qkv, wq, wk, cos, sin)`` of one self-attention layer for kernel tests and benchmarks: fused
    Q/K/V [B, S, 3*H*D] bf16 with a per-channel K bias (what makes K smoothing matter), RMSNorm
    weights [H*D] bf16 near 1, RoPE tables [S, D] fp32 of random angles (interleaved pairs)."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(b, s, 3 * h * d, device=device, generator=g)
    qkv[..., h * d:2 * h * d] += 3.0 * torch.randn(h * d, device=device, generator=g)
    qkv = qkv.to(torch.bfloat16)
    wq = (1 + 0.2 * torch.randn(h * d, device=device, generator=g)).to(torch.bfloat16)
    wk = (1 + 0.2 * torch.randn(h * d, device=device, generator=g)).to(torch.bfloat16)
    ang = torch.rand(s, d // 2, device=device, generator=g) * 6.28
    return qkv, wq, wk, ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
