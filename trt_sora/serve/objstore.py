"""Object storage as a batch output: ``trt-sora batch --out s3://bucket/prefix``.

::

    from trt_sora.serve.batch import run_batch
    run_batch(runner, "jobs.jsonl", "s3://clips/run1")   # or open_output("s3://clips/run1") first

The prefix holds the local folder's layout (``clips/<id>.<fmt>``, ``clips/<id>.json``,
``manifest.json``, ``summary.json``/``.md``, ``.batch.lock``), through fsspec's s3fs. Endpoint,
credentials and region come from botocore's usual sources: ``AWS_ENDPOINT_URL`` (any
S3-compatible server), ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``),
``AWS_DEFAULT_REGION``, ``AWS_PROFILE`` with the shared config and credentials files, an instance
role; ``AWS_MAX_ATTEMPTS`` bounds botocore's retries.

The local folder's guarantees, and how each holds here:

- **Visible only when complete.** Each file is rendered and hashed on local disk, uploaded under a
  temporary key (``clips/.<id>.<fmt>.tmp-<pid>-<token>``, with its sha256 as object metadata),
  checked there (the size the server stored), copied server-side to its final key and the
  temporary key deleted. A single PUT is already all-or-nothing on S3; the temporary key adds that
  the final name only ever points at bytes checked after they landed, and that an upload cut off
  by a crash or a dead server is a hidden temporary key, which the next run deletes, instead of a
  final-name object a consumer of the bucket could pick up.
- **The record is the commit mark.** ``clips/<id>.json`` (the job's manifest entry: request,
  settings, every output's sha256 and size) is written after all its files are copied; a final
  key without its record (a crash between the copy and the record) is redone. Resume reads each
  job's record from the bucket and re-hashes the job's objects by reading them back: an intact
  finished clip is neither generated nor uploaded again; one whose object changed, shrank or went
  missing is redone. ``manifest.json``, the index of every record rewritten after each group, is
  not what resume trusts: a crash between a record and that rewrite would otherwise lose a
  finished clip, and trusting it alone would mean rewriting one growing object after every clip.
- **sha256 per object** in its record, in ``manifest.json``'s ``files`` and in the object's own
  metadata (``x-amz-meta-sha256``, kept by the copy).
- **One writer per prefix.** ``.batch.lock`` is created by a conditional PUT (``If-None-Match: *``).
  A lock left by a killed batch of this host (its pid is gone) is taken over; one held by another
  host names itself in the error and is removed by hand when that batch is known to be gone.
- **Containment.** Every key comes from :meth:`S3Out.key`, which refuses ``..``, ``.``, empty
  segments, backslashes and NUL and keeps the key under the prefix (a record naming an object
  elsewhere is not intact).

Errors are typed before any model loads (:func:`~trt_sora.serve.batch.open_output`): s3fs missing
(:class:`~trt_sora.errors.BackendMissingError`, the ``s3`` extra), no or refused credentials, a
missing bucket, an unreachable endpoint (:class:`~trt_sora.errors.StorageError`). A connection lost
mid-run stops the batch with a StorageError; rerunning the same command resumes it.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import ConfigError, StorageError, TrtSoraError, require
from trt_sora.manifest import FORMAT_VERSION, sha256_file, tool_versions
from trt_sora.serve.records import DONE, GATE_FAILED

log = logging.getLogger("trt_sora")

__all__ = ["S3Out", "S3Results", "parse_url"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CHUNK = 1 << 20
_SHA_NPY = re.compile(r"[0-9a-f]{64}\.npy")
_HELD: set[str] = set()  # tokens of the locks this process holds now
_BATCH_RESUME = ("the batch stopped here: when the endpoint answers again, rerun the same command to resume (finished "
                 "clips are kept and not uploaded again)")
_BATCH_RETRY = "rerun the same command to resume (finished clips are kept)"
_SERVE_RETRY = "the job failed; submit it again once the endpoint answers (its other results are kept)"
_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to a key allowed to read, "
                    "write and list the bucket")


def parse_url(url: str, flag: str = "--out") -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket[/prefix]`` (prefix without slashes at its ends; may be
    empty); ConfigError naming the fix (and the option ``flag``) for anything else."""
    m = re.fullmatch(r"s3://([^/]*)(?:/(.*))?", str(url))
    if not m:
        raise ConfigError(f"{flag} {url!r} is not an s3:// URL; use s3://bucket/prefix")
    bucket, prefix = m.group(1), (m.group(2) or "").strip("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"{flag} {url!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.', "
                          "'-'); use s3://bucket/prefix")
    if prefix:
        _check_rel(prefix, f"{flag} {url!r}")
    return bucket, prefix


def _check_rel(rel: str, where: str) -> str:
    """``rel`` unless a segment of it is empty, ``.`` or ``..`` or it holds a backslash or NUL
    (S3 keys are not paths, but tools that treat them as paths would resolve such a key elsewhere)."""
    if not isinstance(rel, str) or "\x00" in rel or "\\" in rel or any(s in ("", ".", "..") for s in rel.split("/")):
        raise ConfigError(f"{where}: {rel!r} is not a plain key under the prefix (an empty, '.' or '..' segment, a "
                          "backslash or NUL); batch writes only plain names under --out")
    return rel


def _alive(pid: Any) -> bool:
    """Whether process ``pid`` of this host still runs (a permission error means it does)."""
    from trt_sora.manifest import pid_alive

    return not isinstance(pid, bool) and isinstance(pid, int) and pid > 0 and pid_alive(pid)


def _stale(lock: Mapping[str, Any]) -> bool:
    """Whether a lock's holder is known to be gone: a process of this host that no longer runs, or
    this process's own lock from an output already unlocked (whose delete did not reach the server)."""
    if lock.get("host") != socket.gethostname():
        return False
    if lock.get("pid") == os.getpid():
        return lock.get("token") not in _HELD
    return not _alive(lock.get("pid"))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class S3Out:
    """A prefix of a bucket as a batch output (the calls :func:`~trt_sora.serve.batch.run_batch`
    makes on a local folder: ``lock``, ``finished``, ``clear``, ``write_output``, ``write_record``,
    ``write_json``, ``write_text``, ``write_manifest``, ``unlock``).

    Args:
        url: ``s3://bucket[/prefix]``.
        fs: an ``s3fs.S3FileSystem`` (default: one from the AWS environment, no listing cache).
        flag: the option that named the URL (in error messages).

    Raises:
        ConfigError: a malformed URL. BackendMissingError: s3fs missing.
        StorageError: no or refused credentials, no such bucket, an unreachable endpoint.
    """

    def __init__(self, url: str, *, fs=None, flag: str = "--out"):
        self.bucket, self.prefix = parse_url(url, flag)
        self.flag = flag
        self.root = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if fs is None:
            s3fs = require("s3fs", extra="s3")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        self.fs = fs
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # names this run's temporary keys
        self.retry, self.resume = _BATCH_RETRY, _BATCH_RESUME  # what to do after a failed request
        self._scratch: Path | None = None
        self._listing: set[str] | None = None
        self._locked = False
        self._check_bucket()

    def __str__(self) -> str:
        return self.root

    # -- keys and errors ------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        """``bucket/prefix/parts`` (the s3fs path), each part checked to be a plain key under the prefix."""
        rel = _check_rel("/".join(parts), f"key under {self.root}")
        return "/".join(x for x in (self.bucket, self.prefix, rel) if x)

    def url(self, *parts: str) -> str:
        return "s3://" + self.key(*parts)

    @staticmethod
    def endpoint() -> str:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"

    def _error(self, exc: BaseException, what: str) -> TrtSoraError:
        """A typed error for a failed request (the fix named)."""
        if isinstance(exc, TrtSoraError):
            return exc
        name = type(exc).__name__
        if name == "NoCredentialsError":
            return StorageError(f"{what}: no AWS credentials were found; {_CREDENTIALS_FIX}")
        if name == "ProfileNotFound":
            return StorageError(f"{what}: the AWS profile {getattr(exc, 'kwargs', {}).get('profile')!r} is not in the "
                                "AWS config or credentials files; fix AWS_PROFILE, or add the profile (aws configure "
                                "--profile NAME)")
        if isinstance(exc, PermissionError):
            return StorageError(f"{what}: {self.endpoint()} refused the credentials ({exc}); {_CREDENTIALS_FIX}")
        if "Connect" in name or isinstance(exc, (ConnectionError, TimeoutError)):
            return StorageError(f"{what}: lost the connection to {self.endpoint()} ({name}: {exc}); {self.resume}")
        return StorageError(f"{what}: {name}: {exc}; {self.retry}")

    @contextlib.contextmanager
    def _requests(self, what: str) -> Iterator[None]:
        try:
            yield
        except TrtSoraError:
            raise
        except Exception as exc:
            raise self._error(exc, what) from exc

    def _check_bucket(self) -> None:
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            raise StorageError(f"bucket {self.bucket!r} does not exist at {self.endpoint()}; create it (aws s3 mb "
                               f"s3://{self.bucket}) or fix {self.flag} / AWS_ENDPOINT_URL") from None
        except Exception as exc:
            raise self._error(exc, f"checking bucket {self.bucket!r}") from None

    def _read(self, key: str) -> bytes | None:
        """The object's bytes, None when it does not exist."""
        with self._requests(f"reading s3://{key}"):
            try:
                return self.fs.cat_file(key)
            except FileNotFoundError:
                return None

    def _put(self, key: str, data: bytes) -> None:
        with self._requests(f"writing s3://{key}"):
            self.fs.pipe_file(key, data)

    # -- the lock -------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Create ``.batch.lock`` (conditional PUT); ConfigError while another batch holds it."""
        k = self.key(".batch.lock")
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                           "started": _now()}).encode()
        for attempt in (0, 1):
            try:
                self.fs.pipe_file(k, body, mode="create")
                self._locked = True
                _HELD.add(self.token)
                return
            except FileExistsError:
                pass
            except Exception as exc:
                raise self._error(exc, f"locking s3://{k}") from exc
            try:
                other = json.loads(self._read(k) or b"{}")
            except ValueError:
                other = {}
            if attempt == 0 and _stale(other):
                log.warning("batch: %s was left by pid %s of this host, which is gone; taking it over",
                            self.url(".batch.lock"), other.get("pid"))
                with self._requests(f"removing the stale lock s3://{k}"):
                    self.fs.rm_file(k)
                continue
            raise ConfigError(f"another trt-sora batch ({other.get('host', '?')} pid {other.get('pid', '?')}, since "
                              f"{other.get('started', '?')}) holds s3://{k}; wait for it or use another --out, or, if "
                              f"that batch is gone, delete the lock (aws s3 rm s3://{k})")

    def unlock(self) -> None:
        """Remove the lock and the local scratch folder (best effort: a lock this run could not remove
        is taken over by the next run on this host)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._locked:
            self._locked = False
            _HELD.discard(self.token)
            try:
                with self._requests("removing the lock"):
                    self.fs.rm_file(self.key(".batch.lock"))
            except StorageError as exc:
                log.warning("batch: %s", exc)

    # -- resume ---------------------------------------------------------------------------------------
    def read_record(self, jid: str) -> dict | None:
        data = self._read(self.key("clips", f"{jid}.json"))
        try:
            rec = json.loads(data) if data is not None else None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    def _sha256(self, key: str) -> tuple[str, int] | None:
        """sha256 and size of the object's bytes as read back now; None when it does not exist."""
        h, n = hashlib.sha256(), 0
        with self._requests(f"reading s3://{key}"):
            try:
                with self.fs.open(key, "rb", block_size=_CHUNK) as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        n += len(chunk)
            except FileNotFoundError:
                return None
        return h.hexdigest(), n

    def finished(self, jid: str, fingerprint: str) -> dict | None:
        """The record when the job is finished and every object it lists still has its size and
        sha256 under the prefix, else None."""
        rec = self.read_record(jid)
        if not rec or rec.get("status") not in (DONE, GATE_FAILED) or rec.get("fingerprint") != fingerprint:
            return None
        for o in (rec.get("outputs") or {}).values():
            try:
                k = self.key(o["path"])
            except (ConfigError, TypeError, KeyError):  # a record naming an object elsewhere is not intact
                return None
            if self._sha256(k) != (o.get("sha256"), o.get("bytes")):
                return None
        return rec

    def clear(self, jid: str) -> list[str]:
        """Delete whatever a previous attempt of ``jid`` left under ``clips/`` (objects, temporary
        keys, its record); the names deleted."""
        if self._listing is None:
            with self._requests(f"listing {self.url('clips')}"):
                try:
                    self._listing = {p.rsplit("/", 1)[-1] for p in self.fs.ls(self.key("clips"), detail=False)}
                except FileNotFoundError:
                    self._listing = set()
        gone = sorted(n for n in self._listing if n.split(".")[0] == jid or n.startswith(f".{jid}."))
        for n in gone:
            with self._requests(f"deleting {self.url('clips', n)}"):
                self.fs.rm_file(self.key("clips", n))
            self._listing.discard(n)
        return gone

    # -- writes ---------------------------------------------------------------------------------------
    def _scratch_dir(self) -> Path:
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="trt-sora-s3-"))
        return self._scratch

    def write_output(self, jid: str, fmt: str, write: Callable[[Path], Any]) -> dict:
        """Render ``write(path)`` locally, upload it under a temporary key, check it there, copy it
        to ``clips/<jid>.<fmt>`` and delete the temporary key; ``{"path", "sha256", "bytes"}``."""
        local = self._scratch_dir() / f"{jid}.{fmt}"
        write(local)
        sha, size = self.commit(local, f"clips/{jid}.{fmt}")
        local.unlink()
        return {"path": f"clips/{jid}.{fmt}", "sha256": sha, "bytes": size}

    def commit(self, local: Path, rel: str) -> tuple[str, int]:
        """Upload the file ``local`` as ``rel`` under the prefix, visible only when complete: under
        the temporary key ``.<name>.tmp-<token>`` beside it (its sha256 as metadata), checked there,
        copied to its final key, the temporary key deleted. ``(sha256, bytes)`` of the file."""
        sha, size = sha256_file(local, cached=False), local.stat().st_size
        folder, _, name = rel.rpartition("/")
        tmp, final = self.key(*filter(None, (folder, f".{name}.tmp-{self.token}"))), self.key(rel)
        with self._requests(f"uploading {name} to s3://{final}"):
            self.fs.put_file(str(local), tmp, Metadata={"sha256": sha})
            stored = self.fs.info(tmp)["size"]
            if stored != size:
                raise StorageError(f"s3://{tmp} holds {stored} bytes after the upload of {size}; the endpoint lost "
                                   f"part of it: {self.retry}")
            self.fs.copy(tmp, final)
            self.fs.rm_file(tmp)
        return sha, size

    def write_record(self, jid: str, rec: dict) -> None:
        """The job's record, written last (one PUT: all or nothing)."""
        self._put(self.key("clips", f"{jid}.json"), _json(rec))

    def write_json(self, name: str, data: Any) -> None:
        self._put(self.key(name), _json(data))

    def write_text(self, name: str, text: str) -> None:
        self._put(self.key(name), text.encode())

    def write_manifest(self, *, inputs: dict, config: Any, results: dict, records: Mapping[str, dict]) -> None:
        """``manifest.json``: the local manifest's fields; ``files`` lists every clip object with
        the sha256 and size its record holds (the records themselves are not listed)."""
        from trt_sora.config.base import to_dict

        files = {o["path"]: {"sha256": o["sha256"], "bytes": o["bytes"]}
                 for rec in records.values() for o in (rec.get("outputs") or {}).values()}
        self.write_json("manifest.json", {
            "stage": "batch", "format_version": FORMAT_VERSION, "created": _now(), "inputs": dict(inputs),
            "outputs": {}, "files": dict(sorted(files.items())), "config": to_dict(config), "tools": tool_versions(),
            "results": dict(results)})


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, default=str) + "\n").encode()


