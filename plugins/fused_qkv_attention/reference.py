"""PyTorch oracle for the fused_qkv_attention plugin contract (see README.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (across all heads), computed in fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE. ``x`` [B, S, H, D]; ``cos``/``sin`` [S, D] with pairs repeated."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, 0::2], sin[None, :, None, 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2).to(x.dtype)


def fused_qkv_attention(qkv: torch.Tensor, norm_q_weight: torch.Tensor, norm_k_weight: torch.Tensor,
                        rope_cos: torch.Tensor, rope_sin: torch.Tensor, num_heads: int,
                        eps: float = 1e-6) -> torch.Tensor:
    """``qkv`` [B, S, 3*H*D] -> attention output [B, S, H*D] (same dtype)."""
    q, k, v = qkv.chunk(3, dim=-1)
    q, k = rms_norm(q, norm_q_weight, eps), rms_norm(k, norm_k_weight, eps)
    q, k, v = (t.unflatten(-1, (num_heads, -1)) for t in (q, k, v))
    q, k = rope(q, rope_cos, rope_sin), rope(k, rope_cos, rope_sin)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)
