"""Batch generation: a JSONL file of jobs in, one clip per job out, resumable.

::

    from trt_sora.serve.batch import BatchConfig, run_batch
    summary = run_batch(runner, "prompts.jsonl", "out/", BatchConfig(formats=("mp4", "png")))

``prompts.jsonl``: one JSON object a line, the fields of :class:`~trt_sora.runtime.ClipRequest`
(``prompt`` required; ``seed``, ``steps``, ``guidance``, ``shift``, ``negative_prompt``,
``num_frames``, ``height``, ``width``, ``image``) plus an optional ``id`` (1-128 letters, digits, ``-``,
``_``; it names the job's files; default ``line-<n>``). Blank lines and lines starting with ``#``
are skipped. ``image`` (the conditioning image of an image-to-video model) is a path relative to the
jobs file's folder, an absolute path or a ``data:image/...;base64,`` URL; a changed image file redoes
its clip on resume.

The output folder::

    out/clips/<id>.<fmt>     the clip in every asked format (mp4, gif, png contact sheet, npy)
    out/clips/<id>.json      its record: status, request, settings and metadata, output sha256s,
                             the sha256 of the raw frames, timings, attempts, gate verdict
    out/manifest.json        every record's summary (rewritten after each batch of clips)
    out/summary.json/.md     counts, throughput, latency percentiles, formed batch sizes, failures

Crash and kill safety: every file is written under a temp name and renamed; a clip's record is
written last and is its commit mark. On a rerun, a job whose record says done, whose fingerprint
(request, resolved settings, formats, artifact) is unchanged and whose files still hash to the
recorded sha256 is skipped; anything else of that job (a partial clip, a stale record) is removed
and the job redone. Job ids are unique, so no clip is ever written twice. One batch process at a
time per output folder (a lock file).

Object storage: ``out_dir`` may be ``s3://bucket/prefix`` (:mod:`trt_sora.serve.objstore`): the
same layout under the prefix, each file uploaded under a temporary key and copied to its name when
complete, the record still the commit mark, resume re-hashing the objects in the bucket.

Containment: job ids are checked before anything is written (a bad or repeated id is a ConfigError
naming its line), and every path the batch writes or removes goes through one helper
(``_Out.path``) that resolves it, symlinks followed, and refuses anything outside the output folder.

Failures: errors that look transient (out of memory, timeouts, lost workers, I/O errors) are retried
with backoff (an out-of-memory error also halves the batch); a job that fails for good is recorded
(``status: failed`` with the error) and the batch goes on. Optional quality gate: each clip is also
made by a reference backend and compared (worst-frame PSNR, mean SSIM, VMAF through ffmpeg's
libvmaf: a batch asking for VMAF from an ffmpeg without it is refused before anything runs); each
clip's record keeps its scores and the bars, a clip under any bar is recorded ``gate_failed`` and the
batch exits non-zero.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from trt_sora.errors import ConfigError, TrtSoraError
from trt_sora.manifest import sha256_file, write_json, write_manifest
from trt_sora.runfolder import RunFolder
from trt_sora.runtime.generate import MAX_SCALE, ClipRequest, check_bounds
from trt_sora.serve.quality import compare_clips, require_vmaf
from trt_sora.serve.records import DONE, FAILED, GATE_FAILED

log = logging.getLogger("trt_sora")

__all__ = ["BatchConfig", "BatchSummary", "GateConfig", "Job", "LocalExecutor", "check_jobs", "is_remote",
           "is_oom", "is_transient", "open_output", "read_jobs", "run_batch"]

FORMATS = ("mp4", "gif", "png", "npy")
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_ID_FIX = "an id names the job's files: use 1-128 letters, digits, '-' or '_' (or leave it out: line-<n>)"
MAX_RETRY_WAIT = 3600.0  # the first backoff; it doubles per retry
GATE_REFERENCES = ("torch", "ort")


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Per-clip quality gate against a reference backend.

    Attributes:
        reference: backend of the reference runner (``torch``: the PyTorch model; ``ort``: the plain
            ONNX export).
        min_psnr_db: worst-frame PSNR bar in dB (peak 255 on uint8 frames); None = the run folder's
            ``parity.frames.min_psnr_db`` gate (else 25).
        min_ssim: mean-SSIM bar (None: not gated, only reported).
        vmaf: also compute VMAF (needs an ffmpeg with libvmaf); reported, gated only by ``min_vmaf``.
        min_vmaf: mean-VMAF bar, 0-100 (None: not gated); setting it computes VMAF whatever ``vmaf`` says.
    """

    reference: str = "torch"
    min_psnr_db: float | None = None
    min_ssim: float | None = None
    vmaf: bool = False
    min_vmaf: float | None = None

    def __post_init__(self) -> None:
        if self.reference not in GATE_REFERENCES:
            raise ConfigError(f"gate reference {self.reference!r} is not a reference backend; use one of "
                              f"{', '.join(GATE_REFERENCES)} (--gate-against)")
        for name, flag, value, lo, hi, what in (
                ("min_psnr_db", "--psnr-threshold", self.min_psnr_db, 0.0, 200.0, "dB, peak 255"),
                ("min_ssim", "--min-ssim", self.min_ssim, -1.0, 1.0, "mean SSIM"),
                ("min_vmaf", "--vmaf-threshold", self.min_vmaf, 0.0, 100.0, "VMAF score")):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:  # NaN fails
                raise ConfigError(f"{name} ({flag}) = {value!r} is outside [{lo:g}, {hi:g}] ({what}); give a number "
                                  "in that range, or leave it out")

    @property
    def wants_vmaf(self) -> bool:
        """Whether each clip's VMAF is computed (asked for, or gated)."""
        return self.vmaf or self.min_vmaf is not None


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How a batch runs.

    Attributes:
        formats: files written per clip (any of ``mp4``, ``gif``, ``png``, ``npy``).
        scale: pixel-repeat upscaling of the encoded files (the npy keeps the clip's own size).
        retries: extra attempts for transient errors; ``retry_wait``: first backoff in seconds (doubles).
        max_batch: at most this many clips per transformer call group (None: what the buckets allow).
        cfg: ``auto`` / ``batched`` / ``split`` (see :func:`trt_sora.runtime.generate`).
        gate: optional :class:`GateConfig`.
    """

    formats: tuple[str, ...] = ("mp4",)
    scale: int = 1
    retries: int = 2
    retry_wait: float = 1.0
    max_batch: int | None = None
    cfg: str = "auto"
    gate: GateConfig | None = None

    def __post_init__(self) -> None:
        bad = [f for f in self.formats if f not in FORMATS]
        if bad or not self.formats:
            raise ConfigError(f"formats={list(self.formats)}: {'unknown ' + repr(bad[0]) if bad else 'none given'}; "
                              f"use any of {', '.join(FORMATS)}")
        if self.retries < 0 or not (0 <= self.retry_wait <= MAX_RETRY_WAIT) or not 1 <= self.scale <= MAX_SCALE:
            raise ConfigError(f"retries={self.retries}, retry_wait={self.retry_wait}, scale={self.scale}: retries must "
                              f"be >= 0, retry_wait a number of seconds in [0, {MAX_RETRY_WAIT:g}] and scale an "
                              f"integer in [1, {MAX_SCALE}]")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch={self.max_batch} must be >= 1 (or None: what the buckets allow)")


@dataclasses.dataclass(frozen=True)
class Job:
    """One line of the jobs file: ``id``, 1-based ``line``, the request (None when the line is bad:
    then ``error`` says why)."""

    id: str
    line: int
    request: Any = None  # ClipRequest
    error: str | None = None


@dataclasses.dataclass
class BatchSummary:
    """What :func:`run_batch` did (also written as ``summary.json`` / ``summary.md``)."""

    data: dict

    @property
    def ok(self) -> bool:
        """True when every job is done and no clip failed its gate."""
        return self.data["failed"] == 0 and self.data["gate_failed"] == 0


# -- jobs ------------------------------------------------------------------------------------------
def read_jobs(path) -> list[Job]:
    """Parse a JSONL jobs file. A bad line becomes a Job with ``error`` set (recorded as failed,
    the rest still run); a bad or duplicate id is a ConfigError naming the line (its files would have
    no safe name or would overwrite each other)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"jobs file {path} does not exist; write one JSON object per line, e.g. "
                          '{"prompt": "a red circle moving right", "seed": 1}')
    jobs: list[Job] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        jid, req, err = f"line-{n}", None, None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            d, err = None, f"{path.name}:{n}: not JSON ({exc.msg} at column {exc.colno})"
        if isinstance(d, Mapping) and "id" in d:
            d = dict(d)
            jid = _check_id(d.pop("id"), f"{path.name}:{n}")
        if err is None:
            req, err = _request(d, path, n)
        if jid in seen:
            raise ConfigError(f"{path.name}: id {jid!r} appears on lines {seen[jid]} and {n}; ids must be unique")
        seen[jid] = n
        jobs.append(Job(jid, n, req, err))
    if not jobs:
        raise ConfigError(f"{path} holds no jobs (one JSON object per line)")
    return jobs