class S3Results:
    """A prefix of a bucket as the server's result store (``trt-sora serve --results s3://bucket/prefix``).

    A finished clip's frames (``.npy``, written locally first) go up through :meth:`S3Out.commit`
    (a temporary key, checked, copied, deleted: the final key only ever holds a whole clip), named
    as the local file: ``<sha256>.npy`` with a job store (the row's ``result`` is that sha256, so
    a result is found again after a restart), ``<job id>.npy`` without one. The local copy is then
    removed: the bucket is where results live, the local folder a cache of the ones fetched.

    One server per prefix: :meth:`prune` deletes the temporary keys of any other process (uploads a
    crash or a lost connection cut off) and every ``<sha256>.npy`` no live job references.
    """

    def __init__(self, url: str, *, fs=None):
        self.out = S3Out(url, fs=fs, flag="--results")
        self.out.retry = self.out.resume = _SERVE_RETRY

    def __str__(self) -> str:
        return self.out.root

    def put(self, local: Path) -> str:
        """Upload ``local`` as the object of its name, then delete it; its sha256. StorageError when
        the upload fails (no final key then: at most a temporary key, which :meth:`prune` removes)."""
        sha, _ = self.out.commit(local, local.name)
        local.unlink()
        return sha

    def fetch(self, name: str, sha256: str | None, dest: Path) -> Path:
        """Download object ``name`` to ``dest`` (a temp file, checked against ``sha256``, renamed).
        StorageError when the object is gone, unreadable, or holds other bytes."""
        key, tmp = self.out.key(name), dest.with_name(f".{dest.name}.tmp-{self.out.token}")
        with self.out._requests(f"reading s3://{key}"):
            try:
                self.out.fs.get_file(key, str(tmp))
            except FileNotFoundError:
                raise StorageError(f"s3://{key} is gone (deleted outside the server?); the result is lost: submit "
                                   "the job again") from None
        got = sha256_file(tmp, cached=False)
        if sha256 is not None and got != sha256:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"s3://{key} has sha256 {got[:12]}..., its job recorded {sha256[:12]}... (changed "
                               "outside the server); the result is lost: submit the job again")
        os.replace(tmp, dest)
        return dest

    def delete(self, name: str) -> None:
        with self.out._requests(f"deleting s3://{self.out.key(name)}"):
            try:
                self.out.fs.rm_file(self.out.key(name))
            except FileNotFoundError:
                pass

    def prune(self, live: set[str]) -> list[str]:
        """Delete ``<sha256>.npy`` objects whose sha256 is not in ``live`` and other processes'
        temporary keys; the names deleted."""
        with self.out._requests(f"listing {self.out.root}"):
            try:
                names = [p.rsplit("/", 1)[-1] for p in self.out.fs.ls(self.out.root[5:], detail=False)]
            except FileNotFoundError:
                names = []
        gone = [n for n in names if (n.startswith(".") and ".tmp-" in n and not n.endswith(self.out.token))
                or (_SHA_NPY.fullmatch(n) and n[:-4] not in live)]
        for n in gone:
            self.delete(n)
        return gone
