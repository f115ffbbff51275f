"""Run an exported graph in ONNX Runtime one block at a time, so a model bigger than memory can be verified.

:func:`plan` cuts the graph's node list (topological order, as exported) into
contiguous segments, a new one wherever the repeated-block index in the nodes'
recorded module scopes changes (``...blocks.7...``); nodes outside every block
stay with their neighbours. Each segment is a sub-model of exactly the graph's
nodes: its inputs are the values it reads from earlier segments (or the graph
inputs), its outputs the values later segments (or the graph outputs) read, its
weights the initializers its nodes use, referenced in the export's own
``model.onnx.data``. :func:`run_segmented` opens one session per segment, runs
every input set through it and frees it, so ONNX Runtime holds one block's weights
at a time (Wan 14B fp32: ~1.4 GB instead of 57 GB). Same nodes, same weights as
the whole graph; only ONNX Runtime's own fusions cannot cross a cut.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from trt_sora.errors import ExportError

log = logging.getLogger("trt_sora")

SCOPES_KEY = "pkg.torch.onnx.name_scopes"


@dataclasses.dataclass
class Segment:
    index: int
    block: int | None
    nodes: list            # onnx.NodeProto
    inputs: list[str]      # values read from outside (graph inputs or earlier segments)
    outputs: list[str]     # values later segments or the graph outputs read
    initializers: list[str]


def _block_of(node, pattern: re.Pattern) -> int | None:
    for p in node.metadata_props:
        if p.key == SCOPES_KEY:
            m = pattern.search(p.value)
            return int(m.group(1)) if m else None
    return None


def plan(model, container: str) -> list[Segment]:
    """Segments of ``model`` (``onnx.ModelProto``, external data not loaded) cut at block changes
    (``container``: the family's ``block_container``)."""
    pattern = re.compile(rf"\.{re.escape(container)}\.(\d+)\b")
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    groups: list[tuple[int | None, list]] = []
    current: int | None = None
    for node in graph.node:
        b = _block_of(node, pattern)
        if not groups or (b is not None and current is not None and b != current):
            groups.append((b, []))
        if b is not None:
            current = b
            if groups[-1][0] is None:
                groups[-1] = (b, groups[-1][1])
        groups[-1][1].append(node)
    produced_in: dict[str, int] = {}
    for k, (_, nodes) in enumerate(groups):
        for n in nodes:
            for o in n.output:
                produced_in[o] = k
    consumers_after: dict[str, int] = {}  # value -> last segment reading it
    for k, (_, nodes) in enumerate(groups):
        for n in nodes:
            for i in n.input:
                if i:
                    consumers_after[i] = max(consumers_after.get(i, -1), k)
    graph_outs = {o.name for o in graph.output}
    segs = []
    for k, (block, nodes) in enumerate(groups):
        reads, uses = [], []
        seen = set()
        for n in nodes:
            for i in n.input:
                if not i or i in seen:
                    continue
                seen.add(i)
                if i in inits:
                    uses.append(i)
                elif produced_in.get(i, -1) != k:
                    reads.append(i)
        outs = [o for n in nodes for o in n.output
                if o and (o in graph_outs or consumers_after.get(o, -1) > k)]
        segs.append(Segment(k, block, nodes, reads, outs, uses))
    return segs


def _types(model) -> dict[str, object]:
    out = {}
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        out[vi.name] = vi.type.tensor_type.elem_type
    return out


def _segment_model(model, seg: Segment, types: Mapping[str, int]):
    import onnx

    inits = {i.name: i for i in model.graph.initializer}

    def vi(name):
        if name not in types:
            raise ExportError(f"segmented verification: value {name!r} has no recorded type in the export; verify "
                              "the whole graph instead")
        return onnx.helper.make_tensor_value_info(name, types[name], None)

    g = onnx.helper.make_graph(seg.nodes, f"segment_{seg.index}", [vi(n) for n in seg.inputs],
                               [vi(n) for n in seg.outputs], [inits[n] for n in seg.initializers])
    m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return m


def run_segmented(onnx_path: str | Path, feeds: Sequence[Mapping[str, np.ndarray]], *, session_factory,
                  container: str) -> list[list[np.ndarray]]:
    """Outputs of the graph at ``onnx_path`` for each feed dict, computed segment by segment.

    ``session_factory(path) -> onnxruntime.InferenceSession``. Segment files are written beside
    ``onnx_path`` (so their external data references resolve) and removed.
    """
    import onnx

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    segs = plan(model, container)
    types = _types(model)
    live = [dict(f) for f in feeds]
    last_use: dict[str, int] = {}
    for s in segs:
        for i in s.inputs:
            last_use[i] = s.index
    outputs = [o.name for o in model.graph.output]
    log.info("segmented ONNX Runtime verification: %d segments", len(segs))
    for s in segs:
        path = onnx_path.with_name(f".segment_{s.index}.onnx")
        onnx.save(_segment_model(model, s, types), str(path))
        try:
            sess = session_factory(path)
            for values in live:
                res = sess.run(s.outputs, {n: values[n] for n in s.inputs})
                values.update(zip(s.outputs, res))
                for n in s.inputs:  # free what no later segment reads
                    if last_use.get(n) == s.index and n not in outputs:
                        values.pop(n, None)
            del sess
        finally:
            path.unlink(missing_ok=True)
    return [[v[o] for o in outputs] for v in live]