def _request(d, path: Path, n: int):
    """``(ClipRequest, None)`` for line ``n``'s object, or ``(None, error)``."""
    if isinstance(d, Mapping) and isinstance(d.get("image"), str) and not d["image"].startswith("data:"):
        d = {**d, "image": str(path.parent / d["image"])}  # relative to the jobs file (absolute stays)
    try:
        return check_bounds(ClipRequest.from_dict(d, where=f"{path.name}:{n}"), where=f"{path.name}:{n}"), None
    except ConfigError as exc:
        return None, str(exc) if str(exc).startswith(path.name) else f"{path.name}:{n}: {exc}"


def _check_id(jid, where: str) -> str:
    """``jid`` as a string; ConfigError naming ``where`` unless it is 1-128 letters, digits, '-' or '_'
    (it names the job's files: a separator, '..' or NUL could put them outside the output folder)."""
    if isinstance(jid, bool) or not isinstance(jid, (str, int)):
        raise ConfigError(f"{where}: id {jid!r} is a JSON {type(jid).__name__}; {_ID_FIX}")
    jid = str(jid)
    if _ID.fullmatch(jid):  # fullmatch: "$" alone lets a trailing newline through
        return jid
    if not jid:
        why = "is empty"
    elif "\x00" in jid:
        why = "holds a NUL character"
    elif "/" in jid or "\\" in jid or os.sep in jid:
        why = "holds a path separator"
    elif ".." in jid:
        why = "holds '..'"
    elif len(jid) > 128:
        why = f"is {len(jid)} characters long"
    else:
        why = "holds characters other than letters, digits, '-' and '_'"
    shown = repr(jid) if len(repr(jid)) <= 60 else repr(jid)[:57] + "..."
    raise ConfigError(f"{where}: id {shown} {why}; {_ID_FIX}")


