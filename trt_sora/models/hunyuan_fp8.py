"""HunyuanVideo 1.5 dual-stream blocks on the ``torch-fp8`` backend (real FP8 tensor-core GEMMs + Triton).

The HunyuanVideo facts of the GPU FP8 path live here, next to ``hunyuan.py``: which linears a
dual-stream block has, how they fuse (video Q/K/V, text Q/K/V), the per-head QK norms, the joint
attention over video + context tokens with its key mask, and the last block's text stream, whose
output the model never reads (the exported graph drops it, so the Q/DQ graph has no GEMM there).
A block is rewritten from a loaded diffusers ``HunyuanVideo15TransformerBlock`` and the calibration
plan (:func:`trt_sora.runners.fp8_runner.fp8_plan`); every linear without a plan entry (the AdaLN
modulations by default) stays a BF16 GEMM, as the Q/DQ graph leaves it unquantized. The token
refiner and the ByT5 / image projections run as diffusers modules in bf16 (quantization excludes
them by default); a recipe that quantizes some of their linears gets those as FP8 GEMMs.

One block, top to bottom (``q8`` = FP8 E4M3; ``x`` video tokens, ``c`` context tokens)::

    m, mc = silu(temb) @ Wada, silu(temb) @ Wada_c                BF16 GEMMs (AdaLN, 6 vectors each)
    y, yc = q8(LN(x) * (1 + scale) + shift), the same for c        residual_norm_quant
    q, k, v = RMSNorm_head+RoPE(y @ Wqkv); eq, ek, ev = RMSNorm_head(yc @ Wqkv_c)    FP8 GEMMs (fused)
    a     = attention([q; eq], [k; ek], [v; ev], key mask)         8-bit over the valid keys (a key length)
    x, y  = x + (a_x @ Wo) * gate, q8(LN(x) * (1 + scale2) + shift2)    FP8 GEMM, residual_norm_quant
    x     = x + (q8(GELU(y @ W1)) @ W2) * gate2                    FP8 GEMMs, gelu_quant, gated_add
    c     = the same with a_c and the context weights (not in the last block)
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trt_sora.kernels import ops
from trt_sora.kernels.fp8_linear import Gemm, finish, fused_gemm, site, swap_linears
from trt_sora.kernels.reference import rope

__all__ = ["FusedHunyuanBlock", "prepare", "valid_first"]

#: The context stream's linears after the joint attention: dead in the last block.
TEXT_OUT = ("attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")


def _qk_norm(x: torch.Tensor, w: torch.Tensor, heads: int, eps: float, cs=None) -> torch.Tensor:
    """diffusers' per-head ``RMSNorm`` (and RoPE when ``cs`` = (cos, sin) [S, D]) in fp32:
    [B, S, C] -> [B, S, C] bf16."""
    t = x.float().unflatten(-1, (heads, -1))
    t = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * w
    if cs is not None:
        t = rope(t, *cs)
    return t.flatten(2).to(torch.bfloat16)


def valid_first(keys: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit kernel's order of the context tokens that follow ``n`` video tokens, for the key mask
    ``keys`` [B, L] (True: valid): ``(slot [B, L] int64, key_len [B] int32)``: context token i goes to
    slot i, the valid tokens first and the masked ones after them, each group in its own order; the
    keys from ``key_len`` = n + valid context tokens on are the masked ones. No sort, no host sync."""
    valid = keys.bool()
    n_valid = valid.sum(1, keepdim=True)
    slot = torch.where(valid, valid.cumsum(1) - 1, n_valid + (~valid).cumsum(1) - 1)
    return slot, (n + n_valid[:, 0]).to(torch.int32)


