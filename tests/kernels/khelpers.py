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
