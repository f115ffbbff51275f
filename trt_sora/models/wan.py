"""Wan 2.x text-to-video (diffusers ``WanTransformer3DModel``; Wan 2.2 and SkyReels-V2 share it).

Model facts live here and nowhere else: named configs, checkpoint loading,
input names and dims, the export-friendly attention processor, the scheduler
(flow matching with shift) and the sampling settings users run, the text
encoder, layer kinds, fusable projections and the latent decoder (Wan VAE).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from trt_sora.errors import ModelError, require
from trt_sora.models.base import ModelAdapter, ModelSpec, torch_dtype

CLASS_NAME = "WanTransformer3DModel"

_COMMON = dict(
    patch_size=[1, 2, 2], in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024, pos_embed_seq_len=None,
)

#: Named architectures. Real sizes come from the Wan 2.1 release configs.
CONFIGS: dict[str, dict[str, Any]] = {
    "wan-tiny": {**_COMMON, "num_attention_heads": 2, "attention_head_dim": 32, "text_dim": 64,
                 "freq_dim": 32, "ffn_dim": 128, "num_layers": 2},
    "wan2.1-t2v-1.3b": {**_COMMON, "num_attention_heads": 12, "attention_head_dim": 128, "text_dim": 4096,
                        "ffn_dim": 8960, "num_layers": 30},
    "wan2.1-t2v-14b": {**_COMMON, "num_attention_heads": 40, "attention_head_dim": 128, "text_dim": 4096,
                       "ffn_dim": 13824, "num_layers": 40},
}

#: Linear paths inside a transformer block -> layer kind (diffusers' Wan naming).
LAYER_KINDS: dict[str, str] = {
    "attn1.to_q": "attn1.qkv", "attn1.to_k": "attn1.qkv", "attn1.to_v": "attn1.qkv",
    "attn1.to_out.0": "attn1.out",
    "attn2.to_q": "attn2.q", "attn2.to_k": "attn2.kv", "attn2.to_v": "attn2.kv",
    "attn2.to_out.0": "attn2.out",
    "ffn.net.0.proj": "ffn.up", "ffn.net.2": "ffn.down",
}

#: Self-attention Q/K/V read the block's hidden states, cross-attention K/V the text: one GEMM each.
FUSABLE_PROJECTIONS = ((("to_q", "to_k", "to_v"), "to_qkv"), (("to_k", "to_v"), "to_kv"))

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
}

#: Sampling defaults of a diffusers Wan checkpoint folder (Wan 2.1 480p: 50 steps, CFG 5, shift 3).
CHECKPOINT_DEFAULTS: dict[str, Any] = {"shift": 3.0, "guidance_scale": 5.0, "num_steps": 50}


class WanExportAttnProcessor:
    """``WanAttnProcessor`` for text-to-video, rewritten for ONNX/TensorRT.

    Same math as diffusers' processor. Differences: RoPE is computed with
    ``stack`` + ``flatten`` instead of strided in-place writes (no ScatterND in
    the graph), attention is a plain ``scaled_dot_product_attention`` on
    ``[B, H, S, D]`` (TensorRT fuses MatMul-Softmax-MatMul into one kernel), and
    an optional ``observer(site, tensor)`` sees Q, K, V after norm + RoPE so
    calibration can measure the attention inputs.
    """

    def __init__(self, observer: Callable[[str, Any], None] | None = None):
        self.observer = observer
        self.seq = None  # a trt_sora.parallel.SeqShard under Ulysses (self-attention only)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        import torch.nn.functional as F

        if attn.add_k_proj is not None:
            raise ModelError("image-to-video Wan (added_kv_proj_dim) is not supported by the export processor yet; "
                             "use a text-to-video checkpoint")
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
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        if seq is not None:
            out = seq.heads_to_tokens(out)
        return attn.to_out[1](attn.to_out[0](out))


def _rope(x, cos, sin):
    """Interleaved-pair RoPE: ``x`` [B, S, H, D], ``cos``/``sin`` [1, S, 1, D] (pairs repeated)."""
    import torch

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def _make_wrapper(model):
    import torch

    class WanForExport(torch.nn.Module):
        """``forward(hidden_states, timestep, encoder_hidden_states) -> sample``; timestep stays fp32."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, timestep, encoder_hidden_states):
            return self.inner(hidden_states=hidden_states, timestep=timestep,
                              encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    return WanForExport(model)


class WanAdapter(ModelAdapter):
    family = "wan"
    layer_kinds = LAYER_KINDS
    fusable_projections = FUSABLE_PROJECTIONS

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.spec.config["patch_size"])  # type: ignore[return-value]

    @property
    def latent_channels(self) -> int:
        return int(self.spec.config["in_channels"])

    @property
    def text_dim(self) -> int:
        return int(self.spec.config["text_dim"])

    @property
    def head_dim(self) -> int:
        return int(self.spec.config["attention_head_dim"])

    def _construct(self):
        diffusers = require("diffusers", extra="export")
        cfg = {k: v for k, v in self.spec.config.items() if not k.startswith("_")}
        return diffusers.WanTransformer3DModel(**cfg)

    def load(self, dtype: str = "fp32", device: str = "cpu"):
        """Load in ``dtype`` on ``device``. Random-init configs are built on the meta device first and
        given their per-parameter random weights (:mod:`trt_sora.weights.random_init`) straight in the
        target dtype, so a 14B model never needs fp32 host memory."""
        tdtype = torch_dtype(dtype)
        if self.spec.source == "checkpoint":
            diffusers = require("diffusers", extra="export")
            require("accelerate", extra="export")
            from trt_sora.models import frame_embed

            try:
                # a stock checkpoint, or one with wan-shapes' absolute frame embedding (frame_embed.py)
                model = frame_embed.load(self.spec.path, tdtype)
            except (OSError, ValueError, RuntimeError) as exc:
                raise ModelError(f"cannot load a Wan transformer from {self.spec.path}: {exc}") from None
            model = model.to(device)
            # one processor per attention module, so each one's observer hook knows its own site
            model.set_attn_processor({name: WanExportAttnProcessor() for name in model.attn_processors})
            return model.eval().requires_grad_(False)
        from trt_sora.weights.sources import materialize

        model = self.load_empty(dtype)
        return materialize(model, self.weight_source(), device).to(device)

    def load_empty(self, dtype: str = "fp32"):
        """The module :meth:`load` returns (same classes, dtypes, processors), with every parameter on the
        meta device and buffers (RoPE tables) real: for tracing without weights and streamed loading."""
        require("accelerate", extra="export")
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = self._construct()
        if self.spec.source == "checkpoint":
            from trt_sora.models import frame_embed

            if frame_embed.stored_weight_shape(self.spec.path) is not None:
                frame_embed.attach(model)
        _cast_keep_fp32(model, torch_dtype(dtype))
        model.set_attn_processor({name: WanExportAttnProcessor() for name in model.attn_processors})
        return model.eval().requires_grad_(False)

    def weight_source(self):
        """The weights, one tensor at a time: the checkpoint's safetensors, or the random init of the config."""
        from trt_sora.weights.sources import CheckpointSource, RandomInitSource

        if self.spec.source == "checkpoint":
            return CheckpointSource(self.spec.path)
        return RandomInitSource(self.load_empty("fp32"), self.spec.seed, _random_rule)

    def input_dims(self) -> dict[str, dict[int, str]]:
        return {
            "hidden_states": {0: "batch", 2: "latent_frames", 3: "latent_height", 4: "latent_width"},
            "timestep": {0: "batch"},
            "encoder_hidden_states": {0: "batch", 1: "text_len"},
            "sample": {0: "batch", 2: "latent_frames", 3: "latent_height", 4: "latent_width"},
        }

    def fixed_dims(self) -> dict[str, tuple[int, int]]:
        return {"hidden_states": (1, self.latent_channels), "encoder_hidden_states": (2, self.text_dim)}

    def example_inputs(self, point: Mapping[str, int], *, dtype: str = "fp32", device: str = "cpu",
                       seed: int = 0):
        """``hidden_states`` [B, C, F, H, W] (dtype), ``timestep`` [B] fp32 in [0, 1000),
        ``encoder_hidden_states`` [B, L, text_dim] (dtype)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        b, f, h, w, l = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width",
                                                  "text_len"))
        td = torch_dtype(dtype)
        return {
            "hidden_states": torch.randn(b, self.latent_channels, f, h, w, generator=g).to(device, td),
            "timestep": (torch.rand(b, generator=g) * 999.0).to(device, torch.float32),
            "encoder_hidden_states": torch.randn(b, l, self.text_dim, generator=g).to(device, td),
        }

    def export_module(self, model):
        return _make_wrapper(model)

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

    @property
    def vae_scale(self) -> tuple[int, int]:
        """Wan's VAE: 4x in time (``num_frames = 4k + 1``), 8x in space; pixel-space models: 1x."""
        return (1, 1) if self.latent_channels == 3 else (4, 8)

    def scheduler(self, shift: float | None = None):
        return make_scheduler(self.sampling.shift if shift is None else shift)

    def vae(self):
        """``(vae, description)``: the checkpoint's ``vae/`` (``AutoencoderKLWan``, fp32, eval) when
        the model came from a pipeline folder, else a small random one (seeded; enough to see how
        latent error turns into pixel error); ``(None, ...)`` for pixel-space models (3 latent
        channels, e.g. wan-shapes)."""
        import torch

        if self.latent_channels == 3:
            return None, "identity (pixel-space model: latents are frames)"
        diffusers = require("diffusers", extra="export")
        if self.spec.path:
            root = Path(self.spec.path)
            for cand in (root.parent / "vae", root / "vae"):
                if (cand / "config.json").is_file():
                    vae = diffusers.AutoencoderKLWan.from_pretrained(str(cand), torch_dtype=torch.float32)
                    return vae.eval().requires_grad_(False), f"AutoencoderKLWan from {cand}"
        with torch.random.fork_rng():
            torch.manual_seed(0)
            vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=self.latent_channels, dim_mult=[1, 1, 1, 1],
                                             num_res_blocks=1, temperal_downsample=[False, True, True])
        return vae.eval().requires_grad_(False), "random tiny AutoencoderKLWan (seed 0; no VAE weights with this model)"

    def decoder(self):
        """Latents -> frames through :meth:`vae` (un-normalised with its ``latents_mean`` /
        ``latents_std``, as WanPipeline does); pixel-space models: the latents, clamped."""
        import torch

        vae, desc = self.vae()
        if vae is None:
            return (lambda z: z.float().clamp(-1, 1)), desc
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

        def decode(z):
            with torch.inference_mode():
                x = vae.decode(z.float() * std + mean, return_dict=False)[0]
            return x.float().clamp(-1, 1)

        return decode, desc

    def diffusers_pipeline(self, transformer, *, encode, scheduler, defaults):
        """A ready ``WanPipeline`` (see :func:`diffusers_pipeline`): the checkpoint's VAE, or
        :func:`pixel_vae` for pixel-space models."""
        vae, _ = self.vae()
        return diffusers_pipeline(transformer, encode=encode, vae=vae if vae is not None else
                                  pixel_vae(self.latent_channels), scheduler=scheduler, defaults=defaults,
                                  negative=lambda n, text_len: self.negative_embedding(encode, n, text_len))

    def text_encoder(self, source: str | None = None):
        """``source``: None (the model's default), ``"hash"``, a ``.safetensors`` embedding file,
        a pipeline folder with ``text_encoder/`` + ``tokenizer/``, or ``"minilm"``."""
        from trt_sora.models import text

        source = source or self.spec.text_encoder or "hash"
        if source == "hash":
            return text.HashTextEncoder(self.text_dim, seed=self.spec.seed)
        if source == "minilm":
            from trt_sora.models.moving_shapes.text import encode

            return encode
        if str(source).endswith(".safetensors"):
            return text.PrecomputedTextEncoder(source)
        return text.T5TextEncoder(source)


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


