"""Python commands for the tests, forked from a process that imported torch, diffusers and the other
heavy third-party modules once.

A ``python -m trt_sora ...`` that loads a Wan model spends ~15 CPU seconds of our 2-core CI box importing
torch, ONNX and diffusers before it does anything; the serve, batch and reliability tests start dozens of
them. :func:`popen` and :func:`run` take the same command lines as :mod:`subprocess` and, for a Python command
(``sys.executable`` then ``-m MODULE``, ``-c CODE`` or ``SCRIPT``), run it in a child of a
:mod:`multiprocessing` forkserver that preloaded :data:`PRELOAD`: only third-party modules, never
``trt_sora``, which each child imports itself from the ``sys.path`` the command would have had (its
``cwd`` or script folder, then its ``PYTHONPATH``, then the interpreter's own paths). So a child sees its
own environment, working folder, arguments and package copy (the mutation check's), has its own pid for
signals, and exits as the command would: its code, ``-signal`` when killed, 1 with the traceback on an
uncaught exception, non-daemon threads joined and ``atexit`` run.

What differs from a fresh interpreter, so what the tests that use it must not depend on: the preloaded
modules are in ``sys.modules`` before the command starts (tests of what an import pulls in start
``subprocess`` processes), stdin is ``/dev/null``, SIGINT raises KeyboardInterrupt even where the caller
ignores it (as ``tests/reliability`` asks of its processes), and torch's thread count is set from the
command's ``OMP_NUM_THREADS`` after the fact (without the pool thread a fresh torch starts at import with more
than one). The caller's own main module must be safe to import (``if __name__ == "__main__"``): multiprocessing
imports a script's in each child, as it does for ``spawn``. Any other command line goes to :mod:`subprocess`.
"""
from __future__ import annotations

import functools
import io
import json
import os
import signal
import subprocess
import sys
import threading
import types

#: Imported once by the forkserver (what a CLI process that loads a Wan model imports anyway; the mutation
#: check's forkserver adds pytest's own).
PRELOAD = ("numpy", "torch", "onnx", "onnxruntime", "safetensors.torch", "yaml", "diffusers",
           "diffusers.models.transformers.transformer_wan", "diffusers.models.autoencoders.autoencoder_kl_wan",
           "fastapi", "uvicorn")


@functools.cache
def context():
    """The ``multiprocessing`` forkserver context whose server imports :data:`PRELOAD` (when it starts: at its
    first use in this process, by :func:`popen` or by anyone forking through this context)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


@functools.cache
def _base_path() -> tuple[str, ...]:
    """The interpreter's own ``sys.path`` (stdlib, site-packages, .pth entries): a fresh one's, less its first
    entry (the working folder) and what ``PYTHONPATH`` put there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"], env=env,
                         capture_output=True, text=True, check=True).stdout
    return tuple(json.loads(out))


def _python_command(args) -> tuple[str, str, list[str]] | None:
    """``(kind, what, argv)`` for ``[sys.executable, -m MOD | -c CODE | SCRIPT, *rest]``; None otherwise."""
    args = [os.fspath(a) for a in args] if not isinstance(args, (str, bytes)) else None
    if not args or len(args) < 2 or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    first = args[1]
    if first in ("-m", "-c") and len(args) >= 3:
        return first, args[2], args[3:]
    if first.startswith("-"):
        return None  # an interpreter option (-u, -X, -I ...): a real process
    return "script", first, args[2:]


def _stdio(fd: int, env: dict) -> io.TextIOWrapper:
    """``sys.stdout`` / ``sys.stderr`` as Python makes them at start for a non-terminal: block-buffered stdout,
    line-buffered stderr, unbuffered under PYTHONUNBUFFERED."""
    raw = io.FileIO(fd, "w", closefd=False)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    buf = raw if unbuffered else io.BufferedWriter(raw)
    enc, _, errors = (env.get("PYTHONIOENCODING") or "utf-8").partition(":")
    return io.TextIOWrapper(buf, encoding=enc or "utf-8", errors=errors or ("backslashreplace" if fd == 2 else
                            "strict"), line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)


