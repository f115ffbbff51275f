"""What a parity report vouches for: whether it lets a backend serve here, and the files it checked.

The backend that serves is the backend that passed: :func:`mismatch` says why a report does not vouch
for a backend on this GPU, :func:`verify_candidate_files` re-hashes every file the checked candidate
loaded. ``runtime.load`` applies both (``force=True`` logs what it skips).
"""
from __future__ import annotations

import logging
from pathlib import Path

from trt_sora.config.shapes import ShapeProfile
from trt_sora.errors import ArtifactError
from trt_sora.runfolder import RunFolder
from trt_sora.runners.registry import get_backend
from trt_sora.sm import FP8_MIN_SM, device_sm, sm_or_none

log = logging.getLogger("trt_sora")


def fix_hint(run: Path, backend: str) -> str:
    """The check that would vouch for serving ``backend`` from ``run``."""
    b = get_backend(backend)
    dev = " on this GPU" if b.same_sm else ""
    return f"run `trt-sora check --run {run} --recipe <recipe> --backend {b.check_with}`{dev}"


def read_report(run: Path) -> dict | None:
    """``parity/report.json`` after re-hashing the parity folder against its manifest (a report edited
    by hand is not a report); None when no check ever finished."""
    return RunFolder(run).read_report()


def mismatch(rep: dict | None, backend: str, here_sm: int | None, model_hash: str | None = None) -> str | None:
    """Why ``rep`` does not vouch for serving ``backend`` here (None when it does).

    The backend that serves is the backend that passed: the report's candidate must be that backend
    and have executed; ``trt`` and ``torch-fp8`` also need the check to have run on a GPU of this SM
    (``torch-fp8``: SM >= 8.9, FP8 tensor cores). ``torch`` serves the reference itself: any passed
    report of the same model vouches for it.
    """
    if rep is None:
        return "has no parity report: the artifact was never checked against PyTorch"
    if not rep.get("passed"):
        return f"failed its parity gates ({', '.join(rep.get('failed', [])) or '?'}; see parity/report.md)"
    b = get_backend(backend)
    if b.checked_as is None:
        if model_hash and rep.get("model_hash") and rep["model_hash"] != model_hash:
            return f"was checked with model hash {rep['model_hash']}, but the model here is {model_hash}"
        return None
    cand = rep["candidate"]
    got = cand.get("backend", rep.get("backend"))
    if got != b.checked_as:
        return (f"was checked on backend {got!r}, not {backend!r}: the {backend} backend never ran against "
                "PyTorch")
    if not cand.get("executed"):
        return f"records a {backend} candidate that never executed"
    if b.same_sm:
        ran = sm_or_none((cand.get("device") or {}).get("sm"))
        where = (cand.get("device") or {}).get("gpu") or (cand.get("device") or {}).get("device") or "?"
        least = f"SM >= {b.min_sm // 10}.{b.min_sm % 10}" if b.min_sm else ""
        if ran is None:
            need = f"an {least} GPU (FP8 tensor cores)" if b.min_sm else "a GPU"
            return f"was checked on {where}, not on {need}: {backend} results on this GPU are unverified"
        if b.min_sm and ran < b.min_sm:
            return f"was checked on SM{ran} ({where}); {backend} needs FP8 tensor cores ({least})"
        if here_sm != ran:
            return (f"was checked on SM{ran} ({where}) but this device is "
                    f"{'SM' + str(here_sm) if here_sm else 'not a CUDA GPU'}: {backend} numerics differ per GPU")
    if model_hash and rep.get("model_hash") and rep["model_hash"] != model_hash:
        return f"was checked with model hash {rep['model_hash']}, but the model here is {model_hash}"
    return None