def diffusers_pipeline(transformer, *, encode, vae, scheduler, defaults: Mapping[str, Any], negative=None):
    """A ``WanPipeline`` around ``transformer`` (a model or the runtime's drop-in) whose prompts go
    through ``encode(prompts, text_len) -> [B, text_len, D]`` (any text encoder, not only UMT5) and
    whose call defaults (size, steps, guidance, ``max_sequence_length``) are ``defaults``.
    ``negative(batch, text_len)``: the unconditional conditioning when no negative prompt is given
    (the model's own; None: WanPipeline's encoded ``""``)."""
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
                               transformer=transformer)


def make_scheduler(shift: float):
    """Wan's sampler: diffusers ``FlowMatchEulerDiscreteScheduler`` (1000 train timesteps, sigma shift)."""
    diffusers = require("diffusers", extra="export")
    return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))


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


def _random_rule(name: str, shape: tuple, g):
    """Random init of Wan's own parameters: diffusers' ``randn / sqrt(dim)`` for the AdaLN tables.

    Every other parameter gets its module's ``reset_parameters`` distribution, drawn per parameter
    on the CPU (:mod:`trt_sora.weights.random_init`): the same config and seed give the same weights
    on every device and in any loading order, and a 14B model never needs more than one parameter
    in host memory."""
    import torch

    if name.endswith("scale_shift_table"):
        return torch.randn(shape, generator=g, dtype=torch.float32) / shape[-1] ** 0.5
    return None


