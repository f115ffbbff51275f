"""Helpers for the quantize tests (importable: this folder is on sys.path under pytest)."""
from __future__ import annotations

# Calibration points (all dims >= 2) and the evaluation point (different from both).
CALIB_POINTS = (
    {"batch": 2, "latent_frames": 2, "latent_height": 4, "latent_width": 4, "text_len": 8},
    {"batch": 1, "latent_frames": 3, "latent_height": 6, "latent_width": 4, "text_len": 12},
)
EVAL_POINT = {"batch": 2, "latent_frames": 2, "latent_height": 6, "latent_width": 4, "text_len": 12}


def collect_stats(adapter, model, points, path):
    """Run the torch model on random inputs; abs-max of every nn.Linear input and of the attention q/k/v
    (per-module processor observers), saved as CalibStats with the model hash."""
    import torch

    from trt_sora.calibrate.stats import CalibStats, StatsMetadata
    from trt_sora.models.wan import WanExportAttnProcessor

    amax: dict[str, torch.Tensor] = {}

    def upd(name, t):
        v = t.detach().abs().max().float()
        amax[name] = torch.maximum(amax[name], v) if name in amax else v

    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: upd(name, args[0]))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    saved = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "processor", None), WanExportAttnProcessor):
            saved[name] = (m, m.processor)
            m.processor = WanExportAttnProcessor(observer=lambda site, t, name=name: upd(f"{name}.{site}", t))
    try:
        with torch.no_grad():
            for i, p in enumerate(points):
                adapter.forward(model, adapter.example_inputs(p, seed=100 + i))
    finally:
        for h in hooks:
            h.remove()
        for m, proc in saved.values():
            m.processor = proc
    meta = StatsMetadata(method="minmax", model=adapter.spec.ref, model_hash=adapter.spec.model_hash(),
                         num_samples=len(points))
    stats = CalibStats(amax={k: v.reshape(()) for k, v in amax.items()}, metadata=meta)
    stats.save(path)
    return stats


def run_ort(onnx_path, inputs, graph_dtype="fp32", optimize=False):
    """ONNX Runtime CPU. ``optimize=False`` runs the Q/DQ ops as written (exact ONNX semantics);
    with optimizations ORT fuses INT8 Q/DQ into integer kernels whose rounding differs slightly."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
    feeds = {}
    for k, v in inputs.items():
        a = v.numpy()
        if k != "timestep" and graph_dtype == "fp16":
            a = a.astype(np.float16)
        feeds[k] = a
    return sess.run(None, feeds)[0].astype(np.float32)


def torch_fake_quant_run(adapter, model, inputs, stats_path, fmt, config=None):
    """Independent reference: the torch model with every quantized nn.Linear's input and weight
    fake-quantized by torch ops (calibrate.fake_quant). Nothing comes from the quantize stage's
    output (``qdq_map.json``): the sites are the recipe policy's (``quantized_sites``), each input
    scale comes from the calibration stats, and linears that read the same tensor (fused Q/K/V,
    cross-attention K/V: one Q/DQ on that tensor in the graph) share the max of their stats amax,
    found by watching which input tensors the linears receive; weights: max |W| per output row."""
    import torch

    from trt_sora.calibrate.fake_quant import fake_quant
    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.config.recipe import QuantConfig, QuantFormat

    stats = CalibStats.load(stats_path)
    sites = quantized_sites(model, config or QuantConfig(format=QuantFormat(fmt)), adapter.quant_excludes)
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}  # kept alive during the forward: no address is reused
    hooks = [modules[s].register_forward_pre_hook(lambda mod, args, s=s, seen=seen: seen.setdefault(s, args[0]))
             for s in sites]
    try:
        with torch.no_grad():
            adapter.forward(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    key = {s: (t.data_ptr(), tuple(t.shape), t.dtype) for s, t in seen.items()}
    act = {s: max(float(stats.amax[o].max()) for o in sites if key.get(o) == key[s]) for s in seen}
    del seen
    hooks, saved = [], {}
    try:
        for site, amax in act.items():
            m = modules[site]
            saved[site] = m.weight.data
            w = m.weight.data.float()
            m.weight.data = fake_quant(w, w.abs().amax(dim=1), fmt, axis=0)
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, a=amax: (fake_quant(args[0], torch.tensor(a), fmt),) + tuple(args[1:])))
        with torch.no_grad():
            return adapter.forward(model, inputs).float().numpy()
    finally:
        for h in hooks:
            h.remove()
        for site, w in saved.items():
            modules[site].weight.data = w


def float8_misuses(model) -> list[str]:
    """``"tensor -> op node"`` for each use of a float8 tensor (a float8 initializer, or the output of a
    QuantizeLinear whose zero point is one) by an op whose schema at the model's opset does not take
    that type; an op without an ONNX schema (an ONNX Runtime contrib op) takes none."""
    import onnx

    names = {onnx.TensorProto.FLOAT8E4M3FN: "tensor(float8e4m3fn)", onnx.TensorProto.FLOAT8E5M2: "tensor(float8e5m2)"}
    typed = {i.name: names[i.data_type] for i in model.graph.initializer if i.data_type in names}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in typed:
            typed[n.output[0]] = typed[n.input[2]]
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    bad = []
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            if name in typed and typed[name] not in _accepted_types(n, i, opsets):
                bad.append(f"{name} -> {n.op_type} {n.name}")
    return bad


def _accepted_types(node, index: int, opsets: dict) -> set[str]:
    import onnx

    domain = node.domain or "ai.onnx"
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), "" if domain == "ai.onnx" else domain)
    except onnx.defs.SchemaError:
        return set()
    formal = schema.inputs[min(index, len(schema.inputs) - 1)].type_str
    for c in schema.type_constraints:
        if c.type_param_str == formal:
            return set(c.allowed_type_strs)
    return {formal}
