"""Step caching: transformer calls saved vs clip PSNR per setting, PyTorch fp32, on the CPU or a GPU.

The calibrate stage (``trt_sora.calibrate.run.calibrate``, nearest rounding, no report, on ``--device``)
records the model's step statistics (output magnitude ratios, extrapolation errors) over its own
calibration preset at ``--steps``; the schedule of each setting is planned from them for ``--method``
(:func:`trt_sora.caching.schedule_for`) and the fp32 model samples the held-out captions with it. The
uncached clips are sampled once and every setting of ``--configs`` runs in the same process; the JSON
is rewritten after each setting, so a time limit keeps what finished. A setting whose schedule equals
an earlier one's is not sampled again (``same_schedule_as``).
Per setting: branch calls made of the uncached count, final-latent PSNR (peak: the uncached latents'
max - min) and decoded-clip PSNR (peak 2.0, pixels in [-1, 1]) against the uncached
fp32 clip of the same caption and noise, worst and mean over captions (a step calling cond alone, its
uncond estimated under ``caching.cfg_reuse``, makes 1 of its 2 branch calls), and for wan-shapes the probe's
verdicts (colour, motion, background, shape) against the uncached clip's. The gate (``--gate-db``) passes
a setting whose clip PSNR reaches it on every caption with every probe verdict unchanged.

    python benchmarks/caching_bench.py --model wan-shapes --method extrapolate --captions 16 --out x.json
    python benchmarks/caching_bench.py --method extrapolate --configs 0.05:1:2:0.3:0,0.05:1:2:0.3:1 --out c.json
    python benchmarks/caching_bench.py --device cuda --steps 50 --text-embeddings EMB --out y.json  # GPU box

``--text-embeddings``: the calibration and held-out captions' embeddings (``benchmarks/peer_modelopt.py
embed``, made where the model's text encoder is installed) for a machine without it.
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

#: A curve row's keys that name its setting (the rest describe its schedule and clips).
SETTING = ("threshold", "max_skips", "warmup_steps", "cfg_reuse", "cfg_order")
HELD_OUT = ("a red paper boat drifting down a rain-soaked street at dusk",
            "a slow pan across a snowy pine forest under northern lights",
            "a close-up of a hummingbird hovering over a purple flower",
            "an old lighthouse on a cliff during a thunderstorm")


def calibration_preset(adapter, calib_prompts: int | None):
    """The model's calibration preset (``calib_prompts``: fewer or more prompts)."""
    from trt_sora.calibrate.data import load_preset

    preset = load_preset(adapter.spec.defaults.get("calib_preset") or "tiny")
    return dataclasses.replace(preset, num_prompts=calib_prompts) if calib_prompts else preset


def calibrated_ratios(adapter, model, preset, keep: str | None, steps: int | None, device: str, text: str | None):
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
                  preset=preset, report=False, device=device, text_encoder=text)
        if keep:
            shutil.copy(Path(d) / "calib" / RATIOS_FILE, keep)
        return StepRatios.load(Path(d) / "calib" / RATIOS_FILE), time.perf_counter() - t0


def psnr(ref: torch.Tensor, got: torch.Tensor, peak: float) -> float:
    """PSNR in dB of ``got`` vs ``ref``: the MSE in fp64, the log by :func:`trt_sora.metrics.psnr_from_mse`
    (a float32 ``torch.log10`` here once put 1e-6 dB of CPU-dependent rounding into every row)."""
    from trt_sora.metrics import psnr_from_mse

    return psnr_from_mse(float((ref.double() - got.double()).square().mean()), peak)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan-shapes")
    ap.add_argument("--method", default="magcache", choices=("magcache", "extrapolate"))
    ap.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's)")
    ap.add_argument("--device", default="cpu", help="torch device of the model, the sampler and the calibration")
    ap.add_argument("--text-embeddings", default=None, metavar="FILE",
                    help="prompt embeddings standing in for the model's text encoder (peer_modelopt.py embed)")
    ap.add_argument("--gate-db", type=float, default=30.0, help="the clip PSNR every caption must reach")
    ap.add_argument("--captions", type=int, default=16)
    ap.add_argument("--calib-prompts", type=int, default=None, help="default: the model's calibration preset's")
    ap.add_argument("--configs", default="0.02:2:2,0.1:2:2,0.4:2:2",
                    help="threshold:max_skips:warmup_steps[:cfg_reuse[:cfg_order]], comma-separated (cfg_reuse: "
                    "caching.cfg_reuse, default 0 = off; cfg_order default 0) ('': only write --reference)")
    ap.add_argument("--final", type=int, default=1)
    ap.add_argument("--plan", default="runs", choices=("runs", "global"),
                    help="caching.plan of method extrapolate: the threshold per run of reused steps, or the "
                    "whole trajectory's budget")
    ap.add_argument("--damping", type=float, default=1.0,
                    help="caching.damping of method extrapolate for every row (1: the line)")
    ap.add_argument("--ratios", default=None, help="a step-statistics file to reuse (written when missing)")
    ap.add_argument("--reference", default=None, help="a torch.save file of the uncached clips to reuse, e.g. "
                    "ref.pt (written when missing)")
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of torch")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.reference and a.reference.endswith(".safetensors"):  # torch.load reads that name as safetensors
        ap.error("--reference is a torch.save file: name it e.g. ref.pt, not *.safetensors")
    return a


