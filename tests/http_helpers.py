"""Helpers for tests of servers and subprocesses that wait on events (a process's output lines, a
server's long-poll, a runner held at a gate), never on the clock."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import prefork

#: How long a helper waits before calling the test hung. It never decides an outcome.
HANG = 240.0


def trt_sora_cli(*args: str) -> tuple[list[str], dict]:
    """``(command, env)`` of ``python -m trt_sora ARGS`` on this checkout, one thread each: the clips are
    tiny, and on a shared 2-core machine thread pools only contend."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "trt_sora", *args], env


def kill_batch_after_clips(cmd: list[str], env: dict, clips: int = 2) -> None:
    """Run ``trt-sora -v batch ...`` and SIGKILL it once it has logged its ``clips``-th finished clip
    (each ``INFO ... done (`` line follows the clip's commit), reading the log as it is written."""
    proc = prefork.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, lines = 0, []
    for line in proc.stderr:
        lines.append(line)
        seen += " done (" in line and line.split()[0] == "INFO"
        if seen == clips:
            break
    assert seen == clips and proc.poll() is None, f"the batch ended before it could be killed: {''.join(lines)[-800:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


class Lines:
    """A text stream read by a thread as it is written; :meth:`wait_for` blocks until a line matches."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._t = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, start: int = 0) -> re.Match:
        """The first match of ``pattern`` in a line at index >= ``start``; AssertionError if the stream
        ends (or HANG passes) first."""
        rx = re.compile(pattern)
        with self._cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                if self._closed or not self._cond.wait(HANG):
                    raise AssertionError(f"no line matching {pattern!r}; got:\n{''.join(self.lines)[-3000:]}")

    def text(self) -> str:
        with self._cond:
            return "".join(self.lines)


class Http:
    """A JSON client for one server. Waits go through the server's long-poll, not a sleep loop."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.base = f"http://{host}:{port}"

    def __call__(self, method: str, path: str, body=None, timeout: float = HANG, headers: dict | None = None):
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, method=method, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers

    def json(self, method, path, body=None, **kw):
        status, raw, _ = self(method, path, body, **kw)
        return status, json.loads(raw)

    def wait_done(self, job_id: str) -> dict:
        for _ in range(int(HANG // 60) + 1):
            _, v = self.json("GET", f"/v1/jobs/{job_id}?wait=60")
            if v["status"] in ("done", "failed"):
                return v
        raise AssertionError(f"job {job_id} not done after {HANG} s: {v}")

    def wait_metric(self, name: str, value: float, **labels) -> float:
        """The metric once it reads ``value`` (a server counts some requests after its answer, or with no
        answer at all: a client that hung up); what it reads after HANG if it never does."""
        deadline = time.monotonic() + HANG
        while (got := self.metric(name, **labels)) != value and time.monotonic() < deadline:
            pass
        return got

    def metric(self, name: str, **labels) -> float:
        text = self("GET", "/metrics")[1].decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pat = re.compile(rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? ([0-9.e+-]+)$" if want else
                         rf"^{re.escape(name)} ([0-9.e+-]+)$", re.M)
        m = pat.search(text)
        return float(m.groups()[-1]) if m else 0.0


@contextlib.contextmanager
def http_server(app):
    """``app`` served by uvicorn in a thread on a free port of 127.0.0.1 (bound before the thread
    starts, so requests queue in the backlog until the loop takes them): yields an :class:`Http`."""
    import uvicorn

    from trt_sora.serve.server import _bind

    sock = _bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        yield Http(sock.getsockname()[1])
    finally:
        server.should_exit = True
        t.join(HANG)
        sock.close()


class Gated:
    """A runner whose calls, once :meth:`arm` ed, stop at a gate: :attr:`entered` is set when a call
    arrives, and the call goes on when :attr:`release` is set."""

    def __init__(self, runner):
        self._runner = runner
        self.armed = False
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def arm(self) -> None:
        self.armed = True

    def infer(self, feeds):
        if self.armed:
            self.entered.set()
            assert self.release.wait(HANG), "the test never released the gate"
        return self._runner.infer(feeds)