def verify_candidate_files(run: Path, rep: dict) -> dict[str, Path]:
    """Re-hash every file the checked candidate loaded (paths relative to the run folder)."""
    from trt_sora.manifest import verify_file

    rf = RunFolder(run)
    files = rep["candidate"].get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{rf.parity_report} lists no candidate files (an old report); re-run "
                            f"`trt-sora check --run {run}`")
    out = {}
    for rel, sha in files.items():
        p = rf.resolve(rel)
        verify_file(p, sha, None, recorded_in=f"{rf.parity_report} (the checked candidate)",
                    fix=f"re-run the stage that writes it and `trt-sora check --run {run}`")
        out[rel] = p
    return out


def vouched_files(run: Path, rep: dict | None, backend: str, here_sm: int | None, model_hash: str | None,
                  force: bool) -> tuple[dict[str, Path], bool]:
    """``({path relative to run: path}, verified)``: the re-hashed files the report's candidate loaded (none for
    a backend that serves the reference itself), and whether the report vouches for ``backend`` here.
    ArtifactError when it does not, unless ``force`` (then logged, and the run folder's own files serve)."""
    why = mismatch(rep, backend, here_sm, model_hash)
    if why is not None:
        msg = f"{run} {why}; {fix_hint(run, backend)}"
        if not force:
            raise ArtifactError(msg + ", or pass force=True")
        warn_unverified(msg)
        return {}, False
    if rep is None or get_backend(backend).checked_as is None:
        return {}, True
    try:
        return verify_candidate_files(run, rep), True
    except ArtifactError as exc:
        if not force:
            raise
        warn_unverified(str(exc))
        return {}, False


def warn_unverified(msg: str) -> None:
    """What ``force=True`` loads past, logged loudly."""
    log.warning("LOADING UNVERIFIED ARTIFACT (force=True): %s", msg)


def auto_backend(run: Path, rep: dict | None, device: str | None) -> str:
    """The backend the report vouches for, when it can run here; else ArtifactError saying where it can.
    Without a passed report: ``ort`` (``load`` then refuses unless ``force``)."""
    if rep is None or not rep.get("passed"):
        return "ort"
    b = rep["candidate"].get("backend", rep.get("backend", "ort"))
    if not get_backend(b).same_sm:
        sm = device_sm(device)
        if sm is not None and sm >= FP8_MIN_SM and RunFolder(run).qdq_map.is_file():
            log.info("runtime: serving ONNX Runtime (the checked backend). For FP8 tensor cores on this GPU run "
                     "`trt-sora check --run %s --backend torch-fp8` here first", run)
        return b
    ran, here = sm_or_none((rep["candidate"].get("device") or {}).get("sm")), device_sm(device)
    if here is None or here != ran:
        raise ArtifactError(f"{run} was checked on backend {b!r} (SM{ran}), which cannot serve on this machine "
                            f"({'SM' + str(here) if here else 'no CUDA GPU'}); load it on that "
                            f"GPU, or run `trt-sora check --run {run} --backend ort` here and load backend='ort'")
    return b


def served_buckets(run: Path, rep: dict | None) -> tuple[ShapeProfile, ...]:
    """Buckets: the engine manifest's, else the parity report's, else the export's whole range (a
    pair's: its first expert's export; an unchecked pair loads this way only with ``force``)."""
    rf = RunFolder(run)
    for src in ("engine", "parity"):
        if rf.has_manifest(src):
            res = rf.read_manifest(src, check_stage=False).get("results", {})
            if res.get("buckets"):
                return tuple(ShapeProfile.from_yaml(b, where=f"{src} bucket") for b in res["buckets"])
    if rep and rep.get("buckets"):
        return tuple(ShapeProfile.from_yaml(b) for b in rep["buckets"])
    dyn = rf.export_side(rf.read_pair()).read_manifest("export")["results"]["dynamic"]  # a pair: its experts'
    return (ShapeProfile.from_yaml({"name": "export-range", **dyn}),)


def buckets_of(artifact_dir) -> tuple[ShapeProfile, ...]:
    """The shape buckets a run folder serves, read from its files (nothing is loaded)."""
    run = Path(artifact_dir)
    return served_buckets(run, read_report(run))
