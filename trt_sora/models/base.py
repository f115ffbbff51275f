"""The model-adapter contract: everything a stage needs to know about a model family.

Model facts (input names and ranks, patch size, text encoder, scheduler and the
sampling settings users run, export rewrites, quantization exclusions, layer kinds,
fusable projection groups, block naming, the latent decoder, both CFG branches'
conditioning, family-specific shape dims) live in one file per family (``wan.py``,
``hunyuan.py``); optional capabilities (experts of a boundary-switched pair, Ulysses,
the torch-fp8 block rewrite, a diffusers pipeline) are methods a family overrides or
that raise a typed error. Stages only talk to a :class:`ModelAdapter`; nothing outside
``models/`` names a family's module or module paths (``tests/test_family_facts.py``).
The export wrapper (:meth:`ModelAdapter.export_module`) holds the model as ``inner``.
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trt_sora.sampling import Conditioner, SamplingSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: The named dynamic axes of a latent tensor ``[B, C, F, H, W]`` (``hidden_states``, ``sample``).
LATENT_AXES = {0: "batch", 2: "latent_frames", 3: "latent_height", 4: "latent_width"}

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}



def torch_dtype(name: str):
    """``"fp16"`` -> ``torch.float16`` (also accepts a torch.dtype)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    key = getattr(name, "value", name)
    if key not in DTYPES:
        from trt_sora.config.base import did_you_mean
        from trt_sora.errors import ConfigError

        raise ConfigError(f"unknown dtype {key!r}{did_you_mean(key, DTYPES)}; use one of {list(DTYPES)}")
    return getattr(torch, DTYPES[key])


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How a model was resolved: registry name or checkpoint folder, and its identity."""

    ref: str                      # what the user typed
    family: str                   # "wan"
    source: str                   # "random-init" | "checkpoint"
    config: Mapping[str, Any]     # constructor config (diffusers config dict)
    path: str | None = None       # checkpoint folder holding config.json + weights
    seed: int = 0                 # random-init seed
    text_encoder: str | None = None  # "hash" | path to a text encoder | "minilm"
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # scheduler etc.
    expert: str | None = None     # "high" / "low": one expert of a boundary-switched pair

    @property
    def name(self) -> str:
        """A filesystem-safe short name for build/<model>/..."""
        base = Path(self.ref).name if self.source == "checkpoint" and "/" in self.ref else self.ref
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in base) or "model"

    def model_hash(self) -> str:
        """Identity of the weights: config + seed for random init, file sizes/heads for checkpoints.

        Cheap for 28 GB checkpoints: hashes the config, each weight file's size
        and its first and last MiB rather than every byte.
        """
        h = hashlib.sha256(json.dumps(dict(self.config), sort_keys=True, default=str).encode())
        if self.source == "random-init":
            from trt_sora.weights import RANDOM_INIT_VERSION

            h.update(f"seed={self.seed};init={RANDOM_INIT_VERSION}".encode())
        elif self.path:
            for f in sorted(Path(self.path).glob("*.safetensors")) + sorted(Path(self.path).glob("*.bin")):
                size = f.stat().st_size
                h.update(f"{f.name}:{size}".encode())
                with open(f, "rb") as fh:
                    h.update(fh.read(1 << 20))
                    if size > 2 << 20:
                        fh.seek(-(1 << 20), 2)
                        h.update(fh.read(1 << 20))
        return h.hexdigest()[:16]


def transformer_folder(folder: Path, class_name: str) -> tuple[Path, dict[str, Any]] | None:
    """``(folder holding the transformer, its config.json)`` for a diffusers checkpoint folder
    (pipeline root or ``transformer/``) whose transformer is ``class_name``; None for another class.
    A corrupt config or a config without weight files is a typed error."""
    from trt_sora.errors import ModelError

    for cand in (folder / "transformer", folder):
        cfg = cand / "config.json"
        if cfg.is_file():
            try:
                config = json.loads(cfg.read_text())
            except json.JSONDecodeError as exc:
                raise ModelError(f"{cfg} is not valid JSON ({exc}); re-save the checkpoint") from None
            if config.get("_class_name") != class_name:
                return None
            if not any(cand.glob("*.safetensors")) and not any(cand.glob("*.bin")):
                raise ModelError(f"{cand} has a config.json but no weight files (*.safetensors); "
                                 "the checkpoint is incomplete")
            return cand, config
    return None


def torch_fp8_unsupported(adapter: ModelAdapter, why: str):
    """The ConfigError of a model the torch-fp8 backend cannot run: ``why``, and the backends that can."""
    from trt_sora.errors import ConfigError

    return ConfigError(f"backend torch-fp8 cannot run {adapter.name}: {why}; serve it with backend 'trt' "
                       "(TensorRT), 'ort' (ONNX Runtime) or 'torch'")


class StreamedDecoder:
    """For a family with its own :meth:`ModelAdapter.frame_decoder` (a causal VAE, decoded latent frame
    by latent frame): :meth:`ModelAdapter.decoder` is those frame groups, concatenated along frames.
    List it before :class:`ModelAdapter` among the bases."""

    def decoder(self, device=None, dtype=None):
        import torch

        groups, desc = self.frame_decoder(device, dtype)
        return (lambda z: torch.cat(list(groups(z)), dim=2)), desc


class ModelAdapter(Conditioner, abc.ABC):
    """One model family. Input names/shapes, loading, example inputs, scheduler, text encoder;
    as a :class:`~trt_sora.sampling.Conditioner` it builds the model's inputs from latents and
    conditioning inside the one sampler."""

    family: str = ""
    input_names: tuple[str, ...] = ("hidden_states", "timestep", "encoder_hidden_states")
    output_names: tuple[str, ...] = ("sample",)

    #: Shape dims of this family beyond the shared ones (:data:`trt_sora.config.shapes.DIM_NAMES`),
    #: ``{name: (min, opt, max)}``: the default range of each where a recipe's bucket or export range
    #: does not name it (HunyuanVideo 1.5: ``text_len_2``, its second text encoder's tokens).
    family_dims: Mapping[str, tuple[int, int, int]] = {}

    #: Inputs that are 0/1 masks (a server's warm-up feeds them ones).
    mask_inputs: tuple[str, ...] = ()

    #: The module holding the repeated transformer blocks (``blocks.N`` for Wan): the parity check's
    #: per-block probes and the report's block groups.
    block_container: str = "blocks"

    # -- quantization facts ------------------------------------------------------------------------
    #: The family's default Q/DQ exclusions, ``{module pattern: reason}``, in match order (quantize, the
    #: calibration report and fake-quant apply them through :func:`trt_sora.site_policy.site_policy`).
    quant_excludes: Mapping[str, str] = {}

    #: The module-name regex ModelOpt's diffusers example keeps unquantized for this family (the
    #: calibration report's ModelOpt peer row); None: the example has no filter for it.
    modelopt_exclude: str | None = None

    #: Linear paths inside a block -> the layer kind they belong to (``attn1.to_q`` -> ``attn1.qkv``);
    #: the calibration report's sensitivity groups. Paths not listed are their own kind.
    layer_kinds: Mapping[str, str] = {}

    #: Projections that read the same input and may run as one GEMM: ``((member suffixes in output
    #: order), fused suffix)``, e.g. ``(("to_q", "to_k", "to_v"), "to_qkv")``. Tried in order.
    fusable_projections: tuple[tuple[tuple[str, ...], str], ...] = ()

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    # -- identity and shape facts ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def patch_size(self) -> tuple[int, int, int]: ...

    @property
    @abc.abstractmethod
    def latent_channels(self) -> int: ...

    @property
    @abc.abstractmethod
    def text_dim(self) -> int: ...

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def in_channels(self) -> int:
        """Channels of the ``hidden_states`` input (latents plus any concatenated conditioning)."""
        return self.latent_channels

    @property
    def dim_names(self) -> tuple[str, ...]:
        """Every named dim of this family's inputs: the shared ones, then :attr:`family_dims`."""
        from trt_sora.config.shapes import DIM_NAMES

        return DIM_NAMES + tuple(self.family_dims)

    @property
    def num_heads(self) -> int:
        """Self-attention heads (the Ulysses degree must divide it)."""
        return int(self.spec.config["num_attention_heads"])

    def num_params(self) -> int:
        """Parameter count from the config, without allocating weights."""
        import torch

        with torch.device("meta"):
            m = self._construct()
        return sum(p.numel() for p in m.parameters())

    def describe(self) -> dict:
        """JSON-safe identity for manifests, with how the model is sampled (its text encoder and
        sampling settings), so a run folder carries what generation needs."""
        out = {
            "ref": self.spec.ref,
            "family": self.family,
            "source": self.spec.source,
            "path": self.spec.path,
            "model_hash": self.spec.model_hash(),
            "config": dict(self.spec.config),
            "text_encoder": self.spec.text_encoder,
            "negative_prompt": self.spec.defaults.get("negative_prompt", ""),
        }
        if all(k in self.spec.defaults for k in ("num_steps", "guidance_scale", "shift")):
            out["sampling"] = self.sampling.to_dict()
        if self.spec.expert:
            out["expert"] = self.spec.expert
        return out

    # -- loading -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _construct(self):
        """Build the module from ``spec.config`` (called under a device context)."""

    def _construct_empty(self):
        """:meth:`_construct` with every parameter on the meta device and the buffers real (for
        :meth:`load_empty`)."""
        from trt_sora.errors import require

        require("accelerate", extra="export")
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return self._construct()

    @abc.abstractmethod
    def load(self, dtype: str = "fp32", device: str = "cpu"):
        """The eval-mode ``torch.nn.Module`` in ``dtype`` on ``device``."""

    def load_empty(self, dtype: str = "fp32"):
        """The module of :meth:`load` with parameters on the meta device (buffers real); see wan.py."""
        from trt_sora.errors import ModelError

        raise ModelError(f"model family {self.family!r} cannot be loaded without weights yet (streaming export); "
                         "export it with its weights in memory (export_onnx(..., model=adapter.load()))")

    def weight_source(self):
        """A :class:`trt_sora.weights.sources.WeightSource` of the model's parameters (state-dict names),
        one tensor at a time: the checkpoint's safetensors, or the random init of the config
        (:meth:`load_empty` + :meth:`random_init_rule`)."""
        from trt_sora.weights.sources import CheckpointSource, RandomInitSource

        if self.spec.source == "checkpoint":
            return CheckpointSource(self.spec.path)
        return RandomInitSource(self.load_empty("fp32"), self.spec.seed, self.random_init_rule)

    @staticmethod
    def random_init_rule(name: str, shape: tuple, g):
        """The family's random init of a parameter its module's ``reset_parameters`` does not cover
        (a tensor), or None for the module's own distribution (:mod:`trt_sora.weights.random_init`)."""
        return None

    # -- inputs ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def example_inputs(self, point: Mapping[str, int], *, dtype: str = "fp32", device: str = "cpu",
                       seed: int = 0) -> dict[str, torch.Tensor]:
        """Random inputs at a latent-space point ``{batch, latent_frames, ...}``."""

    @abc.abstractmethod
    def input_dims(self) -> dict[str, dict[int, str]]:
        """``{input_name: {axis: dim_name}}`` for the named dynamic dims (output too)."""

    def with_family_dims(self, point: Mapping[str, int], which: str = "opt") -> dict[str, int]:
        """``point`` with every :attr:`family_dims` it lacks set to the default range's ``which``."""
        idx = {"min": 0, "opt": 1, "max": 2}[which]
        return {**{k: int(v[idx]) for k, v in self.family_dims.items()}, **dict(point)}

    @abc.abstractmethod
    def export_module(self, model):
        """A module whose ``forward(*inputs in input_names order)`` returns the output tensor."""

    def forward(self, model, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.export_module(model)(*[inputs[n] for n in self.input_names])

    def input_ranks(self) -> dict[str, int]:
        """``{input_name: rank}`` of the transformer's inputs (their last named or fixed axis + 1)."""
        dims, fixed = self.input_dims(), self.fixed_axes()
        return {n: 1 + max([*dims.get(n, {}), *fixed.get(n, {})]) for n in self.input_names}

    @abc.abstractmethod
    def fixed_axes(self) -> dict[str, dict[int, int]]:
        """``{input_name: {axis: size}}``: every non-dynamic axis of every input (latent channels,
        text-embedding width; an image embedding ``[B, 257, 1280]`` has two)."""

    def buckets_for(self, recipe) -> tuple[tuple, str]:
        """``(buckets, source)``: the recipe's shape buckets, or the model's own when it declares
        them (toy models trained or sized for one small resolution cannot run at 480p). Each
        bucket is checked against the model's patch size and given the family's own dims
        (:attr:`family_dims`) at their default range where it does not name them."""
        from trt_sora.config.shapes import DimRange, ShapeProfile

        own = self.spec.defaults.get("buckets")
        if own:
            buckets = tuple(ShapeProfile.from_yaml(b, where=f"model {self.name} buckets[{i}]",
                                                   extra_dims=tuple(self.family_dims))
                            for i, b in enumerate(own))
            source = f"model {self.name} (replaces the recipe's {[b.name for b in recipe.buckets]})"
        else:
            buckets, source = tuple(recipe.buckets), f"recipe {recipe.name}"
        defaults = {k: DimRange(*v) for k, v in self.family_dims.items()}
        buckets = tuple(b.with_extra(defaults) for b in buckets)
        for b in buckets:
            b.validate(self.patch_size)
        return buckets, source

    # -- sampling and conditioning -----------------------------------------------------------------
    @property
    def sampling(self) -> SamplingSettings:
        """The settings users sample this model with (the model's ``num_steps``, ``guidance_scale``
        and ``shift``): calibration, parity and generation run them unless told otherwise."""
        d = self.spec.defaults
        missing = [k for k in ("num_steps", "guidance_scale", "shift") if k not in d]
        if missing:
            from trt_sora.errors import ModelError

            raise ModelError(f"model {self.name} declares no sampling {', '.join(missing)}; add them to its "
                             f"defaults in trt_sora/models/{self.family}.py")
        two = {k: float(d[k]) for k in ("boundary_ratio", "guidance_scale_2") if d.get(k) is not None}
        return SamplingSettings(num_steps=int(d["num_steps"]), guidance_scale=float(d["guidance_scale"]),
                                shift=float(d["shift"]), **two)

    @abc.abstractmethod
    def scheduler(self, shift: float | None = None):
        """A fresh diffusers scheduler of the family (flow matching for Wan); ``shift`` None =
        :attr:`sampling`'s."""

    @abc.abstractmethod
    def text_encoder(self, source: str | None = None, device=None) -> Callable[[list[str], int], torch.Tensor]:
        """``encode(prompts, text_len) -> [B, text_len, text_dim] float32`` on the CPU (a neural encoder
        computes on ``device``, in bf16 there when it is a GPU)."""

    def heldout_prompts(self) -> list[str] | None:
        """Held-out prompts the model's quality checks should use (its own prompt set's ``heldout``
        split when the model names one, e.g. wan-shapes' captions), else None."""
        ref = self.spec.defaults.get("heldout_prompts")
        if not ref:
            return None
        from trt_sora.prompts import load_prompts

        return [p.prompt for p in load_prompts(ref, split="heldout")]

    def caption_probe(self) -> Callable[[str, Any], dict] | None:
        """``verdict(caption, frames uint8 [F, H, W, 3]) -> dict`` (with ``passes``) when the model
        ships a checker that reads a clip back against its caption (wan-shapes' probe), else None."""
        ref = self.spec.defaults.get("caption_probe")
        if not ref:
            return None
        import importlib

        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    def conditioning(self, encode: Callable[..., Any], prompts: Sequence[str], point: Mapping[str, int], *,
                     negative: str | Sequence[str | None] | None = None, shared: Mapping[str, Any] | None = None,
                     seed: int = 0, cfg: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(cond, uncond)``: the inputs of both CFG branches for ``prompts`` at ``point``, ``{name: [B, ...]}``
        with B = ``len(prompts)`` (the one place calibration, parity and generation build them).

        ``negative``: the unconditional branch's prompt for every row (None: the model's own,
        :meth:`negative_conditioning`), or a list with one per row, each encoded on its own (a row does not
        depend on its batch). ``shared``: what both branches share (an image-to-video model's encoded
        images); None: :meth:`image_conditioning` at ``point`` seeded by ``seed``. ``cfg`` False: uncond None.
        """
        import torch

        point = self.with_family_dims(point)
        shared = self.image_conditioning(point, seed=seed) if shared is None else dict(shared)
        cond = {**self.text_conditioning(encode, list(prompts), point), **shared}
        if not cfg:
            return cond, None
        if isinstance(negative, (list, tuple)):
            rows = [self.negative_conditioning(encode, 1, {**point, "batch": 1}, prompt=n) for n in negative]
            neg = {k: torch.cat([r[k].float() for r in rows]) for k in rows[0]}
        else:
            neg = self.negative_conditioning(encode, len(prompts), point, prompt=negative)
        return cond, {**neg, **shared}

    def text_conditioning(self, encode: Callable[[list[str], int], Any], prompts: list[str],
                          point: Mapping[str, int]) -> dict[str, Any]:
        """The per-branch inputs of ``prompts`` at ``point`` (its ``text_len``): ``{name: [B, ...]}`` fp32
        (default: ``{"encoder_hidden_states": encode(prompts, text_len)}``)."""
        import torch

        from trt_sora.errors import ModelError

        text_len = int(point["text_len"])
        emb = encode(list(prompts), text_len)
        if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or tuple(emb.shape[:2]) != (len(prompts), text_len):
            raise ModelError(f"the text encoder of {self.name} returned {getattr(emb, 'shape', type(emb))} for "
                             f"{len(prompts)} prompts at text_len {text_len}; expected [B, text_len, D]")
        return {"encoder_hidden_states": emb.float()}

    def negative_conditioning(self, encode: Callable[[list[str], int], Any], batch: int,
                              point: Mapping[str, int], prompt: str | None = None) -> dict[str, Any]:
        """The unconditional branch's per-branch inputs: ``prompt`` encoded when given, else the
        model's own - its negative prompt encoded (``negative_prompt`` of its defaults, ``""`` when
        unset), or zeros ``[batch, text_len, text_dim]`` for a model whose dropped-text condition is
        the zero embedding (``negative_prompt: None``, e.g. wan-shapes)."""
        if prompt is None:
            prompt = self.spec.defaults.get("negative_prompt", "")
            if prompt is None:
                import torch

                return {"encoder_hidden_states": torch.zeros(batch, int(point["text_len"]), self.text_dim)}
        return self.text_conditioning(encode, [prompt] * batch, point)

    def image_conditioning(self, point: Mapping[str, int], *, seed: int = 0, images=None) -> dict[str, Any]:
        """Inputs both CFG branches share (image-to-video: the image's latents and embedding) at
        ``point`` (batch = its ``batch``); ``{}`` for text-to-video models. ``images``: fp32
        ``[batch, 3, height, width]`` in ``[-1, 1]`` at the clip's pixel size (generation), or None
        for a seeded stand-in (calibration and parity of random-weight models)."""
        return {}

    @property
    def image_input(self) -> str:
        """Whether generation takes a conditioning image: ``"none"`` (text-to-video), ``"optional"``
        (text- or image-to-video, e.g. Wan 2.2 TI2V) or ``"required"`` (image-to-video)."""
        return "none"

    def image_encoder_description(self) -> str:
        """How :meth:`image_conditioning` encodes a given image, in words (clip metadata)."""
        return "none (text-to-video)"

    # -- decoding (latents <-> pixels) -------------------------------------------------------------
    @abc.abstractmethod
    def decoder(self, device=None, dtype=None) -> tuple[Callable[[Any], Any], str]:
        """``(decode, description)``: latents ``[B, C, F, H, W]`` -> frames ``[B, 3, F', H', W']``
        fp32 in ``[-1, 1]`` (the family's latent decoder), computed on ``device`` in ``dtype``
        (default: CPU, fp32) and returned there."""

    def frame_decoder(self, device=None, dtype=None) -> tuple[Callable[[Any], Iterator[Any]], str]:
        """``(decode_groups, description)``: as :meth:`decoder`, but ``decode_groups(z)`` yields the
        frames ``[B, 3, f, H', W']`` of successive groups of latent frames as each is decoded (a
        stream sends them before the clip is whole); concatenated along frames they equal
        ``decode(z)``. Default: one group, the whole clip (a decoder that needs every latent frame)."""
        decode, desc = self.decoder(device, dtype)
        return (lambda z: iter([decode(z)])), desc

    def vae_on(self, device=None, dtype=None) -> tuple[Any, str]:
        """``(vae, description)`` of :meth:`vae` on ``device`` in ``dtype``: the one :meth:`use_vae`
        installed there, else a copy made once per place; None and None: the fp32 CPU one every stage
        shares."""
        if device is None and dtype is None:
            return self.vae()
        return self._once(self._vae_key(device, dtype), lambda: self._vae_copy(device, dtype))

    def use_vae(self, vae, device, dtype, description: str) -> None:
        """Decode on ``device`` in ``dtype`` with ``vae`` (already there, in that dtype) from now on:
        :meth:`vae_on` returns ``(vae, description)`` for that place, so the family's decoders use it
        and report ``description`` (e.g. a benchmark's full-size VAE in place of the small random one
        of a named config without weights). ConfigError for no place: the fp32 CPU VAE of None and
        None is the model's own, which every stage shares."""
        from trt_sora.errors import ConfigError

        if device is None and dtype is None:
            raise ConfigError(f"use_vae on {self.name} needs a device or a dtype (e.g. 'cpu', torch.float32): "
                              "None and None name the model's own VAE, shared by every stage")
        self.__dict__[self._vae_key(device, dtype)] = (vae, description)

    @staticmethod
    def _vae_key(device, dtype) -> str:
        return f"_vae_{device}_{dtype}"

    def _vae_copy(self, device, dtype) -> tuple[Any, str]:
        """A copy of :meth:`vae` on ``device`` in ``dtype``, described so (None for pixel-space models)."""
        import copy

        vae, desc = self.vae()
        if vae is None:
            return vae, desc
        return (copy.deepcopy(vae).to(device=device, dtype=dtype),
                f"{desc}, {str(dtype).removeprefix('torch.')} on {device}")

    def _once(self, key: str, load: Callable[[], Any]) -> Any:
        """``load()``, run once per adapter (a family's heavy components - its VAE, its image encoder -
        shared by decoding, image encoding and metadata)."""
        if key not in self.__dict__:
            self.__dict__[key] = load()
        return self.__dict__[key]

    @property
    def vae_scale(self) -> tuple[int, int]:
        """``(temporal, spatial)`` downsampling of the family's latent decoder: ``num_frames =
        (latent_frames - 1) * temporal + 1``, ``height = latent_height * spatial``; ``(1, 1)`` for
        pixel-space models."""
        return (1, 1)

    @property
    def fps(self) -> float:
        """Playback frame rate of the model's clips (the model's ``fps`` default; Wan 2.1: 16)."""
        return float(self.spec.defaults.get("fps", 16))

    def pixel_size(self, point: Mapping[str, int]) -> tuple[int, int, int]:
        """``(num_frames, height, width)`` in pixels of a latent-space point."""
        t, s = self.vae_scale
        return ((int(point["latent_frames"]) - 1) * t + 1, int(point["latent_height"]) * s,
                int(point["latent_width"]) * s)

    def latent_size(self, num_frames: int, height: int, width: int) -> dict[str, int]:
        """``{latent_frames, latent_height, latent_width}`` of a pixel size; ShapeError naming the
        nearest valid size when the decoder's scale (and the patch) do not divide it."""
        from trt_sora.errors import ShapeError

        t, s = self.vae_scale
        _, ph, pw = self.patch_size
        bad = [f"num_frames {num_frames} (needs (n - 1) divisible by {t})" if (num_frames - 1) % t or num_frames < 1
               else "", f"height {height} (needs a multiple of {s * ph})" if height % (s * ph) or height < 1 else "",
               f"width {width} (needs a multiple of {s * pw})" if width % (s * pw) or width < 1 else ""]
        bad = [b for b in bad if b]
        if bad:
            raise ShapeError(f"{self.name} cannot make {num_frames} frames of {height}x{width}: {'; '.join(bad)}; "
                             f"pick e.g. {max(1, (num_frames - 1) // t) * t + 1} frames of "
                             f"{max(1, height // (s * ph)) * s * ph}x{max(1, width // (s * pw)) * s * pw}")
        return {"latent_frames": (num_frames - 1) // t + 1, "latent_height": height // s, "latent_width": width // s}

    # -- optional capabilities: a family overrides them or they raise a typed error ----------------
    @property
    def experts(self) -> tuple[str, ...]:
        """``("high", "low")`` for a boundary-switched pair of transformers (Wan 2.2 A14B), else ``()``."""
        return ()

    def expert(self, name: str) -> ModelAdapter:
        """The adapter of one expert (its own weights, same family facts)."""
        from trt_sora.errors import ModelError

        raise ModelError(f"model {self.name} is one transformer, it has no expert {name!r}")

    def enable_sequence_parallel(self, model, seq) -> None:
        """Split ``model``'s token sequence over ``seq`` (:class:`trt_sora.parallel.SeqShard`):
        shard after the input embedding, all-to-all around self-attention, gather before the
        output head. Families that support Ulysses override this."""
        from trt_sora.errors import ConfigError

        raise ConfigError(f"model family {self.family!r} has no sequence-parallel (Ulysses) path; use ulysses=1")

    def sparse_attention_sites(self, model) -> dict[str, Any]:
        """``{block path: object with a ``sparse`` seam}`` for each self-attention of a loaded ``model`` (the
        seam: None for dense, or :class:`trt_sora.sparse.TileSparse`), a capability a family may provide."""
        from trt_sora.errors import ConfigError

        raise ConfigError(f"model family {self.family!r} has no sparse attention path; set "
                          "sparse_attention.enabled: false")

    def token_grid(self, hidden_shape: Sequence[int]) -> tuple[int, int, int]:
        """The self-attention's token grid (latent frames, height, width after patching) for the transformer
        input ``hidden_states`` of ``hidden_shape`` [B, C, F, H, W]; tokens in raster order over it."""
        return tuple(int(n) // p for n, p in zip(hidden_shape[2:5], self.patch_size))  # type: ignore[return-value]

    def torch_fp8_rewrite(self) -> Callable[..., list]:
        """The torch-fp8 backend's block rewrite, a capability a family may provide:
        ``rewrite(model, plan, *, fused, counters, fast_accum) -> blocks`` turns a loaded model's
        planned linears into FP8 GEMMs in place (:mod:`trt_sora.kernels.fp8_linear`); each returned
        block has ``name`` and ``fp8_attention``. A family without it raises ConfigError."""
        raise torch_fp8_unsupported(self, f"model family {self.family!r} has no torch-fp8 block rewrite")

    def attention_keys_all_valid(self, inputs: Mapping[str, Any]) -> bool:
        """Whether every self-attention key of a call with ``inputs`` (the model's inputs by name,
        torch tensors) is a real token; the torch-fp8 runner reports it (a family that masks keys gives
        its 8-bit attention key lengths). Default: the family never masks keys."""
        return True

    def diffusers_pipeline(self, transformer, *, encode, scheduler, defaults: Mapping[str, Any]):
        """A ready diffusers pipeline of the family around ``transformer`` whose prompts go through
        ``encode`` and whose call defaults are ``defaults`` (see ``trt_sora.runtime.diffusers_pipeline``)."""
        from trt_sora.errors import ModelError

        raise ModelError(f"model family {self.family!r} has no diffusers pipeline helper yet; drive the "
                         "runtime with trt_sora.runtime.generate")
