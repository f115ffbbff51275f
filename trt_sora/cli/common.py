"""Shared CLI helpers: progress lines (CLI only, never in library code), JSON summaries."""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager


@contextmanager
def stage_line(name: str):
    """Print ``[stage] ...`` then ``[stage] done in 1.2 s`` (to stderr)."""
    t0 = time.perf_counter()
    print(f"[{name}] running ...", file=sys.stderr, flush=True)
    yield
    print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, default=str))
