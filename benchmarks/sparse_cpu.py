"""Sparse attention on the CPU: attention computed vs clip PSNR per setting, PyTorch fp32 only (wan-shapes).

The calibrate stage (``trt_sora.calibrate.run.calibrate`` with ``sparse=``, nearest rounding, no report)
measures the attention mass outside each candidate window per layer and step over its own preset; each
setting of ``--configs`` is planned from it (:func:`trt_sora.sparse.plan_sparse`) and the fp32 model samples
the held-out captions (one caption and noise per clip) with the plan applied to every call. A setting is
``/``-joined ``key=value`` pairs: ``budget=0.1`` (each layer's narrowest candidate within the mass budget) or
``window=4-1-1`` (that window for every layer), ``dense=N`` (the first N steps dense; default
``--dense-steps``) and ``layers=blocks.0+blocks.5`` (layers kept dense). The first N steps of a setting equal
the dense trajectory's, so a setting resumes the dense clip's latents at step N (``sample``'s ``start_step``).

Per setting: the fraction of query-key blocks computed over the whole trajectory (dense steps and dense
layers counted whole), final-latent PSNR (peak: the dense latents' max - min) and decoded-clip PSNR (peak
2.0) against the dense clip of the same caption and noise, worst and mean, and the probe's verdicts against
the dense clip's. The gate (``--gate-db``) passes a setting whose clip PSNR reaches it on every caption with
every probe verdict unchanged. The JSON is rewritten after each setting.

    python benchmarks/sparse_cpu.py --captions 8 --configs budget=0.1,window=4-1-1/dense=10 --out x.json
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.caching_bench import Bench, _probe, _write, psnr  # noqa: E402


def grid3(s: str) -> tuple[int, int, int]:
    return tuple(int(x) for x in s.split("-"))  # type: ignore[return-value]


def parse_setting(spec: str, base):
    """A ``--configs`` entry as ``(SparseAttentionConfig, uses calibrated mass)``."""
    keys = {"budget": ("mass_budget", float), "window": ("window", grid3), "dense": ("dense_steps", int),
            "layers": ("dense_layers", lambda s: tuple(s.split("+")))}
    fields = {}
    for part in spec.split("/"):
        k, _, v = part.partition("=")
        if k not in keys or not v:
            raise SystemExit(f"--configs entry {spec!r}: {part!r} is not one of {'/'.join(f'{k}=' for k in keys)}")
        name, conv = keys[k]
        fields[name] = conv(v)
    if ("mass_budget" in fields) == ("window" in fields):
        raise SystemExit(f"--configs entry {spec!r} needs one of budget= or window=")
    return dataclasses.replace(base, **fields), "window" not in fields


def computed_fraction(plan, density: dict, timesteps) -> float:
    """Query-key blocks computed over the trajectory, of the dense trajectory's (dense steps count whole)."""
    sparse_steps = sum(t <= plan.dense_above for t in timesteps)
    return (sum(density.values()) * sparse_steps + len(density) * (len(timesteps) - sparse_steps)) / (
        len(density) * len(timesteps))


class SparseBench(Bench):
    """:class:`Bench` sampling with a sparse plan, resuming the dense trajectory after its dense steps."""

    def trajectory(self):
        """The dense clips: ``(latents, frames, seconds, per-step latents)``."""
        res, frames, secs = self.sampled(keep=("latents",))
        return [r.latents for r in res], frames, secs, [[st.latents for st in r.steps] for r in res]

    def run_plan(self, plan, sites, grid, start: int, steps):
        """``(latents, frames, seconds)`` with ``plan`` from step ``start`` on (``steps``: the dense latents)."""
        hook = lambda c: plan.applied(sites, grid, c.timestep, "cpu")  # noqa: E731
        res, frames, secs = self.sampled([st[start - 1] if start else None for st in steps], hook=hook,
                                         start_step=start)
        return [r.latents for r in res], frames, secs


