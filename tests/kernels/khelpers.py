"""Checks the kernel tests share (imported by name: pytest puts this folder on ``sys.path``)."""
from __future__ import annotations

import torch

from trt_sora.kernels import reference as ref


def bits(x):
    """``x``'s raw bits (FP8 as bytes, bf16 as int16) for exact comparisons."""
    return x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16) if x.element_size() == 2 else x


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
