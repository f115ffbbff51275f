"""Prompts in, clips out: text encoding, the model's sampler with CFG, decoding, over a runtime runner.

::

    import trt_sora.runtime as rt
    runner = rt.load("build/wan-shapes/rtx4090-fp8")
    clips = rt.generate(runner, ["a red circle moving right on a black background"], seed=0)
    clips[0].frames            # uint8 [num_frames, height, width, 3]
    clips[0].metadata          # prompt, seed, sampling, cfg, scheduler, text encoder, decoder, timings, ...

Everything a clip depends on comes from the run folder: the model (export manifest), its text
encoder and sampling settings (recorded there with the model; the model's own otherwise), the
shape buckets, and the family's decoder (the checkpoint's VAE through diffusers for latent models,
identity for pixel-space models such as wan-shapes). The denoising loop is
:func:`trt_sora.sampling.sample`, the one sampler calibration and parity also run.

Batching: clips that share settings and size are denoised together, as many per transformer call
as a bucket allows (with CFG, both branches of every clip in one call when a bucket takes twice
the batch). Every clip's noise is drawn from its own seed, so a clip does not depend on what it is
batched with beyond the backend's arithmetic: each clip is decoded alone, and ONNX Runtime on the
CPU gives every row the same bits at any batch size, so there a clip is bit-identical however it was
batched (GPU backends may pick other kernels per batch size: then batched clips can differ from
unbatched ones in the last bits, within the artifact's parity).

torch is imported inside the functions; importing this module loads numpy and the standard library.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trt_sora.errors import ConfigError, ShapeError
from trt_sora.runfolder import RunFolder

log = logging.getLogger("trt_sora")

__all__ = ["Clip", "ClipRequest", "Generator", "check_bounds", "clip_requests", "generate", "run_to_files", "to_uint8"]

CFG_CHOICES = ("auto", "batched", "split")
#: Request bounds, checked before any work. Steps: flow matching trains on 1000 timesteps, more steps
#: only repeat them. Guidance: every family's default lies in 1-10 (Wan 5, HunyuanVideo 6); far past
#: that CFG only saturates the clip, and 1e30-sized scales overflow the latents. Shift: the families'
#: defaults are single digits (Wan 3-5); a bound of 100 leaves room and refuses infinities.
MAX_STEPS = 1000
MAX_GUIDANCE = 50.0
MAX_SHIFT = 100.0
#: Pixel-repeat upscaling of written clips (``--scale``): past this it only multiplies the file size.
MAX_SCALE = 64


@dataclasses.dataclass(frozen=True)
class ClipRequest:
    """One clip to make. ``None`` fields take the run folder's defaults (see :meth:`Generator.resolve`).

    Attributes:
        prompt: the caption.
        seed: noise seed (the clip's noise is drawn from it alone).
        negative_prompt: the unconditional branch's text; None = the model's own unconditional
            conditioning (``adapter.negative_conditioning``: Wan's encoded negative prompt, wan-shapes'
            zero embedding).
        steps, guidance, shift: sampling overrides (default: the artifact's sampling settings).
        num_frames, height, width: pixel size (default: the first bucket's opt point).
        image: the conditioning image of an image-to-video model (required by Wan 2.1 I2V, optional
            for Wan 2.2 TI2V, refused by text-to-video models): a file path or a
            ``data:image/...;base64,`` URL (JSONL lines and HTTP bodies), or in Python a PIL image or
            a uint8 array ``[H, W, 3]``; resized to the clip's size (:func:`trt_sora.runtime.video.read_image`)
            and encoded as the model family says (``adapter.image_conditioning``).
        truncate: accept a prompt longer than the text encoder's tokens at this size by cutting it
            (the clip's metadata then says so under ``truncated``); False: such a prompt is refused
            with a ConfigError naming the limit.
    """

    prompt: str
    seed: int = 0
    negative_prompt: str | None = None
    steps: int | None = None
    guidance: float | None = None
    shift: float | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    image: Any = None
    truncate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ConfigError(f"prompt must be a string, got {type(self.prompt).__name__}")
        if not self.prompt.strip():
            raise ConfigError("prompt is empty; describe the clip, e.g. \"a red circle moving right\"")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise ConfigError(f"negative_prompt must be a string, got {type(self.negative_prompt).__name__}")
        for k in ("prompt", "negative_prompt"):
            if "\x00" in (getattr(self, k) or ""):
                raise ConfigError(f"{k} contains a NUL character; send plain text")
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"truncate={self.truncate!r} must be true or false")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"seed={self.seed!r} must be an integer in [0, 2**63)")
        for k in ("steps", "num_frames", "height", "width"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{k}={v!r} must be an integer >= 1")
        for k in ("guidance", "shift"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ConfigError(f"{k}={v!r} must be a number")
        image = self.image
        if image is not None and not (isinstance(image, (str, os.PathLike, np.ndarray)) or hasattr(image, "convert")):
            raise ConfigError(f"image must be a file path or a data:image/...;base64 URL (in Python also a PIL image "
                              f"or a uint8 array), got {type(self.image).__name__}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "request") -> ClipRequest:
        """From a JSON object (a batch line, an HTTP body); unknown keys are a ConfigError."""
        from trt_sora.config.base import did_you_mean

        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected a JSON object with at least \"prompt\", got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in names]
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], names)}; "
                              f"known keys: {', '.join(names)}")
        if "prompt" not in d:
            raise ConfigError(f"{where}: missing \"prompt\"")
        try:
            return cls(**dict(d))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def check_bounds(req: ClipRequest, *, where: str = "request") -> ClipRequest:
    """``req`` when its settings lie in :data:`MAX_STEPS` / :data:`MAX_GUIDANCE` / :data:`MAX_SHIFT`'s
    ranges (finite); else a ConfigError naming the field and the range. Checked by :func:`clip_requests`
    (``generate``) and batch lines before any work."""
    if req.steps is not None and req.steps > MAX_STEPS:
        raise ConfigError(f"{where}: steps={req.steps} is more than {MAX_STEPS} (the scheduler's train timesteps); "
                          "ask for fewer")
    for k, lo, hi, lo_text in (("guidance", 0.0, MAX_GUIDANCE, "0 (<= 1: no CFG)"),
                               ("shift", 0.0, MAX_SHIFT, "just above 0")):
        v = getattr(req, k)
        if v is not None and (not math.isfinite(v) or not lo <= v <= hi or (k == "shift" and v == lo)):
            raise ConfigError(f"{where}: {k}={v!r} is out of range: give a finite number from {lo_text} to {hi:g}")
    return req


@dataclasses.dataclass
class Clip:
    """A generated clip: ``frames`` uint8 ``[num_frames, height, width, 3]`` (RGB), the final
    ``latents`` fp32 ``[C, latent_frames, latent_height, latent_width]`` and ``metadata`` (JSON-safe:
    prompt, seed, sampling settings, CFG mode, scheduler, text encoder, decoder, model, backend,
    batch, timings). ``frames`` is None for a clip whose decode was stopped (``Generator.run``'s ``wanted``)."""

    prompt: str
    seed: int
    frames: np.ndarray | None
    latents: np.ndarray
    metadata: dict

    @property
    def fps(self) -> float:
        return float(self.metadata.get("fps", 16))


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """A request with every default filled in; ``key`` groups clips that can share a call."""

    request: ClipRequest
    settings: Any  # SamplingSettings
    point: dict  # latent point without batch: latent_frames/height/width, text_len
    size: tuple[int, int, int]  # num_frames, height, width
    truncated: dict = dataclasses.field(default_factory=dict)  # text dim -> [tokens, kept] of a cut prompt

    @property
    def key(self) -> tuple:
        s = self.settings
        return (s.num_steps, s.guidance_scale, s.shift, self.request.image is None,
                *(self.point[k] for k in sorted(self.point)))


def to_uint8(frames) -> np.ndarray:
    """Frames ``[3, F, H, W]`` float in ``[-1, 1]`` (a torch tensor on any device, or an array) -> uint8
    ``[F, H, W, 3]`` on the host: ``round((clip(x, -1, 1) + 1) * 127.5)`` in float32, half to even.

    Computed where the tensor lies, so a GPU's frames cross to the host as uint8 (a quarter of float32's
    bytes) and the host does no float work on them."""
    import torch

    x = frames if isinstance(frames, torch.Tensor) else torch.from_numpy(np.asarray(frames, dtype=np.float32))
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous().cpu().numpy()


class Generator:
    """Generation over one runner: the text encoder and decoder are loaded once, on first use.

    Args:
        runner: a :class:`trt_sora.runtime.ServingRunner` (``runtime.load``), or any runner with
            ``infer``, ``buckets`` and ``run_dir``.
        text_encoder: override the recorded text encoder (``"hash"``, ``"minilm"``, an embedding
            ``.safetensors``, a pipeline folder with ``text_encoder/``).
        adapter: override the model adapter (default: from the run folder's export manifest).

    Thread-safe: concurrent :meth:`run` calls share the runner's pool; loading is locked.
    """

    def __init__(self, runner, *, text_encoder: str | None = None, adapter=None):
        self.runner = runner
        self.run_dir = Path(getattr(runner, "run_dir", "."))
        rf = RunFolder(self.run_dir)
        entry = rf.export_side(rf.read_pair()).read_manifest("export")["results"]["model"]
        if adapter is None:
            from trt_sora.models import adapter_for_manifest

            adapter = adapter_for_manifest(entry)
        self.adapter = adapter
        self.settings = adapter.sampling
        self.sampling_source = ("recorded in export/manifest.json" if entry.get("sampling")
                                else f"the model's ({adapter.name}; this run folder predates recording it)")
        self.text_encoder_source = text_encoder or adapter.spec.text_encoder or "hash"
        self._text_override = text_encoder
        self._encode = None
        self._decode_groups = None
        self.decoder_description = ""
        self._lock = threading.Lock()
        self.checked = _checked(self.run_dir)

    # -- defaults ---------------------------------------------------------------------------------
    @property
    def default_point(self) -> dict[str, int]:
        """The first bucket's opt point without batch (the default clip size; every text dim)."""
        return {k: int(v) for k, v in self.runner.buckets[0].point("opt").items() if k != "batch"}

    @property
    def default_size(self) -> tuple[int, int, int]:
        """``(num_frames, height, width)`` of :attr:`default_point`."""
        return self.adapter.pixel_size(self.default_point)

    @property
    def warmup_image(self) -> np.ndarray | None:
        """A mid-grey image of the default size when the model needs one (a server's warm-up and
        probe requests), else None."""
        if self.adapter.image_input != "required":
            return None
        _, h, w = self.default_size
        return np.full((h, w, 3), 128, np.uint8)

    @property
    def warmup_prompt(self) -> str:
        """A prompt the text encoder can encode (a server's warm-up): ``"warm-up"``, or the first
        caption of a precomputed embedding file (it encodes no other)."""
        known = getattr(self._parts()[0], "index", None)
        return next(iter(known)) if known else "warm-up"

    def resolve(self, req: ClipRequest) -> _Resolved:
        """Fill the defaults in; ShapeError / ConfigError for a size or setting the artifact cannot run."""
        settings = self.settings.override(num_steps=req.steps, guidance_scale=req.guidance, shift=req.shift)
        f0, h0, w0 = self.default_size
        size = (req.num_frames or f0, req.height or h0, req.width or w0)
        lat = self.adapter.latent_size(*size)
        self._check_image(req)
        point = {**lat, **self._text_dims(lat, size)}
        return _Resolved(req, settings, point, size, self._check_length(req, point))

    def _check_length(self, req: ClipRequest, point: Mapping[str, int]) -> dict:
        """``{text dim: [tokens, kept]}`` for each dim a prompt (or negative prompt) of ``req`` needs
        more tokens of than ``point`` holds; a ConfigError naming the limit unless ``req.truncate``.
        An encoder that cannot count tokens (a precomputed embedding file) is not checked."""
        counts = getattr(self._parts()[0], "token_counts", None)
        if counts is None:
            return {}
        texts = [("prompt", req.prompt)] + ([("negative_prompt", req.negative_prompt)] if req.negative_prompt else [])
        cut: dict = {}
        for (field, _), need in zip(texts, counts([t for _, t in texts])):
            for dim, n in need.items():
                limit = int(point.get(dim, n))
                if n <= limit:
                    continue
                if not req.truncate:
                    raise ConfigError(f"{field} has {n} tokens; {self.text_encoder_source}'s {dim} at this size is "
                                      f"{limit}: shorten it, or ask to cut it (\"truncate\": true, `trt-sora "
                                      "generate --truncate`)")
                cut[f"{field}.{dim}" if field != "prompt" else dim] = [n, limit]
        return cut

    def _check_image(self, req: ClipRequest) -> None:
        need = self.adapter.image_input
        if need == "required" and req.image is None:
            raise ConfigError(f"{self.adapter.name} is image-to-video: give the conditioning image (generate(..., "
                              "image=PATH), `trt-sora generate --image PATH`, \"image\": PATH in a batch line, or "
                              "\"image\": \"data:image/png;base64,...\" in an HTTP request)")
        if need == "none" and req.image is not None:
            raise ConfigError(f"{self.adapter.name} is text-to-video: it takes no conditioning image; leave the "
                              "image out")
        im = req.image
        if isinstance(im, (str, os.PathLike)) and not str(im).startswith("data:"):
            from trt_sora.runtime.video import check_image_path

            check_image_path(im)

    def _text_dims(self, lat: Mapping[str, int], size) -> dict[str, int]:
        """The text dims (``text_len`` and the family's own, e.g. ``text_len_2``) of the first bucket
        holding ``lat``: their opt values."""
        for b in self.runner.buckets:
            if all(getattr(b, k).contains(v) for k, v in lat.items()):
                return {k: int(r.opt) for k, r in b.dims() if k.startswith("text_len")}
        listing = "; ".join(f"{b.name}: {self.adapter.pixel_size(b.point('min'))} .. "
                            f"{self.adapter.pixel_size(b.point('max'))}" for b in self.runner.buckets)
        raise ShapeError(f"no bucket of {self.run_dir} makes {size[0]} frames of {size[1]}x{size[2]} "
                         f"(latent {lat['latent_frames']}x{lat['latent_height']}x{lat['latent_width']}); "
                         f"(frames, height, width) per bucket: {listing}; pick a size inside one or rebuild "
                         "with a bucket for it")

    def call_batches(self, r: _Resolved) -> list[int]:
        """Transformer-call batch sizes some bucket takes at ``r``'s point, ascending."""
        hi = max(b.batch.max for b in self.runner.buckets)
        return [n for n in range(1, hi + 1) if any(b.contains({**r.point, "batch": n}) for b in self.runner.buckets)]

    def cfg_mode(self, r: _Resolved, cfg: str = "auto") -> str:
        """``"none"`` without guidance; else ``"batched"`` when a bucket takes both branches of a
        clip in one call (``cfg="auto"`` / ``"batched"``), else ``"split"``."""
        if cfg not in CFG_CHOICES:
            raise ConfigError(f"cfg={cfg!r}; use one of {', '.join(CFG_CHOICES)}")
        if not r.settings.uses_cfg:
            return "none"
        if cfg == "split":
            return "split"
        if 2 in self.call_batches(r):
            return "batched"
        if cfg == "batched":
            raise ShapeError(f"cfg='batched' needs a bucket with batch 2 at {r.point}; buckets: "
                             f"{[(b.name, b.batch.to_yaml()) for b in self.runner.buckets]}; use cfg='split'")
        return "split"

    def clip_batches(self, r: _Resolved, cfg: str = "auto") -> list[int]:
        """How many clips one call group may hold at ``r`` (ascending): call batches / 2 with
        batched CFG."""
        per = 2 if self.cfg_mode(r, cfg) == "batched" else 1
        calls = set(self.call_batches(r))
        return [n for n in range(1, max(calls, default=0) // per + 1) if n * per in calls]

    def max_clips(self, r: _Resolved, cfg: str = "auto") -> int:
        """The most clips one call group can hold at ``r`` (the bucket's batch; halved by batched CFG)."""
        sizes = self.clip_batches(r, cfg)
        if not sizes:
            raise ShapeError(f"no bucket of {self.run_dir} takes one clip at {r.point}")
        return sizes[-1]

    # -- loading ----------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """Where the text encoder and the decoder run: the runner's GPU (decoding in bf16 there), else
        the CPU in fp32."""
        dev = str(getattr(self.runner, "device", "cpu") or "cpu")
        return dev if dev.startswith("cuda") else "cpu"

    def _parts(self):
        with self._lock:
            if self._encode is None:
                import torch

                gpu = self.device.startswith("cuda")
                self._encode = self.adapter.text_encoder(self._text_override, device=self.device if gpu else None)
                self._decode_groups, self.decoder_description = self.adapter.frame_decoder(
                    *((self.device, torch.bfloat16) if gpu else (None, None)))
                if "random" in self.decoder_description:
                    log.warning("generate: %s has no VAE weights; decoding with a %s", self.adapter.name,
                                self.decoder_description)
        return self._encode, self._decode_groups

    # -- generation -------------------------------------------------------------------------------
    def run(self, requests: Sequence[ClipRequest], *, cfg: str = "auto", max_batch: int | None = None,
            hook: Callable | None = None, on_frames: Callable | None = None,
            wanted: Callable | None = None) -> list[Clip]:
        """Clips for ``requests``, in order. Requests with the same settings and size are denoised
        together in groups of at most ``max_batch`` clips (default: what the buckets allow).

        ``hook``: :func:`trt_sora.sampling.sample`'s per-call hook (e.g. to time calls).
        ``on_frames(i, frames)``: called with each group of request ``i``'s frames (uint8
        ``[f, H, W, 3]``, in order; together the clip's) as the family's decoder makes them
        (``adapter.frame_decoder``: Wan, latent frame by latent frame), before the clip is whole.
        ``wanted(i)``: asked before each group of request ``i``'s frames is decoded; False stops
        that clip's decode and it comes back with ``frames=None`` (a server's cancelled job).
        Raises ShapeError (size outside every bucket), ConfigError (bad setting), and what the
        backend raises.
        """
        return self.run_resolved(self._resolve_all(requests), cfg=cfg, max_batch=max_batch, hook=hook,
                                 on_frames=on_frames, wanted=wanted)

    def _resolve_all(self, requests: Sequence[ClipRequest]) -> list[_Resolved]:
        if isinstance(requests, (str, ClipRequest)):
            raise ConfigError("pass a list of requests")
        return [self.resolve(r) for r in requests]

    def run_resolved(self, resolved: Sequence[_Resolved], *, cfg: str = "auto", max_batch: int | None = None,
                     hook: Callable | None = None, on_frames: Callable | None = None,
                     wanted: Callable | None = None) -> list[Clip]:
        """:meth:`run` of requests already :meth:`resolve`-d (for a caller that reads their sizes first, as
        :func:`run_to_files` does: each request is resolved, its prompts tokenised, once)."""
        out: list[Clip | None] = [None] * len(resolved)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(resolved):
            groups.setdefault(r.key, []).append(i)
        for idx in groups.values():
            for chunk in self._chunks(resolved[idx[0]], len(idx), cfg, max_batch):
                part, idx = idx[:chunk], idx[chunk:]
                frames = None if on_frames is None else (lambda j, f, part=part: on_frames(part[j], f))
                keep = None if wanted is None else (lambda j, part=part: wanted(part[j]))
                for i, clip in zip(part, self._run_group([resolved[i] for i in part], cfg, hook, frames, keep)):
                    out[i] = clip
        return out  # type: ignore[return-value]

    def _chunks(self, r: _Resolved, n: int, cfg: str, max_batch: int | None) -> list[int]:
        sizes = [s for s in self.clip_batches(r, cfg) if max_batch is None or s <= max_batch]
        if not sizes:
            raise ShapeError(f"no bucket of {self.run_dir} takes {max_batch} clip(s) at {r.point} "
                             f"(buckets: {[(b.name, b.batch.to_yaml()) for b in self.runner.buckets]})")
        chunks = []
        while n > 0:
            fit = [s for s in sizes if s <= n]
            if not fit:
                raise ShapeError(f"{n} clip(s) at {r.point}: no bucket takes that few; buckets take "
                                 f"{sizes} clip(s) per call")
            chunks.append(fit[-1])
            n -= fit[-1]
        return chunks

    def _run_group(self, group: list[_Resolved], cfg: str, hook, on_frames=None, wanted=None) -> list[Clip]:
        import torch

        from trt_sora.sampling import gaussian_noise, runner_call, sample

        encode, decode_groups = self._parts()
        r0 = group[0]
        mode = self.cfg_mode(r0, cfg)
        settings, p = r0.settings, r0.point
        t0 = time.perf_counter()
        point = {**p, "batch": len(group)}
        cond, uncond = self.adapter.conditioning(encode, [g.request.prompt for g in group], point,
                                                 negative=[g.request.negative_prompt for g in group],
                                                 shared=self._image_conditioning(group), cfg=settings.uses_cfg)
        t1 = time.perf_counter()
        shape = (1, self.adapter.latent_channels, p["latent_frames"], p["latent_height"], p["latent_width"])
        noise = torch.cat([gaussian_noise(shape, g.request.seed) for g in group])
        label = f"{len(group)} clip(s) at {r0.size[0]} frames {r0.size[1]}x{r0.size[2]}"
        scheduler = self.adapter.scheduler(settings.shift)
        served: dict[str, list[int]] = {}

        def tick(info):  # which expert the sampler sent each step to (metadata), then the caller's hook
            if info.expert is not None and info.step not in served.setdefault(info.expert, []):
                served[info.expert].append(info.step)
            return hook(info) if hook else None

        cached = getattr(self.runner, "caching", None)  # the step caching its check passed (runtime.load)
        cache = cached.schedule if cached is not None and cached.applies_to(settings) else None
        res = sample(runner_call(self.runner), noise, cond, uncond, scheduler=scheduler, settings=settings,
                     cfg="split" if mode == "none" else mode, dtype=torch.float32, hook=tick, label=label,
                     conditioner=self.adapter, cache=cache)
        t2 = time.perf_counter()
        # one clip at a time: a decoder's convolutions need not give the same bits at another batch size
        frames = [_decode(decode_groups, res.latents, i, on_frames, wanted) for i in range(len(group))]
        t3 = time.perf_counter()
        call_batch = len(group) * (2 if mode == "batched" else 1)
        bucket = self.runner.bucket_for({**p, "batch": call_batch}).name
        seconds = {"encode": round(t1 - t0, 4), "sample": round(t2 - t1, 4), "decode": round(t3 - t2, 4),
                   "total": round(t3 - t0, 4)}
        common = self._metadata(settings, mode, scheduler, r0, bucket, len(group), call_batch, seconds)
        if cached is not None:
            common["caching"] = _caching_metadata(cached, cache, res.steps, settings)
        if settings.experts:
            common["experts"] = {"boundary_timestep": settings.boundary_timestep,
                                 "steps": {e: served.get(e, []) for e in settings.experts}}
        latents = res.latents.float().cpu().numpy()
        return [Clip(prompt=g.request.prompt, seed=g.request.seed, frames=frames[i], latents=latents[i],
                     metadata={"prompt": g.request.prompt, "negative_prompt": g.request.negative_prompt,
                               "unconditional": self.negative_description(g.request.negative_prompt)
                               if settings.uses_cfg else "none (no CFG)", "seed": g.request.seed,
                               "image": self._image_record(g.request.image), **common,
                               **({"truncated": g.truncated} if g.truncated else {}),
                               "batch": {**common["batch"], "index": i}})
                for i, g in enumerate(group)]

    def _image_conditioning(self, group: list[_Resolved]) -> dict:
        """What both CFG branches share, ``{name: [B, ...]}``: each clip's image encoded as the family
        says (``adapter.image_conditioning``); without images, the family's text-to-video conditioning
        (``{}`` for Wan, zero image latents and tokens for HunyuanVideo 1.5; :meth:`resolve` refused a
        missing image where the model needs one)."""
        import torch

        from trt_sora.runtime.video import read_image

        images = [g.request.image for g in group]
        if any(i is None for i in images) and not all(i is None for i in images):
            raise ConfigError("a call group mixes clips with and without a conditioning image; generate them "
                              "apart")  # grouping keys keep them apart; this guards direct Generator use
        point = {**group[0].point, "batch": 1}
        if images[0] is None:
            return self.adapter.image_conditioning({**point, "batch": len(group)})
        _, h, w = group[0].size
        rows = []
        for im in images:
            pixels = torch.from_numpy(read_image(im, h, w)).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            rows.append(self.adapter.image_conditioning(point, images=pixels))
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    def _image_record(self, image) -> dict | None:
        """What a clip's metadata says of its conditioning image (JSON-safe)."""
        if image is None:
            return None
        if isinstance(image, os.PathLike):
            image = str(image)
        src = image if isinstance(image, str) and not image.startswith("data:") else \
            ("data URL" if isinstance(image, str) else type(image).__name__)
        return {"source": src, "encoding": self.adapter.image_encoder_description()}

    def negative_description(self, negative: str | None) -> str:
        """What the unconditional branch of a clip was conditioned on, in words."""
        if negative is not None:
            return f"negative prompt {negative!r}"
        own = self.adapter.spec.defaults.get("negative_prompt", "")
        return "the model's zero embedding" if own is None else f"the model's negative prompt {own!r}"

    def _metadata(self, settings, mode, scheduler, r: _Resolved, bucket, clips, call_batch, seconds) -> dict:
        from trt_sora import __version__

        sc = dict(getattr(scheduler, "config", {}) or {})
        spec = self.adapter.spec
        f, h, w = r.size
        return {
            "sampling": settings.to_dict(), "sampling_source": self.sampling_source,
            "sampler": "trt_sora.sampling.sample (flow-matching Euler + classifier-free guidance)",
            "cfg": mode,
            "scheduler": {"class": type(scheduler).__name__, "shift": sc.get("shift"),
                          "num_train_timesteps": sc.get("num_train_timesteps")},
            "text_encoder": self.text_encoder_source, "text_len": r.point["text_len"],
            "text_dims": {k: v for k, v in r.point.items() if k.startswith("text_len")},
            "decoder": self.decoder_description,
            "size": {"num_frames": f, "height": h, "width": w}, "fps": self.adapter.fps,
            "latent": {k: r.point[k] for k in ("latent_frames", "latent_height", "latent_width")},
            "model": {"ref": spec.ref, "family": self.adapter.family, "model_hash": spec.model_hash()},
            "run": str(self.run_dir), "backend": getattr(self.runner, "backend", type(self.runner).__name__),
            "bucket": bucket, "batch": {"clips": clips, "call_batch": call_batch},
            "checked": self.checked, "seconds": seconds, "trt_sora": __version__,
        }


def _decode(decode_groups, latents, i: int, on_frames, wanted) -> np.ndarray | None:
    """Clip ``i``'s uint8 frames ``[F, H, W, 3]`` from ``latents[i]`` alone, group by group
    (``on_frames(i, frames)`` with each as it is made); None, decoding no further, once ``wanted(i)``
    says False (asked before the first group and after each)."""
    if wanted is not None and not wanted(i):
        return None
    parts = []
    for x in decode_groups(latents[i:i + 1]):
        parts.append(to_uint8(x[0]))
        if on_frames is not None:
            on_frames(i, parts[-1])
        if wanted is not None and not wanted(i):
            return None
    return np.concatenate(parts)


class _Mp4Streams:
    """``on_frames(i, frames)`` of :meth:`Generator.run` that streams clip ``i``'s groups into an
    :class:`~trt_sora.runtime.video.Mp4Writer` on ``paths[i]`` (opened at its first group, closed at its
    ``counts[i]``-th frame); ``waited[i]``: seconds its close waited for ffmpeg after the last group."""

    def __init__(self, paths: Mapping[int, Path], counts: Mapping[int, int], fps: float, scale: int, preset: str):
        self.paths, self.counts, self.fps, self.scale, self.preset = paths, counts, fps, scale, preset
        self.writers: dict[int, Any] = {}
        self.waited: dict[int, float] = {}

    def __call__(self, i: int, frames: np.ndarray) -> None:
        from trt_sora.runtime.video import Mp4Writer

        if i not in self.paths:
            return
        if i not in self.writers:
            self.writers[i] = Mp4Writer(self.paths[i], self.fps, height=frames.shape[1], width=frames.shape[2],
                                        scale=self.scale, preset=self.preset)
        self.writers[i].write(frames)
        if self.writers[i].frames == self.counts[i]:
            self.close(i)

    def close(self, i: int) -> None:
        t0 = time.perf_counter()
        self.writers[i].close()
        self.waited[i] = round(time.perf_counter() - t0, 4)

    def abort(self) -> None:
        """Stop every writer not closed (their temp files removed)."""
        for mp4 in self.writers.values():
            mp4.abort()


def run_to_files(gen: Generator, requests: Sequence[ClipRequest], paths: Sequence, *, scale: int = 1,
                 preset: str | None = None, **run) -> list[Clip]:
    """:meth:`Generator.run` (``run``: its keyword arguments) writing clip ``i`` to ``paths[i]``, in the
    format its suffix names (:data:`trt_sora.runtime.video.FORMATS`). An MP4 is written while the clip
    decodes: each group of frames goes to ffmpeg as it is made (:class:`~trt_sora.runtime.video.Mp4Writer`,
    x264 ``preset``, default ``video.DEFAULT_PRESET``), so the encode overlaps the decode; its metadata's
    ``seconds`` then say ``decode_and_encode`` (the decode with the encode beside it, and the wait for ffmpeg to finish,
    ``encode_finish``) instead of ``decode``, and ``tail`` says so. Other formats are written after
    the clip (``seconds.write``). On an error no MP4 is left half-written."""
    from trt_sora.runtime.video import DEFAULT_PRESET, write_clip

    preset = preset or DEFAULT_PRESET
    if len(paths) != len(requests):
        raise ConfigError(f"{len(requests)} requests but {len(paths)} output paths; give one path per request")
    paths = [Path(p) for p in paths]
    resolved = gen._resolve_all(requests)
    streamed = {i: p for i, p in enumerate(paths) if p.suffix.lower() == ".mp4"}
    counts = {i: resolved[i].size[0] for i in streamed}
    sink = _Mp4Streams(streamed, counts, float(gen.adapter.fps), scale, preset)
    given = run.pop("on_frames", None)

    def on_frames(i: int, frames: np.ndarray) -> None:
        sink(i, frames)
        if given is not None:
            given(i, frames)

    try:
        clips = gen.run_resolved(resolved, on_frames=on_frames, **run)
    except BaseException:
        sink.abort()
        raise
    for i, (clip, path) in enumerate(zip(clips, paths)):
        seconds = dict(clip.metadata["seconds"])
        if clip.frames is None:  # its decode was stopped: no file
            if i in sink.writers:
                sink.writers[i].abort()
        elif i in streamed:
            if i not in sink.waited:  # it made another count of frames than asked: closed here, after the run
                sink.close(i)
                seconds["total"] = round(seconds["total"] + sink.waited[i], 4)
            seconds["decode_and_encode"] = seconds.pop("decode")
            seconds["encode_finish"] = sink.waited[i]
            clip.metadata["tail"] = (f"each decoded group streamed to ffmpeg (libx264 crf 18, preset {preset}) as it "
                                     "was made: decode_and_encode holds the decode, the encode overlapped with it "
                                     "and encode_finish, the wait for ffmpeg after the last group")
        elif clip.frames is not None:
            t0 = time.perf_counter()
            write_clip(clip.frames, path, clip.fps, scale=scale)
            seconds["write"] = round(time.perf_counter() - t0, 4)
            seconds["total"] = round(seconds["total"] + seconds["write"], 4)
        clip.metadata["seconds"] = seconds
    return clips


def _caching_metadata(served, cache, steps, settings) -> dict:
    """What a clip's metadata says of step caching: the checked setting, whether it applied (only at the
    sampling settings it was checked at) and the branch calls made and reused."""
    branches = [("cond", "uncond") if settings.guidance_at(r.timestep) > 1.0 else ("cond",) for r in steps]
    reused = {b: [r.step for r in steps if b in r.reused] for b in ("cond", "uncond")}
    total = sum(len(b) for b in branches)
    note = ("the checked schedule" if cache is not None else
            f"not applied: checked at {served.sampling}, this clip samples {settings.to_dict()}")
    return {"setting": served.record.get("setting"), "applied": cache is not None, "note": note,
            "reused": reused, "calls": total - sum(len(v) for v in reused.values()), "calls_uncached": total}


def _checked(run: Path) -> dict:
    """What the run folder's parity report says (passed, the backend and sampling it checked)."""
    import json

    rep = RunFolder(run).parity_report
    if not rep.is_file():
        return {"passed": None, "note": "no parity/report.json"}
    d = json.loads(rep.read_text())
    loop = next((c for c in d.get("comparisons", []) if c.get("level") == "loop"), {})
    return {"passed": bool(d.get("passed")), "backend": d.get("backend"), "sampling": loop.get("sampling")}


_GENERATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GEN_LOCK = threading.Lock()


def generator_for(runner, *, text_encoder: str | None = None) -> Generator:
    """The :class:`Generator` of ``runner`` (one per runner and text encoder, kept while the runner lives)."""
    with _GEN_LOCK:
        per = _GENERATORS.setdefault(runner, {})
        if text_encoder not in per:
            per[text_encoder] = Generator(runner, text_encoder=text_encoder)
        return per[text_encoder]


def generate(runner, prompts: str | Sequence[str], *, steps: int | None = None, guidance: float | None = None,
             seed: int | Sequence[int] = 0, negative_prompt: str | None = None, shift: float | None = None,
             num_frames: int | None = None, height: int | None = None, width: int | None = None,
             cfg: str = "auto", max_batch: int | None = None, text_encoder: str | None = None,
             hook: Callable | None = None, image: Any = None, truncate: bool = False,
             on_frames: Callable | None = None, out: Any = None, scale: int = 1) -> list[Clip]:
    """Generate one clip per prompt with a loaded artifact (``trt_sora.runtime.load``).

    Args:
        runner: the loaded run folder (a :class:`~trt_sora.runtime.ServingRunner`).
        prompts: one caption or a list.
        steps, guidance, shift: sampling overrides; default: the artifact's sampling settings (what it
            was calibrated and checked with; ``clip.metadata["checked"]`` says what parity ran).
        seed: one seed (prompt ``i`` gets ``seed + i``) or one per prompt.
        negative_prompt: text of the unconditional CFG branch (None: the model's own unconditional
            conditioning, what it was calibrated and checked with).
        num_frames, height, width: pixel size (default: the first bucket's opt point; wan-shapes 9x32x32).
        cfg: ``"auto"`` (both branches in one call when a bucket allows), ``"batched"``, ``"split"``.
        max_batch: at most this many clips per transformer call group.
        text_encoder: override the recorded text encoder.
        hook: per-call hook of :func:`trt_sora.sampling.sample`.
        image: the conditioning image of an image-to-video model (one for every prompt, or a list with
            one per prompt): a path, a data URL, a PIL image or a uint8 array (see :class:`ClipRequest`).
        truncate: cut prompts longer than the text encoder's tokens (default: ConfigError naming the limit).
        on_frames: ``on_frames(i, frames)`` with each group of prompt ``i``'s uint8 frames as it is
            decoded (see :meth:`Generator.run`).
        out: also write each clip: one path per prompt (a single path for one prompt), the format by its
            suffix; an MP4 is encoded while its clip decodes (:func:`run_to_files`). ``scale``:
            pixel-repeat upscaling of the written files.

    Returns:
        one :class:`Clip` per prompt, in order (uint8 frames ``[F, H, W, 3]`` + metadata).
    """
    reqs = clip_requests(prompts, seed=seed, negative_prompt=negative_prompt, steps=steps, guidance=guidance,
                         shift=shift, num_frames=num_frames, height=height, width=width, image=image,
                         truncate=truncate)
    gen = generator_for(runner, text_encoder=text_encoder)
    if out is None:
        return gen.run(reqs, cfg=cfg, max_batch=max_batch, hook=hook, on_frames=on_frames)
    paths = [out] if isinstance(out, (str, os.PathLike)) else list(out)
    return run_to_files(gen, reqs, paths, scale=scale, cfg=cfg, max_batch=max_batch, hook=hook, on_frames=on_frames)


def clip_requests(prompts: str | Sequence[str], *, seed: int | Sequence[int] = 0, image: Any = None,
                  **settings) -> list[ClipRequest]:
    """The :class:`ClipRequest` of each prompt (arguments as :func:`generate`'s), checked: ConfigError for
    a bad prompt, seed, setting or count before anything loads."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ConfigError("generate: no prompts given")
    seeds = [seed + i for i in range(len(prompts))] if isinstance(seed, int) and not isinstance(seed, bool) \
        else list(seed)
    if len(seeds) != len(prompts):
        raise ConfigError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
    images = list(image) if isinstance(image, (list, tuple)) else [image] * len(prompts)
    if len(images) != len(prompts):
        raise ConfigError(f"generate: {len(prompts)} prompts but {len(images)} images; pass one image per prompt")
    return [check_bounds(ClipRequest(prompt=p, seed=s, image=im, **settings), where="generate")
            for p, s, im in zip(prompts, seeds, images)]