def calibrated_mass(b: Bench, base, keep: str | None):
    """The calibrate stage's attention mass for ``base`` and its seconds (``keep``: reuse / write that file)."""
    from trt_sora.calibrate.run import calibrate
    from trt_sora.config import CalibConfig
    from trt_sora.sparse import MASS_FILE, AttentionMass

    if keep and Path(keep).is_file():
        return AttentionMass.load(keep), None
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        calibrate(b.adapter, CalibConfig(weight_rounding="nearest"), Path(d) / "calib", model=b.model,
                  preset=b.preset, report=False, sparse=base)
        if keep:
            shutil.copy(Path(d) / "calib" / MASS_FILE, keep)
        return AttentionMass.load(Path(d) / "calib" / MASS_FILE), time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--gate-db", type=float, default=30.0)
    ap.add_argument("--captions", type=int, default=8)
    ap.add_argument("--calib-prompts", type=int, default=2)
    ap.add_argument("--tile", default="1-8-16")
    ap.add_argument("--candidates", default="2-1-1,8-0-0,4-1-1,5-1-1,6-1-1",
                    help="windows the calibrate stage measures, narrowest first (frames-rows-cols of tiles)")
    ap.add_argument("--global-frames", type=int, default=0)
    ap.add_argument("--dense-steps", type=int, default=2)
    ap.add_argument("--configs", default="budget=0.05,budget=0.1,window=4-1-1/dense=10")
    ap.add_argument("--mass", default=None, help="an attention-mass file to reuse (written when missing)")
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    a.device, a.steps, a.text_embeddings = "cpu", None, None
    torch.set_num_threads(a.threads)
    from trt_sora.config import SparseAttentionConfig
    from trt_sora.sparse import plan_sparse

    base = SparseAttentionConfig(enabled=True, tile=grid3(a.tile), dense_steps=a.dense_steps,
                                 global_frames=a.global_frames,
                                 candidates=tuple(grid3(c) for c in a.candidates.split(",")))
    settings = [parse_setting(s, base) for s in a.configs.split(",")]
    b = SparseBench(a)
    sites = b.adapter.sparse_attention_sites(b.model)
    mass, calib_s = calibrated_mass(b, base, a.mass)
    ref_lat, ref_frames, ref_s, ref_steps = b.trajectory()
    grid = b.adapter.token_grid(b.clips[0][0].shape)
    timesteps = b.timesteps()
    probe = _probe(a.model, b.captions)
    out = {"model": a.model, "backend": "torch fp32, CPU", "sampling": b.settings.to_dict(), "captions": b.captions,
           "seed": a.seed, "decoder": b.ddesc, "grid": list(grid), "sparse": dataclasses.asdict(base),
           "calibration": {"preset": b.preset.name, "prompts": b.preset.num_prompts,
                           "seconds": calib_s and round(calib_s, 1), "reused_file": calib_s is None and a.mass,
                           "mass": mass.summary(a.dense_steps)},
           "gate": {"min_clip_psnr_db_every_caption": a.gate_db, "probe_verdicts": "all unchanged"},
           "dense_sample_seconds": round(ref_s, 2), "psnr_peak": "latents: dense max - min; clip: 2.0",
           "resume": "a setting's dense steps are the dense trajectory's; it resumes its latents there",
           "curve": [], "torch": torch.__version__, "threads": torch.get_num_threads()}
    for spec, (cfg, calibrated) in zip(a.configs.split(","), settings):
        plan, chosen = plan_sparse(cfg, timesteps, mass if calibrated else None)
        density = plan.density(list(sites), grid)
        computed = computed_fraction(plan, density, timesteps)
        lat, frames, secs = b.run_plan(plan, sites, grid, min(cfg.dense_steps, len(timesteps) - 1), ref_steps)
        lp = [psnr(r, x, float(r.max() - r.min())) for r, x in zip(ref_lat, lat)]
        fp = [psnr(r, x, 2.0) for r, x in zip(ref_frames, frames)]
        row = {"setting": spec, "dense_steps": cfg.dense_steps, "dense_layers": list(cfg.dense_layers),
               "windows": chosen["plan"]["windows"], "density": density, "attention_computed": round(computed, 4),
               "latents_psnr_db": {"worst": min(lp), "mean": sum(lp) / len(lp)},
               "clip_psnr_db": {"worst": min(fp), "mean": sum(fp) / len(fp), "per_caption": fp},
               "sample_seconds": round(secs, 2)}
        if probe:
            row["probe_same_verdicts"] = probe(ref_frames, frames)
        row["gate_passed"] = min(fp) >= a.gate_db and row.get("probe_same_verdicts", len(fp)) == len(fp)
        out["curve"].append(row)
        _write(a.out, out)
        verdicts = f", probe verdicts unchanged {row['probe_same_verdicts']}/{len(fp)}" if probe else ""
        print(f"{spec}: attention computed {computed:.1%}, clip PSNR worst {min(fp):.2f} mean "
              f"{row['clip_psnr_db']['mean']:.2f} dB{verdicts}, {a.gate_db:g} dB gate "
              f"{'pass' if row['gate_passed'] else 'FAIL'}", flush=True)


if __name__ == "__main__":
    main()
