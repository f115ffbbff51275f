"""Wan 2.x transformer blocks on the ``torch-fp8`` backend (real FP8 tensor-core GEMMs + Triton).

The Wan facts of the GPU FP8 path (which linears a block has, how they fuse, where diffusers
rounds to bf16) live here, next to ``wan.py``. A block is rewritten from a loaded diffusers
``WanTransformerBlock`` and the calibration plan ``{module path: (act amax, weight amax)}``
(:func:`trt_sora.runners.fp8_runner.fp8_plan`, the same numbers the Q/DQ graph holds); every
linear without a plan entry stays a BF16 GEMM, exactly as the Q/DQ graph leaves it unquantized.

One block, top to bottom (``q8`` = FP8 E4M3; every quantize fused into the kernel producing it)::

    y1  = q8(LN(x) * (1 + scale_msa) + shift_msa)                 residual_norm_quant
    qkv = y1 @ Wqkv                                               FP8 GEMM (fused Q, K, V)
    a   = attention(RMSNorm+RoPE(q, k), v) -> q8                  qkv epilogue + attention (FP8 or cuDNN BF16)
    x, y2 = x + (a @ Wo) * gate_msa, q8(LN_affine(x))             FP8 GEMM, residual_norm_quant
    c   = cross_attention(y2 @ Wq2, q8(ctx) @ Wkv2) -> q8         FP8 GEMMs, RMSNorm + cuDNN BF16 SDPA (text keys)
    x, y3 = x + c @ Wo2, q8(LN(x) * (1 + c_scale) + c_shift)      FP8 GEMM, residual_norm_quant
    x   = x + (q8(GELU(y3 @ W1)) @ W2) * c_gate                   FP8 GEMMs, gelu_quant, gated_add

Wan 2.1 I2V: the context starts with the CLIP image tokens (``image_len`` of them, the processor's);
the same queries attend to them through the added K/V projections (one FP8 GEMM, ``q8(img) @ Wkv_img``)
and both attentions are summed in bf16 before ``Wo2``. Wan 2.2 TI2V: ``temb`` is per token
([B, S, 6, C], a timestep per latent frame), so every AdaLN vector is a [B, S, C] view the kernels
read per row.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trt_sora.errors import ModelError
from trt_sora.kernels import ops
from trt_sora.kernels.fp8_linear import Fp8Linear, Gemm, finish, fused_gemm, site, swap_linears

__all__ = ["Fp8Linear", "FusedWanBlock", "Gemm", "fuse_blocks", "prepare", "swap_linears"]


class FusedWanBlock(torch.nn.Module):
    """``WanTransformerBlock`` (text-to-video, I2V, TI2V) with FP8 GEMMs and fused quantization.

    ``forward(hidden_states [B, S, C] bf16, encoder_hidden_states [B, L, C] (I2V: image tokens
    first), temb [B, 6, C] (TI2V: [B, S, 6, C]), rotary_emb (cos, sin) [1, S, 1, D])`` as diffusers
    calls it. ``fp8_attention`` switches the self-attention kernel (FP8 Triton vs cuDNN BF16); the
    runner sets it per call.
    """

    def __init__(self, blk, name: str, plan: Mapping[str, Any], counters: dict):
        super().__init__()
        a1, a2 = blk.attn1, blk.attn2
        self.name, self.counters = name, counters
        self.heads = a1.heads
        self.eps = blk.norm1.eps
        self.qk_eps = a1.norm_q.eps
        self.register_buffer("table", blk.scale_shift_table.detach().float(), persistent=False)
        self.qkv = fused_gemm([(f"{name}.attn1.to_{x}", getattr(a1, f"to_{x}")) for x in "qkv"], plan, counters)
        self.out1 = Gemm(a1.to_out[0].weight, a1.to_out[0].bias, *site(plan, f"{name}.attn1.to_out.0"), counters)
        self.q2 = Gemm(a2.to_q.weight, a2.to_q.bias, *site(plan, f"{name}.attn2.to_q"), counters)
        self.kv2 = fused_gemm([(f"{name}.attn2.to_{x}", getattr(a2, f"to_{x}")) for x in "kv"], plan, counters)
        self.out2 = Gemm(a2.to_out[0].weight, a2.to_out[0].bias, *site(plan, f"{name}.attn2.to_out.0"), counters)
        self.image_len, self.kv_img = 0, None
        if a2.add_k_proj is not None:  # Wan 2.1 I2V
            self.image_len = int(getattr(a2.processor, "image_len", 0))
            if self.image_len <= 0:
                raise ModelError(f"{name}: an image-to-video Wan block needs its image token count; load the model "
                                 "through trt_sora's WanAdapter (it sets the processor's image_len)")
            self.kv_img = fused_gemm([(f"{name}.attn2.add_{x}_proj", getattr(a2, f"add_{x}_proj")) for x in "kv"],
                                      plan, counters)
            self.register_buffer("nki", a2.norm_added_k.weight.detach().to(torch.bfloat16), persistent=False)
            self.img_eps = a2.norm_added_k.eps
        ff = blk.ffn.net
        self.ff1 = Gemm(ff[0].proj.weight, ff[0].proj.bias, *site(plan, f"{name}.ffn.net.0.proj"), counters)
        self.ff2 = Gemm(ff[2].weight, ff[2].bias, *site(plan, f"{name}.ffn.net.2"), counters)
        for tag, mod in (("nq1", a1.norm_q), ("nk1", a1.norm_k), ("nq2", a2.norm_q), ("nk2", a2.norm_k)):
            self.register_buffer(tag, mod.weight.detach().to(torch.bfloat16), persistent=False)
        n2 = blk.norm2
        self.norm2_affine = isinstance(n2, torch.nn.LayerNorm) and n2.weight is not None
        self.register_buffer("n2w", n2.weight.detach().float() if self.norm2_affine else None, persistent=False)
        self.register_buffer("n2b", n2.bias.detach().float() if self.norm2_affine else None, persistent=False)
        self.fp8_attention = True
        self.attention_kernel = "int8"  # the 8-bit kernel (kernels.ops.ATTENTION_KERNELS); the runner sets it
        self.seq = None  # a trt_sora.parallel.SeqShard under Ulysses
        self.sparse = None  # a trt_sora.sparse.TileSparse: block-sparse self-attention; the runner sets it per call

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        x = hidden_states.to(torch.bfloat16).contiguous()
        mod = self.table + temb.float()  # [B, 6, C], or per token [B, S, 6, C] (TI2V)
        shift, scale, gate, c_shift, c_scale, c_gate = mod.unbind(-2)  # views the kernels read by stride
        cos, sin = (t.reshape(t.shape[1], -1).float().contiguous() for t in rotary_emb)  # all S tokens' rows
        fp8_attn = self.fp8_attention
        self.counters["fp8_attention" if fp8_attn else "bf16_attention"] = \
            self.counters.get("fp8_attention" if fp8_attn else "bf16_attention", 0) + 1
        # 1. self-attention
        _, y = ops.residual_norm_quant(x, mod_scale=scale, mod_shift=shift, eps=self.eps, act_scale=self.qkv.act_scale)
        att = ops.self_attention(self.qkv(y), self.nq1, self.nk1, cos, sin, self.heads, self.qk_eps, fp8=fp8_attn,
                                 out_scale=self.out1.act_scale, seq=self.seq, sparse=self.sparse,
                                 kernel=self.attention_kernel)
        # 2. cross-attention (text keys: short, cuDNN BF16)
        x, y = ops.residual_norm_quant(x, branch=self.out1(att), gate=gate, weight=self.n2w, bias=self.n2b,
                                       eps=self.eps, act_scale=self.q2.act_scale)
        att2 = self._cross_attention(y, encoder_hidden_states.to(torch.bfloat16))
        # 3. feed-forward
        x, y = ops.residual_norm_quant(x, branch=self.out2(att2), eps=self.eps, mod_scale=c_scale, mod_shift=c_shift,
                                       act_scale=self.ff1.act_scale)
        h = ops.gelu_quant(self.ff1(y), self.ff2.act_scale)
        return ops.gated_add(x, self.ff2(h), c_gate).to(hidden_states.dtype)

    def _cross_attention(self, y, ctx):
        """Queries from ``y`` over the text tokens (I2V: and over the leading image tokens, summed in
        bf16): the ``to_out`` input [B, S, C], FP8 at its scale (:func:`ops.cross_attention`)."""
        c = y.shape[-1]
        img, txt = ctx[:, :self.image_len], ctx[:, self.image_len:]
        q = self.q2(y)
        k, v = self.kv2(ops.quantize(txt, self.kv2.act_scale)).chunk(2, dim=-1)
        k = F.rms_norm(k, (c,), self.nk2, self.qk_eps)
        image = None
        if self.kv_img is not None:
            k_img, v_img = self.kv_img(ops.quantize(img, self.kv_img.act_scale)).chunk(2, dim=-1)
            image = (F.rms_norm(k_img, (c,), self.nki, self.img_eps), v_img)
        return ops.cross_attention(q, self.nq2, k, v, self.heads, self.qk_eps, self.out2.act_scale, ctx2=image)


def fuse_blocks(model, plan: Mapping[str, Any], counters: dict) -> list[FusedWanBlock]:
    """Replace every block of a loaded ``WanTransformer3DModel`` by a :class:`FusedWanBlock`
    (weights quantized once, the diffusers block freed as it goes: nothing here holds the blocks
    not yet rewritten, so the rewrite's peak is the model plus one block, not two models). Returns
    the new blocks."""
    out = []
    for i in range(len(model.blocks)):
        fb = FusedWanBlock(model.blocks[i], f"blocks.{i}", plan, counters)
        model.blocks[i] = fb
        out.append(fb)
    return out


def prepare(model, plan: Mapping[str, Any], *, fused: bool, counters: dict,
            fast_accum: bool = False) -> list[FusedWanBlock]:
    """Rewrite a loaded ``WanTransformer3DModel`` for the ``torch-fp8`` backend, in place.

    ``fused``: every block becomes a :class:`FusedWanBlock`; planned linears outside the blocks
    (a recipe may include ``proj_out``) become :class:`Fp8Linear`. Otherwise only the planned
    linears are swapped. The remaining parameters are cast to bf16, except diffusers'
    ``_keep_in_fp32_modules`` (time embedder, norms, AdaLN tables), as ``from_pretrained`` does.
    ``fast_accum``: every FP8 GEMM uses cuBLASLt's fast accumulation (:func:`trt_sora.kernels.ops.linear_fp8`).
    Returns the fused blocks (empty when not ``fused``).
    """
    blocks = fuse_blocks(model, plan, counters) if fused else []
    swap_linears(model, plan, counters)
    finish(model, fast_accum)
    return blocks
