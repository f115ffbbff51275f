"""The plugin oracle equals the model's own attention on the same weights."""
import importlib.util
from pathlib import Path

import torch

REF = Path(__file__).resolve().parents[2] / "plugins" / "fused_qkv_attention" / "reference.py"


def _load_reference():
    spec = importlib.util.spec_from_file_location("fused_qkv_reference", REF)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_matches_wan_self_attention(tiny_adapter, tiny_model):
    ref = _load_reference()
    attn = tiny_model.blocks[0].attn1
    x = torch.randn(2, 3 * 4 * 6 // 4, attn.to_q.in_features)
    hs = tiny_adapter.example_inputs({"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6,
                                      "text_len": 2})["hidden_states"]
    cos, sin = tiny_model.rope(hs)  # [1, S, 1, D]
    expected = attn(x, None, None, (cos, sin))  # the model's processor incl. to_out
    qkv = torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x)], -1)
    got = ref.fused_qkv_attention(qkv, attn.norm_q.weight, attn.norm_k.weight, cos[0, :, 0].float(),
                                  sin[0, :, 0].float(), attn.heads, attn.norm_q.eps)
    got = attn.to_out[0](got)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
