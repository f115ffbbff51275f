"""The torch-fp8 block rewrite frees each diffusers block as it replaces it, so rewriting a model that
nearly fills the GPU never holds two copies of its weights (a 14B model is 28.6 GB in bf16)."""
from __future__ import annotations

import importlib
import weakref

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("model,module,fused,blocks", [
    ("wan-tiny", "trt_sora.models.wan_fp8", "FusedWanBlock", "blocks"),
    ("hunyuan-tiny", "trt_sora.models.hunyuan_fp8", "FusedHunyuanBlock", "transformer_blocks")])
def test_each_block_is_freed_before_the_next_is_rewritten(model, module, fused, blocks, monkeypatch):
    from trt_sora.models import get_adapter

    fam = importlib.import_module(module)
    net = get_adapter(model).load("fp32", "cpu")
    old = [weakref.ref(b) for b in getattr(net, blocks)]
    assert len(old) >= 2
    alive_at = []
    fused = getattr(fam, fused)

    class Probe(fused):
        def __init__(self, blk, *a, **kw):
            alive_at.append([r() is not None for r in old])
            super().__init__(blk, *a, **kw)

    monkeypatch.setattr(fam, fused.__name__, Probe)
    out = fam.fuse_blocks(net, {}, {})
    assert len(out) == len(old) and all(isinstance(b, Probe) for b in getattr(net, blocks))
    # rewriting block i: blocks before i are gone, i and after still in the model
    assert alive_at == [[j >= i for j in range(len(old))] for i in range(len(old))]
    assert all(r() is None for r in old)
