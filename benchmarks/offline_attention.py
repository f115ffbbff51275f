"""Offline SM 9.0 compiles of both 8-bit attention kernels for each key-tile width, on a machine without a GPU:
the Triton kernel (:func:`trt_sora.kernels.triton_ops.attention_fp8`, each autotuner config, TMA) and the
warp-specialized Gluon kernel (:mod:`trt_sora.kernels.gluon_attention`, 128-key tiles). Per compile: registers and
spills (``ptxas -v``), ptxas's performance notes (a serialized ``wgmma``), and the SASS of the main loop (one full
key tile; the Gluon kernel has one per consumer warpgroup): instructions (NOPs apart), ``IGMMA`` / ``QGMMA``,
``WARPGROUP.DEPBAR`` waits, ``MUFU.EX2``, ``F2FP``, shuffles, local-memory traffic, per tile and per 128 keys. The
shape is Wan 14B's (1 x 40 heads x 32,760 x 128), bf16 and FP8 output.

    PYTHONPATH=<triton 3.6 wheel>:$PWD python benchmarks/offline_attention.py --out results.json

The GPU's Triton (3.6 beside torch 2.11) is the one to compile with: Gluon's API moves between releases.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fake_sm90_driver():
    """A CUDA driver that reports an SM 9.0 target and launches nothing: ``warmup`` compiles only."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class Offline(CudaDriver):
        def __init__(self):  # no libcuda here
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(Offline())


def compile_ws(block_n: int, out_fp8: bool, stages: int = 3, regs=(240, 24), pingpong: bool = True,
               s: int = 32760, h: int = 40, d: int = 128):
    """The kernel compiled for SM 9.0 as :func:`~trt_sora.kernels.gluon_attention.attention_fp8_ws` launches it."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from trt_sora.kernels import gluon_attention as g

    sb = 128
    nblk = -(-s // sb)
    s_pad = nblk * sb
    q8 = torch.empty((1, h, s, d), dtype=torch.int8)
    vt8 = torch.empty((1, h, d, s_pad), dtype=torch.float8_e4m3fn)
    lay = gl.NVMMASharedLayout.get_default_for
    half = g.BLOCK_M // 2
    qd = TensorDescriptor(q8, [h * s, d], [d, 1], [half, d], lay([half, d], gl.int8))
    kd = TensorDescriptor(q8, [h * s, d], [d, 1], [block_n, d], lay([block_n, d], gl.int8))
    vd = TensorDescriptor(vt8, [h * d, s_pad], [s_pad, 1], [d, block_n], lay([d, block_n], gl.float8e4nv))
    sc = torch.empty((1, h, nblk))
    vs = torch.empty((1, h, d))
    o = torch.empty((1, s, h * d), dtype=torch.float8_e4m3fn if out_fp8 else torch.bfloat16)
    return g._attn_ws_kernel.warmup(qd, kd, vd, sc, sc, vs, o, sc, s, h, nblk, 0.1, D=d, BLOCK_M=g.BLOCK_M,
                                    BLOCK_N=block_n, STAGES=stages, OUT_FP8=out_fp8, CONSUMER_REGS=regs[0],
                                    PRODUCER_REGS=regs[1], PINGPONG=pingpong, num_warps=4, maxnreg=168, grid=(1,))


def compile_triton(block_n: int, out_fp8: bool, config: tuple, s: int = 32760, h: int = 40, d: int = 128):
    """The Triton kernel compiled for SM 9.0 as :func:`~trt_sora.kernels.triton_ops.attention_fp8` launches it
    (TMA key/value tiles), with ``config`` = (query rows, PIPE, warps, stages)."""
    from trt_sora.kernels import triton_ops as t

    nblk = -(-s // 128)
    s_pad = nblk * 128
    q8 = torch.empty((1, h, s, d), dtype=torch.int8)
    vt8 = torch.empty((1, h, d, s_pad), dtype=torch.float8_e4m3fn)
    k_arg, v_arg = t.kv_descriptors(q8, vt8, block_n)
    sc = torch.empty((1, h, nblk))
    vs = torch.empty((1, h, d))
    o = torch.empty((1, s, h * d), dtype=torch.float8_e4m3fn if out_fp8 else torch.bfloat16)
    bm, pipe, warps, stages = config
    return t._attn_fp8_kernel.fn.warmup(q8, sc, k_arg, sc, v_arg, vs, o, sc, s, s_pad, h, nblk, 0.1, s.bit_length(),
                                        sc, sc, sc, 0, sc, D=d, OUT_FP8=out_fp8, BLOCK_N=block_n, TMA=True,
                                        SPARSE=False, KEYS=False, BLOCK_M=bm, PIPE=pipe, num_warps=warps,
                                        num_stages=stages, grid=(1,))


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def ptxas_report(ptx: str) -> dict:
    """``ptxas -v`` of the kernel's PTX for sm_90a: registers, spill bytes, and its warnings."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([_tool("ptxas"), "-v", "-arch=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    text = res.stderr + res.stdout
    notes = sorted({ln.split(":", 1)[1].strip() for ln in text.splitlines()
                    if "warning" in ln.lower() or "Performance" in ln})
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None,
            "notes": notes}


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line of ``cubin`` (``cuobjdump -sass``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                             check=True).stdout
    rows = []
    for ln in out.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            rows.append((int(m.group(1), 16), m.group(2).strip()))
    return rows


