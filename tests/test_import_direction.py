"""No stage imports a later one: every ``trt_sora`` import (module level or inside a function)
points down this stack. Shared helpers live in the neutral base layer. No module imports one that
imports it back, directly or through others: a heavy optional dependency stays lazy through a
function-level import of a module below, never of one above."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from script_loader import load_script

import trt_sora

ROOT = Path(trt_sora.__file__).resolve().parent

#: Bottom to top. A module may import its own layer and the layers below it, never a later one.
LAYERS: list[set[str]] = [
    # neutral: errors, config, manifests, metrics, the sampler, ONNX helpers, prompt sets, the Q/DQ
    # site policy, kernels (pure ops), the multi-process communication (parallel), weights one tensor at a time,
    # the teacher-forced trajectory comparison, compute-capability values (sm), the step-caching policy,
    # OpenTelemetry spans (tracing), a run folder's layout (runfolder),
    # the quantized formats' qmax (formats), the sparse-attention pattern (sparse)
    {"__init__", "errors", "config", "manifest", "metrics", "sampling", "teacher_forcing", "onnx_tools", "prompts",
     "site_policy", "parallel", "kernels", "weights", "sm", "caching", "tracing", "runfolder", "formats", "sparse"},
    {"models"},
    {"export"},
    {"calibrate"},
    {"quantize", "checkpoint"},  # siblings: two consumers of the calibration (Q/DQ graph, ModelOpt checkpoint)
    {"build"},
    {"runners"},  # the runner lifecycle and the backend registry that parity and runtime both open through
    {"parity"},
    {"runtime"},
    {"pipeline"},
    {"serve"},
    {"cli", "__main__"},
]
LAYER_OF = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _top(rel: Path) -> str:
    """Top-level unit of a file under trt_sora/: ``calibrate/run.py`` -> ``calibrate``."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``(line, top-level trt_sora unit)`` of every trt_sora import in ``path``, lazy ones included."""
    rel = path.relative_to(root)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                pkg = list(rel.parent.parts)[: len(rel.parent.parts) - node.level + 1]
                full = pkg + (node.module.split(".") if node.module else [])
                names = [".".join(full)] if full else [a.name for a in node.names]
            elif node.module and node.module.split(".")[0] == "trt_sora":
                rest = node.module.split(".")[1:]
                names = [".".join(rest)] if rest else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("trt_sora.")]
        out += [(node.lineno, n.split(".")[0]) for n in names if n]
    return sorted(out)


FILES = sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_unit_has_a_layer():
    units = {_top(p.relative_to(ROOT)) for p in FILES}
    assert units - set(LAYER_OF) == set(), "place new top-level modules in LAYERS"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    src = _top(path.relative_to(ROOT))
    bad = [f"line {line}: {src} -> {dst}" for line, dst in _imports(path)
           if dst in LAYER_OF and LAYER_OF[dst] > LAYER_OF[src]]
    assert not bad, f"{path.relative_to(ROOT)} imports a later stage: {bad}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The rule would fail on the imports this test exists for (guards against a checker that
    silently sees nothing)."""
    f = tmp_path / "trt_sora" / "models" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text("def g():\n    from trt_sora.calibrate.data import load_prompts\n"
                 "from ..parity import metrics\nimport trt_sora.export.exporter\nfrom . import wan\n")
    assert _imports(f, tmp_path / "trt_sora") == [(2, "calibrate"), (3, "parity"), (4, "export"), (5, "models")]


def _module(rel: Path) -> str:
    """Dotted module of a file under trt_sora/: ``calibrate/run.py`` -> ``calibrate.run``,
    ``runtime/__init__.py`` -> ``runtime``, ``__init__.py`` -> ``""`` (the package)."""
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_edges(path: Path, root: Path, modules: set[str]) -> set[str]:
    """Every trt_sora module ``path`` imports (lazy ones included): ``from pkg import mod`` names the
    submodule ``pkg.mod``, ``from pkg import name`` the package ``pkg``."""
    rel = path.relative_to(root)
    pkg = _module(rel).split(".") if rel.name == "__init__.py" else list(rel.parent.parts)
    pkg = [p for p in pkg if p]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "trt_sora":
                base = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                sub = ".".join(base + [a.name])
                out.add(sub if sub in modules else ".".join(base))
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("trt_sora.")}
    return out & modules - {_module(rel)}


def _metrics():
    """benchmarks/architecture_metrics.py, whose Tarjan components count the cycles it reports."""
    return sys.modules.get("architecture_metrics") or load_script("benchmarks/architecture_metrics.py")


def _cycles(root: Path) -> list[list[str]]:
    """The import cycles among the modules under ``root``: every strongly connected component of
    more than one module, each sorted."""
    files = {_module(p.relative_to(root)): p for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    graph = {m: sorted(_module_edges(p, root, set(files))) for m, p in files.items()}
    return _metrics().strongly_connected(graph)


def test_no_import_cycles():
    cycles = _cycles(ROOT)
    assert not cycles, ("modules that import each other (move what they share into a module both import, "
                        f"below them): {cycles}")


def test_the_cycle_checker_sees_lazy_and_relative_imports(tmp_path):
    """A cycle closed by a function-level relative import, one through a package's ``__init__`` and
    one over three modules are found; imports that only point down are not cycles."""
    root = tmp_path / "trt_sora"
    files = {
        "calibrate/__init__.py": "from .data import load\n",
        "calibrate/data.py": "def load():\n    from trt_sora.calibrate import run\n",
        "calibrate/run.py": "def f():\n    from .evaluate import g\n",
        "calibrate/evaluate.py": "from trt_sora.errors import E\ndef g():\n    from . import run\n",
        "runtime/__init__.py": "from trt_sora.runtime.generate import generate\n",
        "runtime/generate.py": "def generate():\n    from trt_sora.runtime import load\n",
        "a.py": "import trt_sora.b\n", "b.py": "import trt_sora.c\n", "c.py": "from . import a\n",
        "errors.py": "", "d.py": "from trt_sora import errors\nfrom trt_sora.calibrate import run\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert _cycles(root) == [["a", "b", "c"], ["calibrate.evaluate", "calibrate.run"], ["runtime", "runtime.generate"]]
