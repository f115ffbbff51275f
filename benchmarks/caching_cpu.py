"""Step caching on the CPU: transformer calls saved vs clip PSNR per threshold, PyTorch fp32 only.

The calibrate stage (``trt_sora.calibrate.run.calibrate``, nearest rounding, no report) records the
model's step statistics (output magnitude ratios, extrapolation errors) over its own calibration
preset; the schedule of each setting is planned from them for ``--method``
(:func:`trt_sora.caching.schedule_for`) and the fp32 model samples the held-out captions with it.
Per setting: branch calls made of the uncached count, final-latent PSNR (peak: the uncached latents'
max - min) and decoded-clip PSNR (peak 2.0, pixels in [-1, 1]) against the uncached
fp32 clip of the same caption and noise, worst and mean over captions, and for wan-shapes the probe's
verdicts (colour, motion, background, shape) against the uncached clip's. The gate (``--gate-db``) passes
a setting whose clip PSNR reaches it on every caption with every probe verdict unchanged.

    python benchmarks/caching_cpu.py --model wan-shapes --method extrapolate --captions 16 --out x.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HELD_OUT = ("a red paper boat drifting down a rain-soaked street at dusk",
            "a slow pan across a snowy pine forest under northern lights",
            "a close-up of a hummingbird hovering over a purple flower",
            "an old lighthouse on a cliff during a thunderstorm")


def calibration_preset(adapter, calib_prompts: int | None):
    """The model's calibration preset (``calib_prompts``: fewer or more prompts)."""
    from trt_sora.calibrate.data import load_preset

    preset = load_preset(adapter.spec.defaults.get("calib_preset") or "tiny")
    return dataclasses.replace(preset, num_prompts=calib_prompts) if calib_prompts else preset


def calibrated_ratios(adapter, model, preset, keep: str | None, steps: int | None):
    """The calibrate stage's step statistics over ``steps`` (None: the model's) and its seconds;
    ``keep``: a file to reuse them from (written on the first run)."""
    from trt_sora.caching import RATIOS_FILE, StepRatios
    from trt_sora.calibrate.run import calibrate
    from trt_sora.config import CalibConfig

    if keep and Path(keep).is_file():
        return StepRatios.load(keep), None
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        calibrate(adapter, CalibConfig(weight_rounding="nearest", num_steps=steps), Path(d) / "calib", model=model,
                  preset=preset, report=False)
        if keep:
            shutil.copy(Path(d) / "calib" / RATIOS_FILE, keep)
        return StepRatios.load(Path(d) / "calib" / RATIOS_FILE), time.perf_counter() - t0


