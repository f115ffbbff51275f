"""The report's measurements: the fake-quantized model against the unquantized one on held-out prompts.

Everything here runs full denoising trajectories (:func:`trt_sora.sampling.sample` at the
calibration's sampling settings - the model's own unless overridden - and ``eval_steps``)
at the preset's first shape on held-out prompts (split ``heldout``) and compares the
FINAL latents ``[B, C, F, H, W]`` with :func:`trt_sora.metrics.compare` (cosine, max-abs, relative L2, PSNR with
the peak = the reference's max - min):

* **calibrator comparison**: every collected method x format, all sites the
  quantize stage will quantize (its policy, default exclusions included) with
  that method's activation amax per tensor and weights per output channel;
* **sensitivity**: one layer group at a time (a *kind* over all blocks, e.g.
  ``ffn.down`` = ``blocks.*.ffn.net.2`` for Wan (the adapter's ``layer_kinds``), or one block ``blocks.N``) with the
  recipe's method and format;
* **skip list**: the groups whose solo quantization costs the most, as
  ``quantization.exclude`` patterns, verified by one more run with them excluded.
"""
from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trt_sora.calibrate.fakequant_model import fake_quantized, quantized_sites
from trt_sora.calibrate.trajectories import EVALUATION_SEEDS, calibration_sampling, heldout_prompts, trajectory_feeds
from trt_sora.errors import ConfigError
from trt_sora.metrics import compare
from trt_sora.sampling import adapter_call, sample

log = logging.getLogger("trt_sora")

__all__ = ["evaluate", "layer_groups", "site_kind"]

_BLOCK_RE = re.compile(r"^(?P<container>[A-Za-z_][A-Za-z0-9_]*)\.(?P<index>\d+)\.(?P<rest>.+)$")

def site_kind(site: str, kinds: Mapping[str, str] | None = None) -> tuple[str | None, str | None, str]:
    """``(container, block index, kind)`` of a linear site; container/index None outside blocks.

    ``kinds``: the family's linear path -> kind table (``adapter.layer_kinds``); paths not in it
    are their own kind. ``blocks.3.ffn.net.2`` -> ``("blocks", "3", "ffn.down")`` for Wan;
    ``proj_out`` -> ``(None, None, "proj_out")``.
    """
    m = _BLOCK_RE.match(site)
    if not m:
        return None, None, site
    return m["container"], m["index"], (kinds or {}).get(m["rest"], m["rest"])