def check_jobs(jobs: Sequence[Job]) -> None:
    """ConfigError unless every job's id is a safe file name and no id repeats (checked before the
    output folder is touched)."""
    seen: dict[str, int] = {}
    for job in jobs:
        _check_id(job.id, f"line {job.line}")
        if job.id in seen:
            raise ConfigError(f"id {job.id!r} appears on lines {seen[job.id]} and {job.line}; ids must be unique")
        seen[job.id] = job.line


def is_transient(exc: BaseException) -> bool:
    """Whether retrying may help: out of memory, timeouts, I/O and connection errors, a lost Ray
    worker. trt_sora's own errors (bad input, shapes, config, a refused artifact) are permanent
    unless they set ``transient = True``."""
    if isinstance(exc, TrtSoraError):
        return bool(getattr(exc, "transient", False))
    if isinstance(exc, (MemoryError, TimeoutError, ConnectionError, OSError)):
        return True
    name, msg = type(exc).__name__.lower(), str(exc).lower()
    return (any(k in name for k in ("outofmemory", "actordied", "actorerror", "workercrashed", "nodedied"))
            or any(k in msg for k in ("out of memory", "cuda error", "resource exhausted", "timed out",
                                      "temporarily unavailable", "failed to allocate")))


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() or \
        "outofmemory" in type(exc).__name__.lower() or "failed to allocate" in str(exc).lower()


# -- executors -------------------------------------------------------------------------------------
class _Pending(NamedTuple):
    """A job to make: the driver resolved its request once (``Generator.resolve``, for its fingerprint
    and group); every executor runs that resolution (``Generator.run_resolved``), gate reference too."""

    job: Job
    resolved: Any  # _Resolved
    fingerprint: str


def run_group(generator, reference, resolved: Sequence, cfg: str) -> tuple[list, list | None]:
    """``(clips, reference_clips | None)`` of one group of resolved requests: the candidate and, when a
    gate is on, the reference run the same resolutions as one call group (every executor's step)."""
    clips = generator.run_resolved(resolved, cfg=cfg, max_batch=len(resolved))
    return clips, reference.run_resolved(resolved, cfg=cfg, max_batch=len(resolved)) if reference else None


class LocalExecutor:
    """Runs clip groups in this process with a :class:`~trt_sora.runtime.Generator` (and the
    reference generator when a gate is on). ``run(groups)`` (lists of :class:`_Pending`) yields
    ``(group, result)`` where result is ``(clips, reference_clips | None)`` or the exception the
    group raised."""

    def __init__(self, generator, reference=None, *, cfg: str = "auto"):
        self.generator = generator
        self.reference = reference
        self.cfg = cfg

    @property
    def max_batch(self) -> int | None:
        return None

    def run(self, groups: Sequence[list]) -> Iterator[tuple[list, Any]]:
        for group in groups:
            try:
                yield group, run_group(self.generator, self.reference, [p.resolved for p in group], self.cfg)
            except Exception as exc:  # recorded per job by the driver (transient ones retried)
                yield group, exc