def spec_from_folder(ref: str, folder: Path) -> ModelSpec | None:
    """A ModelSpec for a diffusers checkpoint folder (pipeline root or ``transformer/``), or None."""
    for cand in (folder / "transformer", folder):
        cfg = cand / "config.json"
        if cfg.is_file():
            try:
                config = json.loads(cfg.read_text())
            except json.JSONDecodeError as exc:
                raise ModelError(f"{cfg} is not valid JSON ({exc}); re-save the checkpoint") from None
            if config.get("_class_name") != CLASS_NAME:
                return None
            if not any(cand.glob("*.safetensors")) and not any(cand.glob("*.bin")):
                raise ModelError(f"{cand} has a config.json but no weight files (*.safetensors); "
                                 "the checkpoint is incomplete")
            pipe_root = folder if cand != folder else None
            te = str(pipe_root) if pipe_root and (pipe_root / "text_encoder").is_dir() else None
            return ModelSpec(ref=ref, family="wan", source="checkpoint", path=str(cand),
                             config={k: v for k, v in config.items() if not k.startswith("_")},
                             text_encoder=te, defaults=dict(CHECKPOINT_DEFAULTS))
    return None


def spec_from_record(entry: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a manifest's model entry (ref, path, config) when the checkpoint folder is
    not on this machine: every fact comes from the recorded config; ``load`` fails naming the path."""
    return ModelSpec(ref=entry.get("ref") or entry["path"], family="wan", source="checkpoint",
                     config=dict(entry["config"]), path=entry["path"], text_encoder=entry.get("text_encoder"),
                     defaults={**CHECKPOINT_DEFAULTS, **(entry.get("sampling") or {})})
