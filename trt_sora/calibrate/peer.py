"""A peer on the same work: NVIDIA ModelOpt's FP8 recipe calibrates the same model, and the report compares.

:func:`modelopt_peer` calibrates a copy of the model with ModelOpt's diffusers FP8
recipe (the ``configs/ptq/presets/diffusers/fp8`` preset of ``nvidia-modelopt``:
per-tensor E4M3 weights and inputs, ``max`` calibration, attention quantizers off
as its diffusers example leaves them by default, and the example's exclusions for the
model family, ``adapter.modelopt_exclude``) over exactly our
calibration trajectories (the preset's prompts, steps, CFG and noise), then samples
held-out prompts with the model's **deployment sampling settings** (``adapter.sampling``:
its step count, CFG and shift; ``adapter.negative_conditioning`` for the unconditional branch) with

* the unquantized model (the reference),
* ours as the engine runs it (the recipe's method, weights per output channel),
* ours as the checkpoint stores it (the same activations, weights per tensor),
* ModelOpt's recipe,
* ModelOpt's ``max`` calibration on our sites (our exclusions): calibrator against calibrator,

and compares each final sample with the reference (cosine, PSNR with the peak =
the reference's max - min), plus the calibration time of each. Only the FP8 format
is compared (ModelOpt's recipe is FP8). Needs ``nvidia-modelopt``
(``pip install 'trt_sora[modelopt]'``); :func:`report_section` renders the table.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trt_sora.calibrate.data import prompts_for_preset
from trt_sora.calibrate.fakequant_model import fake_quantized, quantized_sites
from trt_sora.calibrate.trajectories import (
    PEER_SEEDS,
    branch_inputs,
    calibration_sampling,
    chunks,
    heldout_prompts,
    noise,
    trajectory_feeds,
    trajectory_seed,
)
from trt_sora.errors import ConfigError, require
from trt_sora.metrics import compare
from trt_sora.sampling import adapter_call
from trt_sora.sampling import sample as run_sampler

log = logging.getLogger("trt_sora")

__all__ = ["MODELOPT_PRESET", "modelopt_peer", "report_section"]

#: The ModelOpt recipe (a YAML inside nvidia-modelopt's ``modelopt_recipes``).
MODELOPT_PRESET = "configs/ptq/presets/diffusers/fp8"


def _quiet():
    import io
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))  # ModelOpt prints progress
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def _modelopt():
    with _quiet():
        mtq = require("modelopt.torch.quantization", extra="modelopt", pip="pip install 'trt_sora[modelopt]'")
    return mtq


def modelopt_recipe_config() -> dict[str, Any]:
    """ModelOpt's diffusers FP8 preset as a ``mtq.quantize`` config (attention quantizers off)."""
    _modelopt()
    from modelopt.torch.opt.config_loader import load_config
    from modelopt.torch.quantization.config import QuantizeConfig

    cfg = load_config(MODELOPT_PRESET, schema_type=QuantizeConfig).model_dump(exclude_unset=True)
    # the example's default (no --quantize-mha): no FP8 attention, so the softmax quantizer stays off
    cfg["quant_cfg"].append({"quantizer_name": "*softmax_quantizer", "enable": False})
    return cfg


def _our_sites_config(sites: Sequence[str]) -> dict[str, Any]:
    cfg: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    for s in sites:
        for q in ("weight_quantizer", "input_quantizer"):
            cfg.append({"quantizer_name": f"{s}.{q}", "cfg": {"num_bits": (4, 3), "axis": None}})
    return {"quant_cfg": cfg, "algorithm": "max"}


def _quantized(model) -> list[str]:
    """Module paths whose ModelOpt input and weight quantizers are both enabled."""
    out = []
    for name, mod in model.named_modules():
        iq, wq = getattr(mod, "input_quantizer", None), getattr(mod, "weight_quantizer", None)
        if getattr(iq, "is_enabled", False) and getattr(wq, "is_enabled", False):
            out.append(name)
    return out


