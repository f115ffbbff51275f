"""What ptxas makes of the torch-fp8 backend's memory-bound Triton kernels, without a GPU: compile each one for
``sm_90a`` at Wan 14B's sizes (5,120 channels, heads of 128, the FFN's GELU) with the Triton on the path (its
ptxas), disassemble with its cuobjdump, and report per kernel: registers, local memory (spills), ptxas's note
that the products run serialized, SASS instructions by opcode (predicated ones under their opcode), barriers,
and instructions per element a thread handles. ``--prev``: the same kernels of benchmarks/_prev_triton_ops.py
(``git show REV:trt_sora/kernels/triton_ops.py > benchmarks/_prev_triton_ops.py``) beside them.

A count is not a time: it says where a kernel's instructions go and what a change removed; benchmarks/
epilogue_bench.py times the kernels on a GPU.

    python benchmarks/triton_sass.py --prev --out benchmarks/results/offline_triton_sass_2026-12-07.json
    PYTHONPATH=/tmp/tri36site python benchmarks/triton_sass.py ...   # the device's Triton 3.6 and its ptxas
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[.A-Z0-9_]*")
NORM_SIG = {n: ("*bf16" if n in ("X", "R", "XO") else "*fp32") for n in ("X", "R", "G", "W", "BI", "MS", "MH", "XO")}
NORM_SIG.update({"Y": "*fp8e4nv", "SC": "*fp32", "S": "i32", "C": "i32", "eps": "fp32", "VB": "i64", "VS": "i64"})
NORM_FORMS = {"mod": dict(HAS_R=False, HAS_G=False, HAS_W=False, HAS_MOD=True),
              "residual_gate_affine": dict(HAS_R=True, HAS_G=True, HAS_W=True, HAS_MOD=False),
              "residual_mod": dict(HAS_R=True, HAS_G=False, HAS_W=False, HAS_MOD=True)}
C, FFN = 5120, 13824


def compile_sass(fn, sig: dict, constexprs: dict, warps: int, div16=()) -> dict:
    """One kernel's resources and SASS opcode counts (pointers and ``div16`` arguments known divisible by 16, as
    the JIT specializes them): Triton compiles to a cubin with its own ptxas, the cuobjdump beside it reads it;
    ptxas's wgmma note comes from a second ``ptxas -v`` of the PTX (None where that ptxas refuses the PTX)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in sig and (sig[n].startswith("*") or n in div16)}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        ptx.write_text(k.asm["ptx"])
        cubin.write_bytes(k.asm["cubin"])
        dump = [str(bin_dir / "cuobjdump"), str(cubin)]
        sass = subprocess.run(dump[:1] + ["-sass"] + dump[1:], capture_output=True, text=True, check=True).stdout
        res = subprocess.run(dump[:1] + ["-res-usage"] + dump[1:], capture_output=True, text=True, check=True).stdout
        note = subprocess.run([str(bin_dir / "ptxas"), "-v", "-arch=sm_90a", str(ptx), "-o", str(Path(d) / "x")],
                              capture_output=True, text=True)
    ops = collections.Counter(m.group(1) for m in map(INSTR.match, sass.splitlines()) if m)
    return {"registers": int(re.search(r"REG:(\d+)", res).group(1)),
            "local_bytes": int(re.search(r"LOCAL:(\d+)", res).group(1)),
            "wgmma_serialized": ("wgmma.mma_async instructions are serialized" in note.stderr
                                 if note.returncode == 0 else None),
            "instructions": sum(ops.values()) - ops.get("NOP", 0), "barriers": ops.get("BAR", 0),
            "by_opcode": dict(ops.most_common(16)), "triton": triton.__version__}


def kernels(m) -> dict:
    """``{name: (fn, signature, constexprs, warps, div16, elements a thread handles)}`` of module ``m``'s
    kernels at Wan 14B's sizes, in the launch settings its wrappers use."""
    out = {}
    if "SEG_A" in m._res_norm_quant_kernel.arg_names:
        a, b = m._segments(C)
        shape, warps = dict(SEG_A=a, SEG_B=b), min(m.NORM_MAX_WARPS, max(4, a // 256))
    else:  # the one-tile kernel before the segments
        shape, warps = dict(BLOCK_C=8192), min(m.NORM_MAX_WARPS, max(4, 8192 // 512))
    for form, flags in NORM_FORMS.items():
        out[f"norm_{form}"] = (m._res_norm_quant_kernel, NORM_SIG, dict(flags, QUANT=True, **shape), warps,
                               ("C", "VB"), C / (32 * warps))
    out["gelu_quant"] = (m._act_quant_kernel, {"X": "*bf16", "Y": "*fp8e4nv", "SC": "*fp32", "N": "i32"},
                         dict(GELU=True, QUANT=True, BLOCK=4096), 8, ("N",), 4096 / 256)
    return out


def report(m) -> dict:
    res = {}
    for name, (fn, sig, cst, warps, div16, per_thread) in kernels(m).items():
        r = compile_sass(fn, sig, cst, warps, div16)
        r.update(warps=warps, constexprs=cst)
        if per_thread:
            r["instructions_per_element"] = round(r["instructions"] / per_thread, 1)
        res[name] = r
        print(name, {k: r[k] for k in ("registers", "instructions", "barriers")}, flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prev", action="store_true", help="also benchmarks/_prev_triton_ops.py's kernels")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from trt_sora.kernels import triton_ops

    res = {"target": "sm_90a", "script": "benchmarks/triton_sass.py", "shipped": report(triton_ops)}
    if args.prev:
        from benchmarks import _prev_triton_ops

        res["prev"] = report(_prev_triton_ops)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