def _opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P[T0-9]+\s+", "", ins)
    return ins.split()[0] if ins else ""


def main_loops(rows: list[tuple[int, str]]) -> list[list[str]]:
    """The consumers' main loops: each backward branch's span that holds both products and no store, and no
    other such span inside it: one per consumer warpgroup (the loop over full key tiles)."""
    index = {addr: i for i, (addr, _) in enumerate(rows)}
    spans = []
    for i, (addr, ins) in enumerate(rows):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            body = [x for _, x in rows[index[int(m.group(1), 16)]:i + 1]]
            ops = {_opcode(x).split(".")[0] for x in body}
            if {"IGMMA", "QGMMA"} <= ops and "STG" not in ops:  # not a retry block's jump back (spans stores)
                spans.append((index[int(m.group(1), 16)], i, body))
    inner = [sp for sp in spans if not any(o is not sp and sp[0] <= o[0] and o[1] <= sp[1] for o in spans)]
    return [body for _, _, body in inner]


def loop_counts(body: list[str], keys: int) -> dict:
    ops = [_opcode(x) for x in body]
    count = lambda pred: sum(1 for o in ops if pred(o))  # noqa: E731
    per_tile = {"instructions": count(lambda o: o != "NOP"), "NOP": count(lambda o: o == "NOP"),
                "IGMMA": count(lambda o: o.startswith("IGMMA")), "QGMMA": count(lambda o: o.startswith("QGMMA")),
                "WARPGROUP.DEPBAR": count(lambda o: o.startswith("WARPGROUP.DEPBAR")),
                "WARPGROUP.ARRIVE": count(lambda o: o.startswith("WARPGROUP.ARRIVE")),
                "MUFU.EX2": count(lambda o: o == "MUFU.EX2"), "F2FP": count(lambda o: o.startswith("F2FP")),
                "SHFL": count(lambda o: o.startswith("SHFL")), "SYNCS": count(lambda o: o.startswith("SYNCS")),
                "BAR": count(lambda o: o.startswith("BAR")), "FMUL": count(lambda o: o == "FMUL"),
                "FFMA": count(lambda o: o == "FFMA"), "FADD": count(lambda o: o == "FADD"),
                "FMNMX": count(lambda o: o.startswith("FMNMX")), "LDG": count(lambda o: o.startswith("LDG")),
                "STL/LDL": count(lambda o: o.startswith(("STL", "LDL")))}
    return {"per_tile": per_tile, "per_128_keys": {k: round(v * 128 / keys, 1) for k, v in per_tile.items()}}


def analyse(kernel: str, block_n: int, out_fp8: bool, **kw) -> dict:
    """One compile's ``ptxas -v`` report and main-loop counts (``kernel``: "triton" or "gluon-ws")."""
    k = compile_triton(block_n, out_fp8, **kw) if kernel == "triton" else compile_ws(block_n, out_fp8, **kw)
    loops = main_loops(sass_lines(k.asm["cubin"]))
    return {"kernel": kernel, "block_n": block_n, "out_fp8": out_fp8, **kw, "shared_bytes": k.metadata.shared,
            "ptxas": ptxas_report(k.asm["ptx"]), "main_loops": [loop_counts(b, block_n) for b in loops]}


def _variants(block_ns, stages):
    from trt_sora.kernels import triton_ops as t

    for bn in block_ns:
        configs = {(c.kwargs["BLOCK_M"], c.kwargs["PIPE"], c.num_warps, c.num_stages) for c in t._attn_configs(bn)}
        if bn != t.SCALE_BLOCK:
            configs.add((128, True, 8, 3))  # the 128-row config, left out of wide tiles' autotuning
        for cfg in sorted(configs):
            yield "triton", bn, {"config": cfg}
        for st in stages if bn == t.SCALE_BLOCK else ():  # its 256-key tiles spilled (README): dropped
            yield "gluon-ws", bn, {"stages": st}


def main() -> None:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-n", default="128,256", help="keys per tile, comma-separated")
    ap.add_argument("--stages", default="2,3", help="ring slots of the Gluon kernel, comma-separated")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    _fake_sm90_driver()
    res = {"triton": triton.__version__, "target": "sm_90a", "shape": "1 x 40 x 32760 x 128", "configs": []}
    block_ns = [int(x) for x in a.block_n.split(",")]
    for kernel, bn, kw in _variants(block_ns, [int(x) for x in a.stages.split(",")]):
        for out_fp8 in (False, True):
            try:
                row = analyse(kernel, bn, out_fp8, **kw)
            except Exception as e:  # a config the compiler or ptxas refuses: recorded, not fatal
                row = {"kernel": kernel, "block_n": bn, "out_fp8": out_fp8, **kw,
                       "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"}
            res["configs"].append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
