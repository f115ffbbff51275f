"""Artifact folders: ``manifest.json``, content verification, atomic writes, locks.

A stage writes its folder through :func:`staged_dir` (a temp folder beside it, renamed into place
when complete) and ends with :func:`write_manifest`, which records the stage, its inputs (paths
relative to the run folder, with sha256), its config, tool versions, results, and ``files``: the
sha256 and size of every file the stage wrote. :func:`verify_folder` re-hashes those files, so a
reused stage or a served artifact is the one that was written - whatever path it is reached by
(absolute, symlink, copy).

Hashing is cached by file identity (device, inode, size, mtime and ctime in ns) in this process
and in ``$TRT_SORA_CACHE_DIR`` (default ``~/.cache/trt_sora``; ``TRT_SORA_HASH_CACHE=0`` turns
the file cache off): a ctime cannot be set back from user space, so any write or ``touch -r``
changes the key and forces a re-hash.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import errno
import fcntl
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import ArtifactError, TrtSoraError

log = logging.getLogger("trt_sora")

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
_TOOLS = ("trt_sora", "torch", "diffusers", "onnx", "onnxscript", "onnxruntime", "onnx-graphsurgeon",
          "tensorrt", "tensorrt-rtx-cu13", "tensorrt_rtx_cu13_bindings", "safetensors", "numpy")
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-.*)?$")
_LEGACY_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-[a-z0-9_]{8}$")


# -- hashing ------------------------------------------------------------------------------------------------
class _HashCache:
    """sha256 by file identity, in memory and (best effort) in one JSON file."""

    MAX = 4096

    def __init__(self) -> None:
        self._mem: dict[str, tuple[tuple, str]] = {}
        self._lock = threading.Lock()
        self._loaded = False
        self._dirty = False
        self._saved_at = 0.0

    @staticmethod
    def _path() -> Path | None:
        if os.environ.get("TRT_SORA_HASH_CACHE", "1") == "0":
            return None
        root = os.environ.get("TRT_SORA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "trt_sora")
        return Path(root) / "sha256-v1.json"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        p = self._path()
        if p is None or not p.is_file():
            return
        try:
            for k, (ident, sha) in json.loads(p.read_text()).items():
                self._mem.setdefault(k, (tuple(ident), sha))
        except (OSError, ValueError, TypeError):
            pass  # a broken cache is only a cache miss

    def _save(self) -> None:
        p = self._path()
        if p is None or not self._dirty:
            return
        self._dirty, self._saved_at = False, time.monotonic()
        items = list(self._mem.items())[-self.MAX:]
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_json(p, {k: [list(i), s] for k, (i, s) in items})
        except OSError:
            pass

    def sha256(self, path: Path, *, chunk: int = 1 << 22) -> str:
        st = os.stat(path)
        key, ident = f"{st.st_dev}:{st.st_ino}", (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with self._lock:
            self._load()
            hit = self._mem.get(key)
        if hit and hit[0] == ident:
            return hit[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for b in iter(lambda: f.read(chunk), b""):
                h.update(b)
        sha = h.hexdigest()
        st2 = os.stat(path)
        if (st2.st_size, st2.st_mtime_ns, st2.st_ctime_ns) == ident:  # not written while we read it
            with self._lock:
                self._mem.pop(key, None)
                self._mem[key] = (ident, sha)
                if not self._dirty and not self._saved_at:
                    atexit.register(self._save)
                self._dirty = True
                if time.monotonic() - self._saved_at > 2.0:  # at most every 2 s, and at exit
                    self._save()
        return sha


_CACHE = _HashCache()


def sha256_file(path: str | os.PathLike, *, cached: bool = True) -> str:
    """Hex sha256 of a file (cached by file identity unless ``cached=False``)."""
    if cached:
        return _CACHE.sha256(Path(path))
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 22), b""):
            h.update(b)
    return h.hexdigest()


def tool_versions() -> dict[str, str]:
    out = {}
    for name in _TOOLS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# -- entries -------------------------------------------------------------------------------------------------
def rel_path(path: str | os.PathLike, root: str | os.PathLike) -> str:
    """``path`` relative to ``root`` when it lies inside (``export/model.onnx``), else absolute."""
    p, r = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    try:
        return p.relative_to(r).as_posix()
    except ValueError:
        return str(p)


def file_entry(path: str | os.PathLike, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """``{"path", "sha256", "bytes"}`` of a file (path relative to ``root`` when given and inside it);
    an ONNX file's external data beside it is listed in ``external_data``."""
    p = Path(path)
    entry: dict[str, Any] = {"path": rel_path(p, root) if root else str(p.resolve()),
                             "sha256": sha256_file(p), "bytes": p.stat().st_size}
    data = p.with_name(p.name + ".data")
    if p.suffix == ".onnx" and data.exists():
        entry["external_data"] = {"path": rel_path(data, root) if root else str(data.resolve()),
                                  "sha256": sha256_file(data), "bytes": data.stat().st_size}
    return entry