def layer_groups(sites: Sequence[str], by: str = "both", kind_names: Mapping[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """Layer groups for the sensitivity ranking: ``{"name", "type", "sites", "patterns"}``.

    ``kind_names``: the family's layer kinds (``adapter.layer_kinds``, see :func:`site_kind`).
    ``by``: ``"kind"`` (one group per kind across blocks; patterns ``blocks.*.<path>``),
    ``"block"`` (one per block; pattern ``blocks.N.*``), ``"both"`` or ``"none"``.
    Sites outside blocks form one group each (type ``"layer"``) under ``"kind"``.
    """
    if by not in ("kind", "block", "both", "none"):
        raise ConfigError(f"sensitivity grouping {by!r}; use kind, block, both or none")
    groups: list[dict[str, Any]] = []
    if by in ("kind", "both"):
        kinds: dict[str, dict[str, Any]] = {}
        for s in sites:
            container, _, kind = site_kind(s, kind_names)
            if container is None:
                g = kinds.setdefault(s, {"name": s, "type": "layer", "sites": [], "patterns": [s]})
            else:
                rest = _BLOCK_RE.match(s)["rest"]
                g = kinds.setdefault(kind, {"name": kind, "type": "kind", "sites": [], "patterns": []})
                pat = f"{container}.*.{rest}"
                if pat not in g["patterns"]:
                    g["patterns"].append(pat)
            g["sites"].append(s)
        groups.extend(kinds.values())
    if by in ("block", "both"):
        blocks: dict[str, dict[str, Any]] = {}
        for s in sites:
            container, index, _ = site_kind(s, kind_names)
            if container is None:
                continue
            name = f"{container}.{index}"
            blocks.setdefault(name, {"name": name, "type": "block", "sites": [], "patterns": [f"{name}.*"]})
            blocks[name]["sites"].append(s)
        groups.extend(blocks.values())
    return groups


def _act_amax(stats, method: str, sites: Sequence[str]) -> dict[str, torch.Tensor]:
    out = {}
    for s in sites:
        if method == stats.metadata.method:
            out[s] = stats.amax[s]
        else:
            out[s] = stats.method_amax[s][method]
    return out


def evaluate(adapter, model, stats, preset, quant_config, options, *, encode: Callable, settings=None,
             model_dtype=None, progress: Callable[[str, int, int], None] | None = None,
             weights: tuple[Mapping[str, torch.Tensor], str] | None = None) -> dict[str, Any]:
    """Run the comparison, sensitivity ranking and skip-list check; see the module docstring.

    Args:
        adapter, model: the family adapter and the loaded (unquantized) transformer.
        stats: the :class:`~trt_sora.calibrate.stats.CalibStats` just collected (all methods).
        preset: the :class:`~trt_sora.calibrate.data.CalibPreset` (prompts, negative prompt, first shape).
        quant_config: the recipe's ``QuantConfig`` (site policy; ``format`` for the sensitivity runs).
        options: :class:`trt_sora.calibrate.run.ReportOptions` (``eval_steps`` overrides the step count).
        encode: the text encoder ``(prompts, text_len) -> [B, L, D]``.
        settings: the calibration's :class:`~trt_sora.sampling.SamplingSettings`
            (default: :func:`trt_sora.calibrate.trajectories.calibration_sampling`).
        model_dtype: dtype fed to the model (default fp32).
        progress: ``progress("evaluate", done, total)``.
        weights: ``({site: W'}, format)``: GPTQ-rounded weights, used by every run in that format.

    Returns:
        JSON-safe dict: ``eval`` (setup, PSNR peak), ``quantized_sites``, ``comparison`` (rows of
        method, format, cosine, max_abs, rel_l2, psnr_db), ``sensitivity`` (rows sorted worst first),
        ``skip`` (groups, patterns, YAML, verification metrics).
    """
    ev = _Evaluation(adapter, model, stats, preset, quant_config, options, encode=encode, settings=settings,
                     model_dtype=model_dtype, progress=progress, weights=weights)
    ev.progress("evaluate", 0, ev.total)
    with _counting_flops(model) as flops:
        ev.reference()
    comparison = ev.comparison()
    sensitivity = ev.sensitivity()
    skip, kept = ev.skip_list(sensitivity, comparison)
    per_step = ev.per_step()
    window_rows, tradeoff = ev.tradeoff(flops, skip, kept, per_step)
    fmt_main, linear_total = ev.fmt_main, sum(flops.values()) or 1.0
    return {
        **ev.setup(), "comparison": comparison, "sensitivity": sensitivity, "skip": skip,
        "per_step": per_step, "step_windows": window_rows, "tradeoff": tradeoff,
        "target_psnr_db": options.target_psnr_db if options.target_psnr_db is not None else
        {"fp8_e4m3": 35.0, "int8": 30.0}.get(fmt_main),
        "linear_flops": {"total_per_call": linear_total, "quantized_fraction": _flop_fraction(flops, ev.candidates)},
    }


def _flop_fraction(flops: Mapping[str, float], sites: Sequence[str]) -> float:
    """The share of the linear FLOPs of one call that ``sites`` compute."""
    return sum(flops.get(s, 0) for s in sites) / (sum(flops.values()) or 1.0)


class _Evaluation:
    """One evaluation: the held-out trajectories, the sites and groups it quantizes, its progress
    count, and the unquantized reference every run is compared with."""

    def __init__(self, adapter, model, stats, preset, quant_config, options, *, encode, settings, model_dtype,
                 progress, weights):
        self.adapter, self.model, self.stats, self.options, self.weights = adapter, model, stats, options, weights
        self.progress = progress or (lambda phase, done, total: None)
        self.model_dtype = model_dtype or torch.float32
        self.shape = preset.shapes[0]
        settings = settings or calibration_sampling(adapter, preset)[0]
        self.settings = settings.override(num_steps=options.eval_steps)
        self.steps = steps = self.settings.num_steps
        self.prompts = heldout_prompts(preset, options.eval_prompts)
        self.feeds = trajectory_feeds(adapter, encode, preset, self.prompts, self.shape,
                                      uses_cfg=self.settings.uses_cfg, device=next(model.parameters()).device,
                                      offset=EVALUATION_SEEDS)
        self.fmt_main = quant_config.format.value
        self.methods = [stats.metadata.method] + sorted({m for per in stats.method_amax.values() for m in per})
        self.formats = list(dict.fromkeys(options.formats))
        self.candidates = [s for s in quantized_sites(model, quant_config, adapter.quant_excludes) if s in stats.amax]
        self.groups = layer_groups(self.candidates, options.sensitivity, adapter.layer_kinds)
        self.main_amax = _act_amax(stats, stats.metadata.method, self.candidates)
        modules = dict(model.named_modules())
        w_bytes = sum(modules[s].weight.numel() * modules[s].weight.element_size() for s in self.candidates)
        self.cache = options.cache_weights if options.cache_weights is not None else w_bytes < (1 << 30)
        self.per_run = len(self.feeds) * steps * len(self.settings.branches)
        self.windows = windows = _step_windows(steps)
        # reference, method x format table, one run per group, the skip-list check, the windows, the
        # worst window's complement; plus the teacher-forced per-step trajectory (one held-out chunk)
        self.total = self.per_run * (1 + len(self.methods) * len(self.formats) + len(self.groups) + 1 + len(windows)
                                     + (len(windows) > 1)) + steps * len(self.settings.branches)
        self.done = 0

    def count(self, _call=None, calls: int = 1) -> None:
        self.done += calls
        self.progress("evaluate", self.done, self.total)

    def rounded(self, fmt: str | None):
        """The GPTQ-rounded weights when they are in ``fmt``, else None (nearest rounding)."""
        return self.weights[0] if self.weights is not None and self.weights[1] == fmt else None

    def run(self, quant: Mapping[str, torch.Tensor] | None, fmt: str | None, sites=None, steps_quantized=None):
        """Final latents of every held-out trajectory; ``steps_quantized``: the steps run quantized
        (None = all), the others on the unquantized linears."""
        adapter, model, settings = self.adapter, self.model, self.settings
        outs = []
        at: dict[str, int] = {}

        def hook(call):
            at["step"] = call.step
            self.count(call)
        for noise, cond, uncond, chunk in self.feeds:
            kw = dict(scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="split",
                      dtype=self.model_dtype, hook=hook, label=f"evaluation, held-out prompts {[p.id for p in chunk]}",
                      conditioner=adapter)
            if quant is None:
                outs.append(sample(adapter_call(adapter, model), noise, cond, uncond, **kw).latents)
            else:
                weight_amax = {s: self.stats.amax[f"{s}.weight"] for s in quant if f"{s}.weight" in self.stats.amax}
                on = None if steps_quantized is None else (lambda: at["step"] in steps_quantized)
                with fake_quantized(model, quant, fmt, sites=sites, weight_amax=weight_amax, cache_weights=self.cache,
                                    enabled=on, weights=self.rounded(fmt)):
                    outs.append(sample(adapter_call(adapter, model), noise, cond, uncond, **kw).latents)
        return torch.cat(outs).cpu()

    def reference(self) -> None:
        """The unquantized model's final latents, and the PSNR peak (their max - min)."""
        self.ref = self.run(None, None)
        self.peak = float(self.ref.max() - self.ref.min())

    def metrics(self, got) -> dict[str, float]:
        m = compare(self.ref, got, peak=self.peak)
        return {k: float(m[k]) for k in ("cosine", "max_abs", "rel_l2", "psnr_db")}

    def comparison(self) -> list[dict]:
        """Every collected method x format with all sites quantized."""
        rows = []
        for method in self.methods:
            amax = _act_amax(self.stats, method, self.candidates)
            for fmt in self.formats:
                row = {"method": method, "format": fmt, **self.metrics(self.run(amax, fmt, self.candidates))}
                rows.append(row)
                log.info("calibrator %s %s: cosine %.6f psnr %.2f dB", method, fmt, row["cosine"], row["psnr_db"])
        return rows

    def sensitivity(self) -> list[dict]:
        """One layer group quantized at a time (the recipe's method and format), worst first."""
        rows = [{"group": g["name"], "type": g["type"], "num_sites": len(g["sites"]), "patterns": g["patterns"],
                 **self.metrics(self.run(self.main_amax, self.fmt_main, g["sites"]))} for g in self.groups]
        rows.sort(key=lambda r: (-r["rel_l2"], r["group"]))
        return rows

    def skip_list(self, sensitivity, comparison) -> tuple[dict[str, Any], list[str] | None]:
        """The suggested skip list, verified by one run without its sites; ``(skip, sites kept)``."""
        skip = _skip_list(sensitivity, self.options.max_skip)
        full = next((r for r in comparison if r["method"] == self.stats.metadata.method
                     and r["format"] == self.fmt_main), None)
        kept = None
        if skip["groups"]:
            kept = [s for s in self.candidates if not any(fnmatch.fnmatchcase(s, p) for p in skip["patterns"])]
            skip["with_skip"] = self.metrics(self.run(self.main_amax, self.fmt_main, kept))
            skip["num_sites_kept"] = len(kept)
        else:  # no skip-list run: its share of the progress is done
            self.count(calls=self.per_run)
        skip["all_quantized"] = {k: full[k] for k in ("cosine", "max_abs", "rel_l2", "psnr_db")} if full else None
        return skip, kept

    def per_step(self) -> list[dict]:
        """Which steps' quantization reaches the clip (:func:`_per_step_view` on the first held-out chunk)."""
        return _per_step_view(self.adapter, self.model, self.feeds[0], self.settings, self.main_amax, self.fmt_main,
                              self.candidates, self.stats, self.cache, self.model_dtype, self.count,
                              self.rounded(self.fmt_main))

    def tradeoff(self, flops, skip, kept, per_step) -> tuple[list[dict], list[dict]]:
        """``(window rows, tradeoff rows)``: each window of steps quantized alone, and what the skip list
        or keeping the costliest window unquantized buys against its share of the linear FLOPs."""
        steps, amax, fmt, sites = self.steps, self.main_amax, self.fmt_main, self.candidates
        window_rows = []
        for lo, hi in self.windows:  # one window of steps quantized alone: its share of the final error
            window_rows.append({"steps": [lo, hi], **self.metrics(self.run(amax, fmt, sites,
                                                                           steps_quantized=set(range(lo, hi))))})
        tradeoff = [{"option": "all steps, every quantized linear", "fp8_linear_flop_fraction":
                     _flop_fraction(flops, sites), **skip["all_quantized"]}] if skip["all_quantized"] else []
        if skip.get("with_skip"):
            tradeoff.append({"option": f"skip list ({', '.join(skip['groups'])})", "fp8_linear_flop_fraction":
                             _flop_fraction(flops, kept), **skip["with_skip"], "recipe": {"exclude": skip["patterns"]}})
        worst = min(window_rows, key=lambda r: r["psnr_db"]) if window_rows else None
        if worst is not None and len(self.windows) > 1:
            keep = set(range(steps)) - set(range(*worst["steps"]))
            got = self.run(amax, fmt, sites, steps_quantized=keep)
            lo, hi = worst["steps"]
            tradeoff.append({"option": f"steps {lo}-{hi - 1} unquantized (the window that costs most)",
                             "fp8_linear_flop_fraction": _flop_fraction(flops, sites) * len(keep) / steps,
                             **self.metrics(got), "recipe": {"unquantized_steps": [lo, hi],
                                                             "timesteps": _window_timesteps(per_step, lo, hi)}})
        return window_rows, tradeoff

    def setup(self) -> dict[str, Any]:
        """The report's setup keys: prompts, shape, sampling, PSNR peak, sites, methods and formats."""
        stats, settings = self.stats, self.settings
        return {
            "eval": {"prompt_ids": [p.id for p in self.prompts], "shape": self.shape.as_dict(),
                     "num_steps": self.steps, "guidance_scale": settings.guidance_scale, "shift": settings.shift,
                     "model_num_steps": self.adapter.sampling.num_steps,
                     "psnr_peak": self.peak, "psnr_peak_def": "reference final latent max - min",
                     "ref_max_abs": float(self.ref.abs().max())},
            "quantized_sites": self.candidates,
            "excluded_sites": [s for s in stats.amax if s not in self.candidates and not s.endswith(".weight")
                               and s not in stats.metadata.extra.get("attention_sites", [])],
            "methods": self.methods, "formats": self.formats,
            "sensitivity_method": stats.metadata.method, "sensitivity_format": self.fmt_main,
        }


def _skip_list(rows: Sequence[Mapping[str, Any]], max_skip: int) -> dict[str, Any]:
    """Groups whose solo error (relative L2 of the final latent) is at least twice the median of their
    type (kind/block/layer), worst first, at most ``max_skip``; patterns deduplicated."""
    import statistics

    rule = (f"groups whose solo quantization error (relative L2 of the final latent) is >= 2x the median "
            f"of their grouping (kinds vs blocks), worst first, at most {max_skip}")
    by_type: dict[str, list[float]] = {}
    for r in rows:
        by_type.setdefault(r["type"], []).append(r["rel_l2"])
    med = {t: statistics.median(v) for t, v in by_type.items()}
    chosen = [r for r in rows if len(by_type[r["type"]]) > 1 and r["rel_l2"] > 0
              and r["rel_l2"] >= 2.0 * med[r["type"]]][:max_skip]
    patterns: list[str] = []
    lines = ["quantization:", "  exclude:"]
    for r in chosen:
        for p in r["patterns"]:
            if p not in patterns:
                patterns.append(p)
                lines.append(f'    - "{p}"   # {r["group"]}: solo cosine {r["cosine"]:.6f}, '
                             f'PSNR {r["psnr_db"]:.1f} dB')
    if not chosen:
        lines = ["quantization:", "  exclude: []   # no group stands out"]
    return {"rule": rule, "groups": [r["group"] for r in chosen], "patterns": patterns,
            "yaml": "\n".join(lines) + "\n"}


def _step_windows(steps: int, parts: int = 4) -> list[tuple[int, int]]:
    """Up to ``parts`` consecutive windows covering ``0 .. steps - 1`` (the last one ends the schedule)."""
    n = min(parts, steps)
    edges = [round(i * steps / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n) if edges[i + 1] > edges[i]]


def _window_timesteps(per_step: list[dict], lo: int, hi: int) -> list[float]:
    """The timestep range ``[t(hi - 1), t(lo)]`` of steps ``lo .. hi - 1`` (timesteps fall over the schedule)."""
    ts = {r["step"]: r["timestep"] for r in per_step}
    return [round(ts[hi - 1], 3), round(ts[lo], 3)]


class _counting_flops:
    """Per-call FLOPs of every ``nn.Linear`` (``2 x tokens x in x out``), averaged over the calls seen."""

    def __init__(self, model):
        self.model, self.flops, self.calls, self.hooks = model, {}, {}, []

    def __enter__(self) -> dict[str, float]:
        for name, m in self.model.named_modules():
            if isinstance(m, torch.nn.Linear):
                self.hooks.append(m.register_forward_hook(self._hook(name)))
        return self.flops

    def _hook(self, name):
        def h(mod, args, out):
            n = self.calls.get(name, 0)
            f = 2.0 * args[0].numel() * mod.out_features
            self.flops[name] = (self.flops.get(name, 0.0) * n + f) / (n + 1)
            self.calls[name] = n + 1
        return h

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


def _cast(cond, dtype):
    """A branch's conditioning (``{name: tensor}``, or None) with its float tensors in ``dtype``."""
    if cond is None:
        return None
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items()}


def _per_step_view(adapter, model, feed, settings, amax, fmt, sites, stats, cache, model_dtype, count,
                   rounded=None) -> list[dict]:
    """One held-out trajectory with the fake-quantized model teacher-forced on the unquantized one's
    inputs: per step the worst call's cosine / PSNR and the update's contribution estimate (dB)."""
    from trt_sora.teacher_forcing import reference_with_candidate

    noise, cond, uncond, _ = feed
    state = {"quantized": False}
    weight_amax = {s: stats.amax[f"{s}.weight"] for s in sites if f"{s}.weight" in stats.amax}
    base = adapter_call(adapter, model)

    def ref_call(f):
        state["quantized"] = False
        return base(f)

    def cand_call(f):
        state["quantized"] = True
        try:
            return base(f)
        finally:
            state["quantized"] = False

    with fake_quantized(model, amax, fmt, sites=sites, weight_amax=weight_amax, cache_weights=cache,
                        enabled=lambda: state["quantized"], weights=rounded):
        run = reference_with_candidate(ref_call, cand_call, noise, _cast(cond, model_dtype), _cast(uncond, model_dtype),
                                       scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="split",
                                       count=count, conditioner=adapter)
    rows = []
    for st in run.steps:
        calls = [c for c in run.calls if c["step"] == st["step"]]
        rows.append({"step": st["step"], "timestep": st["timestep"], "sigma": st["sigma"],
                     "sigma_next": st["sigma_next"], "call_cosine": min(c["cosine"] for c in calls),
                     "call_psnr_db": min(c["psnr_db"] for c in calls), "contribution_db": st["contribution_db"]})
    return rows
