"""Sparse attention on the CPU: attention computed vs clip PSNR per setting, PyTorch fp32 only (wan-shapes).

The calibrate stage (``trt_sora.calibrate.run.calibrate`` with ``sparse=``, nearest rounding, no report)
measures the attention mass outside each candidate window per layer and step over its own preset; each
setting of ``--configs`` is planned from it (:func:`trt_sora.sparse.plan_sparse`: a mass budget, or a fixed
window for every layer) and the fp32 model samples the held-out captions with the plan applied to every
call. Per setting: the fraction of query-key blocks computed over the whole trajectory (dense steps and
dense layers counted whole), final-latent PSNR (peak: the dense latents' max - min) and decoded-clip PSNR
(peak 2.0) against the dense clip of the same caption and noise, worst and mean, and the probe's verdicts
against the dense clip's. The gate (``--gate-db``) passes a setting whose clip PSNR reaches it on every caption
with every probe verdict unchanged.

    python benchmarks/sparse_cpu.py --captions 4 --configs budget=0.05,budget=0.2,window=0-1-0 --out x.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.caching_cpu import HELD_OUT, _probe, calibration_preset, psnr  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--gate-db", type=float, default=30.0)
    ap.add_argument("--captions", type=int, default=4)
    ap.add_argument("--calib-prompts", type=int, default=2)
    ap.add_argument("--tile", default="1-8-16")
    ap.add_argument("--candidates", default="0-0-0,1-0-0,1-1-1,2-1-1,4-1-1")
    ap.add_argument("--dense-steps", type=int, default=2)
    ap.add_argument("--configs", default="budget=0.02,budget=0.1,budget=0.3,window=0-0-0")
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    from trt_sora.calibrate.run import calibrate
    from trt_sora.config import CalibConfig, SparseAttentionConfig
    from trt_sora.models import get_adapter
    from trt_sora.parity.loop import loop_inputs
    from trt_sora.sampling import adapter_call, sample
    from trt_sora.sparse import MASS_FILE, AttentionMass, plan_sparse

    def grid3(s):
        return tuple(int(x) for x in s.split("-"))

    adapter = get_adapter(a.model)
    model = adapter.load("fp32", "cpu")
    sites = adapter.sparse_attention_sites(model)
    preset = calibration_preset(adapter, a.calib_prompts)
    settings = adapter.sampling
    sched = adapter.scheduler(settings.shift)
    sched.set_timesteps(settings.num_steps)
    timesteps = [float(t) for t in sched.timesteps]
    base = SparseAttentionConfig(enabled=True, tile=grid3(a.tile), dense_steps=a.dense_steps,
                                 candidates=tuple(grid3(c) for c in a.candidates.split(",")))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        calibrate(adapter, CalibConfig(weight_rounding="nearest"), Path(d) / "calib", model=model, preset=preset,
                  report=False, sparse=base)
        calib_s = time.perf_counter() - t0
        mass = AttentionMass.load(Path(d) / "calib" / MASS_FILE)
    captions = list(adapter.heldout_prompts() or HELD_OUT)[:a.captions]
    shape = {**preset.shapes[0].as_dict(), "batch": 1}
    decode, ddesc = adapter.decoder()
    call = adapter_call(adapter, model)
    clips = [loop_inputs(adapter, shape, seed=a.seed + i, prompts=(c,)) for i, c in enumerate(captions)]
    grid = adapter.token_grid(clips[0][0].shape)

    def run(plan):
        t0 = time.perf_counter()
        hook = None if plan is None else (lambda c: plan.applied(sites, grid, c.timestep, "cpu"))
        lat = [sample(call, n, c, u, scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="batched",
                      conditioner=adapter, hook=hook).latents for n, c, u in clips]
        return lat, [decode(x).float() for x in lat], time.perf_counter() - t0

    ref_lat, ref_frames, ref_s = run(None)
    probe = _probe(a.model, captions)
    rows = []
    for spec in a.configs.split(","):
        kind, value = spec.split("=")
        cfg = dataclasses.replace(base, mass_budget=float(value)) if kind == "budget" else \
            dataclasses.replace(base, window=grid3(value))
        plan, chosen = plan_sparse(cfg, timesteps, mass if kind == "budget" else None)
        density = plan.density(list(sites), grid)
        sparse_steps = sum(t <= plan.dense_above for t in timesteps)
        computed = (sum(density.values()) * sparse_steps + len(density) * (len(timesteps) - sparse_steps)) / (
            len(density) * len(timesteps))
        lat, frames, secs = run(plan)
        lp = [psnr(r, x, float(r.max() - r.min())) for r, x in zip(ref_lat, lat)]
        fp = [psnr(r, x, 2.0) for r, x in zip(ref_frames, frames)]
        row = {"setting": spec, "windows": chosen["plan"]["windows"], "density": density,
               "attention_computed": round(computed, 4),
               "latents_psnr_db": {"worst": min(lp), "mean": sum(lp) / len(lp)},
               "clip_psnr_db": {"worst": min(fp), "mean": sum(fp) / len(fp), "per_caption": fp},
               "sample_seconds": round(secs, 2)}
        if probe:
            row["probe_same_verdicts"] = probe(ref_frames, frames)
        row["gate_passed"] = min(fp) >= a.gate_db and row.get("probe_same_verdicts", len(fp)) == len(fp)
        rows.append(row)
        verdicts = f", probe verdicts unchanged {row['probe_same_verdicts']}/{len(captions)}" if probe else ""
        print(f"{spec}: attention computed {computed:.1%}, clip PSNR worst {min(fp):.2f} mean "
              f"{row['clip_psnr_db']['mean']:.2f} dB{verdicts}, {a.gate_db:g} dB gate "
              f"{'pass' if row['gate_passed'] else 'FAIL'}", flush=True)
    out = {"model": a.model, "backend": "torch fp32, CPU", "sampling": settings.to_dict(), "captions": captions,
           "seed": a.seed, "decoder": ddesc, "grid": list(grid), "sparse": dataclasses.asdict(base),
           "calibration": {"preset": preset.name, "prompts": preset.num_prompts, "seconds": round(calib_s, 1),
                           "mass": mass.summary(a.dense_steps)},
           "gate": {"min_clip_psnr_db_every_caption": a.gate_db, "probe_verdicts": "all unchanged"},
           "dense_sample_seconds": round(ref_s, 2), "psnr_peak": "latents: dense max - min; clip: 2.0",
           "curve": rows, "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
