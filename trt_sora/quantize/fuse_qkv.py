"""Fused QKV: one GEMM of width ``3*d`` (self-attention) or ``2*d`` (cross-attention K/V) + Split.

TensorRT then runs one larger GEMM (and one input quantizer) instead of three.
Applied to the fp32 graph before Q/DQ insertion, so the numerics are unchanged
up to GEMM summation order. Which projections may fuse is the model family's
fact (:attr:`trt_sora.models.base.ModelAdapter.fusable_projections`).
"""
from __future__ import annotations

import logging

import numpy as np

from trt_sora.quantize import tensors
from trt_sora.quantize.sites import Linear

log = logging.getLogger("trt_sora")

def plan_groups(linears: dict[str, Linear], decide, groups) -> list[tuple[str, list[str]]]:
    """``[(fused site, [member sites])]`` for every module whose projections share one input.

    ``groups``: the family's ``((member suffixes in output order), fused suffix)`` tried in order
    (``adapter.fusable_projections``). ``decide(site) -> bool`` is the quantize decision; members
    must agree (one quantizer is shared), else the group is left unfused and that is logged.
    """
    out: list[tuple[str, list[str]]] = []
    used: set[str] = set()
    parents = sorted({s.rsplit(".", 1)[0] for s in linears if "." in s})
    for parent in parents:
        for suffixes, fused in groups:
            members = [f"{parent}.{s}" for s in suffixes]
            if any(m not in linears or m in used for m in members):
                continue
            lins = [linears[m] for m in members]
            if len({id(l.input) for l in lins}) != 1:
                continue
            if any(l.node.op != "MatMul" or l.weight_axis != 1 for l in lins):
                continue
            if len({l.weight.shape[0] for l in lins}) != 1 or len({l.bias_node is None for l in lins}) != 1:
                continue
            if len({bool(decide(m)) for m in members}) != 1:
                log.info("not fusing %s: its members are not all quantized alike", members)
                continue
            out.append((f"{parent}.{fused}", members))
            used.update(members)
    return out


def fuse_group(graph, linears: dict[str, Linear], fused_site: str, members: list[str]) -> Linear:
    """Replace ``members`` (MatMul [+ bias Add]) by MatMul(x, concat W) [+ Add(concat b)] + Split.

    The original output tensors (bias-Add outputs, or MatMul outputs without bias) become the
    Split's outputs, so every consumer is untouched. Returns the fused :class:`Linear`.
    """
    import onnx_graphsurgeon as gs

    lins = [linears[m] for m in members]
    x = lins[0].input
    w = tensors.concat([tensors.of(l.weight) for l in lins], 1, f"{fused_site}.weight")  # computed on write
    widths = [l.out_features for l in lins]
    outs = [(l.bias_node or l.node).outputs[0] for l in lins]
    wc = gs.Constant(f"{fused_site}.weight", w)
    mm_out = gs.Variable(f"{fused_site}__mm", dtype=outs[0].dtype)
    mm = gs.Node("MatMul", name=f"{fused_site}__MatMul", inputs=[x, wc], outputs=[mm_out])
    nodes = [mm]
    bias_node = None
    y = mm_out
    if lins[0].bias_node is not None:
        b = tensors.concat([tensors.of(next(t for t in l.bias_node.inputs if isinstance(t, gs.Constant)))
                            for l in lins], 0, f"{fused_site}.bias")
        y = gs.Variable(f"{fused_site}__biased", dtype=outs[0].dtype)
        bias_node = gs.Node("Add", name=f"{fused_site}__Add", inputs=[mm_out, gs.Constant(f"{fused_site}.bias", b)],
                            outputs=[y])
        nodes.append(bias_node)
    split = gs.Constant(f"{fused_site}__split", np.array(widths, dtype=np.int64))
    for l in lins:  # detach the old nodes; cleanup() removes them
        for n in (l.node, l.bias_node):
            if n is not None:
                n.outputs.clear()
                n.inputs.clear()
    nodes.append(gs.Node("Split", name=f"{fused_site}__Split", inputs=[y, split], outputs=outs, attrs={"axis": -1}))
    graph.nodes.extend(nodes)
    for m in members:
        del linears[m]
    fused = Linear(fused_site, mm, wc, 1, bias_node, members=tuple(members))
    linears[fused_site] = fused
    return fused
