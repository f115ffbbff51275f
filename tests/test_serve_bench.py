"""benchmarks/serve_bench.py's server launch: the server it starts sees the caller's PYTHONPATH."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_server_imports_what_the_callers_pythonpath_holds(tmp_path):
    """A module only on the caller's PYTHONPATH (the device's wheel folder) imports in the server's
    environment, and this checkout comes first."""
    (tmp_path / "only_on_callers_path.py").write_text("WHERE = 'caller'\n")
    env = _bench().server_env({**os.environ, "PYTHONPATH": str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", "import only_on_callers_path as m, trt_sora; "
                          "print(m.WHERE, trt_sora.__file__)"], env=env, capture_output=True, text=True, check=True)
    where, trt_sora_file = out.stdout.split()
    assert where == "caller"
    assert Path(trt_sora_file).resolve().is_relative_to(SCRIPT.parents[1].resolve())
