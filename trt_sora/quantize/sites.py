"""Resolve calibration sites (PyTorch module paths) to ONNX nodes via the exporter's recorded scopes.

A node's site is its deepest recorded module scope (:func:`trt_sora.onnx_tools.module_path`).

A *linear* is a ``MatMul`` (weight initializer pre-transposed to ``[in, out]``,
output channels on axis 1) or a ``Gemm`` (``transB=1``: ``[out, in]``, axis 0)
with a constant weight, plus its bias (``Add`` after a MatMul, input C of a Gemm).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from trt_sora import onnx_tools
from trt_sora.errors import QuantizeError
from trt_sora.quantize import tensors

SCOPES_KEY, WRAPPER_PREFIX = onnx_tools.SCOPES_KEY, onnx_tools.WRAPPER_PREFIX
node_scopes, module_path = onnx_tools.node_scopes, onnx_tools.module_path  # the one scope parser


@dataclasses.dataclass
class Linear:
    """One linear layer in a graphsurgeon graph.

    Attributes:
        site: module path (``blocks.0.attn1.to_q``).
        node: the MatMul/Gemm ``gs.Node``.
        weight: the ``gs.Constant`` weight; ``weight_axis`` is its output-channel axis.
        bias_node: the ``Add`` that adds the bias after a MatMul (None for Gemm / no bias).
        members: for a fused linear, the original sites in output order.
    """

    site: str
    node: Any
    weight: Any
    weight_axis: int
    bias_node: Any = None
    members: tuple[str, ...] = ()

    @property
    def input(self):
        """The activation ``gs.Variable`` ([..., in_features])."""
        return self.node.inputs[0]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[self.weight_axis])


def _is_const(t) -> bool:
    import onnx_graphsurgeon as gs

    return isinstance(t, gs.Constant)


def find_linears(graph, scopes: dict[str, list[str]], *, prefix: str = WRAPPER_PREFIX) -> dict[str, Linear]:
    """``{site: Linear}`` for every MatMul/Gemm with a constant 2-D weight and a module scope.

    Raises QuantizeError when one site owns several such nodes (a module called twice:
    one set of Q/DQ scales cannot be placed unambiguously).
    """
    found: dict[str, list[Linear]] = {}
    for node in graph.nodes:
        if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        w = node.inputs[1]
        if not _is_const(w) or len(w.shape) != 2 or _is_const(node.inputs[0]):
            continue
        site = module_path(scopes.get(node.name, []), prefix)
        if site is None:
            continue
        if node.op == "Gemm":
            if node.attrs.get("transA", 0):
                continue
            axis = 0 if node.attrs.get("transB", 0) else 1
            bias = None
        else:
            axis = 1
            bias = None
            outs = node.outputs[0].outputs
            if len(outs) == 1 and outs[0].op == "Add":
                other = [t for t in outs[0].inputs if t is not node.outputs[0]]
                if len(other) == 1 and _is_const(other[0]) and len(other[0].shape) == 1 \
                        and other[0].shape[0] == w.shape[1]:
                    bias = outs[0]
        found.setdefault(site, []).append(Linear(site, node, w, axis, bias))
    out = {}
    for site, lins in found.items():
        if len(lins) > 1:
            raise QuantizeError(f"site {site!r} matches {len(lins)} linear nodes "
                                f"({', '.join(l.node.name for l in lins)}): the module runs more than once in the "
                                "graph, so one scale cannot be placed; exclude it (quantization.exclude)")
        out[site] = lins[0]
    return out


@dataclasses.dataclass
class Attention:
    """The decomposed scaled-dot-product attention of one attention module.

    ``bmm1`` = MatMul(q * c, k^T * c), ``softmax``, ``bmm2`` = MatMul(softmax, v);
    ``q_in``/``k_in`` are BMM1's inputs, ``q_mul``/``k_mul`` the constant factors
    applied to q/k before it (1.0 when absent), ``v_in`` BMM2's second input.
    """

    module: str
    bmm1: Any
    softmax: Any
    bmm2: Any
    q_mul: float = 1.0
    k_mul: float = 1.0


def find_attentions(graph, scopes: dict[str, list[str]], *, prefix: str = WRAPPER_PREFIX,
                    strict: bool = True) -> dict[str, Attention]:
    """``{attention module path: Attention}`` from Softmax nodes between two MatMuls. A module with
    several softmaxes (an image-to-video cross-attention: text and image attention) is an error
    when ``strict`` (``fp8_attention`` needs one place for its scales), else listed with its first."""
    out: dict[str, Attention] = {}
    for node in graph.nodes:
        if node.op != "Softmax":
            continue
        sc = scopes.get(node.name, [])
        mod = module_path(sc[:-1], prefix) if sc else None  # last scope is the sdpa call
        if mod is None:
            continue
        try:
            bmm1 = node.inputs[0].inputs[0]
        except IndexError:
            continue
        cons = node.outputs[0].outputs
        if bmm1.op != "MatMul" or len(cons) != 1 or cons[0].op != "MatMul":
            continue
        att = Attention(mod, bmm1, node, cons[0])
        for i, attr in ((0, "q_mul"), (1, "k_mul")):
            t = bmm1.inputs[i]
            prod = t.inputs[0] if t.inputs else None
            if prod is not None and prod.op == "Mul":
                c = [x for x in prod.inputs if _is_const(x)]
                if len(c) == 1 and int(np.prod(c[0].shape)) == 1:
                    setattr(att, attr, float(abs(tensors.values(c[0]).reshape(()))))
        if mod in out:
            if strict:
                raise QuantizeError(f"attention module {mod!r} has several softmax nodes; fp8_attention cannot "
                                    "place its scales; turn quantization.fp8_attention off")
            continue
        out[mod] = att
    return out
