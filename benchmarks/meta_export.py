"""Real-size architectures traced to ONNX on the meta device (issue 16): the exporter's own trace (fake
tensors, no weights held or written) of each named real-size model, and what the graph contains.

    python benchmarks/meta_export.py --models wan2.2-ti2v-5b,hunyuanvideo-1.5-480p-t2v \\
        --out benchmarks/results/cpu_meta_export_2026-12-02.json

Per model: parameters and linear layers of the module (meta), the traced graph's node count, MatMul /
Gemm nodes, the linears that own one (by the nodes' module scopes: a linear whose output is unused has
none), scaled-dot-product attentions (Softmax nodes), the exported dims, trace seconds and peak RSS. The full
export (``trt-sora export``) adds the
optimizer pass and streams the weights into ``model.onnx.data``; this measures that the real-size graph
traces, without the hours of random-weight generation and tens of GB of disk. The experts of a pair share one
``traces`` dict, as the export stage's do: the second expert's row is the copy of the first's trace
(``copied``), its seconds what the pair's export pays for its graph.
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _adapters(name: str):
    from trt_sora.models import get_adapter

    a = get_adapter(name)
    return [(f"{name}/{e}", a.expert(e)) for e in a.experts] if a.experts else [(name, a)]


def trace_one(label: str, adapter, traces: dict | None = None) -> dict:
    import torch

    from trt_sora.config import DType, ExportConfig
    from trt_sora.export import exporter as ex
    from trt_sora.export import trace as tr
    from trt_sora.onnx_tools import SCOPES_KEY, module_path

    config = ExportConfig(dtype=DType.BF16, verify=False)
    t0 = time.perf_counter()
    model = adapter.load_empty("bf16")
    params = sum(p.numel() for p in model.parameters())
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    ranges = ex.export_ranges(adapter, config)
    point = ex.export_point(adapter, ranges)
    program = tr.trace(adapter, model, point, config, ex._dynamic_shapes(adapter, ranges), weightless=True,
                       traces=traces)
    seconds = time.perf_counter() - t0
    graph = program.model.graph
    ops = collections.Counter(n.op_type for n in graph)
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    graph_linears = {module_path(ast.literal_eval(n.metadata_props.get(SCOPES_KEY, "[]")))
                     for n in graph if n.op_type in ("MatMul", "Gemm")} & linear_names
    dims = sorted({str(d) for v in graph.inputs for d in v.shape if not isinstance(d, int)})
    return {"model": label, "params": params, "linears": linears, "nodes": sum(ops.values()),
            "matmul_gemm": ops.get("MatMul", 0) + ops.get("Gemm", 0), "linears_in_graph": len(graph_linears),
            "softmax": ops.get("Softmax", 0), "initializers": len(graph.initializers),
            "inputs": [v.name for v in graph.inputs], "dynamic_dims": dims, "trace_point": point,
            "seconds": round(seconds, 1), "copied": program.copied,
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated registry names (real sizes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    rows = json.loads(out.read_text())["results"] if out.exists() else []
    done = {r["model"] for r in rows}
    for name in args.models.split(","):
        traces: dict = {}  # the experts of one pair share it (the export stage's)
        for label, adapter in _adapters(name):
            if label in done:
                continue
            row = trace_one(label, adapter, traces)
            print(json.dumps(row), flush=True)
            rows.append(row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"setup": {"what": __doc__.splitlines()[0], "dtype": "bf16",
                                                 "machine": "CPU, 2 shared cores"}, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
