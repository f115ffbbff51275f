"""Worker of the multi-process tests (importable by spawned children: pytest puts this folder on
sys.path and the children inherit it). One spawn runs every case of one world size, so the
process start-up (torch + diffusers imports) is paid once per world size."""
from __future__ import annotations

import numpy as np


def make_runner(kind: str, run: str | None):
    if kind == "torch":
        from trt_sora.runners.torch_runner import TorchRunner

        return TorchRunner("wan-tiny", dtype="fp32", device="cpu")
    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

    return TorchFp8Runner("wan-tiny", f"{run}/quant/qdq_map.json", f"{run}/calib/stats.safetensors", device="cpu",
                          attention=AttentionPolicy(enabled=kind == "fp8-attn8"))


def run_cases(rank: int, cases: list, run: str | None, checked: str | None, feeds_path: str, out_dir: str) -> None:
    """``cases``: ``(name, cfg, ulysses, kind)``; kind ``torch`` / ``fp8`` / ``fp8-attn8`` (SPMD: every
    rank calls infer) or ``leader`` (runtime.load(parallel=...): rank 0 serves two calls, the
    others follow). Rank 0 saves ``<name>.npz``."""
    from trt_sora.parallel import ParallelConfig
    from trt_sora.runners.parallel_runner import ParallelRunner

    feeds = dict(np.load(feeds_path))
    for name, cfg, ulysses, kind in cases:
        pc = ParallelConfig(cfg=cfg, ulysses=ulysses)
        if kind == "leader":
            import trt_sora.runtime as rt

            sr = rt.load(checked, backend="torch", device="cpu", parallel=pc)
            if rank == 0:
                np.savez(f"{out_dir}/{name}.npz", a=sr.infer(feeds)["sample"], b=sr.infer(feeds)["sample"])
                sr.close()
            else:
                assert sr.follow() >= 2
            continue
        r = ParallelRunner(make_runner(kind, run), pc).activate()
        y = r.infer(feeds)["sample"]
        if rank == 0:
            local = r.mesh.seq.local if r.mesh.seq is not None else -1
            np.savez(f"{out_dir}/{name}.npz", sample=y, local_tokens=local)
        r.deactivate()
