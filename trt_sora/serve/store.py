"""The server's durable job store: SQLite in WAL mode under ``--state-dir``, clips as files named by
their sha256.

::

    STATE/jobs.sqlite               one row a job (request, status, times, error, metadata, result sha256)
    STATE/results/<sha256>.npy      a finished clip's frames, referenced by the rows that made it

A job is committed before the server answers 202, so a process killed at any instant (kill -9
included) loses no accepted job: on the next start :meth:`JobStore.unfinished` returns the jobs
that were queued or running, oldest first, and the engine queues them again. Rows change status
``queued -> running -> done | failed`` (or ``cancelled`` from queued or running); a row re-queued
after a crash counts the attempt.
Retention: :meth:`JobStore.sweep` drops finished rows past an age or beyond a count, then the
result files no row references.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sqlite3
import threading
from pathlib import Path

from trt_sora.errors import ConfigError

__all__ = ["JobRow", "JobStore"]

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    key_id TEXT,
    request TEXT NOT NULL,
    status TEXT NOT NULL,
    submitted REAL NOT NULL,
    started REAL,
    finished REAL,
    error TEXT,
    metadata TEXT,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    trace_id TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, submitted);
"""
_SHA = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class JobRow:
    """One job as stored. ``request``: the ClipRequest's fields; ``result``: the clip's sha256."""

    id: str
    key_id: str | None
    request: dict
    status: str
    submitted: float
    started: float | None
    finished: float | None
    error: str | None
    metadata: dict | None
    result: str | None
    attempts: int
    trace_id: str | None = None


class JobStore:
    """Jobs and results under ``folder`` (created). Thread-safe: one connection behind a lock."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.results = self.folder / "results"
        try:
            self.results.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--state-dir {self.folder}: cannot create it ({exc.strerror}); pick a writable "
                              "folder") from None
        self.path = self.folder / "jobs.sqlite"
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # results written, not yet referenced by a committed row
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise ConfigError(f"{self.path} has job-store schema {version}, this trt_sora reads "
                                  f"{SCHEMA_VERSION}; use another --state-dir or the trt_sora that wrote it")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path} is not a job store ({exc}); move it away or use another "
                              "--state-dir") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args=()) -> None:
        with self._lock:
            self._db.execute(sql, args)

    # -- writes: each one a committed transaction ---------------------------------------------------
    def add(self, job_id: str, request: dict, submitted: float, key_id: str | None = None,
            trace_id: str | None = None) -> None:
        """Commit a new queued job (before the server answers 202)."""
        self._write("INSERT INTO jobs (id, key_id, request, status, submitted, trace_id) "
                    "VALUES (?, ?, ?, 'queued', ?, ?)", (job_id, key_id, json.dumps(request), submitted, trace_id))

    def started(self, ids: list[str], when: float) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("UPDATE jobs SET status='running', started=? WHERE id=?", [(when, i) for i in ids])
            self._db.execute("COMMIT")

    def finished(self, job_id: str, when: float, *, error: str | None = None, metadata: dict | None = None,
                 result: str | None = None, cancelled: bool = False) -> None:
        status = "cancelled" if cancelled else "failed" if error else "done"
        self._write("UPDATE jobs SET status=?, finished=?, error=?, metadata=?, result=? WHERE id=?",
                    (status, when, error, None if metadata is None else json.dumps(metadata), result, job_id))
        with self._lock:
            self._pending.discard(result)

    def requeue(self, ids: list[str]) -> None:
        """Back to queued (after a crash, or a drain that stopped before they ran); counts the attempt."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("UPDATE jobs SET status='queued', started=NULL, attempts=attempts+1 "
                                 "WHERE id=? AND status IN ('queued', 'running')", [(i,) for i in ids])
            self._db.execute("COMMIT")

    def put_result(self, frames) -> tuple[str, Path]:
        """Write ``frames`` (a numpy array) as ``results/<sha256>.npy`` (temp file, then rename);
        ``(sha256, path)``. The same clip twice is one file."""
        import numpy as np

        tmp = self.results / f".{os.getpid()}.{threading.get_ident()}.tmp.npy"
        np.save(tmp, frames)
        digest = _sha256(tmp)
        path = self.results / f"{digest}.npy"
        with self._lock:
            self._pending.add(digest)  # the sweep leaves it until a row references it
        os.replace(tmp, path)
        return digest, path

    # -- reads ------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRow | None:
        rows = self._select("WHERE id=?", (job_id,))
        return rows[0] if rows else None

    def unfinished(self) -> list[JobRow]:
        """Jobs queued or running when the last process stopped, oldest first."""
        return self._select("WHERE status IN ('queued', 'running') ORDER BY submitted, rowid")

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def result_path(self, row: JobRow) -> Path | None:
        return None if row.result is None else self.results / f"{row.result}.npy"

    def _select(self, where: str, args=()) -> list[JobRow]:
        with self._lock:
            cur = self._db.execute(f"SELECT id, key_id, request, status, submitted, started, finished, error, "
                                   f"metadata, result, attempts, trace_id FROM jobs {where}", args)
            rows = cur.fetchall()
        return [JobRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5], r[6], r[7],
                       None if r[8] is None else json.loads(r[8]), r[9], r[10], r[11]) for r in rows]

    def live_results(self) -> set[str]:
        """The sha256 of every result a row references, or one written and not yet referenced."""
        with self._lock:
            live = {r[0] for r in self._db.execute("SELECT result FROM jobs WHERE result IS NOT NULL")}
            return live | self._pending

    # -- retention --------------------------------------------------------------------------------
    def sweep(self, now: float, *, max_age_s: float | None = None, keep: int | None = None) -> list[str]:
        """Drop finished jobs older than ``max_age_s`` (by finish time) and all but the ``keep`` newest
        finished ones; then delete result files no remaining row references. Returns the dropped ids."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            old = []
            if max_age_s is not None:
                old += [r[0] for r in self._db.execute(
                    "SELECT id FROM jobs WHERE status NOT IN ('queued', 'running') AND finished < ?",
                    (now - max_age_s,))]
            if keep is not None:
                old += [r[0] for r in self._db.execute(
                    "SELECT id FROM jobs WHERE status NOT IN ('queued', 'running') ORDER BY finished DESC, rowid DESC "
                    "LIMIT -1 OFFSET ?", (keep,))]
            old = sorted(set(old))
            self._db.executemany("DELETE FROM jobs WHERE id=?", [(i,) for i in old])
            self._db.execute("COMMIT")
        live = self.live_results()
        for p in self.results.glob("*.npy"):
            if _SHA.fullmatch(p.stem) and p.stem not in live:
                p.unlink(missing_ok=True)
        for i in old:  # the encodings made for fetches (<id>.x<scale>.<format>)
            for p in self.results.glob(f"{i}.*"):
                p.unlink(missing_ok=True)
        return old


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
