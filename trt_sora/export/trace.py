"""torch -> ONNX graph (``onnx_ir.Model``) with the weights in memory or not at all.

:func:`trace` runs ``torch.onnx.export(dynamo=True, optimize=False)`` on either
the loaded model or, for a *weightless* export, the family's empty model (meta
parameters) turned into fake tensors: torch.export then traces shapes only and
the graph is identical node for node to the one traced with real weights (tested
on wan-tiny). :func:`bind_weights` gives the weightless graph's initializers lazy
values read from a :class:`~trt_sora.weights.sources.WeightSource` when the file
is written. Exports that share a ``traces`` dict (the experts of a pair) trace one graph once and copy it
(:func:`trace`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from trt_sora.errors import ExportError

log = logging.getLogger("trt_sora")

#: The export wrapper's attribute holding the model (initializers are named ``inner.<state name>``).
WRAPPER_ATTR = "inner."


@contextlib.contextmanager
def fake_weights(model) -> Iterator[Any]:
    """Within the block, ``model``'s parameters (meta) and buffers are fake CPU tensors of one
    ``FakeTensorMode`` (yielded); restored on exit."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    conv = mode.fake_tensor_converter
    cpu = torch.device("cpu")
    saved = []
    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is None:
                continue
            meta = p if p.device.type == "meta" else p.to("meta")
            saved.append((mod._parameters, k, p))
            mod._parameters[k] = torch.nn.Parameter(conv.from_meta_and_device(mode, meta, cpu), requires_grad=False)
        for k, b in list(mod._buffers.items()):
            if b is None:
                continue
            saved.append((mod._buffers, k, b))
            mod._buffers[k] = mode.from_tensor(b)
    try:
        yield mode
    finally:
        for store, k, v in reversed(saved):
            store[k] = v


def trace(adapter, model, point: Mapping[str, int], config, dynamic_shapes, *, weightless: bool,
          traces: dict | None = None):
    """``torch.onnx.export(..., dynamo=True, optimize=False)`` of ``adapter.export_module(model)`` at ``point``;
    returns an object whose ``model`` is the graph (``onnx_ir.Model``, the caller's to change) and ``copied``
    whether it is a copy of an earlier trace.
    ``weightless``: ``model`` is an empty model (meta parameters). ``traces``: a dict the exports of models with
    one graph share (the experts of a pair): a graph is traced once per :func:`trace_key` and each export gets
    its own copy of it (the copy shares the trace's tensors, which no later step changes). A loaded model's key
    hashes its weights too (they are in its graph): for models small enough to hash, such as the tests'."""
    key = trace_key(adapter, model, point, config, dynamic_shapes, weights=not weightless) \
        if traces is not None else None
    if key is not None and key in traces:
        return SimpleNamespace(model=_copy_model(traces[key]), copied=True)
    program = _trace(adapter, model, point, config, dynamic_shapes, weightless=weightless)
    if key is not None:
        traces[key] = _copy_model(program.model)  # before the caller binds weights and optimizes in place
    return SimpleNamespace(model=program.model, copied=False)