def recorded_file_entry(path: str | os.PathLike, manifest: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`file_entry` of ``path`` from the hashes that ``manifest`` (its folder's) records for it and
    its external data, when it lists them (no second pass over a multi-gigabyte ``model.onnx.data``);
    else hashed from the file."""
    p = Path(path)
    files = (manifest or {}).get("files") or {}
    if p.name not in files:
        return file_entry(p)
    entry: dict[str, Any] = {"path": str(p.resolve()), **files[p.name]}
    data = files.get(p.name + ".data")
    if data is not None:
        entry["external_data"] = {"path": str(p.with_name(p.name + ".data").resolve()), **data}
    return entry


def folder_files(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``{relative path: {"sha256", "bytes"}}`` of every file under ``folder`` except the manifest and
    hidden names (locks, temp files)."""
    folder = Path(folder)
    out: dict[str, dict[str, Any]] = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and rel.as_posix() != MANIFEST and not any(s.startswith(".") for s in rel.parts):
            out[rel.as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def _relative_inputs(value: Any, root: Path) -> Any:
    """Input entries with absolute paths inside the run folder ``root`` made relative to it."""
    if isinstance(value, dict):
        out = {k: _relative_inputs(v, root) for k, v in value.items()}
        if isinstance(out.get("path"), str) and os.path.isabs(out["path"]) and "sha256" in out:
            out["path"] = rel_path(out["path"], root)
        return out
    if isinstance(value, list):
        return [_relative_inputs(v, root) for v in value]
    return value


def write_manifest(folder: str | os.PathLike, *, stage: str, inputs: Mapping[str, Any], config: Any,
                   results: Mapping[str, Any] | None = None, outputs: Mapping[str, str] | None = None) -> dict:
    """Write ``folder/manifest.json`` atomically and return it.

    Call it last in the stage's :func:`staged_dir` block: it hashes every file already in ``folder``
    (``files``). Input paths inside the run folder (``folder``'s parent) are stored relative to it.
    """
    from trt_sora.config.base import to_dict

    folder = Path(folder)
    manifest = {
        "stage": stage,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": _relative_inputs(dict(inputs), folder.resolve().parent),
        "outputs": dict(outputs or {}),
        "files": folder_files(folder),
        "config": to_dict(config),
        "tools": tool_versions(),
        "results": dict(results or {}),
    }
    write_json(folder / MANIFEST, manifest)
    return manifest


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (a unique temp file in the same folder, then one rename)."""
    path = Path(path)
    text = json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise storage_error(exc, path) or ArtifactError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        typed = storage_error(exc, path) if isinstance(exc, OSError) else None
        if typed is not None:
            raise typed from None
        raise


def read_json(path: str | os.PathLike, *, what: str = "file", fix: str = "re-run the stage that wrote it") -> Any:
    """JSON from ``path``; ArtifactError naming the file and ``fix`` when it is missing or unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing; {fix}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"cannot read {what} {path} ({exc}); {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None


def read_manifest(folder: str | os.PathLike, *, stage: str | None = None) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} has no {MANIFEST}; it is not a trt_sora artifact folder "
                            "(re-run the stage that makes it)")
    m = read_json(path, what="manifest", fix="re-run the stage")
    if not isinstance(m, dict):
        raise ArtifactError(f"{path} is not a manifest (expected a JSON object); re-run the stage")
    if stage and m.get("stage") != stage:
        raise ArtifactError(f"{folder} holds a {m.get('stage')!r} artifact, expected {stage!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {m.get('format_version')} is not supported "
                            f"(expected {FORMAT_VERSION}); re-run the stage with this trt_sora")
    return m


# -- verification ---------------------------------------------------------------------------------------------
def verify_file(path: Path, sha256: str | None, size: int | None, *, recorded_in: str, fix: str) -> None:
    """ArtifactError naming ``path`` unless it exists with ``size`` bytes and this ``sha256``."""
    if not path.is_file():
        raise ArtifactError(f"{path} is missing (listed in {recorded_in}); {fix}")
    if size is not None and path.stat().st_size != size:
        raise ArtifactError(f"{path} has {path.stat().st_size} bytes, {recorded_in} says {size} (truncated or "
                            f"replaced); {fix}")
    got = sha256_file(path)
    if not sha256 or got != sha256:
        raise ArtifactError(f"{path}: sha256 {got[:12]}... differs from {recorded_in} ({str(sha256)[:12]}...): "
                            f"the file changed after it was written; {fix}")


def verify_folder(folder: str | os.PathLike, *, stage: str | None = None,
                  fix: str = "re-run the stage that writes it") -> dict:
    """Re-hash every file ``folder/manifest.json`` lists; return the manifest or raise ArtifactError
    naming the first missing, truncated or changed file."""
    folder = Path(folder)
    m = read_manifest(folder, stage=stage)
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{folder / MANIFEST} lists no files; {fix}")
    for rel, e in files.items():
        if not isinstance(e, dict):
            raise ArtifactError(f"{folder / MANIFEST}: entry {rel!r} is malformed; {fix}")
        verify_file(folder / rel, e.get("sha256"), e.get("bytes"), recorded_in=str(folder / MANIFEST), fix=fix)
    return m


def verify_inputs(folder: str | os.PathLike, *, fix: str = "re-run this stage") -> dict:
    """The files a stage read must still be the ones it recorded (paths relative to the run folder):
    a quant/ made from another export is stale. Returns the manifest."""
    folder = Path(folder)
    m = read_manifest(folder)
    root = folder.parent
    for name, e in (m.get("inputs") or {}).items():
        for entry in (e, (e or {}).get("external_data") if isinstance(e, dict) else None):
            if isinstance(entry, dict) and entry.get("path") and entry.get("sha256"):
                p = Path(entry["path"])
                verify_file(p if p.is_absolute() else root / p, entry["sha256"], entry.get("bytes"),
                            recorded_in=f"{folder / MANIFEST} (input {name!r})", fix=fix)
    return m


def verified_input(path: str | os.PathLike, *, fix: str | None = None) -> Path:
    """``path``, after checking it against its folder's manifest when it is a trt_sora artifact file
    (a corrupt, truncated or replaced ``export/model.onnx`` is named before anything parses it)."""
    path = Path(path)
    folder = path.parent
    if not (folder / MANIFEST).is_file():
        return path
    m = read_manifest(folder)
    entry = (m.get("files") or {}).get(path.name)
    if entry is None:
        return path
    fix = fix or f"re-run the {m.get('stage', 'stage')} that wrote it"
    verify_file(path, entry.get("sha256"), entry.get("bytes"), recorded_in=str(folder / MANIFEST), fix=fix)
    data = (m.get("files") or {}).get(path.name + ".data")
    if data is not None:
        verify_file(folder / (path.name + ".data"), data.get("sha256"), data.get("bytes"),
                    recorded_in=str(folder / MANIFEST), fix=fix)
    return path


def load_onnx(path: str | os.PathLike, *, load_external_data: bool = True, fix: str = "re-run the stage that "
              "wrote it"):
    """``onnx.load`` with a typed error for a missing, truncated or corrupt file."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist; {fix}")
    try:
        return onnx.load(str(path), load_external_data=load_external_data)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        msg = " ".join(str(exc).split())[:160]
        raise ArtifactError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {msg}); {fix}") from None


def read_safetensors(path: str | os.PathLike, *, fmt: str, what: str, missing: str, fix: str) -> tuple[dict, dict]:
    """``(metadata, {name: numpy array})`` of a safetensors file whose ``metadata["format"]`` is ``fmt``;
    ArtifactError naming ``path`` and ``fix`` when it does not exist (``missing`` says why it would not)
    or holds another format (``what``: the file it should be, "a step-ratios file")."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist: {missing}; {fix}")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != fmt:
            raise ArtifactError(f"{path} is not {what} of this trt_sora ({meta.get('format')!r}); {fix}")
        return meta, {k: f.get_tensor(k) for k in f.keys()}


