"""Build report: what precision each GEMM and attention really runs in.

Source of the per-layer facts: TensorRT's one-line layer information
(``LayerInformationFormat.ONELINE``). With a GPU it comes from ``EngineInspector``;
on CPU-only TensorRT-RTX builds the builder prints the very same dump into its
VERBOSE log when profiling verbosity is DETAILED, as one message that starts with
``Layers:`` followed by one line per engine layer::

    Name: MatMul_46_myl0_2, LayerType: gemm, Inputs: [ { Name: x, Dimensions: [-1,64],
      ..., Datatype: FP8, Format: ... }], Constants: [ { ... Datatype: FP8 ... }],
      Outputs: [ ... ], TacticName: ..., StreamId: 0, Metadata: [ONNX Layer: MatMul_46]...

and an ``I/O Tensors:`` block whose ``ProfileInfo: [ {MinShape..}, {..} ]`` lists one
entry per optimization profile. Myelin duplicates each layer per profile (``_myl<k>_``
or ``[profile k]`` in the name); counts below are for profile 0.

What we learned from TensorRT-RTX 1.7 (SM89) on micro DiT blocks: FP8 linears become
``LayerType: gemm`` layers with FP8 input and FP8 weight constant; a fused QKV linear
whose output is ``Split`` gets its FP8 weight dequantized to fp16 at run time
(``__myl_CastMulFc``: FP8 activation x fp16 weight), while separate Q/K/V FP8 linears
are horizontally fused by the builder into one FP8 GEMM of width 3*d; attention
(``_gemm_mha_v2``) fuses with fp16 Q/K/V.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trt_sora.errors import BuildError
from trt_sora.runfolder import BUILD_REPORT, BUILD_REPORT_MD

REPORT_JSON = BUILD_REPORT
REPORT_MD = BUILD_REPORT_MD
FAILED_JSON = "build_report.failed.json"
FAILED_MD = "build_report.failed.md"

PRECISIONS = ("fp4", "int4", "fp8", "int8", "fp16", "bf16", "fp32")
_RANK = {p: i for i, p in enumerate(PRECISIONS)}
_ATTN_RE = re.compile(r"mha|fmha|attention|flash|_attn|sdpa", re.I)
_GEMM_TYPE_RE = re.compile(r"gemm|matrixmultiply|matmul|conv|fullyconnected|^fc$", re.I)
_GEMM_OP_RE = re.compile(r"^(Fc|Gemm|MatMul|Matmul|Conv|Convolution)$")
_TENSOR_RE = re.compile(r"\{ Name: (?P<name>.*?), Dimensions: \[(?P<dims>[^\]]*)\].*?Datatype: (?P<dt>\w+)")
_META_RE = re.compile(r"\[ONNX Layer: ([^\]]+)\]")
_MYL_RE = re.compile(r"_myl(\d+)_\d+$")
_PROFILE_RE = re.compile(r"\[profile (\d+)\]")


def precision_of(datatype: str) -> str | None:
    """Map TensorRT datatype spellings (``FP8``, ``Half``, ``Float``, ``Int8``, ``BFloat16``...)."""
    d = datatype.lower()
    for keys, p in ((("fp8", "e4m3", "float8"), "fp8"), (("fp4", "e2m1"), "fp4"), (("int4",), "int4"),
                    (("int8",), "int8"), (("bf16", "bfloat"), "bf16"), (("half", "fp16", "float16"), "fp16"),
                    (("float", "fp32", "float32"), "fp32")):
        if any(k in d for k in keys):
            return p
    return None


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]
    dtype: str  # as TensorRT prints it

    @property
    def precision(self) -> str | None:
        return precision_of(self.dtype)

    @property
    def static_volume(self) -> int:
        v = 1
        for d in self.dims:
            v *= max(d, 1)
        return v


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One engine layer as the builder describes it."""

    name: str
    type: str
    inputs: tuple[Tensor, ...]
    constants: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    tactic: str
    onnx_nodes: tuple[str, ...]

    @property
    def profile(self) -> int:
        m = _PROFILE_RE.search(self.name) or _MYL_RE.search(self.name)
        return int(m.group(1)) if m else 0

    @property
    def ops(self) -> tuple[str, ...]:
        """Myelin fused-op chain from ``__myl_CastMulFc_myl0_7`` -> ``(Cast, Mul, Fc)``."""
        m = re.match(r"^__myl_([A-Za-z]+)_myl\d+_\d+$", self.name)
        return tuple(re.findall(r"[A-Z][a-z0-9]*", m.group(1))) if m else ()


