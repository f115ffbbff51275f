"""tests/prefork.py against the reference it stands in for: each command run by :mod:`subprocess` (a fresh
interpreter) and by :mod:`prefork` (forked from the preloaded server) must give the same exit status, stdout
and stderr (a traceback's last line), with the same environment, folder, paths and arguments."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import prefork
import pytest
from http_helpers import HANG

PROGRAMS = {
    "exit-code": "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
    "exit-message": "import sys; sys.exit('a message')",
    "exception": "raise ValueError('boom')",
    "threads-and-atexit": textwrap.dedent("""\
        import atexit, threading
        atexit.register(lambda: print('atexit ran', flush=True))
        print('main done')
        threading.Thread(target=lambda: print('thread ran')).start()"""),
    "where": textwrap.dedent("""\
        import os, sys, on_path
        print(os.getcwd(), os.environ['PREFORK_PROBE'], sys.path, on_path.WHERE, sys.argv, __name__)"""),
    "threads": "import torch; print(torch.get_num_threads(), sorted(k for k in globals() if not k.startswith('__')))",
}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A working folder and a PYTHONPATH folder holding ``on_path`` (a module) and ``pkg`` (a package with a
    ``__main__``)."""
    root = tmp_path_factory.mktemp("prefork")
    lib, cwd = root / "lib", root / "cwd"
    (lib / "pkg").mkdir(parents=True)
    cwd.mkdir()
    (lib / "on_path.py").write_text("WHERE = 'lib'\n")
    (lib / "pkg" / "__init__.py").write_text("")
    (lib / "pkg" / "__main__.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\nsys.exit(5)\n")
    (root / "script.py").write_text("import sys\nprint(__name__, sys.argv, sys.path[0])\n")
    env = {**os.environ, "PYTHONPATH": str(lib), "PREFORK_PROBE": "seen", "OMP_NUM_THREADS": "3"}
    return root, cwd, env


def _communicate(p) -> tuple[str, str]:
    """``p.communicate()``; a child still alive after HANG seconds fails the test with what each of its threads
    waits on (a signal that reached a thread other than the sleeping main one, say)."""
    try:
        return p.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        task = f"/proc/{p.pid}/task"
        waits = {t: open(f"{task}/{t}/wchan").read() for t in os.listdir(task)} if os.path.exists(task) else {}
        p.kill()
        raise AssertionError(f"{p.args} still running after {HANG} s; its threads wait on {waits}") from None


def _both(args, env, cwd):
    ref = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=HANG)
    p = prefork.popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = subprocess.CompletedProcess(args, None, *_communicate(p))
    got.returncode = p.returncode
    assert got.returncode == ref.returncode, (ref, got)
    return ref, got


@pytest.mark.parametrize("name", PROGRAMS)
def test_a_command_forked_is_the_command_run(setting, name):
    _, cwd, env = setting
    ref, got = _both([sys.executable, "-c", PROGRAMS[name]], env, cwd)
    assert got.stdout == ref.stdout
    if ref.stderr.startswith("Traceback"):
        assert got.stderr.startswith("Traceback") and "prefork" not in got.stderr
        assert got.stderr.strip().splitlines()[-1] == ref.stderr.strip().splitlines()[-1]
    else:
        assert got.stderr == ref.stderr


def test_a_module_and_a_script_forked_are_the_ones_run(setting):
    root, cwd, env = setting
    for args in ([sys.executable, "-m", "pkg", "a", "--b"], [sys.executable, str(root / "script.py"), "x"]):
        ref, got = _both(args, env, cwd)
        assert (got.stdout, got.stderr) == (ref.stdout, ref.stderr)


def test_signals_and_timeouts_reach_the_forked_command(setting):
    _, cwd, env = setting
    wait = "import time; print('ready', flush=True); time.sleep(300)"
    for sig, want in ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -2)):
        p = prefork.popen([sys.executable, "-c", wait], env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert p.stdout.readline() == "ready\n" and p.poll() is None
        assert os.getsid(p.pid) == p.pid  # its own session
        p.send_signal(sig)
        out, err = _communicate(p)
        assert p.returncode == want, (sig, p.returncode, err)
        assert ("KeyboardInterrupt" in err) == (sig == signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        prefork.run([sys.executable, "-c", wait], env=env, cwd=cwd, capture_output=True, timeout=0.5)


def test_other_commands_go_to_subprocess(setting):
    _, cwd, env = setting
    for args in (["true"], [sys.executable, "-I", "-c", "pass"]):
        with prefork.popen(args, env=env, cwd=cwd) as p:
            assert isinstance(p, subprocess.Popen)
