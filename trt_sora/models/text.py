"""Text encoders that produce ``[B, text_len, dim]`` float32 prompt embeddings.

Three sources, all local:
- ``HashTextEncoder``: deterministic, dependency-free; for random-weight test
  models (``wan-tiny``) so tests need no downloads.
- ``PrecomputedTextEncoder``: a safetensors file ``{"embeddings": [N, L, D]}`` with
  the prompts in its metadata; for servers/CI that must not load a 5B encoder.
- ``T5TextEncoder``: the pipeline's own UMT5/T5 encoder from a local folder.

Every encoder zero-pads after the prompt's tokens, as Wan's pipeline does. Encoders that can count
a prompt's tokens have ``token_counts(prompts) -> [{text dim: tokens}]`` (the runtime refuses a
prompt longer than the clip's text dims unless the request asks to truncate it); a precomputed
file cannot, and cuts silently.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from trt_sora.errors import ModelError, require


class HashTextEncoder:
    """Words -> stable hashed ids -> fixed random table (seeded). Not a language model."""

    def __init__(self, dim: int, *, vocab: int = 4096, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.vocab = vocab
        self.table = torch.randn(vocab, dim, generator=g) / dim**0.5

    def _ids(self, prompt: str) -> list[int]:
        words = re.findall(r"\w+|[^\w\s]", prompt.lower())
        return [int.from_bytes(hashlib.sha1(w.encode()).digest()[:4], "little") % self.vocab for w in words]

    def token_counts(self, prompts: list[str]) -> list[dict[str, int]]:
        """Tokens each prompt needs, uncut (``{"text_len": n}``)."""
        return [{"text_len": len(self._ids(p))} for p in prompts]

    def __call__(self, prompts: list[str], text_len: int):
        import torch

        out = torch.zeros(len(prompts), text_len, self.dim)
        for i, p in enumerate(prompts):
            ids = self._ids(p)[:text_len]
            if ids:
                out[i, : len(ids)] = self.table[torch.tensor(ids)]
        return out


class PrecomputedTextEncoder:
    """Looks prompts up in a safetensors file written by :func:`save_embeddings`."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ModelError(f"embedding file {path} does not exist; write one with "
                             "trt_sora.models.text.save_embeddings(prompts, embeddings, path)")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            self.emb = f.get_tensor("embeddings").float()
        self.index = {p: i for i, p in enumerate(json.loads(meta.get("prompts", "[]")))}

    def __call__(self, prompts: list[str], text_len: int):
        import torch

        missing = [p for p in prompts if p not in self.index]
        if missing:
            raise ModelError(f"{len(missing)} prompt(s) have no precomputed embedding (first: {missing[0]!r}); "
                             "recompute the embedding file for this prompt set")
        out = torch.zeros(len(prompts), text_len, self.emb.shape[-1])
        for i, p in enumerate(prompts):
            e = self.emb[self.index[p]]
            n = min(text_len, e.shape[0])
            out[i, :n] = e[:n]
        return out


def save_embeddings(prompts: list[str], embeddings, path: str | Path) -> None:
    """Write ``embeddings`` ``[N, L, D]`` for ``prompts`` (atomic; missing folders are made)."""
    import os

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({"embeddings": embeddings.contiguous().float()}, str(tmp), metadata={"prompts": json.dumps(prompts)})
    os.replace(tmp, path)


class T5TextEncoder:
    """The pipeline's (U)MT5 encoder from a local diffusers pipeline folder (bf16 on a GPU, fp32 on
    the CPU); embeddings come back fp32 on the CPU."""

    def __init__(self, folder: str | Path, *, device: str = "cpu"):
        transformers = require("transformers", extra="export")
        folder = Path(folder)
        enc_dir, tok_dir = folder / "text_encoder", folder / "tokenizer"
        if not enc_dir.is_dir() or not tok_dir.is_dir():
            raise ModelError(f"{folder} has no text_encoder/ and tokenizer/ subfolders; pass a diffusers pipeline "
                             "root or a precomputed embedding file (--text-embeddings)")
        import torch

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32  # the pipeline's GPU dtype
        self.model = transformers.UMT5EncoderModel.from_pretrained(str(enc_dir), torch_dtype=dtype).to(device).eval()
        self.device = device

    def token_counts(self, prompts: list[str]) -> list[dict[str, int]]:
        """Tokens each prompt needs, uncut, with the end token (``{"text_len": n}``)."""
        return [{"text_len": len(ids)} for ids in self.tokenizer(list(prompts), add_special_tokens=True).input_ids]

    def __call__(self, prompts: list[str], text_len: int):
        import torch

        tok = self.tokenizer(prompts, padding="max_length", max_length=text_len, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        with torch.no_grad():
            h = self.model(tok.input_ids.to(self.device), tok.attention_mask.to(self.device)).last_hidden_state
        return (h.float().cpu() * tok.attention_mask[..., None]).contiguous()