def _section(line: str, key: str, nxt: Iterable[str]) -> str:
    i = line.find(key + ": ")
    if i < 0:
        return ""
    start = i + len(key) + 2
    ends = [line.find(", " + k + ": ", start) for k in nxt]
    ends = [e for e in ends if e >= 0]
    return line[start:min(ends) if ends else len(line)]


def _tensors(text: str) -> tuple[Tensor, ...]:
    out = []
    for m in _TENSOR_RE.finditer(text):
        dims = tuple(int(x) for x in m.group("dims").split(",") if x.strip().lstrip("-").isdigit())
        out.append(Tensor(m.group("name"), dims, m.group("dt")))
    return tuple(out)


def parse_layer_line(line: str) -> LayerInfo | None:
    """Parse one ONELINE layer description; ``None`` when the line is not one."""
    line = line.strip()
    if not line.startswith("Name: ") or ", LayerType: " not in line:
        return None
    name, rest = line[6:].split(", LayerType: ", 1)
    ltype = rest.split(",", 1)[0].strip()
    keys = ("Inputs", "Constants", "Outputs", "TacticName", "StreamId", "Metadata")
    tactic = _section(line, "TacticName", ("StreamId", "Metadata")).strip()
    return LayerInfo(
        name=name, type=ltype,
        inputs=_tensors(_section(line, "Inputs", keys[1:])),
        constants=_tensors(_section(line, "Constants", keys[2:])),
        outputs=_tensors(_section(line, "Outputs", keys[3:])),
        tactic=tactic,
        onnx_nodes=tuple(_META_RE.findall(_section(line, "Metadata", ()))),
    )


def parse_layer_dump(text: str) -> list[LayerInfo]:
    """All layer lines in ``text`` (a VERBOSE build log or EngineInspector ONELINE output)."""
    return [li for li in (parse_layer_line(ln) for ln in text.splitlines()) if li is not None]


def parse_profile_count(text: str) -> int | None:
    """Number of optimization profiles from the ``I/O Tensors`` block (max over inputs)."""
    counts = [ln.count("MinShape:") for ln in text.splitlines()
              if "IOMode: Input" in ln and "ProfileInfo:" in ln]
    return max(counts) if counts else None


# ----------------------------------------------------------------------------- ONNX facts

@dataclasses.dataclass
class OnnxFacts:
    """What the ONNX graph holds, for comparison with the engine."""

    linear: set[str]  # MatMul/Gemm/Conv nodes with one constant (weight) operand
    bmm: set[str]  # MatMul nodes with two dynamic operands (attention scores/values)
    qkv: dict[str, tuple[int, int]]  # linear nodes with a [d, 3d] weight: name -> (K, N)
    q_formats: set[str]  # "fp8" / "int8" where Q/DQ nodes carry that type
    num_qdq: int
    quantized: set[str] = dataclasses.field(default_factory=set)  # linear nodes whose weight is dequantized


