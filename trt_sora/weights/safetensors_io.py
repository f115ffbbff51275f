"""safetensors files read and written one tensor at a time, with plain file I/O (no mmap).

The ``safetensors`` library memory-maps whole files: every tensor read stays in
the process's resident set until the file is closed, so streaming a 28 GB
checkpoint through it would still show a 28 GB peak RSS. Here a read is one
``os.pread`` of the tensor's bytes and a write appends one tensor after a header
computed up front, so memory holds one tensor at a time.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header
length ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {str: str}}`` (offsets relative to the byte after
the header), then the tensors' bytes.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from trt_sora.errors import ModelError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ALIGN = 8


class SafetensorsFile:
    """Index of one ``.safetensors`` file; :meth:`read` loads a single tensor.

    Attributes:
        path: the file.
        entries: ``{name: (torch dtype, shape tuple, absolute begin, absolute end)}`` in file order.
        metadata: the header's ``__metadata__`` (str -> str).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100 << 20:
                    raise ValueError(f"header length {n} is implausible")
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelError(f"{self.path} is not a readable safetensors file ({exc}); re-download or "
                             "re-write the checkpoint") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if e["dtype"] not in _DTYPES:
                raise ModelError(f"{self.path}: tensor {name!r} has dtype {e['dtype']}, which trt_sora cannot read")
            b, end = e["data_offsets"]
            self.entries[name] = (_DTYPES[e["dtype"]], tuple(e["shape"]), base + b, base + end)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (dtype and shape of the file), a fresh CPU tensor."""
        dtype, shape, begin, end = self.entries[name]
        size = end - begin
        buf = bytearray(size)
        with open(self.path, "rb", buffering=0) as fh:
            view = memoryview(buf)
            done = 0
            while done < size:  # pread may return short counts for multi-GB reads
                chunk = os.preadv(fh.fileno(), [view[done:]], begin + done)
                if chunk <= 0:
                    raise ModelError(f"{self.path} is truncated at tensor {name!r}; re-download the checkpoint")
                done += chunk
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def write_safetensors(path: str | os.PathLike, specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
                      produce: Callable[[str], torch.Tensor], *, metadata: Mapping[str, str] | None = None,
                      progress: Callable[[str, int], None] | None = None) -> int:
    """Write a safetensors file whose tensors are produced one at a time, in ``specs`` order.

    Args:
        path: destination; written to ``path.tmp`` first and renamed when complete.
        specs: ``(name, shape, dtype)`` of every tensor, the file's order.
        produce: ``produce(name)`` returns that tensor (converted to the spec's dtype if needed;
            its shape must match).
        metadata: the header's ``__metadata__``.
        progress: ``progress(name, nbytes)`` after each tensor.

    Returns the file size in bytes.
    """
    path = Path(path)
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for name, shape, dtype in specs:
        n = nbytes(shape, dtype)
        header[name] = {"dtype": _NAMES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for name, shape, dtype in specs:
                t = produce(name)
                if tuple(t.shape) != tuple(int(s) for s in shape):
                    raise ModelError(f"tensor {name!r}: produced shape {tuple(t.shape)} != spec {tuple(shape)}")
                t = t.detach().to("cpu", dtype).contiguous()
                fh.write(_as_bytes(t))
                if progress is not None:
                    progress(name, t.numel() * t.element_size())
                del t
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16/fp8 included), without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
