"""Precomputed prompt embeddings: written where asked (new folders included), read back by prompt."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_embeddings_round_trip_into_a_new_folder(tmp_path):
    from trt_sora.models.text import PrecomputedTextEncoder, save_embeddings

    emb = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "not" / "yet" / "there.safetensors"
    save_embeddings(["a cat", "a dog"], emb, path)
    got = PrecomputedTextEncoder(path)(["a dog", "a cat"], 7)
    assert torch.equal(got[0, :5], emb[1]) and torch.equal(got[1, :5], emb[0])
    assert not got[:, 5:].any() and [p.name for p in path.parent.iterdir()] == ["there.safetensors"]