def modelopt_peer(adapter, model, stats, preset, quant_config, *, encode: Callable, settings=None, model_dtype=None,
                  num_prompts: int = 2, num_steps: int | None = None,
                  progress: Callable[[str, int, int], None] | None = None,
                  weights: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Calibrate with ModelOpt's FP8 recipe and compare it with ours on held-out prompts (module docstring).

    Args:
        adapter, model: the family adapter and the loaded, unquantized transformer (left unchanged;
            ModelOpt quantizes deep copies).
        stats: our :class:`~trt_sora.calibrate.stats.CalibStats` (the recipe's method in ``amax``).
        preset: the calibration preset (ModelOpt's calibration replays its trajectories).
        quant_config: the recipe's ``quantization`` section (our sites).
        encode: the text encoder ``(prompts, text_len) -> [B, L, D]``.
        settings: the calibration's :class:`~trt_sora.sampling.SamplingSettings` (what ModelOpt's
            calibration replays); default :func:`~trt_sora.calibrate.trajectories.calibration_sampling`'s.
        model_dtype: dtype fed to the model (default: fp32).
        num_prompts: held-out prompts sampled (split ``heldout`` of the preset's prompt set).
        num_steps: sampling steps of the comparison; default the model's deployment step count
            (``adapter.sampling.num_steps``).
        progress: ``progress("peer", done, total)``.
        weights: ``{site: W'}`` the calibration's GPTQ-rounded FP8 weights (``weights.safetensors``):
            the engine row uses them (what the Q/DQ graph holds) and a row with nearest rounding is added.

    Returns:
        JSON-safe dict: ``setup`` (prompts, steps, guidance, shift, shape, PSNR peak), ``rows``
        (``{"name", "calibrator", "weights", "sites", "excluded", "calib_seconds", "cosine",
        "psnr_db", "rel_l2", "max_abs"}``), ``modelopt_version``, ``modelopt_excluded``.
    """
    import importlib.metadata

    mtq = _modelopt()
    if getattr(quant_config.format, "value", quant_config.format) != "fp8_e4m3":
        raise ConfigError("the ModelOpt peer comparison is FP8 (ModelOpt's diffusers FP8 recipe); run it with an "
                          "fp8_e4m3 recipe")
    if adapter.modelopt_exclude is None:
        raise ConfigError(f"the ModelOpt peer comparison needs the module filter ModelOpt's diffusers example applies "
                          f"to model family {adapter.family!r}, which declares none (ModelAdapter.modelopt_exclude); "
                          "leave --peer out for this model")
    run = _PeerRun(adapter, model, preset, encode=encode, settings=settings, model_dtype=model_dtype,
                   num_prompts=num_prompts, num_steps=num_steps, progress=progress, extra=weights is not None)
    run.progress("peer", 0, run.total)
    run.reference()
    ours_sites, ours_excl = _our_rows(run, stats, quant_config, weights)
    replay = _modelopt_rows(run, mtq, stats, ours_sites, ours_excl)
    return {
        "setup": run.setup(), "rows": run.rows, "replay_max_rel_diff": replay,
        "modelopt_version": importlib.metadata.version("nvidia-modelopt"),
        "modelopt_recipe": MODELOPT_PRESET, "modelopt_exclude": adapter.modelopt_exclude,
    }


class _PeerRun:
    """The peer comparison's held-out samples (at the deployment settings) against the unquantized
    reference, its replay of our calibration trajectories, and its progress count and rows."""

    def __init__(self, adapter, model, preset, *, encode, settings, model_dtype, num_prompts, num_steps, progress,
                 extra: bool):
        self.adapter, self.model, self.preset, self.encode = adapter, model, preset, encode
        self.progress = progress or (lambda phase, done, total: None)
        self.device = next(model.parameters()).device
        self.model_dtype = model_dtype or torch.float32
        self.calib_settings = settings or calibration_sampling(adapter, preset)[0]
        self.eval_settings = adapter.sampling.override(num_steps=num_steps)  # what users run
        self.shape = preset.shapes[0]
        self.prompts = heldout_prompts(preset, num_prompts)
        # the unconditional branch users sample with: the model's own (not the preset's negative prompt)
        self.feeds = trajectory_feeds(adapter, encode, dataclasses.replace(preset, negative_prompt=None), self.prompts,
                                      self.shape, uses_cfg=self.eval_settings.uses_cfg, device=self.device,
                                      offset=PEER_SEEDS)
        self.calib_plan = [(shape_, chunk) for shape_ in preset.shapes
                           for chunk in chunks(prompts_for_preset(preset), shape_.batch)]
        per_sample = len(self.feeds) * self.eval_settings.num_steps * len(self.eval_settings.branches)
        per_calib = len(self.calib_plan) * self.calib_settings.num_steps * len(self.calib_settings.branches)
        self.total, self.done = (5 + extra) * per_sample + 2 * per_calib, 0
        self.rows: list[dict[str, Any]] = []

    def tick(self, *_):
        self.done += 1
        self.progress("peer", self.done, self.total)
        return contextlib.nullcontext()

    def sample(self, net, ctx=contextlib.nullcontext):
        """The final samples of the held-out prompts with ``net`` (inside ``ctx()``), on the CPU."""
        adapter, settings = self.adapter, self.eval_settings
        outs = []
        for x, cond, uncond, _ in self.feeds:
            with ctx():
                outs.append(run_sampler(adapter_call(adapter, net), x, cond, uncond,
                                        scheduler=adapter.scheduler(settings.shift), settings=settings,
                                        cfg="split", dtype=self.model_dtype, hook=self.tick, conditioner=adapter,
                                        label="peer comparison, held-out prompts").latents)
        return torch.cat(outs).cpu()

    def calibration_loop(self, net):
        """Our calibration trajectories, replayed with ``net`` (same prompts, noise, steps, CFG)."""
        adapter, preset, settings = self.adapter, self.preset, self.calib_settings
        for k, (shape_, chunk) in enumerate(self.calib_plan):
            seed = trajectory_seed(preset, k)
            cond, uncond = branch_inputs(adapter, self.encode, preset, [p.prompt for p in chunk], shape_,
                                         uses_cfg=settings.uses_cfg, seed=seed, device=self.device)
            run_sampler(adapter_call(adapter, net), noise(adapter, shape_, seed, self.device), cond, uncond,
                        scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="split",
                        dtype=self.model_dtype, hook=self.tick, label="ModelOpt calibration", conditioner=adapter)

    def reference(self) -> None:
        """The unquantized model's samples, and the PSNR peak (their max - min)."""
        self.ref = self.sample(self.model)
        self.peak = float(self.ref.max() - self.ref.min())

    def add(self, name, calibrator, weights, got, sites, excluded, seconds) -> None:
        """A row: ``got`` against the reference."""
        m = compare(self.ref, got, peak=self.peak)
        self.rows.append({"name": name, "calibrator": calibrator, "weights": weights, "sites": len(sites),
                          "excluded": excluded, "calib_seconds": round(seconds, 2),
                          **{k: float(m[k]) for k in ("cosine", "psnr_db", "rel_l2", "max_abs")}})
        log.info("peer %s: cosine %.6f, PSNR %.2f dB", name, m["cosine"], m["psnr_db"])

    def setup(self) -> dict[str, Any]:
        s = self.eval_settings
        return {"prompt_ids": [p.id for p in self.prompts], "num_steps": s.num_steps,
                "deployment_steps": self.adapter.sampling.num_steps,
                "guidance_scale": s.guidance_scale, "shift": s.shift, "shape": self.shape.as_dict(),
                "psnr_peak": self.peak, "psnr_peak_def": "reference final sample max - min",
                "calib_preset": self.preset.name, "calib_trajectories": len(self.calib_plan),
                "calib_steps": self.calib_settings.num_steps}


def _our_rows(run: _PeerRun, stats, quant_config, weights) -> tuple[list[str], list[str]]:
    """Our calibration as the engine runs it (and with nearest rounding when ``weights`` are GPTQ-rounded)
    and as the checkpoint stores it; ``(our sites, the linears we leave out)``."""
    model = run.model
    ours_sites = [s for s in quantized_sites(model, quant_config, run.adapter.quant_excludes) if s in stats.amax]
    act = {s: stats.amax[s] for s in ours_sites}
    w_pc = {s: stats.amax[f"{s}.weight"] for s in ours_sites if f"{s}.weight" in stats.amax}
    w_pt = {s: a.max().expand_as(a) for s, a in w_pc.items()}
    ours_time = float(stats.metadata.extra.get("collect_seconds", float("nan")))
    method = stats.metadata.method
    ours_excl = [s for s in (n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear))
                 if s not in ours_sites]
    run.add("trt_sora (engine)", method, "per channel" + (", GPTQ-rounded" if weights is not None else ""),
            run.sample(model, lambda: fake_quantized(model, act, "fp8_e4m3", sites=ours_sites, weight_amax=w_pc,
                                                     weights=weights)),
            ours_sites, ours_excl, ours_time)
    if weights is not None:
        run.add("trt_sora (engine, nearest rounding)", method, "per channel",
                run.sample(model, lambda: fake_quantized(model, act, "fp8_e4m3", sites=ours_sites, weight_amax=w_pc)),
                ours_sites, ours_excl, ours_time)
    run.add("trt_sora (checkpoint)", method, "per tensor",
            run.sample(model, lambda: fake_quantized(model, act, "fp8_e4m3", sites=ours_sites, weight_amax=w_pt)),
            ours_sites, ours_excl, ours_time)
    return ours_sites, ours_excl


def _modelopt_rows(run: _PeerRun, mtq, stats, ours_sites: Sequence[str], ours_excl: list[str]) -> float | None:
    """ModelOpt's FP8 recipe (its diffusers example: quantize + calibrate, then the family's filter) and
    its max calibrator on our sites, both over our calibration trajectories; the replay check."""
    recipe_net = copy.deepcopy(run.model)
    rx = re.compile(run.adapter.modelopt_exclude)
    t0 = time.perf_counter()
    with _quiet():
        mtq.quantize(recipe_net, modelopt_recipe_config(), forward_loop=run.calibration_loop)
        mtq.disable_quantizer(recipe_net, lambda name: rx.match(name) is not None)
    t_recipe = time.perf_counter() - t0
    mo_sites = _quantized(recipe_net)
    mo_excl = [n for n, mod in recipe_net.named_modules() if isinstance(mod, torch.nn.Linear) and n not in mo_sites]
    run.add("ModelOpt FP8 recipe", "max", "per tensor", run.sample(recipe_net), mo_sites, mo_excl, t_recipe)
    del recipe_net

    sites_net = copy.deepcopy(run.model)
    t0 = time.perf_counter()
    with _quiet():
        mtq.quantize(sites_net, _our_sites_config(ours_sites), forward_loop=run.calibration_loop)
    t_sites = time.perf_counter() - t0
    replay = _replay_check(sites_net, stats, ours_sites)
    run.add("ModelOpt max on our sites", "max", "per tensor", run.sample(sites_net), _quantized(sites_net), ours_excl,
            t_sites)
    del sites_net
    return replay


def _replay_check(net, stats, sites: Sequence[str]) -> float | None:
    """Largest relative difference between ModelOpt's max-calibrated input amax and our ``minmax`` amax over the
    same sites: ~0 proves ModelOpt saw exactly our calibration activations (None without minmax stats)."""
    worst = 0.0
    for s in sites:
        ours = stats.amax[s] if stats.metadata.method == "minmax" else stats.method_amax.get(s, {}).get("minmax")
        if ours is None:
            return None
        theirs = float(net.get_submodule(s).input_quantizer.amax.float().max())
        worst = max(worst, abs(theirs - float(ours.max())) / max(float(ours.max()), 1e-30))
    return worst


def report_section(peer: Mapping[str, Any]) -> list[str]:
    """Markdown lines of the peer comparison (a ``## Peer: NVIDIA ModelOpt`` section)."""
    s = peer["setup"]
    lines = ["## Peer: NVIDIA ModelOpt FP8", "",
             f"ModelOpt {peer['modelopt_version']}'s diffusers FP8 recipe (`{peer['modelopt_recipe']}`, max "
             f"calibration, attention unquantized, exclusions `{peer['modelopt_exclude']}`) calibrated over our "
             f"calibration trajectories ({s['calib_trajectories']} x {s['calib_steps']} steps of preset "
             f"`{s['calib_preset']}`), against ours. Final sample of a **{s['num_steps']}-step** trajectory ("
             + ("the model's deployment step count" if s["num_steps"] == s.get("deployment_steps") else
                f"SHORTER than the model's {s.get('deployment_steps')} deployment steps")
             + f"; guidance {s['guidance_scale']}, shift {s['shift']}) at {s['shape']} on held-out "
             f"prompts {', '.join(s['prompt_ids'])}, each against the unquantized model; "
             f"**PSNR peak = {s['psnr_peak']:.4g}** ({s['psnr_peak_def']}). Calibration time: ours collects four "
             "observers and per-step statistics in one pass; ModelOpt's is its max calibrator.", "",
             *([f"Replay check: ModelOpt's max calibration on our sites found our minmax amax to a relative "
                f"{peer['replay_max_rel_diff']:.1e} (the same activations).", ""]
               if peer.get("replay_max_rel_diff") is not None else []),
             "| calibration | calibrator | weights | quantized linears | cosine | PSNR (dB) | rel L2 "
             "| calib time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in peer["rows"]:
        lines.append(f"| {r['name']} | {r['calibrator']} | {r['weights']} | {r['sites']} | {r['cosine']:.6f} | "
                     f"{r['psnr_db']:.2f} | {r['rel_l2']:.4g} | {r['calib_seconds']:.1f} |")
    return lines + [""]
