"""Constant values that are computed when the file is written, one tensor at a time.

The quantize stage edits a graph whose weights can be larger than memory (Wan
14B: 57 GB in fp32). After ``onnx.load(..., load_external_data=False)`` and
graphsurgeon's import, :func:`make_lazy` replaces every constant's values by a
:class:`Deferred`: its shape and dtype, and a function that reads it from the
export's ``model.onnx.data`` (one ``pread``) or from the inline proto. The graph
passes build new deferred values from old ones (:meth:`Deferred.astype`,
:func:`concat`, :meth:`Deferred.map` for quantization) without reading anything.
:func:`write_model` then lays every large constant out in ``model.qdq.onnx.data``,
exports the graph with references to it, and computes and writes the tensors in
file order: peak memory is the largest tensor and its inputs (Wan 14B: one fused
QKV weight, ~0.3 GB), whatever the model size. Small models (no external data)
get their values materialized and saved inline, exactly as before.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger("trt_sora")

#: Tensors of at least this many bytes go to the external data file (onnx.save_model's size_threshold).
EXTERNAL_THRESHOLD = 1024
#: Offsets of tensors of at least 1 MiB are aligned to 4 KiB pages (readers can map them).
_ALIGN, _ALIGN_FROM = 4096, 1 << 20


def _lazy_values_cls():
    from onnx_graphsurgeon.ir.tensor import LazyValues

    return LazyValues


def deferred_class():
    """The :class:`Deferred` type (built on graphsurgeon's ``LazyValues``, imported lazily)."""
    global _DEFERRED
    if _DEFERRED is None:
        _DEFERRED = _make_deferred_class()
    return _DEFERRED


_DEFERRED = None


def _make_deferred_class():
    LazyValues = _lazy_values_cls()

    class Deferred(LazyValues):
        """Values of shape ``shape`` and numpy ``dtype`` that ``compute()`` returns when asked.

        A graphsurgeon ``LazyValues``: graphsurgeon never loads it on its own and exports
        :attr:`tensor` (the proto :func:`write_model` assigns) as the initializer.
        """

        def __init__(self, shape, dtype, compute: Callable[[], np.ndarray], what: str = ""):
            self.shape = tuple(int(s) for s in shape)
            self.dtype = np.dtype(dtype)
            self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
            self.compute = compute
            self.what = what
            self.tensor = None

        def load(self) -> np.ndarray:
            arr = np.asarray(self.compute())
            if arr.shape != self.shape or arr.dtype != self.dtype:
                raise RuntimeError(f"deferred {self.what}: computed {arr.dtype}{arr.shape}, expected "
                                   f"{self.dtype}{self.shape}")
            return arr

        def astype(self, dtype) -> Deferred:
            dtype = np.dtype(dtype)
            if dtype == self.dtype:  # a new object: each constant gets its own proto when written
                return Deferred(self.shape, dtype, self.load, self.what)
            return Deferred(self.shape, dtype, lambda: self.load().astype(dtype), f"{self.what}.astype({dtype})")

        def map(self, fn: Callable[[np.ndarray], np.ndarray], dtype, what: str) -> Deferred:
            """``fn(values)`` (same shape, ``dtype``), computed on write."""
            return Deferred(self.shape, dtype, lambda: fn(self.load()), what)

        def __str__(self):
            return f"Deferred({self.what}, shape={self.shape}, dtype={self.dtype})"

        __repr__ = __str__

    return Deferred


def concat(parts: Sequence, axis: int, what: str):
    """``np.concatenate`` of deferred ``parts`` along ``axis``, computed on write."""
    D = deferred_class()
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return D(shape, parts[0].dtype, lambda: np.concatenate([p.load() for p in parts], axis=axis), what)


def of(const):
    """The deferred values of a graphsurgeon ``Constant`` (wrapping plain arrays); never loads."""
    D = deferred_class()
    v = const._values
    if isinstance(v, D):
        return v
    arr = np.asarray(v)
    return D(arr.shape, arr.dtype, lambda: arr, const.name)


def values(const) -> np.ndarray:
    """A constant's values, read now (for small constants: biases' shapes, scalar factors)."""
    return of(const).load()


def _reader(proto, base_dir: Path) -> Callable[[], np.ndarray]:
    """A function reading an (external or inline) initializer proto's array."""
    import onnx.numpy_helper
    from onnx import TensorProto

    if proto.data_location != TensorProto.EXTERNAL:
        return lambda: onnx.numpy_helper.to_array(proto)
    info = {e.key: e.value for e in proto.external_data}
    path = base_dir / info["location"]
    offset, length = int(info.get("offset", 0)), int(info["length"])
    shape = tuple(int(d) for d in proto.dims)
    dtype = _np_dtype(proto.data_type)
    # plain little-endian elements (not packed 4-bit types): the file's bytes are the array's bytes
    direct = sys.byteorder == "little" and int(np.prod(shape, dtype=np.int64)) * dtype.itemsize == length
    header = TensorProto()
    header.CopyFrom(proto)
    del header.external_data[:]
    header.data_location = TensorProto.DEFAULT

    def read() -> np.ndarray:
        raw = np.empty(length, dtype=np.uint8)  # one buffer, read into in place: no copies, no protobuf
        with open(path, "rb", buffering=0) as fh:
            view, done = memoryview(raw), 0
            while done < length:
                n = os.preadv(fh.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{path} is truncated at tensor {proto.name!r}; re-run the export")
                done += n
        if direct:
            return raw.view(dtype).reshape(shape)
        t = TensorProto()
        t.CopyFrom(header)
        t.raw_data = raw.tobytes()
        return onnx.numpy_helper.to_array(t)

    return read


def make_lazy(graph, base_dir: str | os.PathLike) -> int:
    """Replace every graphsurgeon ``LazyValues`` constant of ``graph`` by a :class:`Deferred` reading it
    from the file (``base_dir``: the ONNX's folder, where its external data lies). Returns the count."""
    import onnx_graphsurgeon as gs

    LazyValues, D = _lazy_values_cls(), deferred_class()
    base = Path(base_dir)
    n = 0
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant) and isinstance(t._values, LazyValues) and not isinstance(t._values, D):
            lv = t._values
            t._values = D(lv.shape, _np_dtype(lv.dtype), _reader(lv.tensor, base), t.name)
            n += 1
    return n


def _np_dtype(dtype) -> np.dtype:
    """graphsurgeon reports numpy dtypes, or an onnx enum for types numpy lacks (bf16, fp8)."""
    if isinstance(dtype, (int, np.integer)):
        from onnx import helper

        return np.dtype(helper.tensor_dtype_to_np_dtype(int(dtype)))
    return np.dtype(dtype)


def constant_bytes(graph) -> int:
    """Total bytes of the graph's constants (without reading any)."""
    import onnx_graphsurgeon as gs

    return sum(of(t).nbytes for t in graph.tensors().values() if isinstance(t, gs.Constant))


def write_model(graph, path: Path, *, external: bool, opset: int, ir_version: int = 9):
    """Export ``graph`` to ``path`` (+ ``path.data`` when ``external``), computing deferred values one at a
    time. Returns the exported ``onnx.ModelProto`` (external tensors not loaded)."""
    import onnx
    import onnx_graphsurgeon as gs
    from onnx import TensorProto, helper

    D = deferred_class()
    data_name = path.name + ".data"
    layout: list[tuple[object, int]] = []  # (deferred, offset)
    offset = 0
    seen: set[int] = set()
    for t in graph.tensors().values():
        if not isinstance(t, gs.Constant):
            continue
        d = of(t)
        if not external or d.nbytes < EXTERNAL_THRESHOLD:
            if isinstance(t._values, D):
                t.values = d.load()  # inline: a plain array graphsurgeon serializes itself
                t.data_location = None  # it may have been external in the export
            continue
        t._values = d
        if id(d) in seen:
            continue
        seen.add(id(d))
        if d.nbytes >= _ALIGN_FROM:
            offset += -offset % _ALIGN
        proto = TensorProto(name=t.name, dims=list(d.shape), data_type=helper.np_dtype_to_tensor_dtype(d.dtype),
                            data_location=TensorProto.EXTERNAL)
        for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(d.nbytes))):
            proto.external_data.add(key=k, value=v)
        d.tensor = proto
        layout.append((d, offset))
        offset += d.nbytes
    model = gs.export_onnx(graph, do_type_check=True)
    model.ir_version = max(model.ir_version, ir_version)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("", opset))
    if external:
        data = path.with_name(data_name)
        with open(data, "wb") as fh:
            fh.truncate(offset)
            for d, off in layout:
                arr = np.ascontiguousarray(d.load())
                fh.seek(off)
                fh.write(memoryview(arr.reshape(-1).view(np.uint8)))
                del arr
        log.info("quantize: wrote %d tensors (%.2f GB) to %s one at a time", len(layout), offset / 1e9, data)
    onnx.save_model(model, str(path))
    return model
