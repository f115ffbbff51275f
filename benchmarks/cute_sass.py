"""What ptxas made of each CuTe attention schedule, without a GPU: compile
:mod:`trt_sora.kernels.cute_attention` for ``sm_90a`` (``CUTE_DSL_ARCH``), assemble its PTX with ``ptxas``,
disassemble with ``cuobjdump``, then report per schedule: registers, spills, ptxas's wgmma warnings (C751x:
the products serialized), the main loop's instructions per key tile by opcode, and, at each WGMMA wait in the
loop, how many of the loop's EX2s (MUFU) come before it. A wait for P V placed before a step's EX2s means
its softmax does not overlap that P V, whatever the source order says.

    python benchmarks/cute_sass.py --site /tmp/cute311 --ptxas .../bin/ptxas --cuobjdump .../bin/cuobjdump \\
        --out benchmarks/results/cute_sass.json

``--site``: a pip ``--target`` folder with nvidia-cutlass-dsl for this Python; ptxas and cuobjdump from the
CUDA 13 wheels (nvidia-cuda-nvcc, nvidia-cuda-cuobjdump) or a CUDA toolkit.
"""
import argparse
import collections
import json
import os
import re
import site
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cute_attention import VARIANTS  # noqa: E402

INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?(.*?);")
BRANCH = re.compile(r"BRA\s+.*?0x([0-9a-f]+)")


def compile_ptx(options: dict, dump: Path, name: str) -> Path:
    """The schedule's PTX, compiled on this CPU from dummy tensors of 2 heads x 1000 tokens, as ``name``.ptx
    (every schedule's dump has the same file name)."""
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump))
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch

    from trt_sora.kernels import cute_attention as ca

    b, h, s, d = 1, 2, 1000, ca.TILE
    nb = -(-s // d)
    opts = {k: v for k, v in options.items() if k not in ("out_fp8", "trace")}
    fp8, trace = bool(options.get("out_fp8")), bool(options.get("trace"))
    q8 = torch.zeros(b * h, s, d, dtype=torch.int8)
    vt8 = torch.zeros(b * h, d, nb * d, dtype=torch.float8_e4m3fn)
    scales = torch.ones(b * h, nb), torch.ones(b * h, nb), torch.ones(b * h, d)
    o = torch.empty(b, s, h, d // 2, dtype=torch.int16 if fp8 else torch.int32)
    args = (ca._dl(q8, 2), ca._dl(q8, 2), ca._dl(vt8, 2), *(ca._dl(x, 1) for x in scales), ca._dl(o, 3))
    tr = (ca._dl(torch.zeros(ca.TRACE_SHAPE, dtype=torch.int64), 3)
          if trace else ca._dl(torch.zeros(1, dtype=torch.int32), 0))
    kern = ca._kernel_type()(**(ca.SCHEDULE | opts), out_fp8=fp8, trace=trace)
    cute.compile(kern, *args, 0.1, ca._dl(scales[2].reshape(-1)[:1], 0), tr, cuda.CUstream(0))
    (ptx,) = dump.rglob("*.ptx")
    return ptx.rename(dump.parent / f"{name}.ptx")


def assemble(ptx: Path, ptxas: str, cuobjdump: str) -> tuple[str, str]:
    cubin = ptx.with_suffix(".cubin")
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)], capture_output=True,
                          text=True, check=True).stderr
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return info, sass


def main_loop(sass: str) -> list[tuple[int, str, str]]:
    """The key-tile loop: the shortest backward branch's body holding both products and the EX2s."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(0)) for m in map(INSTR.match, sass.splitlines()) if m]
    best = None
    for addr, op, text in ins:
        m = BRANCH.search(text) if op == "BRA" else None
        if m and int(m.group(1), 16) < addr:
            body = [x for x in ins if int(m.group(1), 16) <= x[0] <= addr]
            ops = {x[1] for x in body}
            if {"IGMMA", "QGMMA", "MUFU"} <= ops and (best is None or len(body) < len(best)):
                best = body
    return best or []


def report(info: str, sass: str) -> dict:
    loop = main_loop(sass)
    tiles = max(1, sum(op == "MUFU" for _, op, _ in loop) // 64)  # 64 EX2s a tile and thread
    waits, ex2 = [], 0
    for _, op, text in loop:
        ex2 += op == "MUFU"
        if op == "WARPGROUP" and "DEPBAR" in text:
            waits.append({"ex2_before": ex2, "wait": text.split("DEPBAR")[1].strip(" ;.")})
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return {"registers": int(regs.group(1)) if regs else None, "spill_store_bytes": int(spill.group(1)) if spill else 0,
            "wgmma_warnings": sorted(set(re.findall(r"\((C75\d\d)\)", info))),
            "loop_tiles": tiles, "loop_instructions_per_tile": round(len(loop) / tiles, 1),
            "loop_opcodes_per_tile": {k: round(v / tiles, 1) for k, v in
                                      collections.Counter(op for _, op, _ in loop).most_common(12)},
            "loop_ex2": ex2, "loop_waits": waits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default=None, help="a pip --target folder holding nvidia-cutlass-dsl")
    ap.add_argument("--ptxas", required=True)
    ap.add_argument("--cuobjdump", required=True)
    ap.add_argument("--variants", default="overlap,overlap_lazy,lookahead_lazy,overlap_lazy_im,overlap_lazy_epssim")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.site:
        site.addsitedir(a.site)
    res = {"arch": "sm_90a", "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "dump"
        dump.mkdir()
        for name in a.variants.split(","):
            info, sass = assemble(compile_ptx(VARIANTS[name], dump, name), a.ptxas, a.cuobjdump)
            res["variants"][name] = VARIANTS[name] | report(info, sass)
            print(name, json.dumps({k: v for k, v in res["variants"][name].items() if k != "loop_opcodes_per_tile"}),
                  flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
