"""``python gated_serve.py ARM FIFO serve ...``: ``trt-sora serve ...`` whose runner, once the engine is
warm, stops at the first transformer call made while the file ARM exists (created before the start
or later): it prints ``gate: entered`` and blocks reading the named pipe FIFO until the test opens
it for writing (then the gate stays open). So a test knows, without a clock, that a job is at the
model's door when it kills or signals the server, or that it has gone in."""
import os
import sys

import trt_sora.runtime as rt
from trt_sora.cli import main
from trt_sora.serve import scheduler

ARM, FIFO, ARGS = sys.argv[1], sys.argv[2], sys.argv[3:]
_gate = {"warm": False, "passed": False}


class _Gated:
    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def infer(self, feeds):
        if _gate["warm"] and not _gate["passed"] and os.path.exists(ARM):
            sys.stdout.write("gate: entered\n")  # one write: the CLI prints its lines from another thread
            sys.stdout.flush()
            with open(FIFO) as fh:  # blocks until the test opens the pipe for writing (or never)
                fh.read()
            _gate["passed"] = True
        return self._runner.infer(feeds)


_load, _resume = rt.load, scheduler.Engine._resume


def load(*args, **kwargs):
    return _Gated(_load(*args, **kwargs))


def resume(self):  # after the warm-up, before the workers start
    _gate["warm"] = True
    _resume(self)


rt.load, scheduler.Engine._resume = load, resume
sys.exit(main(ARGS))
