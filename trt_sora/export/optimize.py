"""The dynamo exporter's graph optimizer, run by us: same passes as ``torch.onnx.export(optimize=True)``,
faster on big graphs, lazy on weights, deterministic in its output bytes.

* :func:`optimize` runs ``onnxscript``'s optimizer exactly as torch's exporter does
  (constant folding, rewrite rules, dedup, CSE, fusions), with one equivalent
  shortcut: a rewrite pattern with several output nodes (``SlicesSplit``) is only
  tried from a node whose op type can be its first output node. onnxscript builds
  an index of the whole graph for every node it tries, which is quadratic in the
  node count (~100 s for Wan 1.3B's 12k nodes on 2 cores); every attempt the
  shortcut skips would have failed on that first node anyway, so the rewrites,
  their order and the result are unchanged (tested on wan-tiny: byte-identical).
* With ``read=``, weights are :mod:`~trt_sora.export.lazy_weights`: the optimizer
  folds ``Transpose(weight)`` without loading it.
* :func:`canonicalize` removes what made two exports of one model differ: the
  order of ``range_constraints`` (a printed set) and the absolute paths in the
  recorded stack traces (relative to their package, so bytes do not depend on
  where trt_sora or torch is installed).
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import numpy as np

_RANGE_KEY = "pkg.torch.export.ExportedProgram.range_constraints"
_STACK_KEY = "pkg.torch.onnx.stack_trace"
# 'File "/abs/path/site-packages/diffusers/x.py"' -> 'File "diffusers/x.py"'; same for trt_sora's own files
_PATH = re.compile(r'File "[^"]*?/(?:site-packages|dist-packages)/')
_OWN_PATH = re.compile(r'File "[^"]*?/(trt_sora/)')


@contextlib.contextmanager
def _fast_multi_output_match() -> Iterator[None]:
    from onnxscript.rewriter import _basics, _matcher

    cls = _matcher.SimplePatternMatcher
    original = cls.match

    def match(self, model, graph_or_function, node, **kwargs):
        if not self.pattern.has_single_output_node:
            first = self.pattern.output_nodes[0].op_identifier()
            if first is not None and first != node.op_identifier():
                return _basics.MatchResult().fail("first output node's op type differs")
        return original(self, model, graph_or_function, node, **kwargs)

    cls.match = match
    try:
        yield
    finally:
        cls.match = original


def optimize(model, *, read: Callable[[str], np.ndarray] | None = None) -> None:
    """Optimize ``model`` (``onnx_ir.Model``) in place like ``torch.onnx.export(optimize=True)``.

    ``read(name) -> ndarray``: the model's initializers are lazy weights (see
    :mod:`~trt_sora.export.lazy_weights`); placeholders left by folding are resolved.
    """
    from torch.onnx._internal._lazy_import import onnxscript_apis

    from trt_sora.export import lazy_weights

    with _fast_multi_output_match():
        if read is None:
            onnxscript_apis.optimize(model)
        else:
            with lazy_weights.lazy_folding(read):
                onnxscript_apis.optimize(model)
            lazy_weights.resolve_placeholders(model, read)


def canonicalize(model) -> None:
    """Make ``model`` (``onnx_ir.Model``) independent of hash seeds and install paths (in place)."""
    for graph in model.graphs():
        props = graph.metadata_props
        if _RANGE_KEY in props:
            props[_RANGE_KEY] = _sorted_mapping(props[_RANGE_KEY])
        for node in graph:
            st = node.metadata_props.get(_STACK_KEY)
            if st:
                node.metadata_props[_STACK_KEY] = _OWN_PATH.sub(r'File "\1', _PATH.sub('File "', st))


def _sorted_mapping(text: str) -> str:
    """``"{b: VR[1, 2], a: VR[2, 3]}"`` -> ``"{a: VR[2, 3], b: VR[1, 2]}"`` (entries split at top level)."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        return text
    items, depth, cur = [], 0, ""
    for ch in body[1:-1]:
        if ch in "[({":
            depth += 1
        elif ch in "])}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur.strip())
    return "{" + ", ".join(sorted(items)) + "}"
