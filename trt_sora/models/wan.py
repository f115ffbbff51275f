"""Wan 2.x (diffusers ``WanTransformer3DModel``; SkyReels-V2 shares it): text-to-video (2.1), image-to-video
(2.1 I2V: CLIP image tokens through added K/V projections, image latents concatenated on the channel
axis), Wan 2.2 TI2V-5B (48-channel latents, a timestep per latent frame -> per-token timestep
embedding) and Wan 2.2 A14B (two transformers, high-noise and low-noise experts switched at a
timestep boundary).

Model facts live here and nowhere else: named configs, checkpoint loading,
input names and dims, the export-friendly attention processor, the scheduler
(flow matching with shift) and the sampling settings users run, the text
encoder, the image conditioning, layer kinds, fusable projections and the
latent decoder (Wan VAE; Wan 2.2's 48-channel VAE for TI2V).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import ModelError, require
from trt_sora.models.base import LATENT_AXES, ModelAdapter, ModelSpec, StreamedDecoder, torch_dtype, transformer_folder

CLASS_NAME = "WanTransformer3DModel"

_COMMON = dict(
    patch_size=[1, 2, 2], in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024, pos_embed_seq_len=None,
)

_TINY = {**_COMMON, "num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 64, "freq_dim": 32,
         "ffn_dim": 128, "num_layers": 2}
_14B = {**_COMMON, "num_attention_heads": 40, "attention_head_dim": 128, "text_dim": 4096, "ffn_dim": 13824,
        "num_layers": 40}

#: Named architectures. Real sizes come from the Wan 2.1 / 2.2 release configs (the diffusers repos'
#: ``transformer/config.json``); the tiny ones keep every structural feature at test size.
CONFIGS: dict[str, dict[str, Any]] = {
    "wan-tiny": _TINY,
    "wan2.1-t2v-1.3b": {**_COMMON, "num_attention_heads": 12, "attention_head_dim": 128, "text_dim": 4096,
                        "ffn_dim": 8960, "num_layers": 30},
    "wan2.1-t2v-14b": _14B,
    # image-to-video: 16 noise + 4 mask + 16 image-latent channels in, CLIP ViT-H tokens [257, 1280]
    # through added K/V projections in every cross-attention
    "wan-i2v-tiny": {**_TINY, "in_channels": 36, "image_dim": 24, "added_kv_proj_dim": 64},
    "wan2.1-i2v-14b": {**_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    # Wan 2.2 TI2V-5B: 48-channel latents of the Wan 2.2 VAE (16x spatial), timestep per token
    "wan-ti2v-tiny": {**_TINY, "in_channels": 48, "out_channels": 48},
    "wan2.2-ti2v-5b": {**_COMMON, "in_channels": 48, "out_channels": 48, "num_attention_heads": 24,
                       "attention_head_dim": 128, "text_dim": 4096, "ffn_dim": 14336, "num_layers": 30},
    # Wan 2.2 A14B: two Wan 2.1-14B-shaped transformers (high-noise expert, low-noise expert)
    "wan-a14b-tiny": _TINY,
    "wan2.2-t2v-a14b": _14B,
}

#: Tokens of the CLIP image embedding of Wan 2.1 I2V (ViT-H/14 at 224 px: 16 x 16 patches + class).
IMAGE_LEN = 257

#: Channels of the mask Wan 2.1 I2V puts before the image latents (one per pixel frame of a latent frame).
I2V_MASK_CHANNELS = 4

#: Linear paths inside a transformer block -> layer kind (diffusers' Wan naming).
LAYER_KINDS: dict[str, str] = {
    "attn1.to_q": "attn1.qkv", "attn1.to_k": "attn1.qkv", "attn1.to_v": "attn1.qkv",
    "attn1.to_out.0": "attn1.out",
    "attn2.to_q": "attn2.q", "attn2.to_k": "attn2.kv", "attn2.to_v": "attn2.kv",
    "attn2.to_out.0": "attn2.out",
    "attn2.add_k_proj": "attn2.image_kv", "attn2.add_v_proj": "attn2.image_kv",
    "ffn.net.0.proj": "ffn.up", "ffn.net.2": "ffn.down",
}

#: Self-attention Q/K/V read the block's hidden states, cross-attention K/V the text: one GEMM each.
#: Image-to-video cross-attention K/V over the image tokens (added projections): one GEMM too.
FUSABLE_PROJECTIONS = ((("to_q", "to_k", "to_v"), "to_qkv"), (("to_k", "to_v"), "to_kv"),
                       (("add_k_proj", "add_v_proj"), "to_added_kv"))

#: One small bucket for the tiny variants (one TensorRT profile keeps their CI builds short).
_TINY_BUCKET = [{"name": "tiny", "batch": [1, 2, 2], "latent_frames": [2, 3, 4], "latent_height": [4, 4, 8],
                 "latent_width": [4, 6, 8], "text_len": [4, 16, 16]}]

#: Sampling defaults per named config (Wan 2.1's release: 50 steps, CFG 5, shift 3.0 at 480p, 5.0 at 720p).
DEFAULTS: dict[str, dict[str, Any]] = {
    # A random-weight test model cannot run at 480p on a CI CPU: it declares its own small buckets,
    # which replace a recipe's production buckets (the build report says so).
    "wan-tiny": {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 4, "calib_preset": "tiny", "buckets": [
        {"name": "tiny-small", "batch": [1, 2, 2], "latent_frames": [2, 3, 4], "latent_height": [4, 4, 8],
         "latent_width": [4, 6, 8], "text_len": [4, 16, 16]},
        {"name": "tiny-large", "batch": [1, 2, 2], "latent_frames": [4, 5, 8], "latent_height": [8, 8, 16],
         "latent_width": [8, 12, 16], "text_len": [4, 16, 32]},
    ]},
    "wan2.1-t2v-1.3b": {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 50},
    "wan2.1-t2v-14b": {"shift": 5.0, "guidance_scale": 5.0, "num_steps": 50},
    # Wan 2.1 I2V (generate.py): 40 steps, CFG 5, shift 3.0 at 480p (5.0 at 720p)
    "wan-i2v-tiny": {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 4, "calib_preset": "tiny", "image_len": 5,
                     "buckets": _TINY_BUCKET},
    "wan2.1-i2v-14b": {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 40, "image_len": IMAGE_LEN},
    # Wan 2.2 TI2V-5B (wan_ti2v_5B.py): 50 steps, CFG 5, shift 5, 121 frames at 24 fps, 704x1280
    "wan-ti2v-tiny": {"shift": 5.0, "guidance_scale": 5.0, "num_steps": 4, "calib_preset": "tiny",
                      "expand_timesteps": True, "vae": "wan2.2", "fps": 24, "buckets": _TINY_BUCKET},
    "wan2.2-ti2v-5b": {"shift": 5.0, "guidance_scale": 5.0, "num_steps": 50, "expand_timesteps": True,
                       "vae": "wan2.2", "fps": 24},
    # Wan 2.2 T2V A14B (wan_t2v_A14B.py): 40 steps, shift 12, boundary 0.875, CFG 4.0 high-noise / 3.0 low-noise
    "wan-a14b-tiny": {"shift": 12.0, "guidance_scale": 4.0, "guidance_scale_2": 3.0, "boundary_ratio": 0.875,
                      "num_steps": 6, "calib_preset": "tiny", "expert_seeds": {"high": 0, "low": 1},
                      "buckets": _TINY_BUCKET},
    "wan2.2-t2v-a14b": {"shift": 12.0, "guidance_scale": 4.0, "guidance_scale_2": 3.0, "boundary_ratio": 0.875,
                        "num_steps": 40, "expert_seeds": {"high": 0, "low": 1}},
}

#: Experts in sampling order (high-noise first).
EXPERTS_ORDER = ("high", "low")

#: The experts of Wan 2.2 A14B and the diffusers pipeline folder holding each (``boundary_ratio``: the
#: pipeline's ``model_index.json``): the high-noise expert serves ``t >= boundary_ratio * 1000``.
EXPERT_FOLDERS = {"high": "transformer", "low": "transformer_2"}

#: Sampling defaults of a diffusers Wan checkpoint folder (Wan 2.1 480p: 50 steps, CFG 5, shift 3).
CHECKPOINT_DEFAULTS: dict[str, Any] = {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 50}


class WanExportAttnProcessor:
    """``WanAttnProcessor`` rewritten for ONNX/TensorRT (text-to-video and image-to-video).

    Same math as diffusers' processor. Differences: RoPE is computed with
    ``stack`` + ``flatten`` instead of strided in-place writes (no ScatterND in
    the graph), attention is a plain ``scaled_dot_product_attention`` on
    ``[B, H, S, D]`` (TensorRT fuses MatMul-Softmax-MatMul into one kernel), the
    image tokens of an image-to-video cross-attention are the context's first
    ``image_len`` tokens (diffusers assumes 512 text tokens, which bakes the text
    length into the graph), and an optional ``observer(site, tensor)`` sees Q, K,
    V after norm + RoPE so calibration can measure the attention inputs.
    """

    def __init__(self, observer: Callable[[str, Any], None] | None = None, image_len: int = 0):
        self.observer = observer
        self.seq = None  # a trt_sora.parallel.SeqShard under Ulysses (self-attention only)
        self.sparse = None  # trt_sora.sparse's seam: the self-attention as sparse(q, k, v) [B, H, S, D]
        self.image_len = int(image_len)  # image-to-video: leading image tokens of the cross-attention context

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        import torch.nn.functional as F

        image = None
        if attn.add_k_proj is not None:
            if encoder_hidden_states is None or self.image_len <= 0:
                raise ModelError("an image-to-video Wan cross-attention needs the image tokens: load the model "
                                 "through trt_sora's WanAdapter (it sets the processor's image_len)")
            image = encoder_hidden_states[:, :self.image_len]
            encoder_hidden_states = encoder_hidden_states[:, self.image_len:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if getattr(attn, "fused_projections", False):
            if encoder_hidden_states is None:
                q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            else:
                q = attn.to_q(hidden_states)
                k, v = attn.to_kv(context).chunk(2, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # [B, S, H, D]
        seq = self.seq if encoder_hidden_states is None else None
        if rotary_emb is not None:
            cos, sin = rotary_emb if seq is None else (seq.local_slice(t) for t in rotary_emb)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.observer is not None:
            for site, t in (("q", q), ("k", k), ("v", v)):
                self.observer(site, t)
        heads = attn.heads
        if seq is not None:  # Ulysses: this rank's tokens x all heads -> all tokens x its heads
            d = q.shape[-1]
            heads //= seq.size
            q, k, v = (seq.tokens_to_heads(t.flatten(2)).unflatten(2, (heads, d)) for t in (q, k, v))
        qt = q.transpose(1, 2)
        if self.sparse is not None and encoder_hidden_states is None:
            out = self.sparse(qt, k.transpose(1, 2), v.transpose(1, 2))
        else:
            out = F.scaled_dot_product_attention(qt, k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask,
                                                 dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        if image is not None:  # image-to-video: the same queries over the image tokens, summed
            k_i = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
            v_i = attn.add_v_proj(image).unflatten(2, (attn.heads, -1))
            out_i = F.scaled_dot_product_attention(qt, k_i.transpose(1, 2), v_i.transpose(1, 2), dropout_p=0.0,
                                                   is_causal=False)
            out = out + out_i.transpose(1, 2).flatten(2, 3).type_as(q)
        if seq is not None:
            out = seq.heads_to_tokens(out)
        return attn.to_out[1](attn.to_out[0](out))


def _rope(x, cos, sin):
    """Interleaved-pair RoPE: ``x`` [B, S, H, D], ``cos``/``sin`` [1, S, 1, D] (pairs repeated)."""
    import torch

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def _make_wrapper(model, *, image: bool = False, frame_timesteps: bool = False):
    """The export module: ``forward(hidden_states, timestep, encoder_hidden_states[,
    encoder_hidden_states_image]) -> sample``; timestep stays fp32. ``frame_timesteps`` (Wan 2.2
    TI2V): ``timestep`` is ``[B, latent_frames]``, expanded here to the per-token ``[B, S]`` the
    transformer embeds (every token of a latent frame shares its frame's timestep)."""
    import torch

    class WanForExport(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.tokens_hw = tuple(int(p) for p in model.config.patch_size[1:])

        def _timestep(self, hidden_states, timestep):
            if not frame_timesteps:
                return timestep
            ph, pw = self.tokens_hw
            per = (hidden_states.shape[3] // ph) * (hidden_states.shape[4] // pw)
            return timestep.unsqueeze(-1).expand(-1, -1, per).flatten(1)

        def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None):
            return self.inner(hidden_states=hidden_states, timestep=self._timestep(hidden_states, timestep),
                              encoder_hidden_states=encoder_hidden_states,
                              encoder_hidden_states_image=encoder_hidden_states_image if image else None,
                              return_dict=False)[0]

    return WanForExport(model)


#: Layers kept in high precision by default, ``{module pattern: reason}``, in match order (the quantize
#: stage, the calibration report and the fake-quant runners all apply them).
QUANT_EXCLUDES: dict[str, str] = {
    "patch_embedding": "patch embedding (first layer, sees raw latents)",
    "patch_embedding.*": "patch embedding (first layer, sees raw latents)",
    "condition_embedder.time_embedder.*": "timestep embedder (runs on fp32 sinusoids)",
    "condition_embedder.time_proj": "AdaLN modulation projection (scales every block)",
    "condition_embedder.text_embedder.*": "text embedder (conditions every cross-attention)",
    "condition_embedder.image_embedder.*": "image embedder (conditions every cross-attention)",
    "proj_out": "final projection (writes the predicted velocity/noise)",
}

#: The module filter ModelOpt's diffusers example applies to Wan (``filter_func_wan_video``; the calibration
#: report's peer row). Its Wan 2.2 A14B version also keeps blocks 0-2 and 37-39 (of 40) in high precision;
#: that block rule is specific to the 40-block model and is not applied to other depths.
MODELOPT_EXCLUDE = r".*(patch_embedding|condition_embedder|proj_out).*"


class WanAdapter(StreamedDecoder, ModelAdapter):
    family = "wan"
    layer_kinds = LAYER_KINDS
    fusable_projections = FUSABLE_PROJECTIONS
    quant_excludes = QUANT_EXCLUDES
    modelopt_exclude = MODELOPT_EXCLUDE

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if self.is_i2v:  # the CLIP image tokens are a fourth input
            self.input_names = (*ModelAdapter.input_names, "encoder_hidden_states_image")

    # -- facts -------------------------------------------------------------------------------
    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.spec.config["patch_size"])  # type: ignore[return-value]

    @property
    def latent_channels(self) -> int:
        """Channels of the latents (= the predicted velocity): ``out_channels``."""
        return int(self.spec.config.get("out_channels") or self.spec.config["in_channels"])

    @property
    def in_channels(self) -> int:
        """``hidden_states`` channels: the latents, plus mask + image latents for image-to-video."""
        return int(self.spec.config["in_channels"])

    @property
    def text_dim(self) -> int:
        return int(self.spec.config["text_dim"])

    @property
    def head_dim(self) -> int:
        return int(self.spec.config["attention_head_dim"])

    @property
    def is_i2v(self) -> bool:
        """Wan 2.1 image-to-video: CLIP image tokens (``image_dim``) and concatenated image latents."""
        return self.spec.config.get("image_dim") is not None

    @property
    def image_len(self) -> int:
        """CLIP image tokens per clip (257 for Wan 2.1 I2V)."""
        return int(self.spec.defaults.get("image_len", IMAGE_LEN)) if self.is_i2v else 0

    @property
    def frame_timesteps(self) -> bool:
        """Wan 2.2 TI2V: a timestep per latent frame (``timestep`` ``[B, latent_frames]``; the first
        frame of image-to-video gets 0), embedded per token."""
        return bool(self.spec.defaults.get("expand_timesteps"))

    def describe(self) -> dict:
        """The identity for manifests, plus the pipeline facts a checkpoint's ``model_index.json`` gave
        (so a run folder on a machine without the checkpoint still knows the pair / TI2V layout)."""
        out = super().describe()
        pipe = {k: self.spec.defaults[k] for k in ("boundary_ratio", "expand_timesteps") if self.spec.defaults.get(k)}
        if pipe:
            out["pipeline"] = pipe
        return out

    def torch_fp8_rewrite(self):
        """Wan blocks on FP8 GEMMs and fused kernels (:func:`trt_sora.models.wan_fp8.prepare`): text-to-video,
        Wan 2.1 I2V (image K/V), Wan 2.2 TI2V (per-token modulation) and each expert of a Wan 2.2 pair."""
        from trt_sora.models import wan_fp8

        return wan_fp8.prepare

    # -- experts (Wan 2.2 A14B) --------------------------------------------------------------------
    @property
    def experts(self) -> tuple[str, ...]:
        return tuple(EXPERT_FOLDERS) if self.spec.defaults.get("boundary_ratio") is not None else ()

    def expert(self, name: str) -> WanAdapter:
        """One expert's adapter: the high-noise (``transformer/``) or low-noise (``transformer_2/``)
        transformer, with the pair's sampling settings and its own weights (seed or folder)."""
        if name not in self.experts:
            raise ModelError(f"model {self.name} has no expert {name!r}; its experts are {list(self.experts)}")
        import dataclasses

        spec = self.spec
        if spec.source == "checkpoint":
            folder = Path(spec.path).parent / EXPERT_FOLDERS[name]
            return WanAdapter(dataclasses.replace(spec, path=str(folder), expert=name))
        seed = int((spec.defaults.get("expert_seeds") or {}).get(name, EXPERTS_ORDER.index(name)))
        return WanAdapter(dataclasses.replace(spec, seed=seed, expert=name))

    # -- loading -----------------------------------------------------------------------------------
    def _construct(self):
        diffusers = require("diffusers", extra="export")
        cfg = {k: v for k, v in self.spec.config.items() if not k.startswith("_")}
        return diffusers.WanTransformer3DModel(**cfg)

    def _one(self):
        if self.experts and not self.spec.expert:
            raise ModelError(f"model {self.name} is a pair of experts {list(self.experts)}; load one "
                             "(adapter.expert('high') / adapter.expert('low'))")

    def load(self, dtype: str = "fp32", device: str = "cpu"):
        """Load in ``dtype`` on ``device``. Random-init configs are built on the meta device first and
        given their per-parameter random weights (:mod:`trt_sora.weights.random_init`) straight in the
        target dtype, so a 14B model never needs fp32 host memory."""
        self._one()
        tdtype = torch_dtype(dtype)
        if self.spec.source == "checkpoint":
            require("diffusers", extra="export")
            require("accelerate", extra="export")
            from trt_sora.models import frame_embed

            try:
                # a stock checkpoint, or one with wan-shapes' absolute frame embedding (frame_embed.py)
                model = frame_embed.load(self.spec.path, tdtype)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelError(f"cannot load a Wan transformer from {self.spec.path}: {exc}") from None
            _exact_rope_tables(model)
            model = model.to(device)
            # one processor per attention module, so each one's observer hook knows its own site
            model.set_attn_processor({name: WanExportAttnProcessor(image_len=self.image_len)
                                  for name in model.attn_processors})
            return model.eval().requires_grad_(False)
        from trt_sora.weights.sources import materialize

        model = self.load_empty(dtype)
        return materialize(model, self.weight_source(), device).to(device)

    def load_empty(self, dtype: str = "fp32"):
        """The module :meth:`load` returns (same classes, dtypes, processors), with every parameter on the
        meta device and buffers (RoPE tables) real: for tracing without weights and streamed loading."""
        self._one()
        model = self._construct_empty()
        _exact_rope_tables(model)
        if self.spec.source == "checkpoint":
            from trt_sora.models import frame_embed

            if frame_embed.stored_weight_shape(self.spec.path) is not None:
                frame_embed.attach(model)
        _cast_keep_fp32(model, torch_dtype(dtype))
        model.set_attn_processor({name: WanExportAttnProcessor(image_len=self.image_len)
                                  for name in model.attn_processors})
        return model.eval().requires_grad_(False)

    @staticmethod
    def random_init_rule(name: str, shape: tuple, g):
        """Random init of Wan's own parameters: diffusers' ``randn / sqrt(dim)`` for the AdaLN tables.

        Every other parameter gets its module's ``reset_parameters`` distribution, drawn per parameter
        on the CPU (:mod:`trt_sora.weights.random_init`): the same config and seed give the same weights
        on every device and in any loading order, and a 14B model never needs more than one parameter
        in host memory."""
        import torch

        if name.endswith("scale_shift_table"):
            return torch.randn(shape, generator=g, dtype=torch.float32) / shape[-1] ** 0.5
        return None

    def input_dims(self) -> dict[str, dict[int, str]]:
        dims = {
            "hidden_states": dict(LATENT_AXES),
            "timestep": {0: "batch", 1: "latent_frames"} if self.frame_timesteps else {0: "batch"},
            "encoder_hidden_states": {0: "batch", 1: "text_len"},
            "sample": dict(LATENT_AXES),
        }
        if self.is_i2v:
            dims["encoder_hidden_states_image"] = {0: "batch"}
        return dims

    def fixed_axes(self) -> dict[str, dict[int, int]]:
        out = {"hidden_states": {1: self.in_channels}, "encoder_hidden_states": {2: self.text_dim}}
        if self.is_i2v:
            out["encoder_hidden_states_image"] = {1: self.image_len, 2: int(self.spec.config["image_dim"])}
        return out

    def example_inputs(self, point: Mapping[str, int], *, dtype: str = "fp32", device: str = "cpu",
                       seed: int = 0):
        """``hidden_states`` [B, in_channels, F, H, W] (dtype), ``timestep`` [B] fp32 in [0, 1000)
        (TI2V: [B, F], a different timestep per frame), ``encoder_hidden_states`` [B, L, text_dim]
        (dtype); image-to-video also ``encoder_hidden_states_image`` [B, image_len, image_dim]."""
        import torch

        g = torch.Generator().manual_seed(seed)
        b, f, h, w, l = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width",
                                                  "text_len"))
        td = torch_dtype(dtype)
        t_shape = (b, f) if self.frame_timesteps else (b,)
        out = {
            "hidden_states": torch.randn(b, self.in_channels, f, h, w, generator=g).to(device, td),
            "timestep": (torch.rand(t_shape, generator=g) * 999.0).to(device, torch.float32),
            "encoder_hidden_states": torch.randn(b, l, self.text_dim, generator=g).to(device, td),
        }
        if self.is_i2v:
            out["encoder_hidden_states_image"] = torch.randn(b, self.image_len, int(self.spec.config["image_dim"]),
                                                             generator=g).to(device, td)
        return out

    def export_module(self, model):
        return _make_wrapper(model, image=self.is_i2v, frame_timesteps=self.frame_timesteps)

    # -- conditioning (the one sampler's Conditioner) ------------------------------------------------
    def model_inputs(self, latents, timestep, conditioning):
        """Wan's inputs. Image-to-video: ``hidden_states`` = latents + ``latent_condition`` (mask
        and image latents, 20 channels) on the channel axis, as ``WanImageToVideoPipeline``.
        TI2V: a timestep per latent frame; with a ``first_frame`` (image-to-video), that frame's
        latents are the image's and its timestep is 0 (``expand_timesteps`` in diffusers)."""
        import torch

        cond = dict(conditioning)
        hidden = latents
        if self.is_i2v:
            if "latent_condition" not in cond:
                raise ModelError(f"{self.name} is image-to-video: its conditioning needs 'latent_condition' "
                                 "(adapter.image_conditioning)")
            hidden = torch.cat([latents, cond.pop("latent_condition").to(latents.dtype)], dim=1)
        if self.frame_timesteps:
            t = timestep.reshape(-1, 1).expand(-1, latents.shape[2]).clone()
            first = cond.pop("first_frame", None)
            if first is not None:
                hidden = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
                t[:, 0] = 0.0
            timestep = t
        return {"hidden_states": hidden, "timestep": timestep, **cond}

    def final_latents(self, latents, conditioning):
        """TI2V image-to-video: the given first frame replaces the denoised one (as diffusers does)."""
        first = conditioning.get("first_frame") if self.frame_timesteps else None
        if first is None:
            return latents
        import torch

        return torch.cat([first.to(latents.dtype).to(latents.device), latents[:, :, 1:]], dim=2)

    @property
    def image_input(self) -> str:
        """Wan 2.1 I2V needs an image; Wan 2.2 TI2V takes one optionally (its image mode); T2V none."""
        if self.is_i2v:
            return "required"
        return "optional" if self.frame_timesteps else "none"

    def image_conditioning(self, point: Mapping[str, int], *, seed: int = 0, images=None):
        """Image-to-video conditioning both CFG branches share, batch ``point["batch"]``.

        Wan 2.1 I2V: ``encoder_hidden_states_image`` [B, image_len, image_dim] (CLIP tokens) and
        ``latent_condition`` [B, 4 + C, F, H, W] (the first-frame mask, then the latents of the video
        "the image, then black frames", as ``WanImageToVideoPipeline``). Wan 2.2 TI2V with an image:
        ``first_frame`` [B, C, 1, H, W], the image's latents (see :meth:`model_inputs`).

        ``images``: fp32 ``[B, 3, height, width]`` in ``[-1, 1]`` at the clip's pixel size, encoded by
        the VAE (:meth:`vae`; latents normalised with its ``latents_mean`` / ``latents_std``) and the
        image encoder (:meth:`image_encoder`). Without ``images`` (calibration and parity of
        random-weight models): a seeded stand-in (unit-normal tokens and first-frame latents, zeros
        after); TI2V and text-to-video: ``{}`` (TI2V's text-to-video mode)."""
        if images is not None:
            return self._encode_images(point, images)
        if not self.is_i2v:
            return {}
        import torch

        g = torch.Generator().manual_seed(int(seed) + 7_919)
        b, f, h, w = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width"))
        tokens = torch.randn(b, self.image_len, int(self.spec.config["image_dim"]), generator=g)
        c_img = self.in_channels - self.latent_channels - I2V_MASK_CHANNELS
        mask = torch.zeros(b, I2V_MASK_CHANNELS, f, h, w)
        mask[:, :, 0] = 1.0
        lat = torch.zeros(b, c_img, f, h, w)
        lat[:, :, 0] = torch.randn(b, c_img, h, w, generator=g)
        return {"encoder_hidden_states_image": tokens, "latent_condition": torch.cat([mask, lat], dim=1)}

    def _encode_images(self, point: Mapping[str, int], images):
        import torch

        from trt_sora.errors import ShapeError

        if self.image_input == "none":
            raise ModelError(f"{self.name} is text-to-video: it takes no conditioning image; leave the image out")
        b, f, h, w = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width"))
        _, height, width = self.pixel_size(point)
        if tuple(images.shape) != (b, 3, height, width):
            raise ShapeError(f"{self.name}: conditioning images must be [{b}, 3, {height}, {width}] (the clip's size), "
                             f"got {tuple(images.shape)}")
        images = images.float()
        if self.frame_timesteps:  # Wan 2.2 TI2V: the image is the first latent frame (diffusers' expand_timesteps)
            return {"first_frame": self._vae_encode(images[:, :, None])}
        frames = (f - 1) * self.vae_scale[0] + 1
        video = torch.cat([images[:, :, None], images.new_zeros(b, 3, frames - 1, height, width)], dim=2)
        mask = torch.zeros(b, I2V_MASK_CHANNELS, f, h, w)
        mask[:, :, 0] = 1.0
        encode, _ = self.image_encoder()
        return {"encoder_hidden_states_image": encode(images),
                "latent_condition": torch.cat([mask, self._vae_encode(video)], dim=1)}

    def _vae_encode(self, video):
        """Normalised VAE latents (the distribution's mode, ``(z - mean) / std``) of ``video``
        [B, 3, F, H, W] in [-1, 1], one clip at a time (so a clip does not depend on its batch)."""
        import torch

        vae, _ = self.vae()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        with torch.inference_mode():
            z = torch.cat([vae.encode(v[None]).latent_dist.mode() for v in video.float()])
        return (z.float() - mean) * inv_std

    def image_encoder(self):
        """``(encode, description)``: images [B, 3, H, W] in [-1, 1] -> image tokens [B, image_len,
        image_dim] fp32. A pipeline folder's ``image_encoder/`` + ``image_processor/`` (CLIP ViT-H: its
        penultimate hidden states, as ``WanImageToVideoPipeline.encode_image``), else a seeded stand-in
        for random-weight models (:func:`standin_image_tokens`: pooled patches through a fixed random
        projection - deterministic in the image, like the hash text encoder)."""
        return self._once("_image_encoder", self._load_image_encoder)

    def _load_image_encoder(self):
        folder = self._component("image_encoder")
        dim = int(self.spec.config["image_dim"])
        if folder is not None:
            import torch

            transformers = require("transformers", extra="export")
            model = transformers.CLIPVisionModel.from_pretrained(str(folder), torch_dtype=torch.float32)
            processor = transformers.CLIPImageProcessor.from_pretrained(str(folder.parent / "image_processor"))
            model = model.eval().requires_grad_(False)

            def encode(images):
                pixels = [((x.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
                          for x in images.float()]
                with torch.inference_mode():
                    inputs = processor(images=pixels, return_tensors="pt")
                    return model(**inputs, output_hidden_states=True).hidden_states[-2].float()

            return encode, f"CLIPVisionModel from {folder} (penultimate hidden states)"
        seed = self.spec.seed
        return (lambda images: standin_image_tokens(images, self.image_len, dim, seed),
                f"seeded stand-in image tokens (seed {seed}; no image encoder with this model)")

    def image_encoder_description(self) -> str:
        if self.image_input == "none":
            return super().image_encoder_description()
        vae = self.vae()[1]
        if self.frame_timesteps:
            return f"first latent frame from {vae}"
        return f"latents from {vae}; image tokens: {self.image_encoder()[1]}"

    def enable_sequence_parallel(self, model, seq) -> None:
        """Ulysses over a loaded Wan transformer (diffusers blocks or the torch-fp8 fused blocks):
        the hidden states are sharded on entry to the first block and gathered after the last
        (the per-token timestep embedding of Wan 2.2 TI2V is sharded alike); every block's
        self-attention runs the two all-to-alls. RoPE tables reach the blocks whole; each
        attention takes the rows it needs."""
        blocks = list(model.blocks)
        for blk in blocks:
            target = blk if hasattr(blk, "seq") else blk.attn1.processor
            if not hasattr(target, "seq"):
                raise ModelError(f"{type(target).__name__} has no sequence-parallel path; load the model "
                                 "through trt_sora (WanExportAttnProcessor) or the torch-fp8 backend")
            target.seq = seq

        def shard(_m, args):
            hidden, enc, temb, rope = args[:4]
            if temb.dim() == 4:  # per-token timestep embedding [B, S, 6, C]
                temb = seq.shard(temb, dim=1)
            return (seq.shard(hidden, dim=1), enc, temb, rope, *args[4:])

        blocks[0].register_forward_pre_hook(shard)
        blocks[-1].register_forward_hook(lambda _m, _args, out: seq.gather(out, dim=1))

    def sparse_attention_sites(self, model) -> dict[str, Any]:
        """Each block's self-attention: the processor of ``attn1``, or the torch-fp8 fused block itself."""
        return {f"blocks.{i}": blk if hasattr(blk, "sparse") else blk.attn1.processor
                for i, blk in enumerate(model.blocks)}

    @property
    def vae_scale(self) -> tuple[int, int]:
        """Wan's VAE: 4x in time (``num_frames = 4k + 1``), 8x in space (Wan 2.2's VAE of TI2V: 16x);
        pixel-space models: 1x."""
        if self.latent_channels == 3:
            return (1, 1)
        return (4, 16) if self.spec.defaults.get("vae") == "wan2.2" else (4, 8)

    def scheduler(self, shift: float | None = None):
        return make_scheduler(self.sampling.shift if shift is None else shift)

    def vae(self):
        """``(vae, description)``: the checkpoint's ``vae/`` (``AutoencoderKLWan``, fp32, eval) when
        the model came from a pipeline folder, else a small random one (seeded; enough to see how
        latent error turns into pixel error); ``(None, ...)`` for pixel-space models (3 latent
        channels, e.g. wan-shapes). Loaded once per adapter (the decoder and the image encoding share it)."""
        return self._once("_vae", self._load_vae)

    def _component(self, name: str) -> Path | None:
        """A pipeline component folder beside the transformer's (``vae``, ``image_encoder``, ...), or None."""
        if not self.spec.path:
            return None
        root = Path(self.spec.path)
        return next((c for c in (root.parent / name, root / name) if (c / "config.json").is_file()), None)

    def _load_vae(self):
        import torch

        if self.latent_channels == 3:
            return None, "identity (pixel-space model: latents are frames)"
        diffusers = require("diffusers", extra="export")
        cand = self._component("vae")
        if cand is not None:
            vae = diffusers.AutoencoderKLWan.from_pretrained(str(cand), torch_dtype=torch.float32)
            return vae.eval().requires_grad_(False), f"AutoencoderKLWan from {cand}"
        vae, desc = _random_vae(self.latent_channels, self.spec.defaults.get("vae") == "wan2.2")
        return vae.eval().requires_grad_(False), desc

    def frame_decoder(self, device=None, dtype=None):
        """Latents -> frames through :meth:`vae` (un-normalised with its ``latents_mean`` /
        ``latents_std``, as WanPipeline does) on ``device`` in ``dtype``, yielded latent frame by latent
        frame as :func:`causal_decode` makes them (1 pixel frame, then 4 a latent frame); pixel-space
        models: each latent frame, clamped."""
        import torch

        vae, desc = self.vae_on(device, dtype)
        if vae is None:
            return (lambda z: (z[:, :, i:i + 1].float().clamp(-1, 1) for i in range(z.shape[2]))), desc
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(device)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(device)
        dtype = dtype or torch.float32
        lock = self._once(f"_decode_lock_{device}_{dtype}", threading.Lock)  # the VAE's cache is its own state

        def decode_groups(z):
            with torch.inference_mode():
                z = (z.to(device=mean.device, dtype=torch.float32) * std + mean).to(dtype)
            with lock:
                yield from causal_decode(vae, z)

        return decode_groups, desc

    def diffusers_pipeline(self, transformer, *, encode, scheduler, defaults, transformer_2=None):
        """A ready ``WanPipeline`` (see :func:`diffusers_pipeline`): the checkpoint's VAE, or
        :func:`pixel_vae` for pixel-space models; Wan 2.2 TI2V's ``expand_timesteps``; a pair of experts
        (A14B) switches at its ``boundary_ratio`` to ``transformer_2`` (default: ``transformer``, a
        drop-in that routes by timestep itself) with ``guidance_scale_2``."""
        if self.is_i2v:
            raise ModelError(f"{self.name} is image-to-video: the ready pipeline helper is WanPipeline's "
                             "(text-to-video); generate with trt_sora.runtime.generate(..., image=...)")
        vae, _ = self.vae()
        pair = self.sampling.boundary_ratio
        return diffusers_pipeline(transformer, encode=encode, vae=vae if vae is not None else
                                  pixel_vae(self.latent_channels), scheduler=scheduler, defaults=defaults,
                                  negative=lambda n, text_len: self.negative_conditioning(
                                      encode, n, {"text_len": text_len})["encoder_hidden_states"],
                                  transformer_2=(transformer_2 or transformer) if pair else None, boundary_ratio=pair,
                                  expand_timesteps=self.frame_timesteps)

    def text_encoder(self, source: str | None = None, device=None):
        """``source``: None (the model's default), ``"hash"``, a ``.safetensors`` embedding file,
        a pipeline folder with ``text_encoder/`` + ``tokenizer/``, or ``"minilm"``."""
        from trt_sora.models import text

        source = source or self.spec.text_encoder or "hash"
        if source == "hash":
            return text.HashTextEncoder(self.text_dim, seed=self.spec.seed)
        if source == "minilm":
            from trt_sora.models.moving_shapes.text import MiniLMEncoder

            return MiniLMEncoder()
        if str(source).endswith(".safetensors"):
            return text.PrecomputedTextEncoder(source)
        return text.T5TextEncoder(source, device=device or "cpu")


def pixel_vae(channels: int):
    """A stand-in ``AutoencoderKLWan`` for pixel-space models: scale 1 in time and space, zero
    mean, unit std, ``decode(z) = clamp(z, -1, 1)`` - what a WanPipeline needs to run a model whose
    latents are its frames."""
    import torch
    from diffusers.configuration_utils import FrozenDict
    from diffusers.models.autoencoders.vae import DecoderOutput

    class PixelSpaceVAE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("_anchor", torch.zeros(()), persistent=False)  # a device for diffusers to read
            self.config = FrozenDict(scale_factor_temporal=1, scale_factor_spatial=1, z_dim=channels,
                                     latents_mean=[0.0] * channels, latents_std=[1.0] * channels)

        @property
        def dtype(self):
            return torch.float32

        @property
        def device(self):
            return self._anchor.device

        def decode(self, z, return_dict: bool = True):
            x = z.float().clamp(-1, 1)
            return DecoderOutput(sample=x) if return_dict else (x,)

    return PixelSpaceVAE()


def diffusers_pipeline(transformer, *, encode, vae, scheduler, defaults: Mapping[str, Any], negative=None,
                       transformer_2=None, boundary_ratio: float | None = None, expand_timesteps: bool = False):
    """A ``WanPipeline`` around ``transformer`` (a model or the runtime's drop-in) whose prompts go
    through ``encode(prompts, text_len) -> [B, text_len, D]`` (any text encoder, not only UMT5) and
    whose call defaults (size, steps, guidance, ``max_sequence_length``) are ``defaults``.
    ``negative(batch, text_len)``: the unconditional conditioning when no negative prompt is given
    (the model's own; None: WanPipeline's encoded ``""``). ``transformer_2`` + ``boundary_ratio``:
    Wan 2.2's low-noise expert and the switch; ``expand_timesteps``: Wan 2.2 TI2V's per-token timesteps."""
    from diffusers import WanPipeline

    class ArtifactWanPipeline(WanPipeline):
        """``WanPipeline`` with the artifact's text encoder and sampling defaults; otherwise stock."""

        def _get_t5_prompt_embeds(self, prompt=None, num_videos_per_prompt: int = 1, max_sequence_length: int = 226,
                                  device=None, dtype=None):
            prompt = [prompt] if isinstance(prompt, str) else list(prompt)
            e = encode(prompt, max_sequence_length).to(device=device or self._execution_device,
                                                       dtype=dtype or transformer.dtype)
            return e.repeat_interleave(num_videos_per_prompt, dim=0)

        def __call__(self, prompt=None, **kwargs):
            for k, v in defaults.items():
                kwargs.setdefault(k, v)
            if negative is not None and kwargs.get("negative_prompt") is None and \
                    kwargs.get("negative_prompt_embeds") is None and kwargs["guidance_scale"] > 1:
                n = (1 if isinstance(prompt, str) else len(prompt) if prompt is not None
                     else kwargs["prompt_embeds"].shape[0]) * (kwargs.get("num_videos_per_prompt") or 1)
                kwargs["negative_prompt_embeds"] = negative(n, kwargs["max_sequence_length"])
            return super().__call__(prompt, **kwargs)

    return ArtifactWanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler,
                               transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio,
                               expand_timesteps=expand_timesteps)


def causal_decode(vae, z):
    """``AutoencoderKLWan.decode(z)`` (diffusers' ``_decode``, the same calls in the same order) one
    latent frame at a time: yields the frames ``[B, 3, f, H, W]`` fp32 in ``[-1, 1]`` of each latent
    frame as it is decoded, its causal feature cache carrying the earlier ones. A tiled or sliced
    decode is one group (``vae.decode``)."""
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    h, w = z.shape[-2:]
    ratio = vae.spatial_compression_ratio
    if (vae.use_tiling and (w > vae.tile_sample_min_width // ratio or h > vae.tile_sample_min_height // ratio)) \
            or (vae.use_slicing and z.shape[0] > 1):
        with torch.inference_mode():
            yield vae.decode(z, return_dict=False)[0].float().clamp(-1, 1)
        return
    vae.clear_cache()
    try:
        with torch.inference_mode():
            x = vae.post_quant_conv(z)
        for i in range(z.shape[2]):
            with torch.inference_mode():
                vae._conv_idx = [0]
                out = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0)
                if vae.config.patch_size is not None:
                    out = unpatchify(out, patch_size=vae.config.patch_size)
            yield out.float().clamp(-1, 1)
    finally:
        vae.clear_cache()


def _random_vae(z_dim: int, wan22: bool):
    """A small seeded ``AutoencoderKLWan`` (no VAE weights with the model): Wan 2.1's layout, or Wan
    2.2's (residual blocks, 2x2 pixel patches, 16x spatial) for TI2V's 48-channel latents."""
    import torch

    diffusers = require("diffusers", extra="export")
    kw = dict(base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    if z_dim != 16:  # diffusers' defaults hold Wan 2.1's 16 per-channel statistics
        kw.update(latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    if wan22:
        kw.update(is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = diffusers.AutoencoderKLWan(**kw)
    layout = " (Wan 2.2 layout)" if wan22 else ""
    return vae, f"random tiny AutoencoderKLWan{layout} (seed 0; no VAE weights with this model)"


def standin_image_tokens(images, image_len: int, image_dim: int, seed: int = 0):
    """Image tokens of a random-weight image-to-video model (which has no CLIP): a global mean token,
    then the image average-pooled to a ``sqrt(image_len - 1)``-square grid (zero tokens pad the rest),
    through a fixed seeded ``[3, image_dim]`` projection; ``images`` [B, 3, H, W] -> [B, image_len,
    image_dim] fp32. Deterministic in the image, like :class:`trt_sora.models.text.HashTextEncoder`."""
    import math

    import torch
    import torch.nn.functional as F

    x = images.float()
    side = max(1, math.isqrt(max(1, image_len - 1)))
    grid = F.adaptive_avg_pool2d(x, side).flatten(2).transpose(1, 2)
    tokens = torch.cat([x.mean(dim=(2, 3))[:, None], grid], dim=1)[:, :image_len]
    tokens = F.pad(tokens, (0, 0, 0, image_len - tokens.shape[1]))
    proj = torch.randn(3, image_dim, generator=torch.Generator().manual_seed(int(seed) + 104_729))
    return tokens @ proj


def make_scheduler(shift: float):
    """Wan's sampler: diffusers ``FlowMatchEulerDiscreteScheduler`` (1000 train timesteps, sigma shift)."""
    diffusers = require("diffusers", extra="export")
    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))


def _exact_rope_tables(model) -> None:
    """Recompute the RoPE tables (``rope.freqs_cos`` / ``freqs_sin``, diffusers' values: angle ``pos *
    theta**(-2i/dim)`` in float64, pairs repeated, cast to float32) with the C library's scalar cos/sin.
    One float32 entry once came out 1 ULP apart in two processes (in a full test run; not reproduced
    alone), and with it the bytes of the exported graph; the scalar libm path leaves ATen's kernel
    dispatch (SIMD/MKL variants) out of the tables. Equal to diffusers' tables where both are stable."""
    import math

    import numpy as np
    import torch

    rope = model.rope
    cos, sin = [], []
    for dim in (rope.t_dim, rope.h_dim, rope.w_dim):
        inv = [1.0 / (10000.0 ** (i / dim)) for i in range(0, dim, 2)][: dim // 2]
        ang = [[p * f for f in inv] for p in range(rope.max_seq_len)]
        cos.append(np.repeat(np.array([[math.cos(a) for a in row] for row in ang]), 2, axis=1))
        sin.append(np.repeat(np.array([[math.sin(a) for a in row] for row in ang]), 2, axis=1))
    for name, parts in (("freqs_cos", cos), ("freqs_sin", sin)):
        old = getattr(rope, name)
        table = torch.from_numpy(np.concatenate(parts, axis=1).astype(np.float32))
        if tuple(table.shape) != tuple(old.shape):
            raise ModelError(f"Wan RoPE table {name}: computed {tuple(table.shape)}, diffusers has "
                             f"{tuple(old.shape)}: update _exact_rope_tables for this diffusers version")
        setattr(rope, name, table.to(old.dtype))


def _cast_keep_fp32(model, dtype) -> None:
    """Cast to ``dtype`` but keep diffusers' ``_keep_in_fp32_modules`` (time embedder, norms,
    AdaLN tables) in fp32, exactly as ``from_pretrained(torch_dtype=...)`` does."""
    import torch

    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        target = torch.float32 if any(k in name.split(".") for k in keep) else dtype
        p.data = p.data.to(target)
    for name, b in model.named_buffers():
        if b.is_floating_point() and not any(k in name.split(".") for k in keep):
            b.data = b.data.to(dtype)


def checkpoint_defaults(config: Mapping[str, Any], pipeline: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling defaults of a diffusers Wan checkpoint from its transformer config and the pipeline's
    ``model_index.json`` (``boundary_ratio``, ``expand_timesteps``): the release settings of Wan 2.1
    T2V / I2V, Wan 2.2 TI2V-5B, T2V-A14B and I2V-A14B (see :data:`DEFAULTS`)."""
    d = dict(CHECKPOINT_DEFAULTS)
    i2v = int(config.get("in_channels", 16)) > int(config.get("out_channels") or config.get("in_channels", 16))
    if pipeline.get("boundary_ratio") is not None:  # Wan 2.2 A14B: a pair of experts
        d.update(boundary_ratio=float(pipeline["boundary_ratio"]), num_steps=40)
        d.update({"shift": 5.0, "guidance_scale": 3.5, "guidance_scale_2": 3.5} if i2v else
                 {"shift": 12.0, "guidance_scale": 4.0, "guidance_scale_2": 3.0})
    elif pipeline.get("expand_timesteps"):  # Wan 2.2 TI2V-5B
        d.update(expand_timesteps=True, vae="wan2.2", shift=5.0, guidance_scale=5.0, num_steps=50, fps=24)
    elif config.get("image_dim") is not None:  # Wan 2.1 I2V
        d.update(num_steps=40, image_len=int(config.get("pos_embed_seq_len") or IMAGE_LEN))
    return d


def spec_from_folder(ref: str, folder: Path) -> ModelSpec | None:
    """A ModelSpec for a diffusers checkpoint folder (pipeline root or ``transformer/``), or None. A
    pipeline root with ``transformer_2/`` and a ``boundary_ratio`` (Wan 2.2 A14B) is a pair of experts."""
    found = transformer_folder(folder, CLASS_NAME)
    if found is None:
        return None
    cand, config = found
    pipe_root = folder if cand != folder else None
    pipeline = _model_index(pipe_root)
    if pipeline.get("boundary_ratio") is not None and not (pipe_root / "transformer_2" / "config.json").is_file():
        raise ModelError(f"{pipe_root} sets boundary_ratio {pipeline['boundary_ratio']} (two experts) but has no "
                         "transformer_2/; the checkpoint is incomplete")
    te = str(pipe_root) if pipe_root and (pipe_root / "text_encoder").is_dir() else None
    return ModelSpec(ref=ref, family="wan", source="checkpoint", path=str(cand),
                     config={k: v for k, v in config.items() if not k.startswith("_")},
                     text_encoder=te, defaults=checkpoint_defaults(config, pipeline))


def _model_index(root: Path | None) -> dict[str, Any]:
    if root is None or not (root / "model_index.json").is_file():
        return {}
    try:
        return json.loads((root / "model_index.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{root / 'model_index.json'} is not valid JSON ({exc}); re-save the checkpoint") from None


def spec_from_record(entry: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a manifest's model entry (ref, path, config) when the checkpoint folder is
    not on this machine: every fact comes from the recorded config; ``load`` fails naming the path."""
    return ModelSpec(ref=entry.get("ref") or entry["path"], family="wan", source="checkpoint",
                     config=dict(entry["config"]), path=entry["path"], text_encoder=entry.get("text_encoder"),
                     defaults={**checkpoint_defaults(entry["config"], entry.get("pipeline") or {}),
                               **(entry.get("sampling") or {})})


def named_specs() -> dict[str, ModelSpec]:
    """The registry entries of this family: the named configs (random init) and wan-shapes."""
    specs = {name: ModelSpec(ref=name, family="wan", source="random-init", config=cfg, seed=0, text_encoder="hash",
                             defaults=DEFAULTS[name]) for name, cfg in CONFIGS.items()}
    specs["wan-shapes"] = _wan_shapes_spec()
    return specs


def _wan_shapes_spec() -> ModelSpec:
    """The trained pixel-space reference model (``trt_sora/models/moving_shapes``, MODEL_CARD.md)."""
    from trt_sora.models import moving_shapes as ms

    config = json.loads((ms.WEIGHTS_DIR / "config.json").read_text())
    bucket = {"latent_frames": ms.LATENT_FRAMES, "latent_height": ms.LATENT_HEIGHT,
              "latent_width": ms.LATENT_WIDTH, "text_len": ms.TEXT_LEN}
    return ModelSpec(
        ref="wan-shapes", family="wan", source="checkpoint", path=str(ms.WEIGHTS_DIR),
        config={k: v for k, v in config.items() if not k.startswith("_")}, text_encoder="minilm",
        defaults={
            **ms.SAMPLING, "negative_prompt": ms.NEGATIVE_PROMPT, "calib_preset": "moving-shapes", "fps": ms.FPS,
            "caption_probe": "trt_sora.models.moving_shapes.probe:verdict",
            "heldout_prompts": "moving_shapes_v1",
            # trained at one resolution only: one clip with CFG (batch 1-2) and two clips (3-4)
            "buckets": [{"name": "shapes-1clip", "batch": [1, 2, 2], **bucket},
                        {"name": "shapes-2clips", "batch": [3, 4, 4], **bucket}],
        })


ADAPTER = WanAdapter