# -- writable output folders ----------------------------------------------------------------------------------
#: Names trt_sora stages write. A folder holding anything else and no manifest is someone else's:
#: a stage never replaces it (``--out .`` in a checkout must not delete the checkout).
_OURS = re.compile(r"^(manifest\.json|experts\.json|model(\.qdq)?\.onnx(\.data)?|qdq_map\.json|stats\.safetensors"
                   r"|report\.(md|json)"
                   r"|figures|.+\.plan|build_report(\.failed)?\.(json|md)|build_log\.txt|timing\.cache(\.json)?)$")
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error(exc: BaseException, out: Path) -> ArtifactError | None:
    """A typed error for a failed write into ``out`` (full / read-only / not permitted), else None."""
    code = getattr(exc, "errno", None)
    where = getattr(exc, "filename", None)
    if where and not os.path.abspath(where).startswith(os.path.abspath(out.parent)):
        return None  # an input elsewhere failed, not the output folder
    if code is None:  # C libraries wrap the OS error in their own type: ask the file system
        code = _fs_state(out)
    if code in _FULL:
        return ArtifactError(f"cannot write {out}: no space left on that file system ({os.strerror(code)}); "
                             "free some space or pass another --out")
    if code in _DENIED:
        return ArtifactError(f"cannot write {out}: {os.strerror(code)}; pass a writable --out")
    return None


