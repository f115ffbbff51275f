"""ONNX helpers below every stage: ONNX Runtime sessions and the exporter's recorded module scopes.

* :func:`ort_session`: the one ONNX Runtime session factory (CUDA provider first when present,
  quiet logging, ONNX Runtime's Q/DQ fusions off), for a file or serialized bytes.
* Scopes: the dynamo exporter writes ``pkg.torch.onnx.name_scopes`` into each node's
  ``metadata_props``: a list such as ``['', 'inner', 'inner.blocks.0', 'inner.blocks.0.attn1',
  'inner.blocks.0.attn1.to_q', 'linear_5']`` (module scopes, then the op's own name). ``inner``
  is the export wrapper's attribute, so a node's module is its deepest scope without that prefix
  (:func:`node_scopes`, :func:`module_path`); :func:`probe_tensors` maps module paths to the tensor
  each module produces last (the parity checker's probes).

Imports onnx / onnxruntime only inside the functions.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

from trt_sora.errors import require

__all__ = ["ORT_DISABLED_OPTIMIZERS", "SCOPES_KEY", "WRAPPER_PREFIX", "module_path", "node_scopes", "ort_session",
           "probe_tensors"]

SCOPES_KEY = "pkg.torch.onnx.name_scopes"
WRAPPER_PREFIX = "inner."

#: Optimizers every session runs without. QDQSelectorActionTransformer fuses DQ -> op -> Q into integer
#: kernels; ONNX Runtime 1.30 applies it to float8 Q/DQ too and makes nodes no float8 type is valid for
#: (a Transpose below opset 21 once the DQ and Q around it are dropped, a MatMulIntegerToFloat), so an
#: FP8 graph fails to load. Without it ORT runs Q/DQ as written: FP8 results are unchanged, INT8 ones
#: lose the integer kernels' rounding.
ORT_DISABLED_OPTIMIZERS = ("QDQSelectorActionTransformer",)


def ort_session(model: str | Path | bytes, *, providers: Sequence[str] | None = None, threads: int | None = None,
                optimized_path: str | Path | None = None):
    """An ``onnxruntime.InferenceSession`` on a ``.onnx`` path (external data beside it is found) or
    serialized model bytes; ``providers`` default: CUDA first when available, else CPU.
    ``optimized_path``: where ONNX Runtime writes the graph it optimized (to inspect what it runs)."""
    ort = require("onnxruntime", extra="ort", pip="pip install 'trt_sora[ort]' (CPU) or 'trt_sora[ort-gpu]' (CUDA)")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if optimized_path:
        opts.optimized_model_filepath = str(optimized_path)
    avail = ort.get_available_providers()
    provs = list(providers) if providers else [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                                                  if p in avail]
    src = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(src, sess_options=opts, providers=provs, disabled_optimizers=ORT_DISABLED_OPTIMIZERS)


def node_scopes(onnx_model) -> dict[str, list[str]]:
    """``{node name: scope list}`` from the ONNX proto (graphsurgeon drops ``metadata_props``)."""
    out = {}
    for n in onnx_model.graph.node:
        for p in n.metadata_props:
            if p.key == SCOPES_KEY:
                try:
                    out[n.name] = list(ast.literal_eval(p.value))
                except (ValueError, SyntaxError):
                    out[n.name] = []
    return out


def module_path(scopes: list[str], prefix: str = WRAPPER_PREFIX) -> str | None:
    """The deepest module scope (wrapper prefix removed), or None when the node sits at the top."""
    chain: list[str] = []
    for s in scopes:
        prev = chain[-1] if chain else None
        if prev is None or prev == "" or s.startswith(prev + "."):
            chain.append(s)
    deepest = next((s for s in reversed(chain) if s), None)
    if deepest is None or deepest == prefix.rstrip("."):
        return None
    return deepest[len(prefix):] if deepest.startswith(prefix) else deepest


def probe_tensors(onnx_path: str | Path, probes: Sequence[str], prefix: str = WRAPPER_PREFIX) -> dict[str, str]:
    """``{probe: tensor name}``: the output of the last node (graph order is topological) that ran
    inside module ``probe`` (any of its recorded scopes). Probes with no node are left out."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    want = set(probes)
    scopes = node_scopes(model)
    last: dict[str, str] = {}
    for node in model.graph.node:
        if not node.output:
            continue
        for s in scopes.get(node.name, ()):
            s = s[len(prefix):] if s.startswith(prefix) else s
            if s in want:
                last[s] = node.output[0]
    return {p: last[p] for p in probes if p in last}
