"""Comparing two transformers along one sampling trajectory (below every stage: the parity
checker's trajectory level and the calibration report's per-step view use it).

One reference trajectory (:func:`trt_sora.sampling.sample` with the reference call) runs once. At
every call the candidate gets the *same* inputs (teacher forcing), so each step's error is its
own, not the accumulated drift of earlier steps:

* **per call**: cosine, PSNR (peak: the reference output's max - min) and relative L2 of the
  candidate's output against the reference's, for every step and CFG branch group;
* **per step**: the guided velocity ``v = v_u + g (v_c - v_u)`` of both, and the error the step's
  Euler update writes into the latents, ``(sigma_next - sigma) (v_cand - v_ref)``, as a PSNR
  against the final clip's peak (the reference final latents' max - min): the step's
  *contribution* (an estimate: it ignores how later steps carry the error);
* :func:`measured_contribution`: the reference loop re-run from one step with the candidate at
  that step only, final latents compared: what that step alone does to the clip.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["TrajectoryRun", "measured_contribution", "reference_with_candidate"]


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


def _pick(call, expert):
    """The call of ``expert`` when ``call`` is a per-expert mapping (two experts), else ``call``."""
    return call[expert] if isinstance(call, Mapping) else call


def reference_with_candidate(ref_call, cand_call, noise, cond, uncond, *, scheduler, settings, cfg: str,
                             keep_inputs=(), count=None, conditioner=None) -> TrajectoryRun:
    """Run the reference trajectory; feed every call's inputs to the candidate too (see module doc).

    ``ref_call`` / ``cand_call``: :data:`trt_sora.sampling.ModelCall` s, or ``{expert: ModelCall}`` for
    a two-expert model (each step judged on the expert serving it). ``keep_inputs``: steps whose
    first call's inputs are kept as numpy feeds (the single-call levels' samples). ``count(call)``:
    called once per model call (progress). ``conditioner``: the family adapter (how latents +
    conditioning become the model's inputs).
    """
    from trt_sora.metrics import compare
    from trt_sora.sampling import sample

    current: dict[str, Any] = {}
    calls: list[dict] = []
    pending: dict[str, tuple[Any, Any]] = {}
    per_step: dict[int, dict] = {}
    inputs: dict[int, dict] = {}

    def hook(call):
        current["call"] = call
        if count is not None:
            count(call)
        if call.step in keep_inputs and call.step not in inputs:
            inputs[call.step] = {k: v.detach().cpu().numpy().copy() for k, v in call.inputs.items()}

    def guided(i, g):
        if g <= 1.0:
            return pending["cond"][i]
        return pending["uncond"][i] + g * (pending["cond"][i] - pending["uncond"][i])

    def both(feeds):
        call = current["call"]
        y_r = _pick(ref_call, call.expert)(feeds).float()
        y_c = _pick(cand_call, call.expert)(feeds).float().to(y_r.device)
        m = compare(y_r, y_c)
        calls.append({"step": call.step, "timestep": call.timestep, "sigma": call.sigma, "branch": call.branch,
                      **({"expert": call.expert} if call.expert else {}),
                      **{k: m[k] for k in ("cosine", "psnr_db", "rel_l2")}})
        b = y_r.shape[0] // len(call.branches)
        for k, br in enumerate(call.branches):
            pending[br] = (y_r[k * b:(k + 1) * b], y_c[k * b:(k + 1) * b])
        g = settings.guidance_at(call.timestep)
        if len(pending) == (2 if g > 1.0 else 1):  # the step's velocity is complete
            v_r, v_c = guided(0, g), guided(1, g)
            mv = compare(v_r, v_c)
            per_step[call.step] = {"velocity_cosine": mv["cosine"], "velocity_psnr_db": mv["psnr_db"],
                                   "velocity_mse": float((v_c - v_r).double().square().mean())}
            pending.clear()
        return y_r

    res = sample(both, noise, cond, uncond, scheduler=scheduler, settings=settings, cfg=cfg, hook=hook,
                 keep=("latents",), conditioner=conditioner)
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
                          settings, cfg: str, conditioner=None) -> float:
    """Final-latent PSNR (peak ``run.peak``) of the reference loop with the candidate at ``step``
    only: resumed from the reference latents entering ``step`` (``noise`` for step 0), the
    candidate's calls there, the reference's after. ``scheduler``: a fresh one (same schedule)."""
    from trt_sora.sampling import sample

    x0 = noise if step == 0 else run.reference.steps[step - 1].latents
    at = {}

    def hook(call):
        at["step"], at["expert"] = call.step, call.expert

    def mixed(feeds):
        return _pick(cand_call if at["step"] == step else ref_call, at["expert"])(feeds)

    x = sample(mixed, x0, cond, uncond, scheduler=scheduler, settings=settings, cfg=cfg, hook=hook,
               start_step=step, conditioner=conditioner).latents
    return _psnr(float((x.double() - run.reference.latents.double()).square().mean()), run.peak)
