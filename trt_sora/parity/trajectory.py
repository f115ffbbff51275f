"""The trajectory level: the candidate judged on every transformer call of the deployed sampling loop.

One reference trajectory (:func:`trt_sora.sampling.sample` with the reference runner, at the
model's sampling settings) is run once. At every call the candidate gets the *same* inputs
(teacher forcing), so each step's error is its own, not the accumulated drift of earlier steps:

* **per call**: cosine, PSNR (peak: the reference output's max - min) and relative L2 of the
  candidate's output against the reference's, for every step and CFG branch group;
* **per step**: the guided velocity ``v = v_u + g (v_c - v_u)`` of both, and the error the step's
  Euler update writes into the latents, ``(sigma_next - sigma) (v_cand - v_ref)``, as a PSNR
  against the final clip's peak (the reference final latents' max - min): the step's
  *contribution*. At the last steps the update is scaled by a sigma step of ~0.004-0.05, so a
  call far below the per-call gate may still leave the clip untouched;
* **measured contribution**: for a step whose calls miss the per-call gate, the reference loop
  is re-run from that step with the candidate's update there and the reference everywhere else,
  and the final latents are compared: what that step alone does to the clip.

The gate (``parity.trajectory``): every call meets ``min_cosine`` (and ``min_psnr_db`` when set),
or - only when ``min_contribution_db`` is set - its step's measured contribution is at least
``min_contribution_db`` (the step is then reported as exempt, with the measurement).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

__all__ = ["TrajectoryRun", "judge", "measured_contribution", "reference_with_candidate"]


@dataclasses.dataclass
class TrajectoryRun:
    """What one teacher-forced reference trajectory measured.

    Attributes:
        reference: the reference :class:`~trt_sora.sampling.SampleResult` (latents after each step kept).
        calls: one dict per call: step, timestep, sigma, branch, cosine, psnr_db, rel_l2.
        steps: one dict per step: step, timestep, sigma, sigma_next, velocity metrics, contribution_db.
        inputs: ``{step: feeds}`` (numpy) of the first call at each step in ``keep_inputs``.
        peak: the final clip's PSNR peak (reference final latents' max - min).
    """

    reference: Any
    calls: list[dict]
    steps: list[dict]
    inputs: dict[int, dict]
    peak: float


def reference_with_candidate(ref_call, cand_call, noise, cond, uncond, *, scheduler, settings, cfg: str,
                             keep_inputs=()) -> TrajectoryRun:
    """Run the reference trajectory; feed every call's inputs to the candidate too (see module doc).

    ``ref_call`` / ``cand_call``: :data:`trt_sora.sampling.ModelCall` s. ``keep_inputs``: steps whose
    first call's inputs are kept as numpy feeds (the single-call levels' samples).
    """
    from trt_sora.metrics import compare
    from trt_sora.sampling import sample

    current: dict[str, Any] = {}
    calls: list[dict] = []
    pending: dict[str, tuple[Any, Any]] = {}
    per_step: dict[int, dict] = {}
    inputs: dict[int, dict] = {}
    g = settings.guidance_scale

    def hook(call):
        current["call"] = call
        if call.step in keep_inputs and call.step not in inputs:
            inputs[call.step] = {k: v.detach().cpu().numpy().copy() for k, v in call.inputs.items()}

    def guided(i):
        if not settings.uses_cfg:
            return pending["cond"][i]
        return pending["uncond"][i] + g * (pending["cond"][i] - pending["uncond"][i])

    def both(feeds):
        call = current["call"]
        y_r = ref_call(feeds).float()
        y_c = cand_call(feeds).float().to(y_r.device)
        m = compare(y_r, y_c)
        calls.append({"step": call.step, "timestep": call.timestep, "sigma": call.sigma, "branch": call.branch,
                      **{k: m[k] for k in ("cosine", "psnr_db", "rel_l2")}})
        b = y_r.shape[0] // len(call.branches)
        for k, br in enumerate(call.branches):
            pending[br] = (y_r[k * b:(k + 1) * b], y_c[k * b:(k + 1) * b])
        if len(pending) == len(settings.branches):  # the step's velocity is complete
            v_r, v_c = guided(0), guided(1)
            mv = compare(v_r, v_c)
            per_step[call.step] = {"velocity_cosine": mv["cosine"], "velocity_psnr_db": mv["psnr_db"],
                                   "velocity_mse": float((v_c - v_r).double().square().mean())}
            pending.clear()
        return y_r

    res = sample(both, noise, cond, uncond, scheduler=scheduler, settings=settings, cfg=cfg, hook=hook,
                 keep=("latents",))
    peak = float(res.latents.max() - res.latents.min())
    steps = []
    for rec in res.steps:
        v = per_step[rec.step]
        dsig = rec.sigma_next - rec.sigma
        steps.append({"step": rec.step, "timestep": rec.timestep, "sigma": rec.sigma, "sigma_next": rec.sigma_next,
                      "velocity_cosine": v["velocity_cosine"], "velocity_psnr_db": v["velocity_psnr_db"],
                      "contribution_db": _psnr(dsig * dsig * v["velocity_mse"], peak)})
    return TrajectoryRun(reference=res, calls=calls, steps=steps, inputs=inputs, peak=peak)


def _psnr(mse: float, peak: float) -> float:
    if mse == 0:
        return float("inf")
    return 10.0 * math.log10(peak * peak / mse) if peak > 0 else float("-inf")


def measured_contribution(run: TrajectoryRun, ref_call, cand_call, step: int, noise, cond, uncond, *, scheduler,
                          settings, cfg: str) -> float:
    """Final-latent PSNR (peak ``run.peak``) of the reference loop with the candidate at ``step``
    only: resumed from the reference latents entering ``step`` (``noise`` for step 0), the
    candidate's calls there, the reference's after. ``scheduler``: a fresh one (same schedule)."""
    from trt_sora.sampling import sample

    x0 = noise if step == 0 else run.reference.steps[step - 1].latents
    at = {}

    def hook(call):
        at["step"] = call.step

    def mixed(feeds):
        return (cand_call if at["step"] == step else ref_call)(feeds)

    x = sample(mixed, x0, cond, uncond, scheduler=scheduler, settings=settings, cfg=cfg, hook=hook,
               start_step=step).latents
    return _psnr(float((x.double() - run.reference.latents.double()).square().mean()), run.peak)


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
