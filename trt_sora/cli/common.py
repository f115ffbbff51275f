"""Shared CLI helpers: a stage command's arguments and recipe, the argument groups of the commands that
load a run folder, progress lines (CLI only, never in library code), JSON summaries."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager

from trt_sora.runners.registry import BACKENDS

RECIPE_HELP = "recipe name (recipes/*.yaml) or path"
MODEL_HELP = "registry name (see `trt-sora info`) or a diffusers checkpoint folder; default: the recipe's model.default"


def add_stage_args(p, *, model: bool = False, out_help: str = "output folder") -> None:
    """``--recipe R --out DIR`` of a stage command that writes one folder; with ``model``, ``--model M`` first."""
    if model:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--recipe", required=True, help=RECIPE_HELP)
    p.add_argument("--out", required=True, help=out_help)


def stage_recipe(args):
    """The recipe ``--recipe`` names, once ``--out`` is known to be writable (fail before the work, not after it)."""
    from trt_sora.config import load_recipe
    from trt_sora.manifest import check_out_dir

    check_out_dir(args.out)
    return load_recipe(args.recipe)


def overridden(section, **flags):
    """A recipe section with the fields its command-line flags set (None: not given, the recipe's value
    stays), read as the recipe's YAML is (``"int8"`` -> ``QuantFormat.INT8``)."""
    from trt_sora.config.base import from_dict, to_dict

    given = {k: v for k, v in flags.items() if v is not None}
    return from_dict(type(section), {**to_dict(section), **given}, where="command line") if given else section


def add_runtime_args(p) -> None:
    """Arguments that load a run folder (generate, batch and serve)."""
    p.add_argument("--run", required=True, help="run folder build/<model>/<recipe>/ (checked by `trt-sora check`)")
    p.add_argument("--backend", default="auto", choices=["auto", *BACKENDS],
                   help="runtime backend (default auto: TensorRT, else torch-fp8 on an FP8 GPU, else ONNX Runtime)")
    p.add_argument("--device", default=None, help="torch / trt device (default cuda when present)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--force", action="store_true", help="load even when the parity report is missing or failed")
    p.add_argument("--text-encoder", default=None, help="override the recorded text encoder (hash, minilm, a "
                   ".safetensors embedding file, a pipeline folder)")
    p.add_argument("--parallel", default=None, metavar="cfg=2,ulysses=U",
                   help="split every call over the processes of a torchrun job (CFG-parallel x Ulysses sequence "
                        "parallel; torch / torch-fp8 backends): torchrun --nproc-per-node 4 -m trt_sora ... "
                        "--parallel cfg=2,ulysses=2. Rank 0 does the work of the command, the others follow it")


def add_cfg_arg(p) -> None:
    """``--cfg``: how the CFG branches run (generate, batch and serve)."""
    p.add_argument("--cfg", default="auto", choices=["auto", "batched", "split"],
                   help="CFG branches in one call when a bucket allows (auto), always (batched) or two calls (split)")


@contextmanager
def stage_line(name: str):
    """Print ``[stage] ...`` then ``[stage] done in 1.2 s`` (to stderr)."""
    t0 = time.perf_counter()
    print(f"[{name}] running ...", file=sys.stderr, flush=True)
    yield
    print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))


def run_recipe(run, given: str | None = None):
    """``(Recipe, source)`` for a run folder: ``given``, else the ``recipe.yaml`` the pipeline wrote
    there, else the recipe its parity report names, else its folder name (``build/<model>/<recipe>``)
    when that is a known recipe. ConfigError when none applies."""
    from pathlib import Path

    from trt_sora.config import list_recipes, load_recipe
    from trt_sora.errors import ConfigError

    if given:
        return load_recipe(given), "--recipe"
    from trt_sora.runfolder import RunFolder

    run = Path(run)
    rf = RunFolder(run)
    if rf.recipe.is_file():
        return load_recipe(rf.recipe), f"{rf.recipe}"
    rep = rf.parity_report
    if rep.is_file():
        name = json.loads(rep.read_text()).get("recipe")
        if name in list_recipes():
            return load_recipe(name), f"{rep} (recipe {name})"
    if run.name in list_recipes():
        return load_recipe(run.name), f"the run folder's name ({run.name})"
    raise ConfigError(f"{run} records no recipe (no recipe.yaml, no parity report naming one, and its name is not "
                      "a recipe); pass --recipe NAME")