def onnx_facts(model) -> OnnxFacts:
    """Classify GEMM nodes of an ``onnx.ModelProto`` (loaded without external data is fine)."""
    from onnx import TensorProto

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    const_ops = {"DequantizeLinear", "Cast", "Transpose", "Reshape", "Identity", "Constant", "Unsqueeze"}

    def dequantized(name: str, depth: int = 0) -> bool:
        n = producer.get(name)
        if n is None or depth > 4 or n.op_type not in const_ops:
            return False
        return n.op_type == "DequantizeLinear" or bool(n.input) and dequantized(n.input[0], depth + 1)

    def weight_shape(name: str, depth: int = 0):
        if name in inits:
            return tuple(inits[name].dims)
        n = producer.get(name)
        if n is None or depth > 4 or n.op_type not in const_ops:
            return None
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    return tuple(a.t.dims)
            return None
        shape = weight_shape(n.input[0], depth + 1) if n.input else None
        if shape is not None and n.op_type == "Transpose":
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None) or list(range(len(shape)))[::-1]
            shape = tuple(shape[p] for p in perm)
        return shape

    linear, bmm, qkv, quantized = set(), set(), {}, set()
    for n in g.node:
        if n.op_type not in ("MatMul", "Gemm", "Conv", "MatMulInteger", "ConvInteger"):
            continue
        shapes = [weight_shape(i) for i in n.input[:2]]
        if n.op_type == "Conv" or any(s is not None for s in shapes):
            linear.add(n.name)
            if any(shapes[i] is not None and dequantized(n.input[i]) for i in range(len(shapes))):
                quantized.add(n.name)
            w = shapes[1] if len(shapes) > 1 else None
            if n.op_type == "Gemm" and w is not None and any(a.name == "transB" and a.i for a in n.attribute):
                w = tuple(reversed(w))
            if n.op_type != "Conv" and w is not None and len(w) == 2 and w[1] == 3 * w[0]:
                qkv[n.name] = (int(w[0]), int(w[1]))
        else:
            bmm.add(n.name)
    fmt_of = {TensorProto.FLOAT8E4M3FN: "fp8", TensorProto.FLOAT8E4M3FNUZ: "fp8", TensorProto.FLOAT8E5M2: "fp8",
              TensorProto.INT8: "int8", TensorProto.UINT8: "int8"}
    q_formats: set[str] = set()
    num_qdq = 0
    for n in g.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        num_qdq += 1
        for a in n.attribute:
            if a.name == "output_dtype" and a.i in fmt_of:
                q_formats.add(fmt_of[a.i])
        for i in n.input:
            if i in inits and inits[i].data_type in fmt_of:
                q_formats.add(fmt_of[inits[i].data_type])
    return OnnxFacts(linear, bmm, qkv, q_formats, num_qdq, quantized)


# ----------------------------------------------------------------------------- analysis

def _gemm_precision(layer: LayerInfo) -> tuple[str, list[str]]:
    """(precision, operand precisions): the widest of activation and weight operands.

    Activation = first input; weight = the largest matrix constant, else the largest
    further input (weights dequantized at run time arrive as an input).
    """
    ops: list[Tensor] = []
    if layer.inputs:
        ops.append(layer.inputs[0])
    mats = [c for c in layer.constants if len(c.dims) >= 2 and c.static_volume > 1]
    rest = [t for t in layer.inputs[1:] if len(t.dims) >= 2]
    if mats:
        ops.append(max(mats, key=lambda t: t.static_volume))
    elif rest:
        ops.append(max(rest, key=lambda t: t.static_volume))
    precs = [p for p in (t.precision for t in ops) if p]
    if not precs:
        return "unknown", []
    return max(precs, key=lambda p: _RANK[p]), precs


def _is_attention(layer: LayerInfo) -> bool:
    return bool(_ATTN_RE.search(layer.name) or _ATTN_RE.search(layer.tactic) or _ATTN_RE.search(layer.type))


def _is_gemm(layer: LayerInfo) -> bool:
    if _is_attention(layer):
        return False
    if _GEMM_TYPE_RE.search(layer.type):
        return True
    return any(_GEMM_OP_RE.match(op) for op in layer.ops)


