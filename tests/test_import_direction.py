"""No stage imports a later one: every ``trt_sora`` import (module level or inside a function)
points down this stack. Shared helpers live in the neutral base layer."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trt_sora

ROOT = Path(trt_sora.__file__).resolve().parent

#: Bottom to top. A module may import its own layer and the layers below it, never a later one.
LAYERS: list[set[str]] = [
    # neutral: errors, config, manifests, metrics, the sampler, ONNX helpers, prompt sets, the Q/DQ
    # site policy, kernels (pure ops), the multi-process communication (parallel), weights one tensor at a time,
    # the teacher-forced trajectory comparison, compute-capability values (sm), the step-caching policy,
    # OpenTelemetry spans (tracing), a run folder's layout (runfolder)
    {"__init__", "errors", "config", "manifest", "metrics", "sampling", "trajectory", "onnx_tools", "prompts",
     "site_policy", "parallel", "kernels", "weights", "sm", "caching", "tracing", "runfolder"},
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
