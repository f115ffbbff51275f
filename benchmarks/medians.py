"""The end of a per-request timing script: medians over its rows, printed and written as JSON."""
from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path


def finish(result: dict, rows: list[dict], keys: Iterable[str], out: str | None) -> int:
    """``result`` plus ``requests`` (the rows) and ``summary`` (each key's median over the rows, to 4
    decimals): the summary printed, the whole written to ``out`` when given. Returns 0, the exit status."""
    result = {**result, "requests": rows,
              "summary": {f"median_{k}": round(statistics.median(r[k] for r in rows), 4) for k in keys}}
    print(json.dumps(result["summary"]))
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return 0