def analyze(layers: list[LayerInfo], facts: OnnxFacts | None = None, *, profile: int = 0) -> dict[str, Any]:
    """GEMM precision counts, attention fusion and fused-QKV survival for one profile."""
    prof_layers = [li for li in layers if li.profile == profile] or layers
    gemms, bmms, attention = [], [], []
    for li in prof_layers:
        if _is_attention(li):
            qkv_prec = [t.precision for t in li.inputs[:3] if t.precision]
            attention.append({"layer": li.name, "type": li.type, "tactic": li.tactic,
                              "precision": max(qkv_prec, key=lambda p: _RANK[p]) if qkv_prec else "unknown",
                              "output_precision": li.outputs[0].precision if li.outputs else None,
                              "onnx_nodes": list(li.onnx_nodes)})
            continue
        if not _is_gemm(li):
            continue
        prec, operand_precs = _gemm_precision(li)
        k = li.inputs[0].dims[-1] if li.inputs and li.inputs[0].dims else None
        n_out = li.outputs[0].dims[-1] if li.outputs and li.outputs[0].dims else None
        entry = {"layer": li.name, "type": li.type, "precision": prec, "operands": operand_precs,
                 "mixed": len(set(operand_precs)) > 1, "k": k, "n": n_out,
                 "onnx_nodes": [n for n in li.onnx_nodes if facts is None or n in facts.linear or n in facts.bmm],
                 # unknown ONNX facts: every GEMM counts as one the graph wanted quantized
                 "quantized": facts is None or not facts.quantized
                 or any(n in facts.quantized for n in li.onnx_nodes)}
        has_weight = any(len(c.dims) >= 2 and c.static_volume > 1 for c in li.constants)
        covers_linear = facts is not None and any(n in facts.linear for n in li.onnx_nodes)
        covers_bmm = facts is not None and any(n in facts.bmm for n in li.onnx_nodes)
        (gemms if has_weight or covers_linear or not covers_bmm else bmms).append(entry)
    counts = {p: 0 for p in PRECISIONS}
    counts["unknown"] = 0
    for e in gemms:
        counts[e["precision"]] = counts.get(e["precision"], 0) + 1
    total = len(gemms)
    # The requirement is about the GEMMs the Q/DQ graph asked to be quantized: layers the recipe
    # excluded (embedders, AdaLN, proj_out) stay fp16/fp32 on purpose and must not count against it.
    wanted = [e for e in gemms if e["quantized"]]
    wanted_fp8 = sum(e["precision"] == "fp8" for e in wanted)
    wanted_int8 = sum(e["precision"] == "int8" for e in wanted)
    engine_qkv = [e for e in gemms if e["k"] and e["n"] and e["n"] == 3 * e["k"]]
    onnx_qkv = len(facts.qkv) if facts else 0
    return {
        "profile_analyzed": profile,
        "gemm_counts": {k: v for k, v in counts.items() if v or k in ("fp8", "int8", "fp16", "bf16", "fp32")},
        "gemm_total": total,
        "quantized_gemm_total": len(wanted),
        "fp8_gemm_fraction": wanted_fp8 / len(wanted) if wanted else 0.0,
        "int8_gemm_fraction": wanted_int8 / len(wanted) if wanted else 0.0,
        "fp8_gemm_fraction_all": counts["fp8"] / total if total else 0.0,
        "mixed_gemms": [e["layer"] for e in gemms if e["mixed"]],
        "gemms": gemms,
        "unfused_attention_bmms": bmms,
        "attention": {
            "fused": bool(attention),
            "fused_count": len(attention),
            "precisions": sorted({a["precision"] for a in attention}),
            "layers": attention,
        },
        "fused_qkv": {
            "onnx": onnx_qkv,
            "engine": len(engine_qkv),
            "survived": (len(engine_qkv) >= onnx_qkv) if onnx_qkv else None,
            "precisions": [e["precision"] for e in engine_qkv],
            "layers": [e["layer"] for e in engine_qkv],
        },
        "onnx_gemms": {"linear": len(facts.linear), "bmm": len(facts.bmm)} if facts else None,
        "layers_total": len(layers),
        "layers_in_profile": len(prof_layers),
    }


def check_requirements(report: Mapping[str, Any], req) -> list[str]:
    """Unmet requirements of a :class:`BuildRequirements` as readable lines (empty: all met)."""
    a = report["analysis"]
    fails = []
    if req.min_fp8_gemm_fraction > 0 and a["fp8_gemm_fraction"] < req.min_fp8_gemm_fraction:
        non = [f"{g['layer']} ({g['precision']}{', mixed ' + 'x'.join(g['operands']) if g['mixed'] else ''})"
               for g in a["gemms"] if g["precision"] != "fp8" and g.get("quantized", True)][:5]
        n_wanted = a.get("quantized_gemm_total", a["gemm_total"])
        fails.append(f"FP8 GEMM fraction {a['fp8_gemm_fraction']:.3f} < required {req.min_fp8_gemm_fraction} "
                     f"({round(a['fp8_gemm_fraction'] * n_wanted)}/{n_wanted} quantized GEMMs in FP8; "
                     f"not FP8: {', '.join(non)})")
    if req.min_int8_gemm_fraction > 0 and a["int8_gemm_fraction"] < req.min_int8_gemm_fraction:
        fails.append(f"INT8 GEMM fraction {a['int8_gemm_fraction']:.3f} < required {req.min_int8_gemm_fraction} "
                     f"of the {a.get('quantized_gemm_total', a['gemm_total'])} quantized GEMMs")
    if req.require_fused_attention and not a["attention"]["fused"]:
        fails.append(f"attention is not fused (no MHA/fmha kernel; {len(a['unfused_attention_bmms'])} "
                     "batched matmuls run unfused)")
    if req.require_fused_qkv:
        q = a["fused_qkv"]
        if q["engine"] < max(1, q["onnx"]):
            fails.append(f"fused QKV did not survive: {q['engine']} GEMM(s) of width 3*d in the engine, "
                         f"{q['onnx']} in the ONNX")
    return fails


