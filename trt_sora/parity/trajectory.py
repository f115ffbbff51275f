"""The trajectory level: the candidate judged on every transformer call of the deployed sampling loop.

The measurements come from :mod:`trt_sora.teacher_forcing` (teacher-forced per-call metrics along the
reference trajectory at the model's sampling settings, each step's update contribution, and the
measured contribution of a step). At the last steps the update is scaled by a sigma step of
~0.004-0.05, so a call far below the per-call gate may still leave the clip untouched.

The gate (``parity.trajectory``): every call meets ``min_cosine`` (and ``min_psnr_db`` when set),
or - only when ``min_contribution_db`` is set - its step's measured contribution is at least
``min_contribution_db`` (the step is then reported as exempt, with the measurement).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trt_sora.teacher_forcing import TrajectoryRun

__all__ = ["judge", "plot", "step_table"]


def judge(run: TrajectoryRun, gate, measured: Mapping[int, float]) -> tuple[list[dict], list[dict]]:
    """``(checks, per_step_rows)``: the per-call gate over every call, with steps exempted by a
    measured contribution >= ``gate.min_contribution_db`` (see the module docstring)."""
    def call_ok(c):
        ok = gate.min_cosine is None or c["cosine"] >= gate.min_cosine
        if gate.min_psnr_db is not None:
            ok = ok and c["psnr_db"] >= gate.min_psnr_db
        return ok and not math.isnan(c["cosine"])

    limit = getattr(gate, "min_contribution_db", None)
    rows = []
    for s in run.steps:
        cs = [c for c in run.calls if c["step"] == s["step"]]
        worst = min(cs, key=lambda c: c["cosine"])
        row = {**s, "call_cosine": worst["cosine"], "call_psnr_db": min(c["psnr_db"] for c in cs),
               "calls_pass": all(call_ok(c) for c in cs)}
        if s["step"] in measured:
            row["measured_contribution_db"] = measured[s["step"]]
        row["exempt"] = (not row["calls_pass"] and limit is not None and s["step"] in measured
                         and measured[s["step"]] >= limit)
        rows.append(row)
    gated = [r for r in rows if not r["exempt"]]
    checks = []
    if gate.min_cosine is not None:
        w = min(gated or rows, key=lambda r: r["call_cosine"])
        checks.append({"metric": f"per-call cosine, every call of {len(rows)} steps (worst: step {w['step']}, "
                                 f"t={w['timestep']:.1f})" + (f", {len(rows) - len(gated)} step(s) exempt"
                                                               if len(gated) < len(rows) else ""),
                       "value": w["call_cosine"] if gated else float("nan"), "threshold": gate.min_cosine,
                       "op": ">=", "passed": all(r["calls_pass"] for r in gated) and bool(gated)})
    if gate.min_psnr_db is not None:
        w = min(gated or rows, key=lambda r: r["call_psnr_db"])
        checks.append({"metric": f"per-call PSNR dB, every call (worst: step {w['step']})", "value": w["call_psnr_db"],
                       "threshold": gate.min_psnr_db, "op": ">=", "passed": all(r["calls_pass"] for r in gated)})
    for r in rows:
        if r["exempt"] or (not r["calls_pass"] and "measured_contribution_db" in r and limit is not None):
            checks.append({"metric": f"step {r['step']} (t={r['timestep']:.1f}, sigma step "
                                     f"{r['sigma'] - r['sigma_next']:.4f}): measured contribution to the final "
                                     "latents, dB", "value": r["measured_contribution_db"], "threshold": limit,
                           "op": ">=", "passed": bool(r["measured_contribution_db"] >= limit)})
    return checks, rows


def step_table(trajectory: Mapping[str, Any], loop: Mapping[str, Any] | None) -> list[str]:
    """Markdown rows, one per step: the worst call, the step's update contribution (Euler estimate
    and, where measured, the measurement), the free-running loop's latent PSNR, the verdict."""
    free = {r["step"]: r for r in (loop or {}).get("per_step", [])}
    lines = ["| step | t | sigma step | worst call cosine | worst call PSNR dB | contribution dB (est.) | "
             "contribution dB (measured) | free-running latents PSNR dB | calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in trajectory["per_step"]:
        meas = r.get("measured_contribution_db")
        verdict = "pass" if r["calls_pass"] else ("exempt (contribution)" if r["exempt"] else "**FAIL**")
        lines.append(f"| {r['step']} | {r['timestep']:.1f} | {r['sigma'] - r['sigma_next']:.4f} | "
                     f"{r['call_cosine']:.5f} | {r['call_psnr_db']:.1f} | {r['contribution_db']:.1f} | "
                     f"{'' if meas is None else f'{meas:.1f}'} | "
                     f"{free[r['step']]['psnr_db']:.1f} | {verdict} |" if r["step"] in free else
                     f"| {r['step']} | {r['timestep']:.1f} | {r['sigma'] - r['sigma_next']:.4f} | "
                     f"{r['call_cosine']:.5f} | {r['call_psnr_db']:.1f} | {r['contribution_db']:.1f} | "
                     f"{'' if meas is None else f'{meas:.1f}'} | | {verdict} |")
    return lines


def plot(path, trajectory: Mapping[str, Any], loop: Mapping[str, Any] | None, gate) -> None:
    """``path`` (png): per-step worst-call PSNR and cosine, update contribution, free-running PSNR."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = trajectory["per_step"]
    x = [r["step"] for r in rows]
    fig = Figure(figsize=(9, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    ax.plot(x, [r["call_psnr_db"] for r in rows], "o-", label="worst call PSNR (teacher-forced)")
    ax.plot(x, [r["contribution_db"] for r in rows], "s--", label="step's contribution to the clip (est.)")
    meas = [(r["step"], r["measured_contribution_db"]) for r in rows if "measured_contribution_db" in r]
    if meas:
        ax.plot(*zip(*meas), "k*", ms=10, label="contribution, measured")
    free = (loop or {}).get("per_step", [])
    if free:
        ax.plot([r["step"] for r in free], [r["psnr_db"] for r in free], "^-", label="free-running latents PSNR")
    if getattr(gate, "min_contribution_db", None) is not None:
        ax.axhline(gate.min_contribution_db, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("dB")
    ax.legend(fontsize=7)
    ax2.plot(x, [1 - r["call_cosine"] for r in rows], "o-")
    if gate.min_cosine is not None:
        ax2.axhline(1 - gate.min_cosine, color="red", lw=0.8, ls=":", label=f"gate 1 - {gate.min_cosine:g}")
        ax2.legend(fontsize=7)
    ax2.set_yscale("log")
    ax2.set_xlabel("denoising step")
    ax2.set_ylabel("1 - cosine (worst call)")
    fig.suptitle("Every call of the deployed trajectory")
    fig.tight_layout()
    fig.savefig(str(path))
