"""The served runner(s) of a run folder: one backend runner, a pair of experts, or the parallel wrap.

Every backend runner comes from the registry's :meth:`~trt_sora.runners.registry.Backend.open`, the
call ``trt-sora check`` opened its candidate with, over the files the check verified.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trt_sora.errors import ConfigError
from trt_sora.runfolder import RunFolder
from trt_sora.runners.registry import OpenOptions, artifacts_from_files, find_artifacts, get_backend


def served_runners(run: Path, backend: str, files: Mapping[str, Path], family, pair: dict | None,
                   options: OpenOptions) -> list:
    """The backend runner over exactly the verified ``files`` (``{path relative to run: path}``; empty when
    loaded unverified: the run folder's own artifacts), or a pair's :class:`ExpertsRunner`."""
    if not pair:
        return [_open(run, backend, files, family, options)]
    from trt_sora.runtime.experts import ExpertsRunner

    rf = RunFolder(run)
    per = {e: _open(rf.expert(e).path, backend, {r[len(e) + 1:]: p for r, p in files.items() if r.startswith(f"{e}/")},
                    family.expert(e), options) for e in pair["experts"]}
    return [ExpertsRunner(per, pair["boundary_timestep"])]


def _open(root: Path, backend: str, files: Mapping[str, Path], family, options: OpenOptions):
    b = get_backend(backend)
    arts = artifacts_from_files(files) if files else (find_artifacts(root) if b.files else {})
    return b.open(root, arts, family, options)


def parallel_runners(runners: list, backend: str, parallel, concurrency: int) -> list:
    """The backend runner under CFG-parallel x Ulysses, rank 0 leading (see ServingRunner.follow)."""
    from trt_sora.runners.parallel_runner import ParallelRunner

    if backend not in ("torch", "torch-fp8"):
        raise ConfigError(f"parallel inference runs the torch backends (torch, torch-fp8), not {backend!r}; "
                          "load with backend='torch-fp8' or 'torch'")
    if concurrency != 1:
        raise ConfigError("parallel inference serves one call at a time across its ranks; use concurrency=1")
    return [ParallelRunner(runners[0], parallel, leader=True).activate()]
