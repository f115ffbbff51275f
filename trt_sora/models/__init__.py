"""Model registry: a name (``wan-tiny``) or a local diffusers checkpoint folder -> adapter.

A family is one module under ``trt_sora/models/`` listed in :data:`FAMILIES`; it exposes
``ADAPTER`` (its :class:`ModelAdapter`), ``CLASS_NAME`` (the diffusers transformer class its
checkpoints name), ``named_specs()`` (its registered names), ``spec_from_folder(ref, folder)``
(a checkpoint folder of the family, or None) and ``spec_from_record(entry)`` (a manifest's model
entry when the checkpoint is not on this machine). Adding a family is its file and one line here
(or, for a family kept outside the package, one :func:`register_family` call).
"""
from __future__ import annotations

import importlib
from pathlib import Path

from trt_sora.config.base import did_you_mean
from trt_sora.errors import ModelError
from trt_sora.models.base import ModelAdapter, ModelSpec

#: The embedded default model of ``make engine``: a small Wan trained here (weights ship in the repo).
DEFAULT_MODEL = "wan-shapes"

#: ``family -> module``: every model family trt_sora knows.
FAMILIES = {
    "wan": "trt_sora.models.wan",
    "hunyuan": "trt_sora.models.hunyuan",
}


def register_family(name: str, module: str) -> None:
    """Add model family ``name``, implemented by the importable ``module`` (the contract above).
    Registering a known name with another module is a ModelError (one family, one file)."""
    if FAMILIES.get(name, module) != module:
        raise ModelError(f"model family {name!r} is already registered as {FAMILIES[name]}; pick another name")
    FAMILIES[name] = module


def _family(name: str):
    if name not in FAMILIES:
        raise ModelError(f"model family {name!r} has no adapter yet; known families: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name])


def _named() -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for fam in FAMILIES:
        specs.update(_family(fam).named_specs())
    return specs


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
        for fam in FAMILIES:
            spec = _family(fam).spec_from_folder(ref, path)
            if spec is not None:
                return spec
        classes = [_family(f).CLASS_NAME for f in FAMILIES]
        raise ModelError(f"{ref} is not a diffusers checkpoint of a supported model: expected config.json with "
                         f"_class_name in {classes} in it or in its transformer/ subfolder")
    raise ModelError(f"unknown model {ref!r}{did_you_mean(ref, named)}: not a registered name "
                     f"({', '.join(sorted(named))}) and no such folder")


def get_adapter(ref: str | ModelSpec) -> ModelAdapter:
    """The adapter for a model name, checkpoint folder or spec."""
    spec = ref if isinstance(ref, ModelSpec) else resolve(ref)
    return _family(spec.family).ADAPTER(spec)


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
    if entry.get("expert") and entry.get("source") == "checkpoint" and entry.get("path"):
        # one expert of a pair (``<pipeline>/transformer`` or ``transformer_2``): the pair is the pipeline root
        entry = {**entry, "path": str(Path(entry["path"]).parent)}
    if entry.get("source") == "checkpoint" and entry.get("path"):
        if not Path(entry["path"]).exists() and entry.get("config") and entry.get("family") in FAMILIES:
            # the checkpoint is not on this machine (a server holding only the artifact): the recorded
            # config still answers every family fact; loading weights raises ModelError naming the path
            return get_adapter(_family(entry["family"]).spec_from_record(entry))
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


__all__ = ["DEFAULT_MODEL", "FAMILIES", "ModelAdapter", "ModelSpec", "adapter_for_manifest", "get_adapter",
           "list_models", "register_family", "resolve"]
