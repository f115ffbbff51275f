"""Which step caching a run folder serves: the setting its recipe names, only where its check passed it."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import ArtifactError
from trt_sora.runfolder import RunFolder
from trt_sora.runners.registry import get_backend
from trt_sora.runtime.verify import warn_unverified


class ServedCache:
    """The step caching a run folder's check passed: its ``schedule`` (:class:`trt_sora.caching.CacheSchedule`),
    the ``sampling`` settings it was checked at (a request with other settings computes every step) and the
    report's ``record`` (setting, call counts, curve)."""

    def __init__(self, record: Mapping[str, Any], run: Path):
        from trt_sora.caching import CacheSchedule

        self.record = dict(record)
        self.schedule = CacheSchedule.from_dict(record.get("schedule") or {}, where=f"{run}/parity/report.json caching")
        self.sampling = dict(record.get("sampling") or {})

    def applies_to(self, settings) -> bool:
        """True when ``settings`` (SamplingSettings) are the checked ones."""
        return settings.to_dict() == self.sampling


def _run_caching(run: Path, rep: dict | None) -> dict | None:
    """The caching setting a run folder asks for: its ``recipe.yaml``'s section (None when off), else
    (no recipe recorded) the setting its report checked."""
    from trt_sora.config import load_recipe

    rf = RunFolder(run)
    if rf.recipe.is_file():
        c = load_recipe(rf.recipe).caching
        return c.setting() if c.enabled else None
    return ((rep or {}).get("caching") or {}).get("setting")


def caching_mismatch(wanted: dict | None, rep: dict | None, backend: str) -> str | None:
    """Why ``rep`` does not vouch for serving the caching setting ``wanted`` (None when it does, or when
    ``wanted`` is None: no caching, what the loop level checked)."""
    if wanted is None:
        return None
    checked = (rep or {}).get("caching")
    name = f"{wanted.get('method')} threshold {wanted.get('threshold')}"
    if checked is None:
        return f"asks for step caching ({name}) that its parity check never ran"
    if checked.get("setting") != wanted:
        got = checked.get("setting") or {}
        diff = sorted(k for k in set(wanted) | set(got) if wanted.get(k) != got.get(k))
        said = ", ".join(f"{k}: checked {got.get(k)!r}, asked {wanted.get(k)!r}" for k in diff)
        return f"asks for step caching ({name}) but its check passed another setting ({said})"
    if not checked.get("passed"):
        return f"asks for step caching ({name}) that failed its gates (see parity/report.md)"
    ran = rep["candidate"].get("backend", rep.get("backend"))
    if ran != backend:
        return f"asks for step caching ({name}) checked on backend {ran!r}, not {backend!r}"
    return None


def served_caching(run: Path, rep: dict | None, backend: str, force: bool) -> ServedCache | None:
    """The step caching to serve (None: every step computes); ArtifactError when the run folder's setting was
    not the one its check passed (``force``: logged, and served uncached)."""
    wanted = _run_caching(run, rep)
    why = caching_mismatch(wanted, rep, backend)
    if why is not None:
        msg = (f"{run} {why}; run `trt-sora check --run {run} --backend {get_backend(backend).check_with}` "
               "with that recipe, or load with caching=False")
        if not force:
            raise ArtifactError(msg)
        warn_unverified(msg + " (serving without caching)")
        return None
    return ServedCache(rep["caching"], run) if wanted is not None else None