class Bench:
    """The model, the held-out captions' noise and conditioning on ``a.device``, and the sampler over them."""

    def __init__(self, a):
        from trt_sora.models import get_adapter
        from trt_sora.parity.loop import loop_inputs

        self.a, self.adapter = a, get_adapter(a.model)
        self.model = self.adapter.load("fp32", a.device)
        self.preset = calibration_preset(self.adapter, a.calib_prompts)
        self.settings = self.adapter.sampling.override(num_steps=a.steps) if a.steps else self.adapter.sampling
        self.captions = list(self.adapter.heldout_prompts() or HELD_OUT)[:a.captions]
        self.decode, self.ddesc = self.adapter.decoder(device=a.device)
        point = {**self.preset.shapes[0].as_dict(), "batch": 1}
        self.clips = [[_to(x, a.device) for x in loop_inputs(self.adapter, point, seed=a.seed + i, prompts=(c,),
                                                             text_encoder=a.text_embeddings)]
                      for i, c in enumerate(self.captions)]

    def timesteps(self) -> list[float]:
        sched = self.adapter.scheduler(self.settings.shift)
        sched.set_timesteps(self.settings.num_steps)
        return [float(t) for t in sched.timesteps]

    def sampled(self, inits=None, **kw):
        """``(results, frames, seconds)``: the sampler over every caption (``inits``: each clip's starting
        latents, ``None`` for its noise; ``kw``: more of ``sample``'s arguments) and the decoded frames, timed
        together."""
        from trt_sora.sampling import adapter_call, sample

        call, s = adapter_call(self.adapter, self.model), self.settings
        _sync(self.a.device)
        t0 = time.perf_counter()
        res = [sample(call, n if x0 is None else x0, c, u, scheduler=self.adapter.scheduler(s.shift), settings=s,
                      cfg="batched", conditioner=self.adapter, **kw)
               for (n, c, u), x0 in zip(self.clips, inits or [None] * len(self.clips))]
        frames = [self.decode(r.latents).float() for r in res]
        _sync(self.a.device)
        return res, frames, time.perf_counter() - t0

    def run(self, cache):
        """``(latents, frames, seconds)`` of every caption (on the CPU) sampled with ``cache``."""
        res, frames, secs = self.sampled(cache=cache)
        return [r.latents.cpu() for r in res], [f.cpu() for f in frames], secs

    def reference(self):
        """The uncached clips, from ``--reference`` when it holds these captions and settings."""
        a = self.a
        if a.reference and Path(a.reference).is_file():
            ref = torch.load(a.reference)
            if ref["captions"] != self.captions or ref["seed"] != a.seed or ref["sampling"] != self.settings.to_dict():
                raise SystemExit(f"{a.reference} holds other captions, seeds or sampling settings")
            return ref["latents"], ref["frames"], ref["seconds"]
        lat, frames, secs = self.run(None)
        if a.reference:
            torch.save({"captions": self.captions, "seed": a.seed, "sampling": self.settings.to_dict(),
                        "latents": lat, "frames": frames, "seconds": secs}, a.reference)
        return lat, frames, secs


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return {k: _to(v, device) for k, v in x.items()} if isinstance(x, dict) else x


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measure(b: Bench, schedule, ref, probe) -> dict:
    """One setting's row: calls, latent and clip PSNR vs the uncached clips, probe verdicts, the gate."""
    ref_lat, ref_frames = ref
    lat, frames, secs = b.run(schedule)
    computed, total = schedule.calls([b.settings.branches] * b.settings.num_steps)
    lp = [psnr(r, x, float(r.max() - r.min())) for r, x in zip(ref_lat, lat)]
    fp = [psnr(r, x, 2.0) for r, x in zip(ref_frames, frames)]
    row = {"reused": schedule.to_dict()["reused"], "schedule": schedule.to_dict(), "calls": computed,
           "calls_uncached": total,
           "saved_fraction": round(1 - computed / total, 4),
           "latents_psnr_db": {"worst": min(lp), "mean": sum(lp) / len(lp)},
           "clip_psnr_db": {"worst": min(fp), "mean": sum(fp) / len(fp), "per_caption": fp},
           "sample_seconds": round(secs, 3)}
    if probe:
        row["probe_same_verdicts"] = probe(ref_frames, frames)
    row["gate_passed"] = min(fp) >= b.a.gate_db and row.get("probe_same_verdicts", len(fp)) == len(fp)
    return row


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    from trt_sora.caching import schedule_for
    from trt_sora.config import CachingConfig

    b = Bench(a)
    ref_lat, ref_frames, ref_s = b.reference()
    if not a.configs:
        return
    ratios, calib_s = calibrated_ratios(b.adapter, b.model, b.preset, a.ratios, a.steps, a.device, a.text_embeddings)
    probe = _probe(a.model, b.captions)
    out = {"model": a.model, "backend": f"torch fp32, {_device_name(a.device)}", "sampling": b.settings.to_dict(),
           "captions": b.captions, "seed": a.seed, "decoder": b.ddesc,
           "calibration": {"preset": b.preset.name, "prompts": b.preset.num_prompts,
                           "seconds": calib_s and round(calib_s, 1), "reused_file": calib_s is None and a.ratios,
                           "ratios": ratios.summary()},
           "caching": {"method": a.method, "final_steps": a.final,
                       **({"plan": a.plan} if a.plan != "runs" else {}),
                       **({"damping": a.damping} if a.damping != 1.0 else {})},
           "gate": {"min_clip_psnr_db_every_caption": a.gate_db, "probe_verdicts": "all unchanged"},
           "uncached_sample_seconds": round(ref_s, 3), "psnr_peak": "latents: uncached max - min; clip: 2.0",
           "curve": [], "torch": torch.__version__, "threads": torch.get_num_threads()}
    for spec in a.configs.split(","):
        setting = parse_setting(spec)
        cfg = CachingConfig(method=a.method, final_steps=a.final, plan=a.plan, damping=a.damping, **setting)
        schedule = schedule_for(cfg, ratios, b.settings, b.timesteps())
        same = next((i for i, r in enumerate(out["curve"]) if r["schedule"] == schedule.to_dict()), None)
        if same is None:
            row = measure(b, schedule, (ref_lat, ref_frames), probe)
        else:
            row = {**{k: v for k, v in out["curve"][same].items() if k not in SETTING}, "same_schedule_as": same}
        row = {**setting, **row}
        out["curve"].append(row)
        _write(a.out, out)
        verdicts = f", probe verdicts unchanged {row['probe_same_verdicts']}/{len(b.captions)}" if probe else ""
        print(f"{spec}: cond-only steps {row['schedule'].get('cfg_delta', [])}, "
              f"{row['calls']}/{row['calls_uncached']} calls "
              f"({row['saved_fraction']:.0%} saved), clip PSNR worst {row['clip_psnr_db']['worst']:.2f} mean "
              f"{row['clip_psnr_db']['mean']:.2f} dB{verdicts}, {a.gate_db:g} dB gate "
              f"{'pass' if row['gate_passed'] else 'FAIL'}", flush=True)


def parse_setting(spec: str) -> dict:
    """``threshold:max_skips:warmup_steps[:cfg_reuse[:cfg_order]]`` as CachingConfig keywords."""
    parts = spec.split(":")
    if not 3 <= len(parts) <= 5:
        raise SystemExit(f"--configs entry {spec!r} is not threshold:max_skips:warmup_steps[:cfg_reuse[:cfg_order]]")
    kinds = (("threshold", float), ("max_skips", int), ("warmup_steps", int), ("cfg_reuse", float), ("cfg_order", int))
    return {k: t(x) for (k, t), x in zip(kinds, [*parts, "0", "0"][:5])}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if str(device).startswith("cuda") else "CPU"


def _write(path: str, out: dict) -> None:
    """``out`` as JSON at ``path`` through a temp file and a rename (a killed run leaves the last whole one)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


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