def _torch_threads(n: int) -> None:
    """torch's thread count as a fresh interpreter with ``OMP_NUM_THREADS=n`` has it (torch read the variable
    when the server imported it, and caps it at the CPU count). Through OpenMP's own setter, which starts no
    thread (``torch.set_num_threads`` starts the pool: a signal could then land on a pool thread and leave
    the main thread asleep, as it never does in a fresh process)."""
    import ctypes

    import torch

    if torch.get_num_threads() == n:
        return
    with open("/proc/self/maps") as maps:
        omp = sorted({ln.split()[-1] for ln in maps if "libgomp" in ln or "libomp" in ln})
    if omp:
        ctypes.CDLL(omp[0]).omp_set_num_threads(n)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(kind: str, what: str, argv: list[str], env: dict, cwd: str | None, out, err, new_session: bool,
           base_path: tuple[str, ...]) -> None:
    """The command, in the forked process: its fds, environment, folder, session, paths and arguments first."""
    import multiprocessing
    import runpy

    for fd, conn in ((1, out), (2, err)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    if new_session:
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    multiprocessing.current_process().daemon = False  # the command may start processes of its own
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.stdout = sys.__stdout__ = _stdio(1, env)
    sys.stderr = sys.__stderr__ = _stdio(2, env)
    first = {"-m": os.getcwd(), "-c": "", "script": os.path.dirname(os.path.realpath(what))}[kind]
    sys.path[:] = [first, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p), *base_path]
    if env.get("OMP_NUM_THREADS", "").isdigit():
        _torch_threads(min(int(env["OMP_NUM_THREADS"]), os.cpu_count() or 1))
    sys.argv = [what if kind == "script" else kind, *argv]
    code = 0
    try:
        if kind == "-m":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            main = sys.modules["__main__"] = types.ModuleType("__main__")  # a fresh one, as -c runs in
            exec(compile(what, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # the traceback from the command's frames on, as Python prints it
        exc = exc.with_traceback(exc.__traceback__.tb_next)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
        if isinstance(exc, KeyboardInterrupt):  # Python's exit on an uncaught KeyboardInterrupt: by SIGINT
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    threading._shutdown()  # what the interpreter does at exit: join the non-daemon threads, then atexit
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Child:
    """The part of :class:`subprocess.Popen` the tests use, for a command :func:`popen` forked."""

    def __init__(self, args, proc, stdout, stderr):
        self.args, self._proc, self.stdin, self.stdout, self.stderr = args, proc, None, stdout, stderr
        self.pid = proc.pid
        self.returncode = None
        self._readers: dict[str, tuple[threading.Thread, list]] = {}

    def poll(self):
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout=None):
        """``(stdout, stderr)`` read to their end once the child exits (None for a stream not piped); on a
        timeout, TimeoutExpired and the reading goes on for the next call, as :mod:`subprocess` does."""
        if input:
            raise ValueError("prefork children read /dev/null: pass input to a subprocess command")
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                got: list = []
                t = threading.Thread(target=lambda s=stream, g=got: g.append(s.read()), daemon=True)
                t.start()
                self._readers[name] = (t, got)
        self.wait(timeout)
        result = []
        for name in ("stdout", "stderr"):
            if name not in self._readers:
                result.append(None)
                continue
            t, got = self._readers[name]
            t.join()
            getattr(self, name).close()
            result.append(got[0])
        return tuple(result)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _pipe(spec, fd: int, ctx, text: bool):
    """``(the child's end, the parent's stream)`` for stdout (fd 1) or stderr (fd 2) ``spec``: PIPE, DEVNULL,
    or None: the caller's own fd as it is now (pytest's capture of the running test, say)."""
    from multiprocessing.connection import Connection

    if spec is None:
        return Connection(os.dup(fd), readable=False), None
    if spec == subprocess.DEVNULL:
        return Connection(os.open(os.devnull, os.O_WRONLY), readable=False), None
    if spec != subprocess.PIPE:
        raise ValueError(f"prefork: stdout/stderr {spec!r} unsupported (PIPE, DEVNULL or None)")
    r, w = ctx.Pipe(duplex=False)
    stream = open(os.dup(r.fileno()), "r" if text else "rb")
    r.close()
    return w, stream


def popen(args, *, env=None, cwd=None, stdout=None, stderr=None, text=False, start_new_session=False, **kw):
    """:class:`subprocess.Popen` of ``args``, a :class:`Child` forked from the preloaded server when ``args``
    is a Python command and no other option is asked for."""
    cmd = _python_command(args)
    if cmd is None or kw or os.environ.get("TRT_SORA_TESTS_NO_PREFORK"):
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, **kw)
    ctx = context()
    (out_w, out), (err_w, err) = _pipe(stdout, 1, ctx, text), _pipe(stderr, 2, ctx, text)
    proc = ctx.Process(target=_child, daemon=True,
                       args=(*cmd, dict(os.environ if env is None else env), None if cwd is None else str(cwd),
                             out_w, err_w, start_new_session, _base_path()))
    try:
        proc.start()
    finally:
        out_w.close()
        err_w.close()
    return Child(args, proc, out, err)


def run(args, *, env=None, cwd=None, capture_output=False, text=False, timeout=None, check=False, stdout=None,
        stderr=None, **kw) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` through :func:`popen`."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    if kw or _python_command(args) is None:
        return subprocess.run(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text, timeout=timeout,
                              check=check, **kw)
    p = popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, args, out, err)
    return subprocess.CompletedProcess(args, p.returncode, out, err)