# -- the driver ------------------------------------------------------------------------------------
class _Out:
    """The output folder: paths, records, the lock. Every path written or removed comes from :meth:`path`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._real = self.root.resolve()
        self.clips = self.path("clips")
        self.clips.mkdir(exist_ok=True)
        self._lock_fh = None

    def path(self, *parts: str) -> Path:
        """``root/parts``, proven to stay inside the output folder once resolved (symlinks followed);
        ConfigError otherwise (a record naming a path elsewhere, a ``clips`` link to another folder)."""
        p = self.root.joinpath(*parts)
        if "\x00" in str(p):
            raise ConfigError(f"{str(p)!r} holds a NUL character; batch writes only plain names under --out")
        real = p.resolve()
        if not real.is_relative_to(self._real):
            raise ConfigError(f"{p} resolves to {real}, outside the batch output folder {self._real}; batch writes "
                              "only under --out: remove the link or use another --out")
        return p

    def lock(self) -> None:
        import fcntl

        fh = open(self.path(".batch.lock"), "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            other = fh.read().strip() or "?"
            fh.close()
            raise ConfigError(f"another trt-sora batch (pid {other}) is writing to {self.root}; wait for it or "
                              "use another --out") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._lock_fh = fh

    def unlock(self) -> None:
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None

    def record_path(self, jid: str) -> Path:
        return self.path("clips", f"{jid}.json")

    def output_path(self, jid: str, fmt: str) -> Path:
        return self.path("clips", f"{jid}.{fmt}")

    def read_record(self, jid: str) -> dict | None:
        p = self.record_path(jid)
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except (json.JSONDecodeError, OSError):
            return None

    def finished(self, jid: str, fingerprint: str) -> dict | None:
        """The record when the job is finished and intact, else None."""
        rec = self.read_record(jid)
        if not rec or rec.get("status") not in (DONE, GATE_FAILED) or rec.get("fingerprint") != fingerprint:
            return None
        for o in rec.get("outputs", {}).values():
            try:
                p = self.path(o["path"])
            except (ConfigError, TypeError, KeyError):  # a record naming a file elsewhere is not intact
                return None
            if not p.is_file() or p.stat().st_size != o["bytes"] or sha256_file(p) != o["sha256"]:
                return None
        return rec

    def clear(self, jid: str) -> list[str]:
        """Remove whatever a previous attempt of ``jid`` left (partial outputs, temp files, its record)."""
        gone = []
        for p in list(self.clips.glob(f"{jid}.*")) + list(self.clips.glob(f".{jid}.tmp*")):
            if p.stem == jid or p.name.startswith(f".{jid}.tmp"):
                self.path("clips", p.name).unlink(missing_ok=True)
                gone.append(p.name)
        return gone

    # -- writes (the same five calls on :class:`~trt_sora.serve.objstore.S3Out`) --------------------
    def write_output(self, jid: str, fmt: str, write: Callable[[Path], Any]) -> dict:
        """``write(path)`` the job's ``fmt`` file in place (writers use a temp name and rename);
        ``{"path", "sha256", "bytes"}``."""
        p = self.output_path(jid, fmt)
        write(p)
        return {"path": str(p.relative_to(self.root)), "sha256": sha256_file(p), "bytes": p.stat().st_size}

    def write_record(self, jid: str, rec: dict) -> None:
        write_json(self.record_path(jid), rec)

    def write_json(self, name: str, data: Any) -> None:
        write_json(self.path(name), data)

    def write_text(self, name: str, text: str) -> None:
        _atomic_text(self.path(name), text)

    def write_manifest(self, *, inputs: dict, config: Any, results: dict, records: Mapping[str, dict]) -> None:
        """``manifest.json`` with every file of the folder hashed (``records`` are not needed here)."""
        self.path("manifest.json")  # write_manifest writes there
        write_manifest(self.root, stage="batch", inputs=inputs, config=config, results=results)


def open_output(out_dir) -> Any:
    """The output of a batch: a local folder (:class:`_Out`) or, for ``s3://bucket/prefix``, a
    prefix of a bucket (:class:`~trt_sora.serve.objstore.S3Out`: checks s3fs, the credentials and
    the bucket at once). An object that already is an output is returned as it is."""
    if hasattr(out_dir, "write_record"):
        return out_dir
    if is_remote(out_dir):
        from trt_sora.serve.objstore import S3Out

        return S3Out(str(out_dir))
    return _Out(Path(out_dir))


def is_remote(out_dir) -> bool:
    """Whether ``out_dir`` names object storage (``scheme://``); ConfigError for a scheme other than s3."""
    text = str(out_dir)
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if not m:
        return False
    if m.group(1).lower() != "s3":
        raise ConfigError(f"--out {text!r}: object storage {m.group(1)}:// is not supported; use s3://bucket/prefix "
                          "(any S3-compatible endpoint through AWS_ENDPOINT_URL) or a local folder")
    return True


def _fingerprint(job: Job, resolved, config: BatchConfig, artifact: Mapping[str, Any]) -> str:
    body = {"request": dataclasses.asdict(job.request) if job.request else None, "error": job.error,
            "settings": resolved.settings.to_dict() if resolved else None,
            "size": list(resolved.size) if resolved else None, "formats": sorted(config.formats),
            "scale": config.scale, "cfg": config.cfg, "artifact": dict(artifact),
            "gate": dataclasses.asdict(config.gate) if config.gate else None,
            "image_sha256": _image_sha256(job.request.image) if job.request else None}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _image_sha256(image) -> str | None:
    """The conditioning image file's sha256 (a changed image is a changed job); None without a file."""
    if isinstance(image, str) and not image.startswith("data:") and Path(image).is_file():
        return sha256_file(Path(image))
    return None


def _artifact_identity(generator) -> dict:
    run = generator.run_dir
    rep = RunFolder(run).parity_report
    cand = (json.loads(rep.read_text()).get("candidate") or {}) if rep.is_file() else {}
    return {"run": str(run), "backend": getattr(generator.runner, "backend", "?"),
            "candidate_sha256": cand.get("sha256"),
            "model_hash": generator.adapter.spec.model_hash(), "text_encoder": generator.text_encoder_source}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_batch(runner, jobs, out_dir, config: BatchConfig = BatchConfig(), *, reference_runner=None,
              executor=None, progress: Callable[[dict], None] | None = None, text_encoder: str | None = None,
              sleep: Callable[[float], None] = time.sleep) -> BatchSummary:
    """Generate every job of ``jobs`` (a JSONL path or a list of :class:`Job`) into ``out_dir``.

    Args:
        runner: the loaded artifact (``trt_sora.runtime.load``), or None with an ``executor`` that
            brings its own workers (then ``resolver`` info comes from ``executor.generator``).
        jobs: the JSONL file or parsed jobs.
        out_dir: the output folder (created; resumed when it holds a previous run), or
            ``s3://bucket/prefix`` (:mod:`trt_sora.serve.objstore`, the same layout and guarantees), or
            an output opened by :func:`open_output`.
        config: :class:`BatchConfig`.
        reference_runner: the gate's reference (required when ``config.gate`` is set and the
            executor is local).
        executor: what runs clip groups (default :class:`LocalExecutor`; ``trt_sora.serve.ray_fleet``
            spreads them over a Ray cluster).
        progress: called after every group with ``{"done", "total", "failed", "skipped", ...}``.
        text_encoder: override the recorded text encoder (local executor).

    Returns:
        :class:`BatchSummary`; ``summary.ok`` is False when a job failed or a clip failed its gate.
    """
    from trt_sora.runtime.generate import Generator, generator_for

    t_start = time.perf_counter()
    jobs_path = None
    if not isinstance(jobs, (list, tuple)):
        jobs_path = Path(jobs)
        jobs = read_jobs(jobs_path)
    if executor is None:
        gen = generator_for(runner, text_encoder=text_encoder)
        ref = Generator(reference_runner, text_encoder=text_encoder) if config.gate else None
        if config.gate and reference_runner is None:
            raise ConfigError("a quality gate needs the reference runner (reference_runner=)")
        executor = LocalExecutor(gen, ref, cfg=config.cfg)
    gen = executor.generator
    check_jobs(jobs)  # before the output folder is touched
    if config.gate and config.gate.wants_vmaf:
        require_vmaf("--vmaf-threshold" if config.gate.min_vmaf is not None else "--vmaf")
    out = open_output(out_dir)
    out.lock()
    try:
        return _drive(gen, executor, jobs, jobs_path, out, config, progress, sleep, t_start)
    finally:
        out.unlock()


def _drive(gen, executor, jobs, jobs_path, out: _Out, config, progress, sleep, t_start) -> BatchSummary:
    artifact = _artifact_identity(gen)
    state = {"total": len(jobs), "done": 0, "skipped": 0, "failed": 0, "gate_failed": 0, "retries": 0,
             "generated": 0}
    batches: dict[int, int] = {}
    latencies: list[float] = []
    records: dict[str, dict] = {}
    gate_bar = _gate_bar(gen.run_dir, config.gate) if config.gate else None
    pending = [p for p in (_pending(gen, job, out, config, artifact, records, state) for job in jobs) if p is not None]
    state["done"] = state["skipped"]
    _report(progress, state)
    groups = _groups(gen, pending, config, executor)
    attempts: dict[str, int] = {}
    wait = config.retry_wait
    while groups:
        retry: list[list] = []
        for grp, result in executor.run(groups):
            for p in grp:
                attempts[p.job.id] = attempts.get(p.job.id, 0) + 1
            if isinstance(result, BaseException):
                retry += _on_error(out, grp, result, attempts, config, records, state)
                continue
            clips, ref_clips = result
            batches[len(grp)] = batches.get(len(grp), 0) + 1
            for k, ((job, _resolved, fp), clip) in enumerate(zip(grp, clips)):
                rec = _commit(out, job, fp, clip, ref_clips[k] if ref_clips else None, config, gate_bar,
                              attempts[job.id])
                records[job.id] = rec
                latencies.append(clip.metadata["seconds"]["total"])
                state["generated"] += 1
                state["done"] += 1
                state["gate_failed"] += rec["status"] == GATE_FAILED
                log.info("batch: %s %s (%d of %d)", job.id, rec["status"], state["done"], state["total"])
            _report(progress, state)
            _write_manifest(out, gen, jobs, jobs_path, records, config, artifact)
        groups = retry
        if retry:
            state["retries"] += sum(len(g) for g in retry)
            log.warning("batch: retrying %d clip(s) after transient errors (waiting %.1f s)",
                        sum(len(g) for g in retry), wait)
            sleep(wait)
            wait *= 2
    _write_manifest(out, gen, jobs, jobs_path, records, config, artifact)
    return _summarize(out, gen, jobs, records, state, batches, latencies, config, time.perf_counter() - t_start)


def _pending(gen, job: Job, out: _Out, config, artifact, records, state) -> _Pending | None:
    """``job`` resolved (once: its fingerprint, its group and its run all use this resolution), or
    None when it is finished already (its record kept) or cannot be made (a failure recorded)."""
    resolved, err = None, job.error
    if job.request is not None:
        try:
            resolved = gen.resolve(job.request)
        except TrtSoraError as exc:
            err = str(exc)
    fp = _fingerprint(job, resolved, config, artifact)
    rec = out.finished(job.id, fp)
    if rec is not None:
        records[job.id] = rec
        state["skipped"] += 1
        state["gate_failed"] += rec["status"] == GATE_FAILED
        return None
    cleared = out.clear(job.id)
    if cleared:
        log.info("batch: %s: removed %s of an unfinished or changed earlier attempt", job.id, ", ".join(cleared))
    if err is not None:
        records[job.id] = _failure(out, job, fp, err, transient=False, attempts=0)
        state["failed"] += 1
        return None
    return _Pending(job, resolved, fp)


def _report(progress, state) -> None:
    if progress is not None:
        progress(dict(state))


def _groups(gen, pending, config: BatchConfig, executor) -> list[list]:
    """Pending jobs grouped by shared settings and size, in chunks of what one call group holds."""
    by_key: dict[tuple, list] = {}
    for p in pending:
        by_key.setdefault(p[1].key, []).append(p)
    cap = min(x for x in (config.max_batch, executor.max_batch) if x) if (config.max_batch or executor.max_batch) \
        else None
    groups = []
    for items in by_key.values():
        sizes = [s for s in gen.clip_batches(items[0][1], config.cfg) if cap is None or s <= cap] or [1]
        while items:
            n = max([s for s in sizes if s <= len(items)] or [1])
            groups.append(items[:n])
            items = items[n:]
    return groups


def _on_error(out: _Out, grp, exc, attempts, config: BatchConfig, records, state) -> list[list]:
    """Retry groups for a failed group, or failure records."""
    transient = is_transient(exc)
    left = [p for p in grp if attempts[p[0].id] <= config.retries]
    if transient and left:
        log.warning("batch: %s failed (%s: %s); will retry", ", ".join(p[0].id for p in grp), type(exc).__name__, exc)
        if len(left) > 1 and is_oom(exc):
            return [left[:len(left) // 2], left[len(left) // 2:]]
        return [left]
    if not transient and len(grp) > 1:
        # one job may be at fault: run each alone once to find it (no attempt spent)
        for p in grp:
            attempts[p[0].id] -= 1
        return [[p] for p in grp]
    for job, _, fp in grp:
        records[job.id] = _failure(out, job, fp, f"{type(exc).__name__}: {exc}", transient=transient,
                                   attempts=attempts[job.id])
        state["failed"] += 1
        log.error("batch: %s failed: %s", job.id, exc)
    return []


def _failure(out: _Out, job: Job, fp: str, error: str, *, transient: bool, attempts: int) -> dict:
    rec = {"id": job.id, "line": job.line, "status": FAILED, "fingerprint": fp,
           "request": dataclasses.asdict(job.request) if job.request else None,
           "error": {"message": error, "transient": transient}, "attempts": attempts, "finished": _now(),
           "worker": f"{socket.gethostname()}:{os.getpid()}"}
    out.write_record(job.id, rec)
    return rec


def _commit(out: _Out, job: Job, fp: str, clip, ref_clip, config: BatchConfig, gate_bar, attempts: int) -> dict:
    """Write the clip's files, then its record (the commit mark)."""
    from trt_sora.runtime.video import write_clip

    t0 = time.perf_counter()
    outputs = {}
    for fmt in config.formats:
        scale = 1 if fmt == "npy" else config.scale
        outputs[fmt] = out.write_output(job.id, fmt, lambda p, s=scale: write_clip(clip.frames, p, clip.fps, scale=s))
    status, gate = DONE, None
    if ref_clip is not None:
        gate = compare_clips(ref_clip.frames, clip.frames, vmaf=config.gate.wants_vmaf)
        gate.update(gate_bar)
        gate["below"] = _below(gate, gate_bar)
        gate["passed"] = not gate["below"]
        status = DONE if gate["passed"] else GATE_FAILED
    rec = {"id": job.id, "line": job.line, "status": status, "fingerprint": fp,
           "request": dataclasses.asdict(job.request), "outputs": outputs,
           "frames": {"shape": list(clip.frames.shape), "sha256": hashlib.sha256(clip.frames.tobytes()).hexdigest()},
           "metadata": clip.metadata, "gate": gate, "attempts": attempts,
           "seconds": {**clip.metadata["seconds"], "write": round(time.perf_counter() - t0, 4)},
           "finished": _now(), "worker": clip.metadata.get("worker", f"{socket.gethostname()}:{os.getpid()}")}
    out.write_record(job.id, rec)
    return rec


def _below(scores: dict, bar: dict) -> list[str]:
    """The bars a clip's scores miss, of ``psnr``, ``ssim``, ``vmaf`` (a VMAF that could not be
    computed misses its bar: an unmeasured clip never passes)."""
    below = []
    if not scores["worst_psnr_db"] >= bar["min_psnr_db"]:
        below.append("psnr")
    if bar["min_ssim"] is not None and not scores["mean_ssim"] >= bar["min_ssim"]:
        below.append("ssim")
    if bar["min_vmaf"] is not None and not (isinstance(scores["vmaf"], float) and scores["vmaf"] >= bar["min_vmaf"]):
        below.append("vmaf")
    return below


def _gate_bar(run: Path, gate: GateConfig) -> dict:
    """The gate's bars: given, else the run folder's ``parity.frames.min_psnr_db``, else 25 dB."""
    bar, source = gate.min_psnr_db, "given"
    if bar is None:
        try:
            bar = float(RunFolder(run).read_manifest("parity", check_stage=False)["config"]["frames"]["min_psnr_db"])
            source = f"{run}/parity manifest (parity.frames.min_psnr_db)"
        except (TrtSoraError, KeyError, TypeError, ValueError):
            bar, source = 25.0, "default 25 dB (no parity.frames gate recorded)"
    return {"reference": gate.reference, "min_psnr_db": bar, "min_psnr_source": source, "min_ssim": gate.min_ssim,
            "min_vmaf": gate.min_vmaf}


def _write_manifest(out: _Out, gen, jobs, jobs_path, records, config: BatchConfig, artifact) -> None:
    from trt_sora.manifest import file_entry

    clips = {}
    for job in jobs:
        rec = records.get(job.id)
        if rec is None:
            continue
        clips[job.id] = {"status": rec["status"], "line": job.line, "prompt": (rec.get("request") or {}).get("prompt"),
                         "seed": (rec.get("request") or {}).get("seed"),
                         "outputs": rec.get("outputs", {}), "frames_sha256": (rec.get("frames") or {}).get("sha256"),
                         "settings": (rec.get("metadata") or {}).get("sampling"),
                         "seconds": rec.get("seconds"), "error": rec.get("error"),
                         "gate": (rec.get("gate") or {}).get("passed"), "quality": _scores(rec.get("gate"))}
    inputs = {"run": artifact, **({"jobs": file_entry(jobs_path)} if jobs_path else {})}
    out.write_manifest(inputs=inputs, config=config, records=records,
                       results={"jobs": len(jobs), "finished": sum(c["status"] != FAILED for c in clips.values()),
                                "clips": clips})


def _scores(gate: dict | None) -> dict | None:
    """A clip's gate scores for the manifest (None without a gate)."""
    if not gate:
        return None
    return {k: gate.get(k) for k in ("worst_psnr_db", "mean_psnr_db", "mean_ssim", "vmaf", "below")}


def _summarize(out: _Out, gen, jobs, records, state, batches, latencies, config, wall) -> BatchSummary:
    failures = [{"id": j.id, "line": j.line, "error": records[j.id]["error"]["message"]}
                for j in jobs if j.id in records and records[j.id]["status"] == FAILED]
    gate_failures = [{"id": j.id, **{k: records[j.id]["gate"].get(k) for k in ("worst_psnr_db", "mean_ssim", "vmaf",
                                                                             "below")}}
                     for j in jobs if j.id in records and records[j.id]["status"] == GATE_FAILED]
    lat = np.asarray(latencies) if latencies else None
    gates = [r["gate"] for r in records.values() if r.get("gate")]
    data = {
        "run": str(gen.run_dir), "backend": getattr(gen.runner, "backend", "?"), "out": str(out.root),
        **state, "finished": state["done"], "failures": failures, "gate_failures": gate_failures,
        "formed_batches": {str(k): v for k, v in sorted(batches.items())},
        "seconds": {"wall": round(wall, 2)},
        "throughput_clips_per_s": round(state["generated"] / wall, 4) if wall > 0 and state["generated"] else 0.0,
        "clip_seconds": {"p50": round(float(np.percentile(lat, 50)), 3), "p95": round(float(np.percentile(lat, 95)), 3)}
        if lat is not None else None,
        "gate": _gate_summary(gates, config) if config.gate else None,
    }
    out.write_json("summary.json", data)
    out.write_text("summary.md", _markdown(data))
    return BatchSummary(data)


def _gate_summary(gates: list[dict], config: BatchConfig) -> dict:
    d: dict[str, Any] = {"reference": config.gate.reference, "clips": len(gates)}
    if gates:
        d["worst_psnr_db"] = min(g["worst_psnr_db"] for g in gates)
        d["worst_mean_ssim"] = min(g["mean_ssim"] for g in gates)
        d["min_psnr_db"] = gates[0]["min_psnr_db"]
        d["min_vmaf"] = gates[0].get("min_vmaf")
        vm = [g["vmaf"] for g in gates if isinstance(g.get("vmaf"), (int, float))]
        d["vmaf"] = {"min": min(vm), "mean": float(np.mean(vm))} if vm else (gates[0].get("vmaf_note") or "not asked")
    return d


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _vmaf_text(g: dict) -> str:
    v = g["vmaf"]
    text = f"min {v['min']:.2f}, mean {v['mean']:.2f}" if isinstance(v, dict) else str(v)
    return text + (f" (bar {g['min_vmaf']:g})" if g.get("min_vmaf") is not None else "")


def _markdown(d: dict) -> str:
    lines = [f"# Batch summary: {d['out']}", "", f"Run folder `{d['run']}`, backend `{d['backend']}`.", "",
             "| jobs | finished | generated now | skipped (finished earlier) | failed | gate failed | retries |",
             "|---|---|---|---|---|---|---|",
             f"| {d['total']} | {d['finished']} | {d['generated']} | {d['skipped']} | {d['failed']} | "
             f"{d['gate_failed']} | {d['retries']} |", ""]
    if d["clip_seconds"]:
        lines += [f"Wall time {d['seconds']['wall']} s, {d['throughput_clips_per_s']} clips/s; per-clip group time "
                  f"p50 {d['clip_seconds']['p50']} s, p95 {d['clip_seconds']['p95']} s.", "",
                  "Formed batches (clips per call group: count): " +
                  ", ".join(f"{k}: {v}" for k, v in d["formed_batches"].items()), ""]
    if d.get("gate"):
        g = d["gate"]
        lines += [f"Quality gate against `{g['reference']}`: {g['clips']} clips" +
                  (f", worst-frame PSNR {g['worst_psnr_db']:.2f} dB (bar {g['min_psnr_db']} dB), worst mean SSIM "
                   f"{g['worst_mean_ssim']:.4f}; VMAF: {_vmaf_text(g)}" if g["clips"] else ""), ""]
    if d["failures"]:
        lines += ["## Failed", "", "| id | line | error |", "|---|---|---|"]
        lines += [f"| {f['id']} | {f['line']} | {f['error'].replace('|', '/')} |" for f in d["failures"]] + [""]
    if d["gate_failures"]:
        lines += ["## Below the quality gate", "", "| id | worst PSNR dB | mean SSIM | VMAF | below |",
                  "|---|---|---|---|---|"]
        lines += [f"| {f['id']} | {f['worst_psnr_db']:.2f} | {f['mean_ssim']:.4f} | "
                  f"{'-' if f['vmaf'] is None else format(f['vmaf'], '.2f')} | {', '.join(f['below'] or [])} |"
                  for f in d["gate_failures"]] + [""]
    return "\n".join(lines)
