"""benchmarks/architecture_metrics.py on a synthetic package whose cycles, imports and hits are known."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "__init__.py": "",
    # a -> b at module level, b -> a inside a function: a cycle only when function imports count
    "a.py": "from pkg import b\n\n\ndef _helper():\n    return b\n",
    "b.py": "def f():\n    from pkg.a import _helper\n    return _helper()\n",
    # c <-> d at module level (d relative): a cycle either way
    "c.py": "import pkg.d\n",
    "d.py": "from . import c\n",
    # a TYPE_CHECKING import never runs: no edge, not counted
    "e.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import a\n",
    "models/__init__.py": "",
    "models/wan.py": 'SITE = "condition_embedder.time_proj"\n_WAN_DIMS = {}\n',
    "runner.py": ('"""Docstrings may say condition_embedder and attn1."""\n'
                  "from pkg.models import wan_fp8\n\n"
                  "_WAN_DIMS = {}\nwant = wanted = 1\n\n\n"
                  "def site():\n"
                  '    """Returns blocks.0.attn1.to_q."""\n'
                  '    return "blocks.0.attn1.to_q"\n'),
    "join.py": ("import os\n\n"
                'FOLDERS = {"build": "engine"}\n\n\n'
                "def paths(run):\n"
                '    return [run / "parity" / "report.json", run / FOLDERS["build"],\n'
                '            os.path.join(run, "calib"), run / "other", run / "exports"]\n'),
    "runfolder.py": 'class RunFolder:\n    def export(self, run):\n        return run / "export" / "manifest.json"\n',
    "manifest.py": 'MANIFEST = "manifest.json"\n\n\ndef f(folder):\n    return folder / MANIFEST, folder / "parity"\n',
}


@pytest.fixture(scope="module")
def am():
    mod = load_script("benchmarks/architecture_metrics.py")
    yield mod
    sys.modules.pop(mod.__name__, None)


@pytest.fixture()
def result(am, tmp_path):
    for rel, text in FILES.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    return am.analyze(tmp_path / "pkg")


def test_cycles_split_by_import_kind(result):
    c = result["cycles"]
    assert c["all"] == {"count": 2, "components": [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]}
    assert c["module_level"] == {"count": 1, "components": [["pkg.c", "pkg.d"]]}
    assert c["edges"] == {"module": 4, "function": 1}  # a->b, c->d, d->c, runner->pkg.models; b->a


def test_function_imports_and_underscore_names(result):
    # module-level: a, c, d, e (typing), runner, join (os); inside functions: b; e's guarded one left out
    assert result["function_imports"] == {"total": 7, "inside_functions": 1, "share": round(1 / 7, 4)}
    assert result["underscore_imports"]["items"] == [
        {"file": "pkg/b.py", "line": 2, "source": "pkg.a", "name": "_helper"}]


def test_family_names_outside_models(result):
    hits = [(h["file"], h["line"], h["what"]) for h in result["family_names_outside_models"]["items"]]
    assert hits == [("pkg/runner.py", 2, "imports pkg.models.wan_fp8"),
                    ("pkg/runner.py", 4, "identifier _WAN_DIMS"),
                    ("pkg/runner.py", 10, "string names 'blocks.0'")]


def test_runfolder_joins_outside_home(result):
    hits = [(h["file"], h["line"], h["what"]) for h in result["runfolder_joins_outside_runfolder"]["items"]]
    assert hits == [("pkg/join.py", 7, "joins 'parity'"), ("pkg/join.py", 7, "joins 'report.json'"),
                    ("pkg/join.py", 7, "looks up FOLDERS[...]"), ("pkg/join.py", 8, "joins 'calib'"),
                    ("pkg/manifest.py", 5, "joins 'parity'")]


def test_longest_functions(result):
    top = [(r["name"], r["file"], r["lines"]) for r in result["longest_functions"]]
    assert top == [("f", "pkg/b.py", 3), ("paths", "pkg/join.py", 3), ("site", "pkg/runner.py", 3),
                   ("_helper", "pkg/a.py", 2), ("f", "pkg/manifest.py", 2), ("RunFolder.export", "pkg/runfolder.py", 2)]


def _safetensors(path: Path, meta: dict, data: bytes) -> None:
    header = {"__metadata__": meta, "w": {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_hashes_tell_deterministic_files(am, tmp_path):
    for run, (meta, data) in {"r1": ({"a": "1", "b": "2"}, b"\0" * 8), "r2": ({"b": "2", "a": "1"}, b"\0" * 8),
                              "r3": ({"a": "1", "b": "2"}, b"\1" * 8)}.items():
        (tmp_path / run / "calib").mkdir(parents=True)
        _safetensors(tmp_path / run / "calib" / "stats.safetensors", meta, data)
        (tmp_path / run / "recipe.yaml").write_text("same\n")
    res = am.compare_hashes([tmp_path / "r1", tmp_path / "r2"])
    assert list(res["deterministic"]) == ["recipe.yaml"]
    assert res["differ"] == ["calib/stats.safetensors"]  # metadata order only: bytes differ, tensors agree
    assert list(res["tensors_deterministic"]) == ["calib/stats.safetensors"]
    assert am.check_expected(tmp_path / "r2", res) == []
    assert am.check_expected(tmp_path / "r3", res) == ["calib/stats.safetensors"]
