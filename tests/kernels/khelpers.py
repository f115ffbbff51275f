"""Checks the kernel tests share (imported by name: pytest puts this folder on ``sys.path``)."""
from __future__ import annotations

import torch

from trt_sora.kernels import reference as ref


def bits(x):
    """``x``'s raw bits (FP8 as bytes, bf16 as int16) for exact comparisons."""
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16) if x.element_size() == 2 else x


RESIDUAL_NORM_VARIANTS = ("mod", "residual_gate_affine", "residual_mod", "bf16_out")


def residual_norm_inputs(variant: str, b: int, s: int, c: int, g):
    """``(x, kwargs, act_scale)`` of one ``residual_norm_quant`` variant: bf16 ``x`` and branch [b, s, c],
    gates and modulation [b, c], LayerNorm weight and bias [c], drawn from ``g`` on its device."""
    dev = g.device
    x = torch.randn(b, s, c, device=dev, generator=g).to(torch.bfloat16)
    r = torch.randn(b, s, c, device=dev, generator=g).to(torch.bfloat16)
    gate, ms, mh = (torch.randn(b, c, device=dev, generator=g) * 0.3 for _ in range(3))
    w, bi = torch.randn(c, device=dev, generator=g), torch.randn(c, device=dev, generator=g)
    sc = torch.tensor(6.0 / 448, device=dev)
    kw = {"mod": dict(mod_scale=ms, mod_shift=mh, act_scale=sc),
          "residual_gate_affine": dict(branch=r, gate=gate, weight=w, bias=bi, act_scale=sc),
          "residual_mod": dict(branch=r, mod_scale=ms, mod_shift=mh, act_scale=sc),
          "bf16_out": dict(branch=r, gate=gate, mod_scale=ms, mod_shift=mh)}[variant]
    return x, kw, sc


def assert_qkv_epilogue_matches(ops, qkv, wq, wk, cos, sin, h: int) -> None:
    """``ops.qkv_rmsnorm_rope`` against the reference: the bf16 outputs within two bf16 roundings (norm,
    weight and the RoPE rotation round in turn), the 8-bit operands as :func:`assert_operands_match`
    holds them, Q within 2 INT8 steps, and V^T's padding past the tokens zeros."""
    for got, want in zip(ops.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False),
                         ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=False)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    ops8 = ops.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    ref8 = ref.qkv_rmsnorm_rope(qkv, wq, wk, cos, sin, h, fp8=True)
    s, vt8 = qkv.shape[1], ops8[4]
    assert_operands_match(ops8, ref8, s)
    assert (ops8[0].int() - ref8[0].int()).abs().max() <= 2
    assert not vt8[..., ref.vt_key_order(vt8.shape[-1]).to(vt8.device) >= s].float().any()


def assert_operands_match(got, want, s: int) -> None:
    """The QKV epilogue's 8-bit operands ``(q8, qs, k8, ks, vt8, vs)`` vs the reference's
    ``(q8, qs, k8, ks, v8, vs, k_mean)`` for ``s`` tokens: block scales from the fp32 tile vs the reference's
    bf16 tensor (2%), V's scale exact, K within 2 INT8 steps, V^T in the key order bit for bit."""
    _, qs, k8, ks, vt8, vs = got
    _, rqs, rk8, rks, rv8, rvs, _ = want
    torch.testing.assert_close(qs, rqs, rtol=2e-2, atol=0)
    torch.testing.assert_close(ks, rks, rtol=2e-2, atol=0)
    torch.testing.assert_close(vs, rvs, rtol=1e-6, atol=0)
    assert (k8.int() - rk8.int()).abs().max() <= 2
    assert torch.equal(bits(ref.vt_natural(vt8, s)), bits(rv8))


def run_attention(t, ops8, cfg, *, block_n=None, tma=False, blocks=None, key_len=None, out_scale=None):
    """``t._attn_fp8_kernel`` over the operands ``ops8`` with one autotuner config ``cfg`` (``.fn``: no
    autotuning, which would time configs on a GPU), into a NaN-filled output: bf16, or FP8 at ``out_scale``.
    ``block_n`` keys per tile (default the scale block); ``tma``: K / V^T through descriptors; ``blocks``
    ``(kidx, kcnt, krag)``: the sparse path; ``key_len``: the key-lengths path."""
    import triton

    q8, qs, k8, ks, vt8, vs = ops8
    b, h, s, d = q8.shape
    bn = block_n or t.SCALE_BLOCK
    fp8 = out_scale is not None
    o = torch.full((b, s, h * d), float("nan"), device=q8.device).to(ref.FP8 if fp8 else torch.bfloat16)
    k_arg, v_arg = t.kv_descriptors(k8, vt8, bn) if tma else (k8, vt8)
    kidx, kcnt, krag = blocks if blocks is not None else (qs, qs, qs)
    t._attn_fp8_kernel.fn[(triton.cdiv(s, cfg.kwargs["BLOCK_M"]), b * h)](
        q8, qs, k_arg, ks, v_arg, vs, o, out_scale if fp8 else o, s, vt8.shape[-1], h, qs.shape[-1],
        1.4426950408889634 / d ** 0.5, s.bit_length(), kidx, kcnt, krag, kidx.shape[-1] if blocks is not None else 0,
        key_len if key_len is not None else qs, D=d, OUT_FP8=fp8, SPARSE=blocks is not None,
        KEYS=key_len is not None, BLOCK_N=bn, TMA=tma, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **cfg.kwargs)
    return o

