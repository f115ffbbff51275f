"""The repo's scripts (``benchmarks/*.py``, ``.ci/*.py``) loaded as modules for the tests that call them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str):
    """A fresh module of the script at ``rel`` (from the repo root), registered in ``sys.modules`` under its
    file's stem (dataclasses look their module up by name)."""
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
