"""HunyuanVideo 1.5 (diffusers ``HunyuanVideo15Transformer3DModel``): text-to-video, 8.3B parameters.

Every fact of the family lives here: named configs, checkpoint loading, the inputs (the latents
with the image-conditioning channels concatenated, two text encoders' embeddings with their
masks, SigLIP image tokens), the export rewrites, the scheduler and the sampling settings users
run, the text conditioning, layer kinds, fusable projections, what must not be quantized, and the
latent decoder (``AutoencoderKLHunyuanVideo15``).

Export rewrites (the stock forward does not export; the rewritten one computes the same ``sample``):

* **one key-padding mask** instead of diffusers' per-sample reordering. The stock forward moves each
  sample's valid text tokens to the front with boolean indexing (data-dependent shapes, a Python
  loop over the batch) and masks query *and* key rows. Attention is permutation-equivariant over the
  text tokens (they carry no RoPE) and the video tokens only read valid keys, so concatenating the
  three streams as they are and masking only the keys gives the same video output - and no row is
  ever fully masked, so no NaN can reach a value tensor in ONNX Runtime or TensorRT;
* **text-to-video without a branch**: ``torch.all(image_embeds == 0)`` becomes a tensor that masks
  the image tokens (the stock ``if`` would bake the branch taken at trace time into the graph);
* **the token refiner** attends with the key-padding part of its ``[B, 1, L, L]`` query x key mask
  (whose padded query rows are fully masked: NaN);
* **RoPE from tables**: per-axis cos/sin tables (fp32, :data:`ROPE_MAX_POSITIONS` positions) sliced
  to the token grid, instead of ``arange`` + trigonometry in the graph (TensorRT cannot build the
  ``Range`` once the graph is fp16).

The graph inputs keep the diffusers names (``hidden_states`` [B, 2C+1, F, H, W], ``timestep`` [B],
``encoder_hidden_states`` [B, L, 3584] + ``encoder_attention_mask`` [B, L], ``encoder_hidden_states_2``
[B, L2, 1472] + ``encoder_attention_mask_2`` [B, L2], ``image_embeds`` [B, 729, 1152]); ``L`` is the
shared ``text_len`` dim, ``L2`` the family's own ``text_len_2`` (ByT5 glyph tokens, 256 in the
pipeline). Masks are float (1 = token, 0 = padding), as the diffusers pipeline passes them.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import ModelError, require
from trt_sora.models.base import LATENT_AXES, ModelAdapter, ModelSpec, StreamedDecoder, torch_dtype, transformer_folder

CLASS_NAME = "HunyuanVideo15Transformer3DModel"

_COMMON = dict(patch_size=1, patch_size_t=1, qk_norm="rms_norm", rope_theta=256.0, use_meanflow=False,
               num_refiner_layers=2, mlp_ratio=4.0)
_REAL = {**_COMMON, "in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128,
         "num_layers": 54, "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152,
         "rope_axes_dim": [16, 56, 56], "task_type": "t2v"}

#: Named architectures: the release transformers (tencent/HunyuanVideo-1.5, diffusers configs) and a
#: tiny one with every structural feature (refiner, ByT5 projection, image tokens, 3-axis RoPE).
CONFIGS: dict[str, dict[str, Any]] = {
    "hunyuan-tiny": {**_COMMON, "in_channels": 17, "out_channels": 8, "num_attention_heads": 2,
                     "attention_head_dim": 16, "num_layers": 2, "num_refiner_layers": 1, "mlp_ratio": 2.0,
                     "text_embed_dim": 32, "text_embed_2_dim": 24, "image_embed_dim": 16,
                     "rope_axes_dim": [4, 6, 6], "target_size": 64, "task_type": "t2v"},
    "hunyuanvideo-1.5-480p-t2v": {**_REAL, "target_size": 640},
    "hunyuanvideo-1.5-720p-t2v": {**_REAL, "target_size": 960},
}

#: RoPE positions per axis the export tables hold (latent frames / height / width after patching).
ROPE_MAX_POSITIONS = 1024

#: SigLIP image tokens (the pipeline's ``vision_num_semantic_tokens``).
IMAGE_LEN = 729

_TINY_BUCKET = [{"name": "tiny", "batch": [1, 2, 2], "latent_frames": [2, 3, 4], "latent_height": [4, 4, 8],
                 "latent_width": [4, 6, 8], "text_len": [4, 16, 16], "text_len_2": [2, 8, 8]}]

#: Sampling settings of the release (PIPELINE_CONFIGS of HunyuanVideo-1.5): 50 steps, CFG 6, flow
#: shift 5 at 480p and 9 at 720p, the pipeline's empty negative prompt.
DEFAULTS: dict[str, dict[str, Any]] = {
    "hunyuan-tiny": {"shift": 5.0, "guidance_scale": 6.0, "num_steps": 4, "calib_preset": "tiny", "image_len": 4,
                     "text_len_2": (1, 8, 16), "buckets": _TINY_BUCKET},
    "hunyuanvideo-1.5-480p-t2v": {"shift": 5.0, "guidance_scale": 6.0, "num_steps": 50, "image_len": IMAGE_LEN},
    "hunyuanvideo-1.5-720p-t2v": {"shift": 9.0, "guidance_scale": 6.0, "num_steps": 50, "image_len": IMAGE_LEN},
}
CHECKPOINT_DEFAULTS: dict[str, Any] = {"shift": 5.0, "guidance_scale": 6.0, "num_steps": 50, "image_len": IMAGE_LEN}

#: Linear paths inside a dual-stream block -> layer kind (the calibration report's groups).
LAYER_KINDS: dict[str, str] = {
    "attn.to_q": "attn.qkv", "attn.to_k": "attn.qkv", "attn.to_v": "attn.qkv", "attn.to_out.0": "attn.out",
    "attn.add_q_proj": "attn.text_qkv", "attn.add_k_proj": "attn.text_qkv", "attn.add_v_proj": "attn.text_qkv",
    "attn.to_add_out": "attn.text_out",
    "ff.net.0.proj": "ffn.up", "ff.net.2": "ffn.down",
    "ff_context.net.0.proj": "ffn_text.up", "ff_context.net.2": "ffn_text.down",
}

#: The video stream's Q/K/V read one tensor, the text stream's Q/K/V another: one GEMM each.
FUSABLE_PROJECTIONS = ((("to_q", "to_k", "to_v"), "to_qkv"),
                       (("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_qkv"))

#: Layers kept in high precision by default, ``{module pattern: reason}``, in match order (the quantize
#: stage, the calibration report and the fake-quant runners all apply them).
QUANT_EXCLUDES: dict[str, str] = {
    "x_embedder*": "patch embedding (first layer, sees raw latents)",
    "time_embed*": "timestep embedder",
    "*.norm1.linear": "AdaLN modulation",
    "*.norm1_context.linear": "AdaLN modulation",
    "norm_out.*": "final AdaLN modulation",
    "proj_out": "final projection (writes the predicted velocity/noise)",
    "context_embedder.*": "text token refiner (conditions every block; runs on <= 1000 text tokens)",
    "context_embedder_2.*": "ByT5 glyph projection (zeros for prompts without quoted text; <= 256 tokens)",
    "image_embedder.*": "SigLIP image projection (zeros in text-to-video)",
}


class HunyuanJointAttnProcessor:
    """``HunyuanVideo15AttnProcessor2_0`` for export: video Q/K/V (RMS-normed, RoPE) and text Q/K/V
    (RMS-normed) in one attention with a key-padding mask ``[B, 1, 1, S_video + L_text]`` (every video
    token valid, the text's from ``attention_mask`` [B, L_text] bool). Same math for every valid query;
    an ``observer(site, tensor)`` sees the joint Q, K, V (calibration)."""

    def __init__(self, observer: Callable[[str, Any], None] | None = None):
        self.observer = observer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        import torch
        import torch.nn.functional as F

        q, k, v = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = _rope(q, *image_rotary_emb), _rope(k, *image_rotary_emb)
        n_video = hidden_states.shape[1]
        eq = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        ek = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        ev = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], dim=1), torch.cat([k, ek], dim=1), torch.cat([v, ev], dim=1)
        if self.observer is not None:
            for site, t in (("q", q), ("k", k), ("v", v)):
                self.observer(site, t)
        keys = F.pad(attention_mask.bool(), (n_video, 0), value=True)[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=keys, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        video, text = out[:, :n_video], out[:, n_video:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)


class HunyuanRefinerAttnProcessor:
    """The token refiner's self-attention (diffusers ``Attention``, no QK norm). The stock refiner passes
    a query x key mask ``[B, 1, L, L]`` (valid query AND valid key) whose padded query rows are fully
    masked (NaN in SDPA); this processor attends with its key-padding part (``any`` over the queries:
    ``[B, 1, 1, L]``), the same for every valid token and finite for the padded ones (which the joint
    attention never reads)."""

    def __init__(self, observer: Callable[[str, Any], None] | None = None):
        self.observer = observer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **_):
        import torch.nn.functional as F

        q, k, v = (f(hidden_states).unflatten(2, (attn.heads, -1)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if self.observer is not None:
            for site, t in (("q", q), ("k", k), ("v", v)):
                self.observer(site, t)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attention_mask is not None and attention_mask.shape[-2] != 1:
            attention_mask = attention_mask.bool().any(dim=-2, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3).to(q.dtype)))


def _rope(x, cos, sin):
    """diffusers' ``apply_rotary_emb(use_real=True, sequence_dim=1)``: ``x`` [B, S, H, D], cos/sin [S, D]."""
    import torch

    re_, im = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-im, re_], dim=-1).flatten(3)
    return (x.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(x.dtype)


def _make_wrapper(model):
    """The export module: ``forward(<the seven inputs>) -> sample`` (see the module docstring)."""
    import torch
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    class HunyuanVideo15ForExport(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            cfg = inner.config
            # per-axis tables, as the stock RoPE computes them; buffers of the transformer itself (not of
            # this wrapper), so a weightless export finds their values among the model's buffers
            device = next(inner.parameters()).device
            device = torch.device("cpu") if device.type == "meta" else device
            for i, d in enumerate(cfg.rope_axes_dim):
                cos, sin = get_1d_rotary_pos_embed(int(d), torch.arange(ROPE_MAX_POSITIONS, dtype=torch.float32),
                                                   float(cfg.rope_theta), use_real=True)
                inner.register_buffer(f"export_rope_cos_{i}", cos.to(device), persistent=False)
                inner.register_buffer(f"export_rope_sin_{i}", sin.to(device), persistent=False)

        def _rope(self, f: int, h: int, w: int):
            """``(cos, sin)`` [f*h*w, D]: the stock ``HunyuanVideo15RotaryPosEmbed`` for an (f, h, w) token
            grid, sliced from fp32 tables (the stock one builds them from ``arange`` each call, which
            TensorRT cannot build once the graph is fp16)."""
            out = []
            for kind in ("cos", "sin"):
                parts = []
                for i, n in enumerate((f, h, w)):
                    t = getattr(self.inner, f"export_rope_{kind}_{i}")[:n]
                    shape = [1, 1, 1, t.shape[-1]]
                    shape[i] = n
                    parts.append(t.reshape(shape).expand(f, h, w, t.shape[-1]))
                out.append(torch.cat(parts, dim=-1).flatten(0, 2))
            return tuple(out)

        def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                    encoder_hidden_states_2, encoder_attention_mask_2, image_embeds):
            m = self.inner
            b, _, f, h, w = hidden_states.shape
            pt, ps = m.config.patch_size_t, m.config.patch_size
            rope = self._rope(f // pt, h // ps, w // ps)
            # the graph input stays fp32; the model embeds it in its own dtype, as diffusers' pipeline passes
            # it (`t.to(latents.dtype)`): an fp32 timestep would promote the bf16 text stream to fp32
            timestep = timestep.to(hidden_states.dtype)
            temb = m.time_embed(timestep)
            x = m.x_embedder(hidden_states)
            keys = encoder_attention_mask > 0.5
            keys_2 = encoder_attention_mask_2 > 0.5
            types = m.cond_type_embed(torch.arange(3, device=x.device))  # text, ByT5, image
            text = m.context_embedder(encoder_hidden_states, timestep, keys) + types[0]
            text_2 = m.context_embedder_2(encoder_hidden_states_2) + types[1]
            has_image = (image_embeds != 0).flatten().any()  # the stock `if torch.all(image_embeds == 0)`
            image = m.image_embedder(image_embeds) * has_image.to(x.dtype) + types[2]
            image_keys = has_image.reshape(1, 1).expand(b, image_embeds.shape[1])
            context = torch.cat([image, text_2, text], dim=1)
            context_keys = torch.cat([image_keys, keys_2, keys], dim=1)
            for blk in m.transformer_blocks:
                x, context = blk(x, context, temb, context_keys, rope)
            x = m.proj_out(m.norm_out(x, temb))
            x = x.reshape(b, f // pt, h // ps, w // ps, -1, pt, ps, ps).permute(0, 4, 1, 5, 2, 6, 3, 7)
            return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    return HunyuanVideo15ForExport(model)


class HunyuanTextEncoder:
    """Seeded stand-ins for HunyuanVideo 1.5's two text encoders (random-weight models): per-word hash
    embeddings for the MLLM (Qwen2.5-VL) stream and the ByT5 glyph stream, with the pipeline's masks:
    MLLM tokens = the prompt's words (at least one), ByT5 tokens = the characters of its quoted text
    (none - an all-zero, fully masked stream - when the prompt quotes nothing, as the pipeline does)."""

    def __init__(self, dim: int, dim_2: int, seed: int = 0):
        from trt_sora.models import text

        self.mllm = text.HashTextEncoder(dim, seed=seed)
        self.glyph = text.HashTextEncoder(dim_2, seed=seed + 1)

    @staticmethod
    def glyph_text(prompt: str) -> str:
        """The quoted text of a prompt (the pipeline's ``extract_glyph_texts``: "..." and '...')."""
        return " ".join(m.group(1) or m.group(2) for m in re.finditer(r'"([^"]*)"|\u201c([^\u201d]*)\u201d', prompt))

    def token_counts(self, prompts: list[str]) -> list[dict[str, int]]:
        """Tokens each prompt needs in each stream, uncut: its words, and its quoted characters + 1."""
        return [{"text_len": max(1, n["text_len"]), "text_len_2": len(g) + 1 if g else 0}
                for n, g in zip(self.mllm.token_counts(prompts), map(self.glyph_text, prompts))]

    def __call__(self, prompts: list[str], text_len: int, text_len_2: int) -> dict[str, Any]:
        import torch

        e = self.mllm(prompts, text_len).float()
        n = torch.tensor([min(text_len, max(1, len(p.split()))) for p in prompts])
        mask = (torch.arange(text_len)[None] < n[:, None]).float()
        glyphs = [self.glyph_text(p) for p in prompts]
        e2 = self.glyph([g or " " for g in glyphs], text_len_2).float()
        n2 = torch.tensor([min(text_len_2, len(g) + 1) if g else 0 for g in glyphs])
        mask_2 = (torch.arange(text_len_2)[None] < n2[:, None]).float()
        return {"encoder_hidden_states": e * mask[..., None], "encoder_attention_mask": mask,
                "encoder_hidden_states_2": e2 * mask_2[..., None], "encoder_attention_mask_2": mask_2}


class HunyuanVideo15Adapter(StreamedDecoder, ModelAdapter):
    family = "hunyuan"
    input_names = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                   "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds")
    mask_inputs = ("encoder_attention_mask", "encoder_attention_mask_2")
    layer_kinds = LAYER_KINDS
    fusable_projections = FUSABLE_PROJECTIONS
    quant_excludes = QUANT_EXCLUDES
    block_container = "transformer_blocks"

    # -- facts -------------------------------------------------------------------------------
    @property
    def family_dims(self) -> dict[str, tuple[int, int, int]]:
        """``text_len_2``: ByT5 glyph tokens (the pipeline pads them to 256)."""
        return {"text_len_2": tuple(self.spec.defaults.get("text_len_2", (1, 256, 256)))}

    @property
    def patch_size(self) -> tuple[int, int, int]:
        c = self.spec.config
        return (int(c["patch_size_t"]), int(c["patch_size"]), int(c["patch_size"]))

    @property
    def latent_channels(self) -> int:
        return int(self.spec.config["out_channels"])

    @property
    def in_channels(self) -> int:
        return int(self.spec.config["in_channels"])

    @property
    def text_dim(self) -> int:
        return int(self.spec.config["text_embed_dim"])

    @property
    def image_len(self) -> int:
        return int(self.spec.defaults.get("image_len", IMAGE_LEN))

    def _dims(self) -> dict[str, int]:
        c = self.spec.config
        return {"text_2": int(c["text_embed_2_dim"]), "image": int(c["image_embed_dim"])}

    # -- loading -----------------------------------------------------------------------------
    def _construct(self):
        diffusers = require("diffusers", extra="export")
        cls = getattr(diffusers, CLASS_NAME, None)
        if cls is None:
            raise ModelError(f"diffusers {diffusers.__version__} has no {CLASS_NAME}; install diffusers >= 0.36 "
                             "(trt_sora pins 0.42.1: pip install -e .[export])")
        return cls(**{k: v for k, v in self.spec.config.items() if not k.startswith("_")})

    def load(self, dtype: str = "fp32", device: str = "cpu"):
        """The transformer in ``dtype`` on ``device`` with the export processors: a checkpoint folder's
        weights, or the per-parameter random init of the config (:mod:`trt_sora.weights.random_init`:
        drawn on the CPU, the same on every device and in any loading order)."""
        tdtype = torch_dtype(dtype)
        if self.spec.source == "checkpoint":
            diffusers = require("diffusers", extra="export")
            try:
                model = getattr(diffusers, CLASS_NAME).from_pretrained(self.spec.path, torch_dtype=tdtype)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelError(f"cannot load a HunyuanVideo 1.5 transformer from {self.spec.path}: {exc}") from None
            _set_processors(model)
            return model.to(device).eval().requires_grad_(False)
        from trt_sora.weights.sources import materialize

        return materialize(self.load_empty(dtype), self.weight_source(), device).to(device)

    def load_empty(self, dtype: str = "fp32"):
        """The module :meth:`load` returns with every parameter on the meta device and buffers real (for
        tracing without weights and streamed loading)."""
        model = self._construct_empty()
        tdtype = torch_dtype(dtype)
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.data = t.data.to(tdtype)
        _set_processors(model)
        return model.eval().requires_grad_(False)

    @staticmethod
    def random_init_rule(name: str, shape: tuple, g):
        """Random init of the parameters outside ``nn.Linear`` / ``nn.Conv`` / ``nn.LayerNorm``: diffusers'
        ``RMSNorm`` weights (QK norms) are ones, the ``cond_type_embed`` table ``N(0, 1)`` (``nn.Embedding``)."""
        import torch

        if name.endswith("cond_type_embed.weight"):
            return torch.randn(shape, generator=g, dtype=torch.float32)
        if ".norm" in name and name.endswith(".weight"):
            return torch.ones(shape)
        return None

    # -- inputs ------------------------------------------------------------------------------
    def input_dims(self) -> dict[str, dict[int, str]]:
        return {"hidden_states": dict(LATENT_AXES), "timestep": {0: "batch"},
                "encoder_hidden_states": {0: "batch", 1: "text_len"},
                "encoder_attention_mask": {0: "batch", 1: "text_len"},
                "encoder_hidden_states_2": {0: "batch", 1: "text_len_2"},
                "encoder_attention_mask_2": {0: "batch", 1: "text_len_2"},
                "image_embeds": {0: "batch"}, "sample": dict(LATENT_AXES)}

    def fixed_axes(self) -> dict[str, dict[int, int]]:
        d = self._dims()
        return {"hidden_states": {1: self.in_channels}, "encoder_hidden_states": {2: self.text_dim},
                "encoder_hidden_states_2": {2: d["text_2"]}, "image_embeds": {1: self.image_len, 2: d["image"]}}

    def example_inputs(self, point: Mapping[str, int], *, dtype: str = "fp32", device: str = "cpu",
                       seed: int = 0):
        """Random inputs at ``point``: latents + zero image-conditioning channels, timestep [B] in
        [0, 1000), both text streams with masks (at least one MLLM token valid per sample; the first
        sample's ByT5 stream fully masked, as for a prompt without quoted text), zero image tokens
        (text-to-video)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        p = self.with_family_dims(point)
        b, f, h, w, l, l2 = (int(p[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width",
                                                  "text_len", "text_len_2"))
        td, d = torch_dtype(dtype), self._dims()
        x = torch.cat([torch.randn(b, self.latent_channels, f, h, w, generator=g),
                       torch.zeros(b, self.in_channels - self.latent_channels, f, h, w)], dim=1)
        n = torch.randint(1, l + 1, (b,), generator=g)
        n2 = torch.randint(0, l2 + 1, (b,), generator=g)
        n2[0] = 0
        mask = (torch.arange(l)[None] < n[:, None]).float()
        mask_2 = (torch.arange(l2)[None] < n2[:, None]).float()
        return {"hidden_states": x.to(device, td),
                "timestep": (torch.rand(b, generator=g) * 999.0).to(device, torch.float32),
                "encoder_hidden_states": torch.randn(b, l, self.text_dim, generator=g).to(device, td),
                "encoder_attention_mask": mask.to(device, td),
                "encoder_hidden_states_2": torch.randn(b, l2, d["text_2"], generator=g).to(device, td),
                "encoder_attention_mask_2": mask_2.to(device, td),
                "image_embeds": torch.zeros(b, self.image_len, d["image"]).to(device, td)}

    def export_module(self, model):
        return _make_wrapper(model)

    # -- torch-fp8 ---------------------------------------------------------------------------
    def torch_fp8_rewrite(self):
        """Dual-stream blocks on FP8 GEMMs and fused kernels (:func:`trt_sora.models.hunyuan_fp8.prepare`)."""
        from trt_sora.models import hunyuan_fp8

        return hunyuan_fp8.prepare

    def attention_keys_all_valid(self, inputs) -> bool:
        """The joint attention's keys are the video tokens, the image tokens (masked unless some
        ``image_embeds`` is nonzero, as the export forward does) and both text streams (their masks)."""
        has_image = bool((inputs["image_embeds"] != 0).any())
        return has_image and all(bool((inputs[m] > 0.5).all()) for m in self.mask_inputs)

    # -- conditioning ------------------------------------------------------------------------
    def model_inputs(self, latents, timestep, conditioning):
        """``hidden_states`` = latents + ``latent_condition`` (image latents and their mask; zeros in
        text-to-video, as ``HunyuanVideo15Pipeline.prepare_cond_latents_and_mask``)."""
        import torch

        cond = dict(conditioning)
        lc = cond.pop("latent_condition", None)
        if lc is None:
            raise ModelError(f"{self.name}: its conditioning needs 'latent_condition' (adapter.image_conditioning)")
        return {"hidden_states": torch.cat([latents, lc.to(latents.dtype)], dim=1), "timestep": timestep, **cond}

    def image_conditioning(self, point: Mapping[str, int], *, seed: int = 0, images=None):
        """Text-to-video: zero condition latents + mask (``2C + 1 - C`` channels) and zero image tokens."""
        import torch

        if images is not None:
            raise ModelError(f"{self.name} is text-to-video; image-to-video HunyuanVideo 1.5 is not wired in yet")
        b, f, h, w = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width"))
        return {"latent_condition": torch.zeros(b, self.in_channels - self.latent_channels, f, h, w),
                "image_embeds": torch.zeros(b, self.image_len, self._dims()["image"])}

    def text_conditioning(self, encode, prompts, point):
        p = self.with_family_dims(point)
        return encode(list(prompts), int(p["text_len"]), int(p["text_len_2"]))

    def text_encoder(self, source: str | None = None, device=None):
        """``"hash"`` (the default of named random-weight models): seeded stand-ins with the pipeline's
        masks (:class:`HunyuanTextEncoder`)."""
        source = source or self.spec.text_encoder or "hash"
        if source != "hash":
            raise ModelError(f"{self.name}: HunyuanVideo 1.5's text encoders (Qwen2.5-VL-7B + ByT5) are not wired "
                             f"into trt_sora yet (asked for {source!r}); use text_encoder='hash'")
        d = self._dims()
        return HunyuanTextEncoder(self.text_dim, d["text_2"], seed=self.spec.seed)

    # -- sampling ----------------------------------------------------------------------------
    def scheduler(self, shift: float | None = None):
        return make_scheduler(self.sampling.shift if shift is None else shift)

    def vae(self):
        """``(vae, description)``: ``AutoencoderKLHunyuanVideo15`` from the checkpoint's ``vae/`` (fp32,
        eval), else a small seeded one; loaded once per adapter."""
        return self._once("_vae", self._load_vae)

    def _load_vae(self):
        import torch

        diffusers = require("diffusers", extra="export")
        cls = diffusers.AutoencoderKLHunyuanVideo15
        vae, desc = None, ""
        if self.spec.path:
            for cand in (Path(self.spec.path).parent / "vae", Path(self.spec.path) / "vae"):
                if (cand / "config.json").is_file():
                    vae, desc = cls.from_pretrained(str(cand), torch_dtype=torch.float32), f"{cls.__name__} from {cand}"
                    break
        if vae is None:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                vae = cls(latent_channels=self.latent_channels, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1)
            desc = f"random tiny {cls.__name__} (seed 0; no VAE weights with this model)"
        return vae.eval().requires_grad_(False), desc

    def frame_decoder(self, device=None, dtype=None):
        """Latents -> frames through :meth:`vae` (latents / ``scaling_factor``, as the pipeline) on
        ``device`` in ``dtype``, yielded latent frame by latent frame as :func:`causal_decode` makes
        them (1 pixel frame, then 4 a latent frame)."""
        import torch

        vae, desc = self.vae_on(device, dtype)
        scale = float(vae.config.scaling_factor)
        dtype = dtype or torch.float32

        def decode_groups(z):
            with torch.inference_mode():
                z = (z.to(device=device, dtype=torch.float32) / scale).to(dtype)
            yield from causal_decode(vae, z)

        return decode_groups, desc

    @property
    def vae_scale(self) -> tuple[int, int]:
        """``AutoencoderKLHunyuanVideo15``: 4x in time, 16x in space."""
        return (4, 16)

    @property
    def fps(self) -> float:
        """The release samples at 24 fps (121 frames)."""
        return float(self.spec.defaults.get("fps", 24))

    @property
    def num_heads(self) -> int:
        return int(self.spec.config["num_attention_heads"])


def causal_decode(vae, z):
    """``AutoencoderKLHunyuanVideo15.decode(z)`` one latent frame at a time: yields the frames
    ``[B, 3, f, H, W]`` fp32 in ``[-1, 1]`` of each latent frame (1, then 4) as it is decoded. The
    decoder is causal in time (front-padded convolutions, frame-causal attention): its input
    convolution and mid block (the attention) run once over every latent frame, then the up blocks
    run frame by frame, each causal convolution prepending the last input frames it saw. The same
    operations in fp32, summed in another order where a kernel picks its algorithm by size (ATen's
    convolution backend, a vectorised elementwise loop's tail), so equal to ``decode`` within fp32
    rounding, not bit for bit. A tiled or sliced decode is one group (``vae.decode``)."""
    import torch

    h, w = z.shape[-2:]
    if (vae.use_tiling and (w > vae.tile_latent_min_width or h > vae.tile_latent_min_height)) \
            or (vae.use_slicing and z.shape[0] > 1):
        with torch.inference_mode():
            yield vae.decode(z, return_dict=False)[0].float().clamp(-1, 1)
        return
    d, seen = vae.decoder, {}  # seen: each causal convolution's last padded input frames
    with torch.inference_mode():
        x = d.mid_block(d.conv_in(z) + z.repeat_interleave(repeats=d.repeat, dim=1))
    for i in range(z.shape[2]):
        with torch.inference_mode():
            h = x[:, :, i:i + 1]
            for block in d.up_blocks:
                for resnet in block.resnets:
                    h = _resnet(resnet, h, seen)
                for up in block.upsamplers or ():
                    h = _upsample(up, h, seen, first=i == 0)
            h = _causal_conv(d.conv_out, d.conv_act(d.norm_out(h)), seen)
        yield h.float().clamp(-1, 1)


def _causal_conv(conv, x, seen: dict):
    """``HunyuanVideo15CausalConv3d(x)`` for frames that follow those it saw last (``seen``): the
    first group is front-padded by replicating its first frame, a later one by the frames before it."""
    import torch
    import torch.nn.functional as F

    pad = conv.time_causal_padding  # (w, w, h, h, frames before, 0)
    prev = seen.get(id(conv))
    x = F.pad(x, pad if prev is None else (*pad[:4], 0, 0), mode=conv.pad_mode)
    if prev is not None:
        x = torch.cat([prev, x], dim=2)
    seen[id(conv)] = x[:, :, x.shape[2] - pad[4]:]
    return conv.conv(x)


def _resnet(block, x, seen: dict):
    """``HunyuanVideo15ResnetBlock(x)`` through :func:`_causal_conv`."""
    h = _causal_conv(block.conv1, block.nonlinearity(block.norm1(x)), seen)
    h = _causal_conv(block.conv2, block.nonlinearity(block.norm2(h)), seen)
    return h + (x if block.conv_shortcut is None else block.conv_shortcut(x))


def _upsample(up, x, seen: dict, first: bool):
    """``HunyuanVideo15Upsample(x)`` through :func:`_causal_conv`; with temporal upsampling only the
    clip's first frame stays one frame (``first``), every later one becomes two."""
    import torch

    h, rearrange = _causal_conv(up.conv, x, seen), up._dcae_upsample_rearrange
    if not up.add_temporal_upsample:
        return rearrange(h, r1=1, r2=2, r3=2) + rearrange(x.repeat_interleave(repeats=up.repeats, dim=1),
                                                          r1=1, r2=2, r3=2)
    h_next = rearrange(h[:, :, int(first):], r1=2, r2=2, r3=2)
    x_next = rearrange(x[:, :, int(first):], r1=2, r2=2, r3=2).repeat_interleave(repeats=up.repeats, dim=1)
    if not first:
        return h_next + x_next
    h_first = rearrange(h[:, :, :1], r1=1, r2=2, r3=2)
    x_first = rearrange(x[:, :, :1], r1=1, r2=2, r3=2).repeat_interleave(repeats=up.repeats // 2, dim=1)
    return torch.cat([h_first[:, :h_first.shape[1] // 2], h_next], dim=2) + torch.cat([x_first, x_next], dim=2)


def _set_processors(model) -> None:
    """One export processor per attention module (each observer hook knows its own site)."""
    procs = {}
    for name in model.attn_processors:
        procs[name] = HunyuanRefinerAttnProcessor() if ".token_refiner." in f".{name}" else HunyuanJointAttnProcessor()
    model.set_attn_processor(procs)


class _PipelineSigmas:
    """Mixin: ``set_timesteps(n)`` with the sigmas ``HunyuanVideo15Pipeline`` passes
    (``linspace(1, 0, n + 1)[:-1]``, then shifted), not the scheduler's own ``linspace(1, 1/1000, n)``."""

    def set_timesteps(self, num_inference_steps=None, device=None, **kw):
        import numpy as np

        if num_inference_steps is not None and "sigmas" not in kw and "timesteps" not in kw:
            kw["sigmas"] = np.linspace(1.0, 0.0, int(num_inference_steps) + 1)[:-1]
        return super().set_timesteps(num_inference_steps, device=device, **kw)


def make_scheduler(shift: float):
    """HunyuanVideo 1.5's sampler: flow-matching Euler with ``shift`` over the pipeline's sigmas."""
    diffusers = require("diffusers", extra="export")
    cls = type("HunyuanVideo15Scheduler", (_PipelineSigmas, diffusers.FlowMatchEulerDiscreteScheduler), {})
    return cls(num_train_timesteps=1000, shift=float(shift))


def spec_from_folder(ref: str, folder: Path) -> ModelSpec | None:
    """A ModelSpec for a HunyuanVideo 1.5 diffusers folder (pipeline root or ``transformer/``), or None."""
    found = transformer_folder(folder, CLASS_NAME)
    if found is None:
        return None
    cand, config = found
    shift = 9.0 if int(config.get("target_size", 640)) >= 960 else 5.0
    return ModelSpec(ref=ref, family="hunyuan", source="checkpoint", path=str(cand),
                     config={k: v for k, v in config.items() if not k.startswith("_")},
                     text_encoder="hash", defaults={**CHECKPOINT_DEFAULTS, "shift": shift})


def spec_from_record(entry: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a manifest's model entry when the checkpoint is not on this machine."""
    return ModelSpec(ref=entry.get("ref") or entry["path"], family="hunyuan", source="checkpoint",
                     config=dict(entry["config"]), path=entry["path"], text_encoder="hash",
                     defaults=dict(CHECKPOINT_DEFAULTS))


def named_specs() -> dict[str, ModelSpec]:
    """The registry entries of this family."""
    return {name: ModelSpec(ref=name, family="hunyuan", source="random-init", config=cfg, seed=0,
                            text_encoder="hash", defaults=DEFAULTS[name]) for name, cfg in CONFIGS.items()}


ADAPTER = HunyuanVideo15Adapter
