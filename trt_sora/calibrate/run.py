"""The calibration stage: real denoising trajectories -> per-site amax -> ``stats.safetensors`` + report.

:func:`calibrate` is the stage function (``trt-sora calibrate``, ``make engine``)::

    res = calibrate(get_adapter("wan-tiny"), CalibConfig(method="percentile"), "build/.../calib",
                    preset="tiny", quant_format="fp8_e4m3")
    res.stats.amax["blocks.0.attn1.to_q"]      # fp32 []: input amax of that linear
    res.stats_path, res.report_path, res.manifest

What it runs, for every shape of the preset and every chunk of ``shape.batch``
prompts (prompt set split ``preset.split``, ``preset.num_prompts`` of them,
chosen by ``preset.seed``): one trajectory of :func:`trt_sora.sampling.sample` at the
model's own sampling settings (``adapter.sampling``: the steps, CFG and shift users
run; see :func:`~trt_sora.calibrate.trajectories.calibration_sampling` for the explicit overrides), from seeded
Gaussian noise; the cond and uncond branches run as separate forwards
(``cfg="split"``) so each batch is labelled with its branch. Every ``nn.Linear``
input and every attention q/k/v (through the processor's observer seam) feeds all
four observers (minmax, ema, percentile, mse) at once, plus a per-step x
per-branch abs-max grid (:mod:`trt_sora.calibrate.hooks`). The chosen method's
amax becomes ``<site>.amax``; the others are kept as ``<site>.amax_<method>`` so
the report compares methods from this one pass. Weights get a per-output-channel
amax (``<linear>.weight.amax``, ``max |W|`` per row).

Memory: activations are reduced on their device inside the hooks and never
stored; the observers hold at most a 2048-bin histogram per site. Peak memory is
the model plus one forward's activations: a 14B Wan in bf16 (28 GB) calibrates on
one 80 GB GPU (``adapter.load("bf16", "cuda")``, pass it as ``model=``); if weights
plus activations do not fit, :func:`trt_sora.calibrate.hooks.offload_blocks` keeps
the blocks on the host and moves one at a time.

GPTQ weight rounding (``calibration.weight_rounding``) adds fp64 input Hessians, at most
``calibration.gptq_max_hessian_gb`` at a time: when they do not all fit, the trajectories run once
more per further group of linears, with only that group's Hessian hooks (:mod:`trt_sora.calibrate.gptq`).

Deterministic for a seed: prompts, noise (drawn on the CPU, then moved) and the
trajectory order are fixed, and the observers are order-stable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trt_sora.caching import RATIOS_FILE, MagnitudeRecorder, StepRatios
from trt_sora.calibrate.data import CalibPreset, load_preset, prompts_for_preset
from trt_sora.calibrate.shards import shard_range
from trt_sora.calibrate.trajectories import (
    branch_inputs,
    calibration_sampling,
    chunks,
    compute_dtype,
    noise,
    trajectory_seed,
)
from trt_sora.config.recipe import CalibConfig, CalibMethod, QuantConfig, QuantFormat
from trt_sora.errors import CalibrationError, ConfigError
from trt_sora.models.base import DTYPES
from trt_sora.runfolder import CALIB_REPORT, CALIB_STATS
from trt_sora.sparse import MASS_FILE, AttentionMass, MassRecorder, render_mass

log = logging.getLogger("trt_sora")

__all__ = ["ALL_METHODS", "CalibResult", "ReportOptions", "calibrate", "calibrate_experts", "observer_kwargs",
           "Progress"]

#: Every method collected in one pass (the chosen one first).
ALL_METHODS = tuple(m.value for m in CalibMethod)

#: ``progress(phase, done, total)``: phases ``"calibrate"`` (forwards), ``"evaluate"`` (forwards).
Progress = Callable[[str, int, int], None]


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """What the report's PyTorch evaluation runs (held-out prompts, fake-quantized model).

    Attributes:
        eval_prompts: held-out prompts (split ``heldout`` of the preset's prompt set).
        eval_steps: denoising steps of each evaluation trajectory; ``None`` = the preset's.
        formats: formats of the comparison table's columns.
        sensitivity: layer groups quantized one at a time: ``"kind"`` (attn1.qkv, ffn.up, ...
            over all blocks), ``"block"`` (blocks.N), ``"both"`` or ``"none"``.
        max_skip: at most this many groups in the suggested skip list.
        top_k: layers shown in the drift / outlier / CFG figures and tables.
        cache_weights: keep fake-quantized weight copies during evaluation runs (faster, one extra
            copy of the quantized weights); ``None`` = only when they total under 1 GiB.
        peer: ``"modelopt"`` adds the peer comparison (:mod:`trt_sora.calibrate.peer`: ModelOpt's FP8
            recipe calibrated on the same trajectories, sampled at the model's default step count);
            ``None`` = off.
        peer_prompts, peer_steps: held-out prompts and steps of the peer comparison (``None`` steps =
            the model's default).
        target_psnr_db: final-latent PSNR the quality-vs-speed recommendation aims for; ``None`` =
            35 dB for FP8, 30 dB for INT8 (against the unquantized model).
    """

    eval_prompts: int = 2
    eval_steps: int | None = None
    formats: tuple[str, ...] = ("fp8_e4m3", "int8")
    sensitivity: str = "both"
    max_skip: int = 3
    top_k: int = 6
    cache_weights: bool | None = None
    peer: str | None = None
    peer_prompts: int = 2
    peer_steps: int | None = None
    target_psnr_db: float | None = None

    def __post_init__(self) -> None:
        if self.peer not in (None, "modelopt"):
            raise ConfigError(f"ReportOptions.peer={self.peer!r}; use 'modelopt' or None")
        if self.sensitivity not in ("kind", "block", "both", "none"):
            raise ConfigError(f"ReportOptions.sensitivity={self.sensitivity!r}; use kind, block, both or none")
        if self.eval_prompts < 1:
            raise ConfigError(f"ReportOptions.eval_prompts={self.eval_prompts} must be >= 1")


@dataclasses.dataclass
class CalibResult:
    """What :func:`calibrate` produced.

    Attributes:
        stats: the :class:`~trt_sora.calibrate.stats.CalibStats` written.
        stats_path: ``out_dir/stats.safetensors``.
        report_path: ``out_dir/report.md``, or ``None`` when ``report=False``.
        manifest: the ``manifest.json`` content.
        evaluation: the report's numbers (calibrator comparison, sensitivity, skip list), or None.
    """

    stats: Any
    stats_path: Path
    report_path: Path | None
    manifest: dict
    evaluation: dict | None = None


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """What one calibration pass runs with: the same for every side (a pair's experts share it).

    Attributes:
        config, quant_config, report_options: the recipe's sections and the report's options.
        preset, prompts: the calibration preset and the prompts it selected.
        settings, sampling_note: the trajectories' sampling settings and where they come from.
        method, methods: the recipe's method, then every method collected (the chosen one first).
        qfmt: the engine's format; cfg: ``"split"`` or ``"batched"``.
        shard: ``(i, n)`` of a shard run, else None; pair: the pair's adapter, else None.
        text_encoder, encode: the text source named, and the encoder ``(prompts, text_len) -> [B, L, D]``.
        model_dtype, device: the dtype the model computes in and where it runs.
        progress: ``progress(phase, done, total)``; report: write the report (and its evaluation).
        t_start: ``time.perf_counter()`` when the pass began.
        sparse: the recipe's ``sparse_attention`` when its windows are calibrated, else None.
    """

    config: CalibConfig
    quant_config: QuantConfig | None
    report_options: ReportOptions | None
    preset: CalibPreset
    prompts: list
    settings: Any
    sampling_note: str
    method: str
    methods: tuple[str, ...]
    qfmt: QuantFormat
    cfg: str
    shard: tuple[int, int] | None
    pair: Any
    text_encoder: str | None
    encode: Callable
    model_dtype: Any
    device: Any
    progress: Progress
    report: bool
    t_start: float
    sparse: Any = None


@dataclasses.dataclass(frozen=True)
class CalibratedSide:
    """One side's results, ready to write (a pair has one per expert).

    Attributes:
        adapter, model, out_dir: the side's adapter, loaded transformer and calibration folder.
        stats: its :class:`~trt_sora.calibrate.stats.CalibStats`.
        rounded: ``{site: W'}`` GPTQ-rounded weights, or None.
        ratios: step caching's :class:`~trt_sora.caching.StepRatios`, or None.
        rounding: ``(HessianPlan or None, note, record)`` of :func:`_gptq_plan` and :func:`_gptq_passes`.
        forwards: transformer calls observed; served: ``{step: timestep}`` the side served.
        from_shards: the shard folders merged, or None.
    """

    adapter: Any
    model: Any
    out_dir: Any
    stats: Any
    rounded: dict | None
    ratios: StepRatios | None
    rounding: tuple
    forwards: int
    served: Mapping[int, float]
    from_shards: Sequence[str | Path] | None
    mass: AttentionMass | None = None


def _method(value) -> str:
    key = getattr(value, "value", value)
    if key not in ALL_METHODS:
        from trt_sora.config.base import did_you_mean

        raise ConfigError(f"unknown calibration method {key!r}{did_you_mean(str(key), ALL_METHODS)}; "
                          f"choose one of {', '.join(ALL_METHODS)} (recipe calibration.method or --method)")
    return key


def observer_kwargs(config: CalibConfig, quant_format: QuantFormat | str) -> dict[str, dict[str, Any]]:
    """Observer constructor arguments from the recipe's ``calibration`` section."""
    fmt = getattr(quant_format, "value", quant_format)
    return {
        "ema": {"averaging_constant": float(config.ema_constant)},
        "percentile": {"percentile": float(config.percentile), "num_bins": int(config.num_bins)},
        "mse": {"fmt": fmt if fmt in ("fp8_e4m3", "int8") else "fp8_e4m3", "num_bins": int(config.num_bins)},
    }


def _negative_label(adapter, preset: CalibPreset) -> str:
    if preset.negative_prompt is not None:
        return preset.negative_prompt
    neg = adapter.spec.defaults.get("negative_prompt", "")
    return "(zero embedding: the model's unconditional)" if neg is None else neg


_DTYPE_NAMES = {torch_name: name for name, torch_name in DTYPES.items()}  # "bfloat16" -> "bf16"


def _probe(adapter, model, preset: CalibPreset):
    """One forward of ``model`` at the smallest latent size of the preset's first shape (batch 1, one
    patch per latent axis): what :func:`~trt_sora.calibrate.gptq.shared_inputs` watches."""
    pt, ph, pw = adapter.patch_size
    point = adapter.with_family_dims({**preset.shapes[0].as_dict(), "batch": 1, "latent_frames": pt,
                                      "latent_height": ph, "latent_width": pw}, "min")
    first = next(model.parameters())
    dtype = _DTYPE_NAMES.get(str(compute_dtype(model)).replace("torch.", ""), "fp32")
    return lambda: adapter.forward(model, adapter.example_inputs(point, dtype=dtype, device=str(first.device)))


def _gptq_plan(adapter, model, preset: CalibPreset, config: CalibConfig, qfmt: QuantFormat,
               quant_config: QuantConfig | None, max_gb: float):
    """``(plan, note)``: the :class:`~trt_sora.calibrate.gptq.HessianPlan` of the linears GPTQ rounds - the
    ones the quantize stage quantizes (the recipe's and the family's exclusions applied), linears
    reading one input sharing its Hessian, split into passes that fit ``max_gb`` GiB - or ``None``
    (nearest rounding, an unquantized recipe, or ``auto`` where one Hessian alone exceeds the budget);
    ``note`` says which and why."""
    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.calibrate.gptq import plan_hessians, shared_inputs

    if config.weight_rounding == "nearest" or qfmt is QuantFormat.NONE:
        return None, "nearest"
    sites = quantized_sites(model, quant_config or QuantConfig(format=qfmt), adapter.quant_excludes)
    if not sites:
        return None, "nearest (no quantized linear)"
    leader = shared_inputs(model, sites, _probe(adapter, model, preset))
    try:
        plan = plan_hessians(model, leader, max_gb)
    except ConfigError as exc:
        if config.weight_rounding == "gptq":
            raise
        log.warning("calibration.weight_rounding: auto rounds to nearest: %s", exc)
        return None, f"nearest (auto: {exc})"
    d = plan.describe()
    gib = d["hessian_bytes"] / 2 ** 30
    why = ("all fit at once" if plan.passes == 1 else
           f"they need {gib:.3g} GiB, over calibration.gptq_max_hessian_gb: {max_gb:g}")
    note = (f"gptq: {len(leader)} linears, {d['hessians']} input Hessians ({d['shared_inputs']} linears share "
            f"another's input: {gib:.3g} instead of {d['unshared_hessian_bytes'] / 2 ** 30:.3g} GiB), {plan.passes} "
            f"pass{'es' if plan.passes > 1 else ''} over the calibration trajectories ({why})")
    log.info("calibration weight rounding: %s", note)
    return plan, note


def _round_weights(modules, stats, hessians, tokens, sites, leader, fmt: str, config: CalibConfig) -> dict:
    """``{site: W'}``: each site's weight GPTQ-rounded onto its ``<site>.weight`` per-row grid
    (``hessians``/``tokens`` keyed by the Hessian leaders, ``leader``: ``{site: leader}``)."""
    from trt_sora.calibrate.gptq import gptq_round

    return {s: gptq_round(modules[s].weight, hessians[leader[s]], stats.amax[f"{s}.weight"], fmt,
                          damp=config.gptq_damp).cpu()
            for s in sites if tokens[leader[s]] and f"{s}.weight" in stats.amax}


def _resolve_preset(adapter, config: CalibConfig, preset) -> CalibPreset:
    if isinstance(preset, CalibPreset):
        return preset
    return load_preset(preset or config.preset)


def _collect(run: CalibrationRun, sides, models, lead, plan, todo: range, *, timesteps: dict, forwards: dict,
             total: int, hessians: Mapping[Any, Any] | None = None, phase: str = "calibrate",
             recorder=None, mass: MassRecorder | None = None) -> dict | None:
    """Run the trajectories ``plan[k] for k in todo`` with the observers installed on every model
    (``sides``: ``{None: adapter}``, or ``{expert: adapter}`` for a pair switched at its boundary, each
    observing exactly the steps it serves); ``{side: {site: SiteStats}}``. ``hessians``: ``{side:
    HessianHooks}`` (:mod:`trt_sora.calibrate.gptq`) open over the same forwards (GPTQ). ``recorder``: the
    sampler's step cache recording the transformer output's magnitude ratios (step caching); ``mass``: the
    recorder of the attention mass outside sparse attention's candidate windows (one transformer). Another
    ``phase`` (``"gptq pass 2/3"``): a later GPTQ pass - the same trajectories (prompts, seeds, steps)
    with only the Hessian hooks; returns None."""
    from trt_sora.calibrate.hooks import CollectionHooks
    from trt_sora.sampling import CallInfo, adapter_call, expert_calls, sample

    preset, settings, progress = run.preset, run.settings, run.progress
    model_device = next(models[next(iter(sides))].parameters()).device
    observe = phase == "calibrate"
    done = 0
    progress(phase, 0, total)
    with contextlib.ExitStack() as stack:
        okw = observer_kwargs(run.config, run.qfmt)
        hooks = {k: stack.enter_context(CollectionHooks(m, methods=run.methods, branches=settings.branches,
                                                        observer_kwargs=okw)) for k, m in models.items()} \
            if observe else {}
        for h in (hessians or {}).values():
            stack.enter_context(h)

        def on_call(call: CallInfo):
            nonlocal done
            done += 1
            progress(phase, done, total)
            if not observe:
                return None
            timesteps[call.expert].setdefault(call.step, call.timestep)
            forwards[call.expert] += 1
            at = hooks[call.expert].at(step=call.step, branch=call.branch)
            if mass is None:
                return at
            both = contextlib.ExitStack()
            both.enter_context(at)
            both.enter_context(mass.at(mass_sites, lead.token_grid(call.inputs[lead.input_names[0]].shape),
                                       call.step))
            return both

        call = expert_calls(settings, lambda e: adapter_call(sides[e], models[e]))
        mass_sites = lead.sparse_attention_sites(models[None]) if mass is not None else {}
        for k in todo:  # k: the trajectory's index in the whole plan (it seeds the noise), shards included
            _, shape, chunk = plan[k]
            seed = trajectory_seed(preset, k)
            cond, uncond = branch_inputs(lead, run.encode, preset, [p.prompt for p in chunk], shape,
                                         uses_cfg=settings.uses_cfg, seed=seed, device=model_device)
            x = noise(lead, shape, seed, model_device)
            label = f"shape {shape.as_dict()}, prompts {[p.id for p in chunk]}"
            sample(call, x, cond, uncond, scheduler=lead.scheduler(settings.shift), settings=settings,
                   cfg=run.cfg if settings.uses_cfg else "split", dtype=run.model_dtype, hook=on_call, label=label,
                   conditioner=lead, cache=recorder if observe else None)
        if not observe:
            return None
        sites = {k: h.used_sites() for k, h in hooks.items()}
    for k, found in sites.items():
        if not found:
            raise CalibrationError(
                f"no calibration site of {sides[k].name}{f' (expert {k})' if k else ''} saw data: " +
                ("the trajectories never reach its steps - check the boundary and the step count" if k else
                 "the model has no nn.Linear reached by its forward; check the adapter's forward"))
    return sites


def _reduce(model, sites: Mapping[str, Any], meta):
    """``CalibStats`` of the sites, plus every linear's per-output-channel weight amax ``max |W|``. A site
    that saw only zeros (e.g. an image projection fed zeros in text-to-video) has no scale to measure:
    it gets no statistics (the quantize stage names it unless it is excluded) and a warning."""
    import torch

    from trt_sora.calibrate.stats import CalibStats

    modules = dict(model.named_modules())
    meta.extra["weight_sites"] = []
    meta.extra["attention_sites"] = [n for n in sites if not isinstance(modules.get(n), torch.nn.Linear)]
    stats = CalibStats.from_sites(sites, meta)
    zeros = [k for k, a in stats.amax.items() if not bool((a > 0).all())]
    if zeros:
        log.warning("calibration: %d site(s) saw only zeros and get no statistics: %s", len(zeros),
                    ", ".join(zeros[:8]) + (" ..." if len(zeros) > 8 else ""))
        for store in (stats.amax, stats.method_amax, stats.amax_per_step, stats.count_per_step, stats.histograms):
            for k in zeros:
                store.pop(k, None)
        sites = {k: v for k, v in sites.items() if k not in zeros}
        meta.extra["zero_sites"] = zeros
    for name in list(sites):
        mod = modules.get(name)
        if isinstance(mod, torch.nn.Linear):
            with torch.no_grad():
                wa = mod.weight.detach().float().abs().amax(dim=1).cpu()
            # an all-zero output row quantizes to zero at any scale; 1.0 keeps the file valid (amax > 0)
            stats.amax[f"{name}.weight"] = torch.where(wa > 0, wa, torch.ones_like(wa))
            meta.extra["weight_sites"].append(f"{name}.weight")
    return stats


def _merged(folders: Sequence[str | Path], adapter, preset: CalibPreset, settings, method: str, config: CalibConfig):
    """The exact merge of shard folders (:mod:`trt_sora.calibrate.shards`), checked against this run
    (model, preset, sampling and the observer settings the merged amax is computed with)."""
    from trt_sora.calibrate.shards import merge_stats
    from trt_sora.calibrate.stats import CalibStats

    stats = merge_stats([CalibStats.load(Path(f) / CALIB_STATS, validate=False) for f in folders])
    m = stats.metadata
    want = {"model_hash": adapter.spec.model_hash(), "preset": preset.name, "method": method,
            "num_steps": settings.num_steps, "guidance_scale": settings.guidance_scale, "shift": settings.shift}
    bad = {k: (getattr(m, k), v) for k, v in want.items() if getattr(m, k) != v}
    for obs, key, name in (("percentile", "num_bins", "num_bins"), ("percentile", "percentile", "percentile"),
                           ("ema", "averaging_constant", "ema_constant")):
        got = ((m.observers or {}).get(obs) or {}).get(key)
        if got is not None and float(got) != float(getattr(config, name)):
            bad[f"calibration.{name}"] = (got, getattr(config, name))
    if bad:
        k, (got, exp) = next(iter(bad.items()))
        raise CalibrationError(f"the shards were calibrated with {k}={got!r}, this run asks for {exp!r}; merge them "
                               "with the recipe, preset and model they were run with (or rerun the shards)")
    return stats


def calibrate(adapter, config: CalibConfig, out_dir, *, model=None, preset: CalibPreset | str | None = None,
              quant_format: QuantFormat = QuantFormat.FP8_E4M3, text_encoder: str | None = None,
              device="cpu", progress: Progress | None = None, report: bool = True,
              quant_config: QuantConfig | None = None, report_options: ReportOptions | None = None,
              dtype: str | None = None, cfg: str = "split", shard: tuple[int, int] | None = None,
              from_shards: Sequence[str | Path] | None = None, sparse=None) -> CalibResult:
    """Calibrate ``adapter``'s model over real denoising trajectories; write stats, report, manifest.

    Args:
        adapter: a :class:`~trt_sora.models.base.ModelAdapter`.
        config: the recipe's ``calibration`` section (``method`` picks ``<site>.amax``).
        out_dir: the artifact folder, written atomically: ``stats.safetensors``, ``report.md``,
            ``figures/*.png``, ``manifest.json``.
        model: the loaded transformer (default: ``adapter.load(dtype or "fp32", device)``).
        preset: a :class:`CalibPreset`, a preset name/path, or None for ``config.preset``.
        quant_format: the format the engine will use (MSE observer target, sensitivity format).
        text_encoder: text source for :meth:`adapter.text_encoder` (``"hash"``, an embedding
            ``.safetensors``, a pipeline folder); None = the model's default.
        device: where the forwards run (``"cpu"``, ``"cuda"``); a given ``model`` stays where it is.
        progress: ``progress(phase, done, total)`` callback (the CLI draws a bar with it).
        report: also run the PyTorch evaluation and write ``report.md`` + figures.
        quant_config: the recipe's ``quantization`` section, so the report quantizes exactly the
            sites the quantize stage will (default ``QuantConfig(format=quant_format)``).
        report_options: see :class:`ReportOptions`.
        dtype: load dtype when ``model`` is None (``"fp32"``, ``"bf16"``, ``"fp16"``).
        cfg: ``"split"`` (one forward per CFG branch) or ``"batched"`` (both branches in one forward
            at twice the batch: half the forwards and observer calls; per-branch drift is still kept).
            The EMA observer sees one batch per step instead of two, so its amax differs.
        shard: ``(i, n)``: run only slice ``i`` of ``n`` of the trajectories and write a shard
            artifact (observer states, no report); see :mod:`trt_sora.calibrate.shards`.
        from_shards: shard folders of one calibration: merge them (exactly) instead of running
            trajectories, then write the stats, report and manifest like a one-pass run.
        sparse: the recipe's ``sparse_attention``: when it is on without a fixed window, the attention
            mass outside each candidate window is measured per layer and step over the same trajectories
            (``attention_mass.safetensors``; not in sharded runs).

    Returns:
        :class:`CalibResult`.

    Raises:
        ConfigError: unknown method (with a hint), bad preset.
        CalibrationError: missing or empty prompt set, NaN/inf activations (naming site, step,
            branch), a forward that changes the sample shape, a site that only saw zeros.
    """
    if adapter.experts:
        raise ConfigError(f"model {adapter.name} is a pair of experts {list(adapter.experts)}; calibrate both over "
                          "the same trajectories with calibrate_experts(adapter, config, {expert: out_dir})")
    return _calibrate({None: adapter}, config, {None: out_dir}, models={None: model}, preset=preset,
                      quant_format=quant_format, text_encoder=text_encoder, device=device, progress=progress,
                      report=report, quant_config=quant_config, report_options=report_options, dtype=dtype,
                      cfg=cfg, shard=shard, from_shards={None: list(from_shards)} if from_shards else None,
                      sparse=sparse)[None]


def calibrate_experts(adapter, config: CalibConfig, out_dirs: Mapping[str, Any], *,
                      models: Mapping[str, Any] | None = None, preset: CalibPreset | str | None = None,
                      quant_format: QuantFormat = QuantFormat.FP8_E4M3, text_encoder: str | None = None,
                      device="cpu", progress: Progress | None = None, report: bool = True,
                      quant_config: QuantConfig | None = None, report_options: ReportOptions | None = None,
                      dtype: str | None = None, cfg: str = "split", shard: tuple[int, int] | None = None,
                      from_shards: Mapping[str, Sequence[str | Path]] | None = None) -> dict[str, CalibResult]:
    """Calibrate both experts of a boundary-switched pair (Wan 2.2 A14B) over the *same* trajectories:
    each trajectory switches at the model's boundary as users sample it, and each expert's observers
    see exactly the steps that expert serves. Writes one calibration folder per expert
    (``out_dirs[expert]``, as :func:`calibrate`), each recording the steps it served; its report holds
    the statistics (drift, outliers) - a pair's PyTorch evaluation is the parity check's per-expert
    levels.

    Shards (as :func:`calibrate`): ``shard=(i, n)`` runs slice ``i`` of the shared trajectories - every
    trajectory of the slice still switches at the boundary, so each expert's shard folder holds its
    observers over the steps it serves of those trajectories; ``from_shards={expert: [shard folders]}``
    merges each expert's shards exactly (the one-pass statistics bit for bit).

    ``models``: ``{expert: loaded transformer}`` (default: each expert loaded); the other arguments
    as :func:`calibrate`. Returns ``{expert: CalibResult}``.
    """
    if not adapter.experts:
        raise ConfigError(f"model {adapter.name} is one transformer; use calibrate()")
    missing = [e for e in adapter.experts if e not in out_dirs]
    if missing:
        raise ConfigError(f"calibrate_experts needs an output folder per expert; missing {missing}")
    if from_shards is not None:
        missing = [e for e in adapter.experts if not from_shards.get(e)]
        if missing:
            raise ConfigError(f"merging the shards of a pair needs each expert's shard folders; missing {missing}")
        if shard is not None:
            raise ConfigError("pass shard= (run one slice) or from_shards= (merge the slices), not both")
    sides = {e: adapter.expert(e) for e in adapter.experts}
    return _calibrate(sides, config, dict(out_dirs), models=dict(models or {}), preset=preset,
                      quant_format=quant_format, text_encoder=text_encoder, device=device, progress=progress,
                      report=report, quant_config=quant_config, report_options=report_options, dtype=dtype,
                      cfg=cfg, shard=shard, from_shards={e: list(from_shards[e]) for e in sides} if from_shards
                      else None, pair=adapter)


def _calibrate(sides: Mapping[Any, Any], config: CalibConfig, out_dirs: Mapping[Any, Any], *, models, preset,
               quant_format, text_encoder, device, progress, report, quant_config, report_options, dtype,
               cfg="split", shard=None, from_shards=None, pair=None, sparse=None) -> dict[Any, CalibResult]:
    """One calibration pass: the trajectories of the preset at the model's sampling settings, every
    call observed on the model serving it (``sides``: ``{None: adapter}`` or ``{expert: adapter}``;
    ``from_shards``: ``{side: [shard folders]}``)."""
    t_start = time.perf_counter()
    lead = pair or sides[next(iter(sides))]
    method = _method(config.method)
    qfmt = QuantFormat(getattr(quant_format, "value", quant_format))
    preset = _resolve_preset(lead, config, preset)
    prompts = prompts_for_preset(preset)
    if not prompts:
        raise CalibrationError(f"preset {preset.name!r} selected no prompts; set num_prompts >= 1 and check "
                               f"prompt set {preset.prompt_set!r}")
    progress = progress or (lambda phase, done, total: None)
    models = {k: models.get(k) if models.get(k) is not None else a.load(dtype or "fp32", str(device))
              for k, a in sides.items()}
    first = models[next(iter(sides))]
    if cfg not in ("split", "batched"):
        raise ConfigError(f"cfg={cfg!r}: use 'split' or 'batched'")
    settings, sampling_note = calibration_sampling(lead, preset, config)
    run = CalibrationRun(
        config=config, quant_config=quant_config, report_options=report_options, preset=preset, prompts=prompts,
        settings=settings, sampling_note=sampling_note, method=method,
        methods=(method,) + tuple(m for m in ALL_METHODS if m != method), qfmt=qfmt, cfg=cfg, shard=shard,
        pair=pair, text_encoder=text_encoder, encode=lead.text_encoder(text_encoder),
        model_dtype=compute_dtype(first), device=next(first.parameters()).device, progress=progress,
        report=report and shard is None,  # the merged calibration reports: calibrate(from_shards=...)
        t_start=t_start, sparse=sparse if sparse is not None and sparse.enabled and sparse.window is None else None)
    plan = [(si, shape, chunk) for si, shape in enumerate(preset.shapes) for chunk in chunks(prompts, shape.batch)]
    todo = range(len(plan)) if shard is None else shard_range(len(plan), *shard)
    calls = 1 if cfg == "batched" or not settings.uses_cfg else len(settings.branches)
    total = 0 if from_shards else len(todo) * settings.num_steps * calls
    timesteps: dict[Any, dict[int, float]] = {k: {} for k in sides}
    forwards: dict[Any, int] = {k: 0 for k in sides}
    budget = config.gptq_max_hessian_gb / len(sides)  # GiB; a pair's experts split the budget
    gptq = {k: _gptq_plan(a, models[k], preset, config, qfmt, quant_config, budget)  # {side: (plan, note)}
            for k, a in sides.items()}
    plans = {k: p for k, (p, _) in gptq.items() if p is not None}
    stats: dict[Any, Any] = {}
    recorder = MagnitudeRecorder(settings.num_steps)
    mass = _mass_recorder(run, sides, shard, from_shards)
    t_collect = 0.0
    if from_shards:
        stats = {k: _merged(from_shards[k], a, preset, settings, method, config) for k, a in sides.items()}
        timesteps = {k: _served(stats[k].metadata) for k in sides}
    else:
        log.info("calibrating %s: %d of %d trajectories x %d steps x %d branches (%s, cfg %s, methods %s; "
                 "sampling: %s)", lead.name, len(todo), len(plan), settings.num_steps, len(settings.branches),
                 preset.name, cfg, ", ".join(run.methods), sampling_note)

    def trajectories(group: int, hessians: Mapping[Any, Any]) -> None:
        """Pass ``group`` over this run's trajectories: the first with the observers (-> ``stats``), the
        later GPTQ passes with only their group's Hessian hooks."""
        nonlocal t_collect
        kw = dict(timesteps=timesteps, forwards=forwards, total=total, hessians=hessians)
        if group:
            n = max(pl.passes for pl in plans.values())
            _collect(run, sides, models, lead, plan, todo, phase=f"gptq pass {group + 1}/{n}", **kw)
            return
        sites = _collect(run, sides, models, lead, plan, todo, recorder=recorder, mass=mass, **kw)
        stats.update({k: _reduce(models[k], sites[k], _metadata(run, a, plan, todo, timesteps[k]))
                      for k, a in sides.items()})
        t_collect = time.perf_counter() - t_start

    with contextlib.ExitStack() as stack:
        shard_tmp = _hessian_dirs(stack, plans, out_dirs) if shard is not None and plans else None
        rounded, record = _gptq_passes(plans, models, trajectories, stats, config, qfmt.value,
                                       shard_tmp=shard_tmp, from_shards=from_shards)
        ratios = {k: _step_ratios(recorder, timesteps[k], from_shards[k] if from_shards else None) for k in sides}
        return {k: _write(run, CalibratedSide(
            adapter=a, model=models[k], out_dir=out_dirs[k], stats=stats[k],
            rounded=rounded.get(k) if shard is None else None, ratios=ratios[k],
            rounding=(gptq[k][0], gptq[k][1], record.get(k)), forwards=forwards[k], served=timesteps[k],
            from_shards=from_shards[k] if from_shards else None,
            mass=mass.result(sorted(timesteps[k])) if mass is not None else None), t_collect) for k, a in sides.items()}


def _mass_recorder(run: CalibrationRun, sides, shard, from_shards) -> MassRecorder | None:
    """The attention-mass recorder when the recipe calibrates sparse attention's windows (one transformer,
    one pass: sharded runs and pairs measure none, with a warning)."""
    if run.sparse is None:
        return None
    if shard is not None or from_shards or len(sides) != 1:
        log.warning("calibration: sparse attention's mass is measured in one pass over one transformer; a sharded "
                    "run or a pair records none (set sparse_attention.window, or calibrate in one pass)")
        return None
    return MassRecorder(run.sparse, run.settings.num_steps)


def _step_ratios(recorder: MagnitudeRecorder, served: Mapping[int, float], from_shards) -> StepRatios | None:
    """The output magnitude ratios over the steps a side served (step caching's statistics): this pass's,
    or the shards' rows in shard order (None, with a warning, when a shard predates recording them)."""
    if not from_shards:
        return recorder.ratios(sorted(served))
    from trt_sora.manifest import read_manifest

    order = sorted(from_shards, key=lambda f: (read_manifest(f, stage="calibrate")["results"].get("shard") or [0])[0])
    files = [Path(f) / RATIOS_FILE for f in order]
    if not all(f.is_file() for f in files):
        log.warning("calibration: a shard has no %s (it predates step caching): no step ratios recorded", RATIOS_FILE)
        return None
    return StepRatios.merged([StepRatios.load(f) for f in files])


def _hessian_dirs(stack: contextlib.ExitStack, plans: Mapping[Any, Any], out_dirs: Mapping[Any, Any]) -> dict:
    """``{side: folder}`` beside each output folder for a shard's Hessians, pass by pass, until its folder is
    written (removed when ``stack`` closes); one per side: a pair's experts write files of the same names."""
    from trt_sora.manifest import check_out_dir

    dirs = {}
    for k in plans:
        out = check_out_dir(out_dirs[k])  # (creates its parent)
        dirs[k] = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix=f".{out.name}.tmp-{os.getpid()}-hessians-", dir=out.parent)))
    return dirs


def _gptq_passes(plans: Mapping[Any, Any], models, trajectories, stats, config: CalibConfig, fmt: str, *,
                 shard_tmp: Mapping[Any, Path] | None, from_shards) -> tuple[dict, dict]:
    """Accumulate and use every GPTQ pass's input Hessians, one group at a time (``plans``: ``{side:
    HessianPlan}``): ``trajectories(group, hooks)`` runs the trajectories with that group's hooks (pass 0
    also the observers; a merge reads the shards' Hessians instead, ``from_shards``: ``{side: folders}``),
    then the group's weights are rounded (a shard saves its Hessians to ``shard_tmp[side]`` for the merge)
    and its Hessians freed before the next.
    Returns ``({side: {site: W'}}, {side: what the manifest records})``."""
    from trt_sora.calibrate.gptq import HessianHooks, load_hessians

    rounded: dict[Any, dict] = {k: {} for k in plans}
    files: dict[Any, list[str]] = {k: [] for k in plans}
    passes, peak = max((pl.passes for pl in plans.values()), default=0), 0
    times: list[dict] = []
    for g in range(passes if from_shards else max(passes, 1)):
        t0 = time.perf_counter()
        if from_shards:
            held = {k: load_hessians(from_shards[k], pl.groups[g]) for k, pl in plans.items() if g < pl.passes}
        else:
            hooks = {k: HessianHooks(models[k], pl.sites_of(g), shared=pl.leader)
                     for k, pl in plans.items() if g < pl.passes}
            trajectories(g, hooks)
            held = {k: (h.hessians, h.tokens) for k, h in hooks.items()}
            del hooks
        t1 = time.perf_counter()
        peak = max(peak, sum(x.numel() * x.element_size() for hs, _ in held.values() for x in hs.values()))
        for k in list(held):
            _use_group(k, held.pop(k), plans[k], g, models[k], stats[k], config, fmt,
                       shard_tmp[k] if shard_tmp is not None else None, rounded, files)
        if g < passes:
            times.append({"trajectories_s": round(t1 - t0, 3), "round_s": round(time.perf_counter() - t1, 3)})
            log.info("GPTQ pass %d/%d: %d linears, %.3g GiB of Hessians, %.1f s trajectories, %.1f s %s", g + 1,
                     passes, sum(len(pl.sites_of(g)) for pl in plans.values() if g < pl.passes),
                     sum(pl.group_bytes(g) for pl in plans.values() if g < pl.passes) / 2 ** 30, t1 - t0,
                     time.perf_counter() - t1, "saving" if shard_tmp is not None else "rounding")
    record = {k: {**pl.describe(), "peak_hessian_bytes": peak, "pass_seconds": times,
                  "hessian_files": [str(shard_tmp[k] / f) for f in files[k]] if shard_tmp is not None else []}
              for k, pl in plans.items()}
    return rounded, record


def _use_group(side, held, plan, group: int, model, stats, config: CalibConfig, fmt: str, shard_tmp, rounded,
               files) -> None:
    """Round one pass's sites of ``side`` from its Hessians ``held = (hessians, tokens)``, or save them (shard)."""
    from trt_sora.calibrate.gptq import hessians_file, save_hessians

    hessians, tokens = held
    if shard_tmp is not None:
        name = hessians_file(group, plan.passes)
        save_hessians(shard_tmp / name, hessians, tokens)
        files[side].append(name)
        return
    rounded[side].update(_round_weights(dict(model.named_modules()), stats, hessians, tokens, plan.sites_of(group),
                                        plan.leader, fmt, config))


def _served(meta) -> dict[int, float]:
    """``{step: timestep}`` a statistics file covers: every step, or a pair's expert's ``steps_served``."""
    steps = meta.extra.get("steps_served")
    return dict(zip(steps if steps is not None else range(len(meta.timesteps)), meta.timesteps))


def _metadata(run: CalibrationRun, adapter, plan, todo, served: Mapping[int, float]):
    """The ``StatsMetadata`` of one model's statistics (a pair's expert: the steps it served)."""
    from trt_sora.calibrate.stats import StatsMetadata

    settings, preset = run.settings, run.preset
    steps = sorted(served)
    meta = StatsMetadata(
        method=run.method, num_samples=sum(plan[k][1].batch for k in todo),
        num_steps=settings.num_steps, timesteps=[served[i] for i in steps], branches=list(settings.branches),
        shapes=[s.as_dict() for s in preset.shapes], model=adapter.spec.ref,
        model_hash=adapter.spec.model_hash(), preset=preset.name, prompt_set=preset.prompt_set, seed=preset.seed,
        guidance_scale=settings.guidance_scale, shift=settings.shift,
        extra={"sampling": run.sampling_note, "model_sampling": adapter.sampling.to_dict(),
               "prompt_ids": [p.id for p in run.prompts], "negative_prompt": _negative_label(adapter, preset),
               "model_dtype": str(run.model_dtype).replace("torch.", ""), "device": str(run.device),
               "quant_format": run.qfmt.value, "cfg": run.cfg,
               "collect_seconds": round(time.perf_counter() - run.t_start, 3)})
    if run.shard is not None:
        meta.extra.update({"shard": list(run.shard), "shard_trajectories": [todo.start, todo.stop]})
    if run.pair is not None:
        meta.extra.update(expert=adapter.spec.expert, steps_served=steps)
    return meta


def _report(tmp, run: CalibrationRun, side: CalibratedSide):
    """The calibration report in ``tmp``, with the PyTorch evaluation (and ModelOpt peer) it shows; a pair's
    experts get no evaluation (the parity check judges each). Returns ``(evaluation or None, report path)``."""
    from trt_sora.calibrate.report import write_report

    config, qfmt, rounded = run.config, run.qfmt, side.rounded
    adapter, model, stats = side.adapter, side.model, side.stats
    kw = dict(encode=run.encode, settings=run.settings, model_dtype=run.model_dtype, progress=run.progress)
    opts = run.report_options or ReportOptions(eval_prompts=config.eval_prompts, eval_steps=config.eval_steps,
                                               sensitivity=config.sensitivity)
    qcfg = run.quant_config or QuantConfig(format=qfmt)
    if qcfg.format is QuantFormat.NONE:  # an unquantized recipe: still show what FP8 would cost
        qcfg = dataclasses.replace(qcfg, format=QuantFormat.FP8_E4M3)
    evaluation = None
    if run.pair is None:
        from trt_sora.calibrate import evaluate as ev

        evaluation = ev.evaluate(adapter, model, stats, run.preset, qcfg, opts,
                                 weights=(rounded, qfmt.value) if rounded else None, **kw)
        if opts.peer == "modelopt":
            from trt_sora.calibrate.peer import modelopt_peer

            evaluation["peer"] = modelopt_peer(adapter, model, stats, run.preset, qcfg, num_prompts=opts.peer_prompts,
                                               num_steps=opts.peer_steps,
                                               weights=rounded if qfmt is QuantFormat.FP8_E4M3 else None, **kw)
    return evaluation, write_report(tmp, stats, evaluation, preset=run.preset, options=opts,
                                    quant_format=qcfg.format.value, weight_rounding=side.rounding[1])


def _write(run: CalibrationRun, side: CalibratedSide, t_collect: float) -> CalibResult:
    """Write one side's calibration folder (stats, GPTQ-rounded weights, the step caching's output
    magnitude ratios, a shard's Hessians, report, manifest) atomically; ``t_collect``: seconds the
    trajectories took."""
    from trt_sora.calibrate.gptq import WEIGHTS_FILE, save_rounded_weights
    from trt_sora.config.base import to_dict
    from trt_sora.manifest import file_entry, staged_dir, write_manifest

    adapter, stats, rounded, rounding, qfmt = side.adapter, side.stats, side.rounded, side.rounding, run.qfmt
    config, settings, from_shards, pair = run.config, run.settings, side.from_shards, run.pair
    steps = sorted(side.served)
    with staged_dir(side.out_dir) as tmp:
        stats.save(tmp / CALIB_STATS)
        hessian_files = [Path(f) for f in (rounding[2] or {}).get("hessian_files", [])]
        for f in hessian_files:  # a shard's: the merge rounds with them
            os.replace(f, tmp / f.name)
        if rounded is not None:
            save_rounded_weights(tmp / WEIGHTS_FILE, rounded, {s: stats.amax[f"{s}.weight"] for s in rounded},
                                 qfmt.value, {"method": "gptq", "damp": config.gptq_damp, "sites": len(rounded)})
        evaluation, report_path = _report(tmp, run, side) if run.report else (None, None)
        seconds = time.perf_counter() - run.t_start
        results = {"num_sites": len(stats.amax), "method": run.method, "methods": list(run.methods), "cfg": run.cfg,
                   "shard": list(run.shard) if run.shard else None,
                   "from_shards": len(from_shards) if from_shards else None,
                   "sampling": {**settings.to_dict(), "note": run.sampling_note},
                   "collect_seconds": round(t_collect, 3), "seconds": round(seconds, 3),
                   "num_forwards": side.forwards, "timesteps": [side.served[i] for i in steps]}
        inputs = {"model": adapter.describe(), "preset": run.preset.to_dict(),
                  "text_encoder": run.text_encoder or adapter.spec.text_encoder or "default"}
        if from_shards:
            inputs["shards"] = [file_entry(Path(f) / CALIB_STATS) for f in from_shards]
        if pair is not None:
            results["expert"] = {"name": adapter.spec.expert, "steps_served": steps,
                                 "boundary_ratio": settings.boundary_ratio,
                                 "trajectories": "shared with the other expert: one pass, switched at the boundary",
                                 "evaluation": "not run for a pair; the parity check judges each expert"}
            inputs["experts"] = {e: pair.expert(e).spec.model_hash() for e in pair.experts}
        if evaluation is not None:
            results["comparison"] = evaluation.get("comparison")
            results["suggested_exclude"] = evaluation.get("skip", {}).get("patterns", [])
            if evaluation.get("peer"):
                results["peer"] = evaluation["peer"]
        outputs = {"stats": CALIB_STATS}
        record = {k: v for k, v in (rounding[2] or {}).items() if k != "hessian_files"}
        results["weight_rounding"] = {"method": "gptq" if rounding[0] else "nearest", "format": qfmt.value,
                                      "sites": len(rounded or ()), "note": rounding[1], **record}
        if rounded is not None:
            outputs["weights"] = WEIGHTS_FILE
        if side.ratios is not None:
            side.ratios.save(tmp / RATIOS_FILE)
            outputs["step_ratios"] = RATIOS_FILE
            results["step_ratios"] = side.ratios.summary()
        if side.mass is not None:
            side.mass.save(tmp / MASS_FILE)
            outputs["attention_mass"] = MASS_FILE
            results["attention_mass"] = side.mass.summary(run.sparse.dense_steps)
            if report_path is not None:
                with open(report_path, "a") as f:
                    f.write("\n".join(render_mass(side.mass, run.sparse)) + "\n")
        if hessian_files:
            outputs["hessians"] = [f.name for f in hessian_files]
        if report_path is not None:
            outputs["report"] = CALIB_REPORT
        manifest = write_manifest(
            tmp, stage="calibrate", inputs=inputs,
            config={"calibration": to_dict(config), "quant_format": qfmt.value,
                    "quantization": to_dict(run.quant_config) if run.quant_config is not None else None},
            results=results, outputs=outputs)
    out = Path(side.out_dir)
    log.info("calibration of %s: %d sites in %.1f s -> %s", adapter.name, len(stats.amax), seconds, out)
    return CalibResult(stats=stats, stats_path=out / CALIB_STATS,
                       report_path=(out / CALIB_REPORT) if run.report else None, manifest=manifest,
                       evaluation=evaluation)