def _fs_state(out: Path) -> int | None:
    d = out
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail == 0:
        return errno.ENOSPC
    return None


def make_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p`` with typed errors (a parent that is a file, a read-only or full file system)."""
    path = Path(os.path.abspath(path))
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ArtifactError(f"cannot create {path}: {parent} is a file, not a folder; pass another --out")
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error(exc, path) or ArtifactError(f"cannot create {path}: {exc.strerror}; pass another "
                                                       "--out") from None
    return path


def check_out_dir(out: str | os.PathLike) -> Path:
    """``out`` as an absolute path a stage may create or replace; ArtifactError with the fix otherwise.

    Refused: an empty path, an existing file, a path below a file, a folder that holds files but no
    trt_sora manifest (never replace a folder of someone else's files), an unwritable parent.
    """
    if str(out).strip() in ("", "."):
        raise ArtifactError(f"--out {str(out)!r} is not an output folder; pass a new or trt_sora folder path")
    out = Path(os.path.abspath(out))
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out {out} is a file; pass a folder path")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArtifactError(f"--out {out}: {parent} is a file, not a folder; pass another --out")
            break
    if out.is_dir() and not (out / MANIFEST).is_file():
        foreign = sorted(p.name for p in out.iterdir() if not _OURS.match(p.name) and not p.name.startswith("."))
        if foreign:
            raise ArtifactError(f"--out {out} holds files that are not a trt_sora artifact ({', '.join(foreign[:3])}"
                                f"{', ...' if len(foreign) > 3 else ''}); pass a new or empty folder (a stage "
                                "replaces its output folder as a whole)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise storage_error(exc, out.parent) or ArtifactError(f"cannot create {out.parent}: {exc.strerror}; "
                                                             "pass another --out") from None
    if not os.access(out.parent, os.W_OK | os.X_OK) or _fs_state(out.parent) in _DENIED:
        raise ArtifactError(f"cannot write {out}: {out.parent} is not writable; pass a writable --out")
    return out


# -- locks and dead temp folders ----------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a permission error means it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_lock_dir(path: Path) -> int | None:
    """An fd holding an exclusive flock on directory ``path``, or None when someone else holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_dead_temps(parent: str | os.PathLike, name: str | None = None) -> list[str]:
    """Remove ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>`` folders in ``parent`` whose process is gone
    (kill -9, power loss): nobody holds their lock and their pid is dead. Returns what was removed."""
    parent = Path(parent)
    removed: list[str] = []
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        m = _TEMP_RE.match(p.name)
        legacy = _LEGACY_TEMP_RE.match(p.name) if m is None else None
        if not (m or legacy) or (name and (m or legacy)["name"] != name) or not p.is_dir():
            continue
        if m and pid_alive(int(m["pid"])) and int(m["pid"]) != os.getpid():
            continue
        if m and int(m["pid"]) == os.getpid():
            continue  # ours, in use
        fd = _try_lock_dir(p)
        if fd is None:
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)
        if not p.exists():
            removed.append(p.name)
    if removed:
        log.info("removed temp folders of dead runs in %s: %s", parent, ", ".join(removed))
    return removed


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, *, on_wait: Callable[[str], None] | None = None,
                poll: float = 0.5) -> Iterator[Path]:
    """Hold ``folder/.trt_sora.lock`` (an exclusive flock, released when the process dies) while the
    block runs; another holder makes us wait (``on_wait(message)`` is called once)."""
    folder = make_dir(folder)
    path = folder / ".trt_sora.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise storage_error(exc, path) or ArtifactError(f"cannot lock {folder}: {exc.strerror}") from None
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if not told:
                    holder = path.read_text().strip() or "another process"
                    msg = f"{folder} is in use by {holder}; waiting for it to finish"
                    log.warning(msg)
                    if on_wait:
                        on_wait(msg)
                    told = True
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} since {_dt.datetime.now().isoformat(timespec='seconds')}".encode())
        yield folder
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; on success it replaces ``out`` in one rename.

    On any error (or SIGINT / SIGTERM in the CLI) the temp folder is removed and an existing ``out``
    stays as it was, so a stage never leaves a half-written artifact behind. A process killed with
    -9 cannot clean up: its temp folder holds a lock that dies with it, and the next stage writing
    beside it (or :func:`sweep_dead_temps`) removes it. Writing into a full or read-only file system
    is an :class:`ArtifactError`.
    """
    out = check_out_dir(out)
    sweep_dead_temps(out.parent, out.name)
    prefix = f".{out.name}.tmp-{os.getpid()}-"
    fd = None
    try:  # from before the folder exists: a SIGTERM landing between mkdtemp and the yield must clean up too
        try:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
            tmp.chmod(0o755)
        except OSError as exc:
            raise storage_error(exc, out) or ArtifactError(f"cannot create a folder beside {out}: "
                                                          f"{exc.strerror}; pass another --out") from None
        fd = _try_lock_dir(tmp)
        try:
            yield tmp
        except Exception as exc:
            if not isinstance(exc, TrtSoraError):
                typed = storage_error(exc, out)
                if typed is not None:
                    raise typed from exc
            raise
        _swap_in(tmp, out)
    except BaseException:
        for p in out.parent.glob(f"{glob.escape(prefix)}*"):  # this call's folder, wherever the signal landed
            shutil.rmtree(p, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def _swap_in(tmp: Path, out: Path) -> None:
    """Replace ``out`` by ``tmp`` (a folder of the same stage or a new path) under the parent's lock."""
    pfd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(pfd, fcntl.LOCK_EX)
        if out.exists():
            new_stage = _stage_of(tmp)
            old_stage = _stage_of(out)
            foreign = old_stage is None and any(not _OURS.match(p.name) for p in out.iterdir())
            if not out.is_dir() or foreign or (
                    old_stage is not None and new_stage is not None and old_stage != new_stage):
                shutil.rmtree(tmp, ignore_errors=True)
                raise ArtifactError(f"--out {out} holds a {old_stage or 'non-trt_sora'} artifact; this stage writes "
                                    f"{new_stage or 'another kind'} - pass another --out")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        try:
            if out.exists():
                os.replace(out, old)
            os.replace(tmp, out)
        except BaseException as exc:  # an OS error, or a signal between the two renames: the old one returns
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not out.exists():
                os.replace(old, out)
            if not isinstance(exc, OSError):
                raise
            raise storage_error(exc, out) or ArtifactError(f"cannot move the finished artifact to {out}: "
                                                          f"{exc.strerror}") from None
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(pfd)


def _stage_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("stage")
    except (OSError, ValueError, AttributeError):
        return None


def invalidate(folder: str | os.PathLike) -> None:
    """Remove an artifact folder in one rename (then delete it): nothing half-removed stays readable."""
    folder = Path(folder)
    if not folder.exists():
        return
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    shutil.rmtree(old, ignore_errors=True)