def requirement_fix_hint(fails: list[str]) -> str:
    hints = []
    if any("FP8" in f or "INT8" in f for f in fails):
        hints.append("check the Q/DQ placement (quantize stage: per-tensor Q/DQ on each linear input, "
                     "weight DQ per output channel, fp16 graph) or lower the recipe's "
                     "build.requirements.min_*_gemm_fraction")
    if any("attention" in f for f in fails):
        hints.append("keep attention matmuls unquantized (quantization.fp8_attention: false) on an fp16 graph")
    if any("QKV" in f for f in fails):
        hints.append("set quantization.fused_qkv: false (the builder fuses separate Q/K/V GEMMs itself) "
                     "or drop build.requirements.require_fused_qkv")
    return "; ".join(hints)


# ----------------------------------------------------------------------------- writing

def to_markdown(report: Mapping[str, Any]) -> str:
    """A short human summary of the JSON report."""
    a = report["analysis"]
    c = a["gemm_counts"]
    lines = [
        f"# Build report: {report.get('name', '')}",
        "",
        f"- status: **{report['status']}**" + (f" ({'; '.join(report['failures'])})" if report.get("failures") else ""),
        f"- backend: {report['backend']} {report['backend_version']}, target SM{report['sm']}",
        "- engines: " + ", ".join(f"`{e['file']}` ({e['bytes'] / 1e6:.2f} MB)" for e in report["engines"]),
        f"- profiles: {report['profiles']['built']} built, {report['profiles']['in_engine']} in the engine "
        f"({report['profiles']['evidence']})",
        f"- build time: {report['build_seconds']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MB",
        "",
        "| GEMMs (profile 0) | fp8 | int8 | fp16 | bf16 | fp32 | total | quantized in ONNX | fp8 fraction of those |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| engine layers | {c.get('fp8', 0)} | {c.get('int8', 0)} | {c.get('fp16', 0)} | {c.get('bf16', 0)} "
        f"| {c.get('fp32', 0)} | {a['gemm_total']} | {a.get('quantized_gemm_total', '-')} "
        f"| {a['fp8_gemm_fraction']:.3f} |",
        "",
        f"- attention fused: {a['attention']['fused']} ({a['attention']['fused_count']} kernels, "
        f"precision {', '.join(a['attention']['precisions']) or '-'}); unfused attention matmuls: "
        f"{len(a['unfused_attention_bmms'])}",
        f"- fused QKV: {a['fused_qkv']['onnx']} in the ONNX, {a['fused_qkv']['engine']} in the engine "
        f"(precision {', '.join(a['fused_qkv']['precisions']) or '-'})",
    ]
    if a["mixed_gemms"]:
        lines.append(f"- mixed-precision GEMMs (weight dequantized at run time): {', '.join(a['mixed_gemms'])}")
    return "\n".join(lines) + "\n"


def write_report(folder: str | Path, report: Mapping[str, Any], *, failed: bool = False) -> Path:
    """Write ``build_report.json`` + ``.md`` (``build_report.failed.*`` when ``failed``)."""
    from trt_sora.manifest import write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js, md = (FAILED_JSON, FAILED_MD) if failed else (REPORT_JSON, REPORT_MD)
    write_json(folder / js, report)
    (folder / md).write_text(to_markdown(report))
    return folder / js


def load_report(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_JSON
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError(f"cannot read build report {path}: {exc}; re-run `trt-sora build`") from None
