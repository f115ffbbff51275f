"""Frozen, typed configuration: shape profiles, stage configs, recipes (YAML in/out)."""
from __future__ import annotations

import os
from pathlib import Path

from trt_sora.config.base import did_you_mean, from_dict, to_dict
from trt_sora.config.recipe import (
    AttentionKernel,
    AttentionMode,
    Backend,
    BuildConfig,
    BuildRequirements,
    CacheMethod,
    CachePlan,
    CachingConfig,
    CalibConfig,
    CalibMethod,
    DType,
    ExportConfig,
    ExternalData,
    ModelConfig,
    ParityConfig,
    ParityGate,
    QuantConfig,
    QuantFormat,
    Recipe,
    SparseAttentionConfig,
    TorchFp8Config,
    recipe_from_dict,
    recipe_to_dict,
)
from trt_sora.config.shapes import DIM_NAMES, DimRange, ShapeProfile, check_point
from trt_sora.errors import ConfigError

__all__ = [
    "AttentionKernel", "AttentionMode", "Backend", "BuildConfig", "BuildRequirements", "CacheMethod", "CachePlan",
    "CachingConfig",
    "CalibConfig",
    "CalibMethod",
    "DIM_NAMES", "DType", "DimRange", "ExportConfig", "ExternalData", "ModelConfig", "ParityConfig",
    "ParityGate", "QuantConfig", "QuantFormat", "Recipe", "ShapeProfile", "SparseAttentionConfig", "TorchFp8Config",
    "check_point",
    "from_dict", "to_dict", "load_recipe", "dump_recipe", "recipe_dirs", "list_recipes",
    "recipe_from_dict", "recipe_to_dict", "repo_root", "data_dir",
]


def repo_root() -> Path:
    """The source checkout holding ``recipes/``, ``calib/`` (editable installs)."""
    return Path(__file__).resolve().parents[2]


def data_dir(name: str) -> Path:
    """The shipped ``recipes`` or ``calib`` folder: ``trt_sora/_<name>`` (package data in a wheel; a
    symlink to the checkout's top-level folder in a source tree), else the checkout's ``<name>/``."""
    packaged = Path(__file__).resolve().parents[1] / f"_{name}"
    return packaged if packaged.is_dir() else repo_root() / name


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up: $TRT_SORA_RECIPES, ./recipes, the shipped recipes."""
    dirs = []
    if os.environ.get("TRT_SORA_RECIPES"):
        dirs.append(Path(os.environ["TRT_SORA_RECIPES"]))
    dirs += [Path.cwd() / "recipes", data_dir("recipes")]
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen and r.is_dir():
            seen.add(r)
            out.append(r)
    return out


def list_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in recipe_dirs():
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the recipe as "
                          "UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror}); check the path and its "
                          "permissions") from None
    except yaml.YAMLError as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML ({msg}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping")
    return data


def load_recipe(ref: str | os.PathLike) -> Recipe:
    """Load a recipe by name (``h100-fp8``) or by path to a YAML file."""
    ref_s = str(ref)
    path = Path(ref_s)
    if not (ref_s.endswith((".yaml", ".yml")) or path.exists()):
        known = list_recipes()
        if ref_s not in known:
            raise ConfigError(
                f"unknown recipe {ref_s!r}{did_you_mean(ref_s, known)}; "
                f"available: {', '.join(sorted(known)) or '(none found)'}"
            )
        path = known[ref_s]
    if not path.is_file():
        raise ConfigError(f"recipe file {path} does not exist; available: {', '.join(sorted(list_recipes()))}")
    data = _read_yaml(path)
    try:
        recipe = recipe_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    import yaml

    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False)
