"""Artifact folders: ``manifest.json`` (stage, inputs + sha256, config, tool versions, results)
and atomic writes (stage into a temp folder, rename when complete)."""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from trt_sora.errors import ArtifactError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_TOOLS = ("trt_sora", "torch", "diffusers", "onnx", "onnxscript", "onnxruntime", "onnx-graphsurgeon",
          "tensorrt", "tensorrt-rtx-cu13", "tensorrt_rtx_cu13_bindings", "safetensors", "numpy")


def sha256_file(path: str | os.PathLike, *, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
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


def file_entry(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    entry = {"path": str(p.resolve()), "sha256": sha256_file(p), "bytes": p.stat().st_size}
    data = p.with_name(p.name + ".data")
    if p.suffix == ".onnx" and data.exists():
        entry["external_data_sha256"] = sha256_file(data)
    return entry


def write_manifest(folder: str | os.PathLike, *, stage: str, inputs: Mapping[str, Any], config: Any,
                   results: Mapping[str, Any] | None = None, outputs: Mapping[str, str] | None = None) -> dict:
    """Write ``folder/manifest.json`` atomically and return it."""
    from trt_sora.config.base import to_dict

    manifest = {
        "stage": stage,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": dict(inputs),
        "outputs": dict(outputs or {}),
        "config": to_dict(config),
        "tools": tool_versions(),
        "results": dict(results or {}),
    }
    write_json(Path(folder) / MANIFEST, manifest)
    return manifest


def write_json(path: str | os.PathLike, data: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def read_manifest(folder: str | os.PathLike, *, stage: str | None = None) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} has no {MANIFEST}; it is not a trt_sora artifact folder "
                            "(re-run the stage that makes it)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path} is corrupt ({exc}); re-run the stage") from None
    if stage and m.get("stage") != stage:
        raise ArtifactError(f"{folder} holds a {m.get('stage')!r} artifact, expected {stage!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format_version {m.get('format_version')} is not supported "
                            f"(expected {FORMAT_VERSION}); re-run the stage with this trt_sora")
    return m


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside ``out``; on success it replaces ``out`` in one rename.

    On any error the temp folder is removed and an existing ``out`` stays as it was,
    so a stage never leaves a half-written artifact behind.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