def trace_key(adapter, model, point: Mapping[str, int], config, dynamic_shapes, *, weights: bool = False) -> str:
    """What a trace depends on, hashed: the family, the export wrapper and the model's modules, config,
    parameter and buffer names, shapes and dtypes, the example inputs' shapes and dtypes, the dynamic shapes, the
    opset and the input and output names; with ``weights`` (a loaded model, whose graph holds them) the bytes of
    every parameter and buffer (a weightless trace has none)."""
    import hashlib

    wrapper = adapter.export_module(model)
    example = adapter.example_inputs(point, dtype=config.dtype.value)
    config_items = sorted(getattr(model, "config", {}).items())
    parts = [type(adapter).__qualname__, adapter.name, repr(wrapper), repr(config_items),
             [(n, tuple(t.shape), str(t.dtype)) for n, t in (*model.named_parameters(), *model.named_buffers())],
             [(n, tuple(example[n].shape), str(example[n].dtype)) for n in adapter.input_names],
             list(adapter.output_names), repr(dynamic_shapes), config.opset, config.dtype.value]
    if weights:
        h = hashlib.sha256()
        for _, t in (*model.named_parameters(), *model.named_buffers()):
            h.update(to_numpy(t.detach().cpu()).reshape(-1).view(np.uint8).data)
        parts.append(h.hexdigest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _copy_model(model):
    """A copy of ``model`` (``onnx_ir.Model``) whose nodes and values are new objects (tensors shared: the
    exporter replaces an initializer's tensor, never changes one). The copy's graph names the nodes and values
    that optimizing adds from the original's counters, so both give the same bytes (a clone's start at 0)."""
    import copy

    import onnx_ir as ir

    graph = model.graph.clone()
    graph._name_authority = copy.deepcopy(model.graph._name_authority)  # counters and the names taken
    return ir.Model(graph, ir_version=model.ir_version, producer_name=model.producer_name,
                    producer_version=model.producer_version, domain=model.domain, model_version=model.model_version,
                    doc_string=model.doc_string, functions=[f.clone() for f in model.functions.values()],
                    metadata_props=dict(model.metadata_props))


def _trace(adapter, model, point: Mapping[str, int], config, dynamic_shapes, *, weightless: bool):
    import torch

    example = adapter.example_inputs(point, dtype=config.dtype.value)
    args = tuple(example[n] for n in adapter.input_names)
    ctx = fake_weights(model) if weightless else contextlib.nullcontext()
    try:
        with ctx as mode:
            if weightless:
                args = tuple(mode.from_tensor(a) for a in args)
            wrapper = adapter.export_module(model).eval()
            with torch.no_grad():
                return torch.onnx.export(
                    wrapper, args, dynamo=True, opset_version=config.opset,
                    input_names=list(adapter.input_names), output_names=list(adapter.output_names),
                    dynamic_shapes=dynamic_shapes, optimize=False, verbose=False)
    except Exception as exc:  # the exporter raises many types; wrap them in one
        raise ExportError(f"torch.onnx.export failed for {adapter.name} at {point}: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


def to_numpy(t) -> np.ndarray:
    """A CPU torch tensor as a numpy array (bf16 / fp8 through ``ml_dtypes``), no copy."""
    import torch

    special = {torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
    if t.dtype in special:
        import ml_dtypes

        bits = torch.int16 if t.dtype == torch.bfloat16 else torch.int8
        return t.contiguous().view(bits).numpy().view(getattr(ml_dtypes, special[t.dtype]))
    return t.contiguous().numpy()


def bind_weights(ir_model, empty_model, source):
    """Give every initializer of the weightless ``ir_model`` a lazy value; returns ``read(name)``.

    Initializer ``inner.<name>``: parameter ``<name>`` read from ``source`` in the dtype it has in
    ``empty_model``, or buffer ``<name>`` of ``empty_model`` (real, e.g. RoPE tables). Raises
    ExportError for an initializer that is neither (a constant created while tracing, whose value a
    fake trace cannot know).
    """
    from trt_sora.export.lazy_weights import weight_tensor
    from trt_sora.weights.sources import read_as

    params = dict(empty_model.named_parameters())
    buffers = dict(empty_model.named_buffers())

    def read(init_name: str) -> np.ndarray:
        name = init_name[len(WRAPPER_ATTR):] if init_name.startswith(WRAPPER_ATTR) else init_name
        if name in params:
            return to_numpy(read_as(source, name, params[name].dtype))
        return to_numpy(buffers[name])

    for init_name, value in ir_model.graph.initializers.items():
        name = init_name[len(WRAPPER_ATTR):] if init_name.startswith(WRAPPER_ATTR) else init_name
        if name not in params and name not in buffers:
            raise ExportError(f"initializer {init_name!r} is neither a parameter nor a buffer of the model (a constant "
                              "made during tracing); the weightless export cannot know its value - export with the "
                              "weights in memory (export_onnx(..., model=adapter.load()))")
        ct = value.const_value
        uses = list(value.uses())
        only_t = bool(uses) and all(u.node.op_type == "Transpose" and u.node.domain in ("", "ai.onnx") for u in uses)
        value.const_value = weight_tensor(init_name, ct.dtype, ct.shape, read, transposed_only=only_t)
    return read