def psnr(ref: torch.Tensor, got: torch.Tensor, peak: float) -> float:
    mse = float((ref.double() - got.double()).square().mean())
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(peak ** 2 / mse)).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--method", default="magcache", choices=("magcache", "extrapolate"))
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's)")
    ap.add_argument("--gate-db", type=float, default=30.0, help="the clip PSNR every caption must reach")
    ap.add_argument("--captions", type=int, default=16)
    ap.add_argument("--calib-prompts", type=int, default=None, help="default: the model's calibration preset's")
    ap.add_argument("--configs", default="0.02:2:2,0.1:2:2,0.4:2:2",
                    help="threshold:max_skips:warmup_steps, comma-separated ('': only write --reference)")
    ap.add_argument("--final", type=int, default=1)
    ap.add_argument("--ratios", default=None, help="a step-statistics file to reuse (written when missing)")
    ap.add_argument("--reference", default=None, help="a file of the uncached clips to reuse (written when missing)")
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    from trt_sora.caching import schedule_for
    from trt_sora.config import CachingConfig
    from trt_sora.models import get_adapter
    from trt_sora.parity.loop import loop_inputs
    from trt_sora.sampling import adapter_call, sample

    adapter = get_adapter(a.model)
    model = adapter.load("fp32", "cpu")
    preset = calibration_preset(adapter, a.calib_prompts)
    settings = adapter.sampling.override(num_steps=a.steps) if a.steps else adapter.sampling
    sched = adapter.scheduler(settings.shift)
    sched.set_timesteps(settings.num_steps)
    captions = list(adapter.heldout_prompts() or HELD_OUT)[:a.captions]
    shape = preset.shapes[0].as_dict()
    decode, ddesc = adapter.decoder()
    call = adapter_call(adapter, model)
    clips = []
    for i, caption in enumerate(captions):
        noise, cond, uncond = loop_inputs(adapter, {**shape, "batch": 1}, seed=a.seed + i, prompts=(caption,))
        clips.append((noise, cond, uncond))

    def run(cache):
        t0 = time.perf_counter()
        lat = [sample(call, n, c, u, scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="batched",
                      conditioner=adapter, cache=cache).latents for n, c, u in clips]
        return lat, [decode(x).float() for x in lat], time.perf_counter() - t0

    if a.reference and Path(a.reference).is_file():
        ref = torch.load(a.reference)
        if ref["captions"] != captions or ref["seed"] != a.seed or ref["sampling"] != settings.to_dict():
            raise SystemExit(f"{a.reference} holds other captions, seeds or sampling settings")
        ref_lat, ref_frames, ref_s = ref["latents"], ref["frames"], ref["seconds"]
    else:
        ref_lat, ref_frames, ref_s = run(None)
        if a.reference:
            torch.save({"captions": captions, "seed": a.seed, "sampling": settings.to_dict(), "latents": ref_lat,
                        "frames": ref_frames, "seconds": ref_s}, a.reference)
    if not a.configs:
        return
    ratios, calib_s = calibrated_ratios(adapter, model, preset, a.ratios, a.steps)
    probe = _probe(a.model, captions)
    rows = []
    branches = [settings.branches] * settings.num_steps
    for spec in a.configs.split(","):
        thr, skips, warm = float(spec.split(":")[0]), int(spec.split(":")[1]), int(spec.split(":")[2])
        cfg = CachingConfig(method=a.method, threshold=thr, max_skips=skips, warmup_steps=warm, final_steps=a.final)
        schedule = schedule_for(cfg, ratios, settings, sched.timesteps)
        lat, frames, secs = run(schedule)
        computed, total = schedule.calls(branches)
        lp = [psnr(r, x, float(r.max() - r.min())) for r, x in zip(ref_lat, lat)]
        fp = [psnr(r, x, 2.0) for r, x in zip(ref_frames, frames)]
        row = {"threshold": thr, "max_skips": skips, "warmup_steps": warm, "reused": schedule.to_dict()["reused"],
               "calls": computed, "calls_uncached": total,
               "saved_fraction": round(1 - computed / total, 4),
               "latents_psnr_db": {"worst": min(lp), "mean": sum(lp) / len(lp)},
               "clip_psnr_db": {"worst": min(fp), "mean": sum(fp) / len(fp), "per_caption": fp},
               "sample_seconds": round(secs, 2)}
        if probe:
            row["probe_same_verdicts"] = probe(ref_frames, frames)
        row["gate_passed"] = min(fp) >= a.gate_db and row.get("probe_same_verdicts", len(fp)) == len(fp)
        rows.append(row)
        verdicts = f", probe verdicts unchanged {row['probe_same_verdicts']}/{len(captions)}" if probe else ""
        print(f"threshold {thr:g} max_skips {skips} warmup {warm}: {computed}/{total} calls "
              f"({row['saved_fraction']:.0%} saved), clip PSNR worst "
              f"{min(fp):.2f} mean {row['clip_psnr_db']['mean']:.2f} dB{verdicts}, "
              f"{a.gate_db:g} dB gate {'pass' if row['gate_passed'] else 'FAIL'}", flush=True)
    out = {"model": a.model, "backend": "torch fp32, CPU", "sampling": settings.to_dict(), "captions": captions,
           "seed": a.seed, "decoder": ddesc, "calibration": {"preset": preset.name, "prompts": preset.num_prompts,
                                                             "seconds": calib_s and round(calib_s, 1),
                                                             "ratios": ratios.summary()},
           "caching": {"method": a.method, "final_steps": a.final},
           "gate": {"min_clip_psnr_db_every_caption": a.gate_db, "probe_verdicts": "all unchanged"},
           "uncached_sample_seconds": round(ref_s, 2),
           "psnr_peak": "latents: uncached max - min; clip: 2.0", "curve": rows,
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    Path(a.out).write_text(json.dumps(out, indent=1))


def _probe(model: str, captions):
    """wan-shapes: how many clips keep every probe verdict of their uncached clip (None for other models)."""
    if model != "wan-shapes":
        return None
    from trt_sora.models.moving_shapes.data import parse_caption
    from trt_sora.models.moving_shapes.probe import probe_batch

    specs = [parse_caption(c) for c in captions]

    def same(ref_frames, frames):
        ref = probe_batch(torch.cat(ref_frames))
        got = probe_batch(torch.cat(frames))
        return sum(r.matches(s) == g.matches(s) for r, g, s in zip(ref, got, specs))

    return same


if __name__ == "__main__":
    main()
