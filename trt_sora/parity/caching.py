"""The step-caching level of the parity check: the candidate's sampling loop with the recipe's cache
schedule, its clip gated against the *uncached* reference clip with the loop and frames gates, and the
curve over ``caching.sweep`` (threshold -> transformer calls saved -> PSNR) recorded beside it.

The schedule comes from this model's calibrated step statistics (``calib/step_ratios.safetensors``: output
magnitude ratios and extrapolation errors; a pair: each expert's, joined by step) at the loop's sampling
settings, so what passes here is exactly
what the runtime replays (``report["caching"]["schedule"]``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trt_sora.caching import RATIOS_FILE, CacheSchedule, StepRatios, caching_record, schedule_for
from trt_sora.parity.metrics import compare, frame_metrics, gate_check

__all__ = ["CachingPlan", "caching_level", "plan_caching"]


@dataclasses.dataclass(frozen=True)
class CachingPlan:
    """The recipe's caching setting at the loop's settings: the ratio files it read (``{name: path}``), the
    schedule of each threshold of the curve (the recipe's and ``caching.sweep``'s) and the CFG branches
    each step runs."""

    config: Any
    settings: Any
    files: dict[str, Path]
    schedules: dict[float, CacheSchedule]
    branches: list[tuple[str, ...]]

    @property
    def schedule(self) -> CacheSchedule:
        return self.schedules[self.config.threshold]


def plan_caching(config, settings, timesteps: Sequence[float], calib_dirs: dict[str, Path]) -> CachingPlan:
    """Read the calibrated ratios of each ``{name: calib folder}`` and plan the schedule of every threshold
    (ArtifactError naming the fix when a calibration predates step ratios; ConfigError when it ran another
    step count)."""
    files = {name: Path(d) / RATIOS_FILE for name, d in calib_dirs.items()}
    ratios = StepRatios.joined([StepRatios.load(f) for f in files.values()])
    thresholds = sorted(set(config.sweep) | {config.threshold})
    branches = [tuple(b for b in ("cond", "uncond") if b == "cond" or settings.guidance_at(float(t)) > 1.0)
                for t in timesteps]
    return CachingPlan(config, settings, files, {t: schedule_for(config, ratios, settings, timesteps, t)
                                                 for t in thresholds}, branches)


def caching_level(plan: CachingPlan, run_loop: Callable[[CacheSchedule], Any], ref_latents, ref_frames, decode,
                  gates) -> tuple[dict, dict]:
    """``(comparison, record)``: the cached candidate loop per threshold (``run_loop(schedule) -> final
    latents``), judged against the uncached reference's latents and decoded frames with ``gates.loop``
    and ``gates.frames``; the comparison gates the recipe's threshold, the record (``report["caching"]``)
    holds its schedule, call counts and the curve."""
    curve = [_point(t, s, plan, run_loop, ref_latents, ref_frames, decode, gates) for t, s in plan.schedules.items()]
    chosen = next(p for p in curve if p["threshold"] == plan.config.threshold)
    chosen["chosen"] = True
    computed, total = plan.schedule.calls(plan.branches)
    record = {**caching_record(plan.config, plan.schedule, plan.settings, computed, total),
              "curve": [{k: v for k, v in p.items() if k != "checks"} for p in curve], "passed": chosen["passed"]}
    what = (f"step caching ({plan.config.method.value}, threshold {plan.config.threshold:g}): the candidate's loop "
            f"reusing {total - computed} of {total} branch calls, vs the uncached reference clip")
    return ({"level": "caching", "what": what, "metrics": {k: chosen[k] for k in ("psnr_db", "frames_psnr_db",
                                                                                  "saved_fraction")},
             "checks": chosen["checks"], "passed": chosen["passed"]}, record)


def _point(threshold: float, schedule: CacheSchedule, plan: CachingPlan, run_loop, ref_latents, ref_frames, decode,
           gates) -> dict:
    latents = run_loop(schedule)
    lat = compare(ref_latents, latents)
    fr = frame_metrics(ref_frames, decode(latents))
    checks = gate_check(lat, gates.loop) + [
        {**c, "metric": "frames " + {"psnr_db": "worst_frame_psnr_db"}.get(c["metric"], c["metric"])}
        for c in gate_check({**fr, "psnr_db": fr["worst_psnr_db"]}, gates.frames, ssim_key="worst_ssim")]
    computed, total = schedule.calls(plan.branches)
    return {"threshold": threshold, "chosen": False, "calls": computed, "calls_uncached": total,
            "saved_fraction": round(1.0 - computed / max(total, 1), 6), "reused": schedule.to_dict()["reused"],
            "psnr_db": lat["psnr_db"], "frames_psnr_db": fr["worst_psnr_db"], "frames_worst_ssim": fr["worst_ssim"],
            "checks": checks, "passed": all(c["passed"] for c in checks)}


def render(record: dict) -> list[str]:
    """The report.md section: the setting, its schedule and the curve."""
    s = record["setting"]
    lines = ["", "## Step caching", "",
             f"{s['method']}, threshold {s['threshold']:g}, at most {s['max_skips']} reused steps in a row, first "
             f"{s['warmup_steps']} and last {s['final_steps']} steps computed, branches {s['branches']} may reuse: "
             f"{record['calls']} of {record['calls_uncached']} branch calls ({record['saved_fraction']:.1%} saved); "
             f"reused steps {record['schedule']['reused']}{_cfg_note(record)}. "
             f"{'PASSED' if record['passed'] else 'FAILED'}.", "",
             "| threshold | calls | saved | latents PSNR dB | worst frame PSNR dB | gates |",
             "|---|---|---|---|---|---|"]
    for p in record["curve"]:
        mark = " (chosen)" if p["chosen"] else ""
        lines.append(f"| {p['threshold']:g}{mark} | {p['calls']}/{p['calls_uncached']} | {p['saved_fraction']:.1%} | "
                     f"{p['psnr_db']:.2f} | {p['frames_psnr_db']:.2f} | {'pass' if p['passed'] else 'fail'} |")
    return lines


def _cfg_note(record: dict) -> str:
    """The CFG-reuse part of the report's setting line ('' when it is off)."""
    s, sched = record["setting"], record["schedule"]
    if not s.get("cfg_reuse"):
        return ""
    return (f"; CFG reuse (budget {s['cfg_reuse']:g}, order {s['cfg_order']}): uncond estimated from cond at steps "
            f"{sched.get('cfg_delta', [])}")
