"""Weightless export: traced under fake tensors, weights streamed into the file; the same graph and bytes as
the export with the weights in memory, and as torch's own exporter; deterministic bytes; segmented ORT."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from trt_sora.config import ExportConfig, ExternalData
from trt_sora.export import export_onnx


def _bytes(res):
    d = res.onnx_path.parent
    data = d / "model.onnx.data"
    return (d / "model.onnx").read_bytes(), data.read_bytes() if data.exists() else b""


def test_weightless_is_byte_identical_in_another_process(tmp_path, tiny_export, tiny_points):
    """The in-memory export of the session fixture vs a weightless export in a fresh interpreter with another
    hash seed (the exporter prints a set into the graph metadata: its order used to follow the seed)."""
    out = tmp_path / "w"
    code = textwrap.dedent(f"""
        from trt_sora.config import ExportConfig
        from trt_sora.export import export_onnx
        res = export_onnx("wan-tiny", ExportConfig(verify_points={[dict(p) for p in tiny_points]!r}), {str(out)!r})
        assert res.manifest["results"]["weights"].startswith("random init")
    """)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    assert (out / "model.onnx").read_bytes() == tiny_export.onnx_path.read_bytes()
    import json

    m = json.loads((out / "manifest.json").read_text())
    assert m["results"]["parity"] == tiny_export.parity  # same reference, same graph: the same numbers


def test_same_graph_as_torch_exporter(tiny_adapter, tiny_model, tiny_export):
    """Our pipeline (trace, optimizer with the multi-output-pattern shortcut, canonicalize) gives what
    ``torch.onnx.export(optimize=True)`` gives, node for node and weight for weight."""
    import torch

    from trt_sora.export.exporter import _dynamic_shapes, export_point
    from trt_sora.export.optimize import canonicalize

    cfg = ExportConfig()
    point = export_point(tiny_adapter, cfg.dynamic)
    ex = tiny_adapter.example_inputs(point)
    with torch.no_grad():
        prog = torch.onnx.export(tiny_adapter.export_module(tiny_model).eval(),
                                 tuple(ex[n] for n in tiny_adapter.input_names), dynamo=True, opset_version=20,
                                 input_names=list(tiny_adapter.input_names),
                                 output_names=list(tiny_adapter.output_names),
                                 dynamic_shapes=_dynamic_shapes(tiny_adapter, cfg.dynamic), optimize=True)
    canonicalize(prog.model)
    theirs = prog.model_proto
    ours = onnx.load(str(tiny_export.onnx_path))

    def nodes(m):
        return [(n.op_type, n.name, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute],
                 [(p.key, p.value) for p in n.metadata_props]) for n in m.graph.node]

    assert nodes(ours) == nodes(theirs)
    a = {i.name: onnx.numpy_helper.to_array(i) for i in ours.graph.initializer}
    b = {i.name: onnx.numpy_helper.to_array(i) for i in theirs.graph.initializer}
    assert list(a) == list(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_wide_weightless_equals_in_memory(tmp_path, wide_adapter, wide_export, tiny_points):
    """At 1.3B width every linear weight is a lazy placeholder while the optimizer runs; the file is still the
    one the in-memory export writes, and ONNX Runtime (segment by segment) matches PyTorch."""
    r = wide_export.manifest["results"]
    assert r["verify_mode"] == "segmented" and r["external_data"]
    for p in wide_export.parity:
        assert p["cosine"] >= 0.99999 and p["max_abs"] <= p["max_abs_limit"], p
    cfg = ExportConfig(external_data=ExternalData.ALWAYS, verify=False)
    mem = export_onnx(wide_adapter, cfg, tmp_path / "mem", model=wide_adapter.load("fp32"))
    assert _bytes(mem) == _bytes(wide_export)


def test_segmented_ort_matches_whole_graph(tiny_export, tiny_adapter, tiny_points):
    from trt_sora.export.exporter import ort_session
    from trt_sora.export.segments import plan, run_segmented

    model = onnx.load(str(tiny_export.onnx_path), load_external_data=False)
    segs = plan(model, tiny_adapter.block_container)
    assert [s.block for s in segs] == [0, 1]  # pre-block nodes join block 0, the head joins the last block
    assert sum(len(s.nodes) for s in segs) == len(model.graph.node)
    feeds = [{k: v.numpy() for k, v in tiny_adapter.example_inputs(p, seed=i).items()}
             for i, p in enumerate(tiny_points)]
    whole = ort_session(tiny_export.onnx_path)
    for (got,), f in zip(run_segmented(tiny_export.onnx_path, feeds, session_factory=ort_session,
                                             container=tiny_adapter.block_container), feeds):
        np.testing.assert_allclose(got, whole.run(None, f)[0], rtol=1e-5, atol=1e-5)
    assert not list(tiny_export.onnx_path.parent.glob(".segment_*")), "segment files left behind"


def test_canonical_range_constraints():
    from trt_sora.export.optimize import _sorted_mapping

    assert _sorted_mapping("{s9: VR[1, 8], 2*s2: VR[2, 256], s1: VR[2, 128]}") == \
        "{2*s2: VR[2, 256], s1: VR[2, 128], s9: VR[1, 8]}"


def test_the_shared_trace_key_tells_graphs_apart():
    """The key under which a pair's experts share one weightless trace (:func:`trace.trace_key`): equal for the two
    experts of a pair (one architecture, two weight files), different wherever the graph could differ: another
    family variant (image tokens, per-frame timesteps), one more block, another dtype, opset or trace point."""
    import copy

    from trt_sora.config.recipe import DType
    from trt_sora.export import exporter as ex
    from trt_sora.export import trace as tr
    from trt_sora.models import get_adapter

    def key(adapter, cfg=None, model=None, point=None):
        cfg = cfg or ExportConfig()
        model = model if model is not None else adapter.load_empty(cfg.dtype.value)
        plan = ex.plan_export(adapter, cfg, model, weightless=True)
        return tr.trace_key(adapter, model, point or plan.point, cfg, ex._dynamic_shapes(adapter, plan.ranges))

    pair = get_adapter("wan-a14b-tiny")
    assert len({key(pair.expert(e)) for e in pair.experts}) == 1
    tiny = get_adapter("wan-tiny")
    deeper = tiny.load_empty("fp32")
    deeper.blocks.append(copy.deepcopy(deeper.blocks[0]))
    point = dict(ex.export_point(tiny, ex.export_ranges(tiny, ExportConfig())), latent_frames=4)
    keys = [key(tiny), key(get_adapter("wan-i2v-tiny")), key(get_adapter("wan-ti2v-tiny")), key(tiny, model=deeper),
            key(tiny, ExportConfig(dtype=DType.FP16)), key(tiny, ExportConfig(opset=21)), key(tiny, point=point)]
    assert len(set(keys)) == len(keys)
    assert key(tiny) == keys[0]  # and the same model, loaded again, keeps its key