def _index(slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return slot[..., None].expand(-1, -1, x.shape[-1])


class FusedHunyuanBlock(torch.nn.Module):
    """``HunyuanVideo15TransformerBlock`` with FP8 GEMMs and fused quantization.

    ``forward(hidden_states [B, S, C], encoder_hidden_states [B, L, C], temb [B, C], attention_mask
    [B, L] bool (the context keys), freqs_cis (cos, sin) [S, D] fp32)`` as the export forward calls it;
    returns ``(hidden_states, encoder_hidden_states)`` (the latter unchanged when ``text_out`` is
    False: the last block, whose text output nothing reads; a plan's sites there go unused).
    ``fp8_attention`` switches the joint attention's kernel (8-bit with a key length per sample vs BF16
    SDPA with the key mask); the runner sets it per call (its attention policy).
    """

    def __init__(self, blk, name: str, plan: Mapping[str, Any], counters: dict, *, text_out: bool = True):
        super().__init__()
        a = blk.attn
        self.name, self.counters, self.heads, self.text_out = name, counters, a.heads, text_out
        self.eps, self.qk_eps = blk.norm2.eps, a.norm_q.eps

        def gemm(path, lin):
            return Gemm(lin.weight, lin.bias, *site(plan, f"{name}.{path}"), counters)

        self.ada, self.ada_c = gemm("norm1.linear", blk.norm1.linear), gemm("norm1_context.linear",
                                                                             blk.norm1_context.linear)
        self.qkv = fused_gemm([(f"{name}.attn.to_{x}", getattr(a, f"to_{x}")) for x in "qkv"], plan, counters)
        self.qkv_c = fused_gemm([(f"{name}.attn.add_{x}_proj", getattr(a, f"add_{x}_proj")) for x in "qkv"], plan,
                                counters)
        self.out, self.ff1, self.ff2 = (gemm("attn.to_out.0", a.to_out[0]), gemm("ff.net.0.proj", blk.ff.net[0].proj),
                                        gemm("ff.net.2", blk.ff.net[2]))
        if text_out:
            self.out_c, self.ff1_c, self.ff2_c = (gemm(TEXT_OUT[0], a.to_add_out),
                                                  gemm(TEXT_OUT[1], blk.ff_context.net[0].proj),
                                                  gemm(TEXT_OUT[2], blk.ff_context.net[2]))
        for tag, mod in (("nq", a.norm_q), ("nk", a.norm_k), ("nq_c", a.norm_added_q), ("nk_c", a.norm_added_k)):
            self.register_buffer(tag, mod.weight.detach().float(), persistent=False)
        self.register_buffer("ones", torch.ones(a.to_q.out_features, dtype=torch.bfloat16, device=self.nq.device),
                             persistent=False)
        self.fp8_attention = True
        self.attention_kernel = "int8"  # the 8-bit kernel (kernels.ops.ATTENTION_KERNELS); the runner sets it

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis):
        x = hidden_states.to(torch.bfloat16).contiguous()
        c = encoder_hidden_states.to(torch.bfloat16).contiguous()
        e = F.silu(temb.to(torch.bfloat16))
        # shift, scale, gate (attention); shift, scale, gate (FFN): diffusers' AdaLayerNormZero order
        m, mc = ([t.contiguous() for t in g(e).float().chunk(6, dim=1)] for g in (self.ada, self.ada_c))
        _, y = ops.residual_norm_quant(x, mod_scale=m[1], mod_shift=m[0], eps=self.eps, act_scale=self.qkv.act_scale)
        _, yc = ops.residual_norm_quant(c, mod_scale=mc[1], mod_shift=mc[0], eps=self.eps,
                                        act_scale=self.qkv_c.act_scale)
        att = self._attention(self.qkv(y), self.qkv_c(yc), attention_mask, freqs_cis)
        n = x.shape[1]
        x = self._branches(x, att[:, :n], m, self.out, self.ff1, self.ff2)
        if self.text_out:
            c = self._branches(c, att[:, n:], mc, self.out_c, self.ff1_c, self.ff2_c)
        return x.to(hidden_states.dtype), c.to(encoder_hidden_states.dtype)

    def _attention(self, qkv, qkv_c, keys, cs):
        """Joint attention -> [B, S + L, C] bf16: video Q/K per-head RMS-normed and rotated, context
        Q/K per-head RMS-normed; context keys where ``keys`` [B, L] is False are masked. The 8-bit
        ``int8`` kernel takes a key length per sample instead of a mask: the context tokens go in valid
        ones first (the masked ones sit anywhere: image, ByT5 and MLLM padding), their outputs put back;
        another 8-bit kernel has no mask (the runner turns it on only where every key is valid)."""
        fp8 = self.fp8_attention
        tag = "fp8_attention" if fp8 else "bf16_attention"
        self.counters[tag] = self.counters.get(tag, 0) + 1
        q, k, v = qkv.chunk(3, dim=-1)
        eq, ek, ev = qkv_c.chunk(3, dim=-1)
        h, eps = self.heads, self.qk_eps
        q, k = _qk_norm(q, self.nq, h, eps, cs), _qk_norm(k, self.nk, h, eps, cs)
        eq, ek = _qk_norm(eq, self.nq_c, h, eps), _qk_norm(ek, self.nk_c, h, eps)
        n = q.shape[1]
        masked = fp8 and self.attention_kernel == "int8"
        if masked:
            slot, key_len = valid_first(keys, n)
            eq, ek, ev = (torch.empty_like(t).scatter_(1, _index(slot, t), t) for t in (eq, ek, ev))
        joint = torch.cat([torch.cat(p, dim=1) for p in ((q, eq), (k, ek), (v, ev))], dim=-1).contiguous()
        if fp8:  # Q and K arrive normalized: unit statistics and weights, no RoPE
            b, s = joint.shape[:2]
            ones = torch.ones(b * s, 2, device=joint.device, dtype=torch.float32)
            out = ops.self_attention(joint, self.ones, self.ones, None, None, h, eps, fp8=True, rstd=ones,
                                     kernel=self.attention_kernel, key_len=key_len if masked else None)
            if masked:
                out[:, n:] = out[:, n:].gather(1, _index(slot, out))  # each context token's row back in place
            return out
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in joint.chunk(3, dim=-1))
        mask = F.pad(keys.bool(), (qkv.shape[1], 0), value=True)[:, None, None, :]
        return ops.heads_to_tokens(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def _branches(self, x, att, m, out, ff1, ff2):
        """One stream after the attention: gated output projection, norm + modulation, gated FFN."""
        x, y = ops.residual_norm_quant(x, branch=out(att.contiguous()), gate=m[2], mod_scale=m[4], mod_shift=m[3],
                                       eps=self.eps, act_scale=ff1.act_scale)
        h = ops.gelu_quant(ff1(y), ff2.act_scale)
        return ops.gated_add(x, ff2(h), m[5])


def fuse_blocks(model, plan: Mapping[str, Any], counters: dict) -> list[FusedHunyuanBlock]:
    """Replace every dual-stream block of a loaded ``HunyuanVideo15Transformer3DModel`` by a
    :class:`FusedHunyuanBlock` (weights quantized once, the diffusers block freed as it goes)."""
    out, blocks = [], model.transformer_blocks
    for i, blk in enumerate(blocks):
        fb = FusedHunyuanBlock(blk, f"transformer_blocks.{i}", plan, counters, text_out=i < len(blocks) - 1)
        blocks[i] = fb
        out.append(fb)
        del blk
    return out


def prepare(model, plan: Mapping[str, Any], *, fused: bool, counters: dict,
            fast_accum: bool = False) -> list[FusedHunyuanBlock]:
    """Rewrite a loaded ``HunyuanVideo15Transformer3DModel`` for the ``torch-fp8`` backend, in place.

    ``fused``: every dual-stream block becomes a :class:`FusedHunyuanBlock`; planned linears outside
    them (token refiner, projections, when a recipe quantizes them) become ``Fp8Linear``. Otherwise
    only the planned linears are swapped (diffusers' blocks run as they are). Returns the fused blocks.
    """
    blocks = fuse_blocks(model, plan, counters) if fused else []
    swap_linears(model, plan, counters)
    finish(model, fast_accum)
    return blocks
