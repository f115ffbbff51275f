"""benchmarks/serve_bench.py's server launch: the server it starts sees the caller's PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from script_loader import ROOT, load_script


def _bench():
    return load_script("benchmarks/serve_bench.py")


def test_the_server_imports_what_the_callers_pythonpath_holds(tmp_path):
    """A module only on the caller's PYTHONPATH (the device's wheel folder) imports in the server's
    environment, and this checkout comes first."""
    (tmp_path / "only_on_callers_path.py").write_text("WHERE = 'caller'\n")
    env = _bench().server_env({**os.environ, "PYTHONPATH": str(tmp_path)})
    out = subprocess.run([sys.executable, "-c", "import only_on_callers_path as m, trt_sora; "
                          "print(m.WHERE, trt_sora.__file__)"], env=env, capture_output=True, text=True, check=True)
    where, trt_sora_file = out.stdout.split()
    assert where == "caller"
    assert Path(trt_sora_file).resolve().is_relative_to(ROOT.resolve())
