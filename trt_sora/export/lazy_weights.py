"""Weights that stay on disk while the exporter's optimizer runs, and are read one tensor at a time on save.

The dynamo exporter traces under a fake mode (no weight memory) and leaves
initializers without data. Its optimizer (onnxscript: constant folding, dedup,
CSE, fusions) then needs values only for two things: small constants it folds or
deduplicates (below :data:`SMALL` elements: given as real arrays), and the
``Transpose`` of a weight that ``nn.Linear`` lowers to (folded into a new
``[in, out]`` initializer). For a larger weight that only a ``Transpose`` reads,
:func:`weight_tensor` hands the optimizer a :class:`Placeholder`: an array of the
right shape and dtype that occupies one element of memory (a NaN, so a rewrite
rule that inspected its values would find no match rather than a wrong one),
carrying a *recipe* (which weight, which transposes). Every other weight reads its
real values whenever the optimizer asks (a rule such as
``RemoveOptionalBiasFromGemm`` looks at a bias), one at a time. :func:`lazy_folding`
lets the optimizer fold a ``Transpose`` of a placeholder into another placeholder;
any other op that meets a placeholder gets the real values (correct, just not
memory-free). Afterwards
:func:`resolve_placeholders` turns every placeholder left in the graph into a
``LazyTensor`` that reads the weight and applies the recipe when the file is
written, so the optimizer runs exactly as in an in-memory export (same folds in
the same order: same node and initializer names, same bytes) while peak memory
stays at one weight.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import numpy as np

log = logging.getLogger("trt_sora")

#: Weights of at most this many elements are handed to the optimizer as real values (it folds and
#: deduplicates constants of this size; onnxscript's fold input limit is 8192 elements).
SMALL = 8192

#: ``("weight", name)`` or ``("transpose", perm, inner_recipe)``.
Recipe = tuple


class Placeholder(np.ndarray):
    """A read-only, zero-stride array standing for a tensor that is not in memory."""

    recipe: Recipe

    def __array_finalize__(self, obj) -> None:
        self.recipe = getattr(obj, "recipe", None)


def placeholder(shape, dtype, recipe: Recipe) -> Placeholder:
    base = np.full((), np.nan, dtype=dtype) if np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16" \
        else np.zeros((), dtype=dtype)
    arr = np.lib.stride_tricks.as_strided(base, shape=tuple(int(s) for s in shape),
                                          strides=(0,) * len(shape), writeable=False)
    out = arr.view(Placeholder)
    out.recipe = recipe
    return out


def materialize(recipe: Recipe, read: Callable[[str], np.ndarray]) -> np.ndarray:
    """The real array of ``recipe``; ``read(name)`` returns a weight as a numpy array."""
    kind = recipe[0]
    if kind == "weight":
        return read(recipe[1])
    if kind == "transpose":
        return _transpose(materialize(recipe[2], read), recipe[1])
    raise ValueError(f"unknown lazy-weight recipe {recipe!r}")


def _transpose(arr: np.ndarray, perm) -> np.ndarray:
    """``np.transpose(arr, perm)`` made contiguous; through torch's blocked copy (faster, threaded) when it
    can hold the dtype."""
    try:
        import torch

        t = torch.from_numpy(arr)
    except (ImportError, TypeError):  # bf16/fp8 numpy (ml_dtypes) arrays: view the bits
        t = None
    if t is None and arr.dtype.itemsize in (1, 2):
        import torch

        bits = arr.view(np.int8 if arr.dtype.itemsize == 1 else np.int16)
        return torch.from_numpy(bits).permute(*perm).contiguous().numpy().view(arr.dtype)
    if t is None:
        return np.ascontiguousarray(np.transpose(arr, perm))
    return t.permute(*perm).contiguous().numpy()


def _ir():
    import onnx_ir as ir

    return ir


def weight_tensor(name: str, dtype, shape, read: Callable[[str], np.ndarray], *, transposed_only: bool = False):
    """An ``ir`` tensor for weight ``name`` (``ir.DataType`` ``dtype``, ``ir.Shape`` ``shape``) whose bytes
    come from ``read(name)`` when written. ``transposed_only``: only ``Transpose`` nodes read it, so a
    large one shows the optimizer a :class:`Placeholder` instead of its values."""
    ir = _ir()

    class WeightTensor(ir.LazyTensor):
        __slots__ = ()

        def numpy(self) -> np.ndarray:
            if transposed_only and self.size > SMALL:
                return placeholder(tuple(self.shape), self.dtype.numpy(), ("weight", name))
            return super().numpy()

    def load():
        return ir.tensor(np.ascontiguousarray(read(name)), dtype=dtype)

    return WeightTensor(load, dtype=dtype, shape=shape, name=name)


class _LazyEvaluator:
    """Wraps onnxscript's constant-folding evaluator: ``Transpose`` of a placeholder stays lazy."""

    def __init__(self, inner, read: Callable[[str], np.ndarray]):
        self.inner = inner
        self.read = read
        self.materialized: list[str] = []

    def get_evaluator(self, *args):
        return self.inner.get_evaluator(*args)

    def evaluate(self, domain: str, op: str, version: int, *args, **kwargs):
        if not any(isinstance(a, Placeholder) for a in args):
            return self.inner.evaluate(domain, op, version, *args, **kwargs)
        if domain in ("", "ai.onnx") and op == "Transpose" and isinstance(args[0], Placeholder):
            src = args[0]
            perm = tuple(kwargs.get("perm") or range(src.ndim - 1, -1, -1))
            return placeholder(tuple(src.shape[i] for i in perm), src.dtype, ("transpose", perm, src.recipe))
        real = [materialize(a.recipe, self.read) if isinstance(a, Placeholder) else a for a in args]
        self.materialized.append(op)
        return self.inner.evaluate(domain, op, version, *real, **kwargs)


@contextlib.contextmanager
def lazy_folding(read: Callable[[str], np.ndarray]) -> Iterator[_LazyEvaluator]:
    """Within the block, onnxscript's constant folder keeps ``Transpose(weight)`` lazy (see module doc)."""
    from onnxscript.optimizer import _constant_folding as cf

    original = cf._reference_evaluator
    wrapper = _LazyEvaluator(original, read)
    cf._reference_evaluator = wrapper
    try:
        yield wrapper
    finally:
        cf._reference_evaluator = original
    if wrapper.materialized:
        log.info("export: constant folding read %d weight(s) in full (ops %s)", len(wrapper.materialized),
                 sorted(set(wrapper.materialized)))


def resolve_placeholders(model, read: Callable[[str], np.ndarray]) -> int:
    """Replace every placeholder-backed initializer / Constant value in ``model`` (``ir.Model``) by a
    ``LazyTensor`` that materializes its recipe on write. Returns how many were replaced."""
    ir = _ir()
    count = 0

    def lazy(t):
        raw = getattr(t, "raw", None)
        if not isinstance(raw, Placeholder):
            return None
        recipe = raw.recipe
        return ir.LazyTensor(lambda: ir.tensor(materialize(recipe, read), dtype=t.dtype), dtype=t.dtype,
                             shape=t.shape, name=t.name)

    for graph in model.graphs():
        for value in graph.initializers.values():
            new = lazy(value.const_value) if value.const_value is not None else None
            if new is not None:
                value.const_value = new
                count += 1
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and lazy(attr.value) is not None:
                    raise RuntimeError(f"node {node.name!r} holds a lazy weight as a Constant attribute; "
                                       "this export path cannot stream it")
    return count
