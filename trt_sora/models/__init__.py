"""Model registry: a name (``wan-tiny``) or a local diffusers checkpoint folder -> adapter."""
from __future__ import annotations

from pathlib import Path

from trt_sora.config.base import did_you_mean
from trt_sora.errors import ModelError
from trt_sora.models.base import ModelAdapter, ModelSpec

#: The embedded default model of ``make engine``: a small Wan trained here (weights ship in the repo).
DEFAULT_MODEL = "wan-shapes"


def _named() -> dict[str, ModelSpec]:
    from trt_sora.models import wan

    specs = {
        name: ModelSpec(ref=name, family="wan", source="random-init", config=cfg, seed=0,
                        text_encoder="hash", defaults=wan.DEFAULTS[name])
        for name, cfg in wan.CONFIGS.items()
    }
    specs["wan-shapes"] = _wan_shapes_spec()
    return specs


def _wan_shapes_spec() -> ModelSpec:
    """The trained pixel-space reference model (``trt_sora/models/moving_shapes``, MODEL_CARD.md)."""
    import json

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


def list_models() -> list[str]:
    return sorted(_named())


def resolve(ref: str) -> ModelSpec:
    """Resolve a registry name or a checkpoint folder path to a :class:`ModelSpec`."""
    named = _named()
    if not isinstance(ref, str) or not ref.strip():
        raise ModelError(f"model {ref!r} is empty; pass a registered name ({', '.join(sorted(named))}) or a "
                         "diffusers checkpoint folder, or leave --model out for the recipe's model.default")
    if ref in named:
        return named[ref]
    path = Path(ref)
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"{ref} is a file; pass a diffusers checkpoint folder (with config.json or "
                             "transformer/config.json) or one of: " + ", ".join(sorted(named)))
        from trt_sora.models import wan

        spec = wan.spec_from_folder(ref, path)
        if spec is None:
            raise ModelError(
                f"{ref} is not a diffusers checkpoint of a supported model: expected config.json with "
                f"_class_name {wan.CLASS_NAME!r} in it or in its transformer/ subfolder"
            )
        return spec
    raise ModelError(f"unknown model {ref!r}{did_you_mean(ref, named)}: not a registered name "
                     f"({', '.join(sorted(named))}) and no such folder")


def get_adapter(ref: str | ModelSpec) -> ModelAdapter:
    """The adapter for a model name, checkpoint folder or spec."""
    spec = ref if isinstance(ref, ModelSpec) else resolve(ref)
    if spec.family == "wan":
        from trt_sora.models.wan import WanAdapter

        return WanAdapter(spec)
    raise ModelError(f"model family {spec.family!r} has no adapter yet")


def adapter_for_manifest(entry: dict) -> ModelAdapter:
    """The adapter for an export manifest's ``results.model`` entry: its registry name when that is
    registered (so a named checkpoint such as ``wan-shapes`` keeps its own buckets, text encoder and
    defaults), else its checkpoint folder, else its recorded family + config (an unregistered random-init
    architecture), else its ref. The text encoder and sampling settings the entry records (what the
    artifact was calibrated and checked with) take precedence."""
    return _with_record(_adapter_for_entry(entry), entry)


def _adapter_for_entry(entry: dict) -> ModelAdapter:
    ref = entry.get("ref")
    if ref in _named():
        return get_adapter(ref)
    if entry.get("source") == "checkpoint" and entry.get("path"):
        if not Path(entry["path"]).exists() and entry.get("config") and entry.get("family"):
            # the checkpoint is not on this machine (a server holding only the artifact): the recorded
            # config still answers every family fact; loading weights raises ModelError naming the path
            from trt_sora.models import wan

            if entry["family"] == "wan":
                return get_adapter(wan.spec_from_record(entry))
        return get_adapter(entry["path"])
    if entry.get("source") == "random-init" and entry.get("config") and entry.get("family") and ref not in _named():
        # an unregistered architecture built from a config (tests, sweeps): the config answers the facts
        return get_adapter(ModelSpec(ref=ref or "model", family=entry["family"], source="random-init",
                                     config=dict(entry["config"]), text_encoder="hash"))
    return get_adapter(ref)


def _with_record(adapter: ModelAdapter, entry: dict) -> ModelAdapter:
    import dataclasses

    changes = {}
    if entry.get("text_encoder") and entry["text_encoder"] != adapter.spec.text_encoder:
        changes["text_encoder"] = entry["text_encoder"]
    recorded = dict(entry.get("sampling") or {})
    if "negative_prompt" in entry:
        recorded["negative_prompt"] = entry["negative_prompt"]
    if any(adapter.spec.defaults.get(k) != v for k, v in recorded.items()):
        changes["defaults"] = {**adapter.spec.defaults, **recorded}
    return type(adapter)(dataclasses.replace(adapter.spec, **changes)) if changes else adapter


__all__ = ["DEFAULT_MODEL", "ModelAdapter", "ModelSpec", "adapter_for_manifest", "get_adapter", "list_models",
           "resolve"]
