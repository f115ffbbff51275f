"""The calibration report: ``report.md`` + ``figures/*.png`` for human review.

Built from the stats file (per-site amax of every method, per-step x per-branch
grids, ``|x|`` histograms) and the evaluation of :mod:`trt_sora.calibrate.evaluate`.
Per-layer quantization errors (clipped fraction, SQNR) are computed from the
stored histograms - each bin's count placed at its centre - so no activation is
ever stored; they are exact to one bin width (``hist_range / num_bins``).

Figures are drawn with matplotlib's object API (``Figure`` + Agg canvas), which
never touches the global pyplot backend of the process.

Sections: summary, calibrator comparison (FP8 / INT8 x method: cosine, max-abs,
PSNR of the final latent on held-out prompts), sensitivity ranking, suggested skip
list (YAML for ``quantization.exclude``), per-layer table, drift over timesteps,
outlier histograms, CFG branch differences.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trt_sora.calibrate.fake_quant import fake_quant
from trt_sora.runfolder import CALIB_REPORT

log = logging.getLogger("trt_sora")

__all__ = ["histogram_error", "layer_rows", "write_report"]

_FMT_LABEL = {"fp8_e4m3": "FP8", "int8": "INT8"}


def histogram_error(hist: torch.Tensor, hist_range: float, amax: float, fmt: str,
                    absmax: float | None = None) -> dict[str, float]:
    """Quantization error of the data a ``|x|`` histogram holds, at ``amax`` in ``fmt``.

    Args:
        hist: int64 ``[num_bins]`` counts over ``[0, hist_range]``.
        hist_range: upper edge of the last bin (units of x).
        amax: clipping bound (> 0).
        fmt: ``"fp8_e4m3"`` / ``"int8"``.
        absmax: exact max |x| (bin centres are capped to it), optional.

    Returns:
        ``clipped_fraction`` (bins whose centre exceeds ``amax``), ``sqnr_db`` (``10 log10(E[x^2] / E[e^2])``,
        inf when lossless) and ``rel_mse``.
    """
    counts = hist.double()
    n = float(counts.sum())
    if n == 0 or hist_range <= 0 or amax <= 0:
        return {"clipped_fraction": 0.0, "sqnr_db": math.inf, "rel_mse": 0.0}
    w = hist_range / len(hist)
    centres = (torch.arange(len(hist), dtype=torch.float64) + 0.5) * w
    if absmax is not None:
        centres = torch.minimum(centres, torch.tensor(float(absmax), dtype=torch.float64))
    q = fake_quant(centres.float(), float(amax), fmt).double()
    err = float(((centres - q) ** 2) @ counts)
    sig = float((centres ** 2) @ counts)
    clipped = float(counts[centres > amax].sum()) / n
    rel = err / sig if sig > 0 else 0.0
    sqnr = math.inf if err == 0 else (10.0 * math.log10(sig / err) if sig > 0 else -math.inf)
    return {"clipped_fraction": clipped, "sqnr_db": sqnr, "rel_mse": rel}


def _f(x: float, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def _scalar(t) -> float:
    return float(torch.as_tensor(t).float().max())


def layer_rows(stats, quantized: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per activation site (linear inputs and attention q/k/v; weights left out).

    Keys: ``site``, ``quantized`` (bool), ``amax`` (``{method: float}``, chosen one included),
    ``chosen``, ``clipped_fraction``, ``sqnr_fp8_e4m3``, ``sqnr_int8``, ``drift`` (max/min of the
    per-step amax), ``cfg_ratio`` (cond/uncond max amax, None without CFG), ``outlier`` (minmax /
    chosen amax).
    """
    weight_sites = set(stats.metadata.extra.get("weight_sites", []))
    q = set(quantized)
    rows = []
    for site, a in stats.amax.items():
        if site in weight_sites:
            continue
        amax = {stats.metadata.method: _scalar(a)}
        amax.update({m: _scalar(v) for m, v in stats.method_amax.get(site, {}).items()})
        chosen = amax[stats.metadata.method]
        absmax = amax.get("minmax")
        row: dict[str, Any] = {"site": site, "quantized": site in q, "amax": amax, "chosen": chosen}
        if site in stats.histograms:
            h, r = stats.histograms[site]
            for fmt in ("fp8_e4m3", "int8"):
                e = histogram_error(h, r, chosen, fmt, absmax)
                row[f"sqnr_{fmt}"] = e["sqnr_db"]
                row["clipped_fraction"] = e["clipped_fraction"]
        grid = stats.amax_per_step.get(site)
        if grid is not None and grid.numel():
            g = grid if grid.dim() == 2 else grid[:, None]
            per_step = g.max(dim=1).values
            seen = per_step[per_step > 0]
            row["drift"] = float(seen.max() / seen.min()) if seen.numel() and float(seen.min()) > 0 else None
            if g.shape[1] == 2 and float(g[:, 1].max()) > 0:
                row["cfg_ratio"] = float(g[:, 0].max() / g[:, 1].max())
            else:
                row["cfg_ratio"] = None
        row["outlier"] = (absmax / chosen) if absmax and chosen > 0 else None
        rows.append(row)
    return rows


# -- figures ---------------------------------------------------------------------------------------

def _figure(w: float = 8.0, h: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _drift_figure(stats, sites: Sequence[str], path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ts = stats.metadata.timesteps
    branches = stats.metadata.branches
    for i, s in enumerate(sites):
        g = stats.amax_per_step[s]
        g = g if g.dim() == 2 else g[:, None]
        x = ts[: g.shape[0]] if len(ts) >= g.shape[0] else list(range(g.shape[0]))
        color = f"C{i % 10}"
        for b, style in zip(range(g.shape[1]), ("-", "--")):
            ax.plot(x, g[:, b].tolist(), style, color=color, marker="o", ms=3,
                    label=f"{s} ({branches[b] if b < len(branches) else b})")
    ax.set_xlabel("timestep (denoising runs right to left)")
    ax.set_ylabel("abs-max per step")
    if len(ts) > 1 and ts[0] > ts[-1]:
        ax.invert_xaxis()
    ax.set_title("activation amax over denoising steps (solid: cond, dashed: uncond)")
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def _hist_figure(stats, rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    n = len(rows)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig = _figure(4.0 * cols, 3.0 * nrows)
    for i, row in enumerate(rows):
        ax = fig.add_subplot(nrows, cols, i + 1)
        h, r = stats.histograms[row["site"]]
        # 128 plotted bins are plenty to see a tail and keep drawing fast
        k = max(1, len(h) // 128)
        hb = h[: len(h) // k * k].reshape(-1, k).sum(1)
        w = r / len(hb)
        ax.step([(j + 0.5) * w for j in range(len(hb))], [int(c) + 0.5 for c in hb.tolist()], where="mid",
                lw=0.8, color="0.3")
        ax.set_yscale("log")
        for j, (m, a) in enumerate(sorted(row["amax"].items())):
            ax.axvline(a, color=f"C{j}", ls="--", lw=1, label=f"{m} {a:.3g}")
        ax.set_title(row["site"], fontsize=7)
        ax.set_xlabel("|x|", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5)
    fig.subplots_adjust(hspace=0.5, wspace=0.3)
    fig.savefig(path)


def _cfg_figure(rows: Sequence[Mapping[str, Any]], stats, path: Path) -> None:
    fig = _figure(5.5, 5.0)
    ax = fig.add_subplot(1, 1, 1)
    xs, ys = [], []
    for row in rows:
        g = stats.amax_per_step.get(row["site"])
        if g is None or g.dim() != 2 or g.shape[1] != 2:
            continue
        xs.append(float(g[:, 1].max()))
        ys.append(float(g[:, 0].max()))
    ax.loglog(xs, ys, "o", ms=3)
    if xs:
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel("uncond amax")
    ax.set_ylabel("cond amax")
    ax.set_title("CFG branches: per-site amax (max over steps)")
    fig.tight_layout()
    fig.savefig(path)


def _sens_figure(sens: Sequence[Mapping[str, Any]], path: Path) -> None:
    fig = _figure(8.0, max(2.5, 0.3 * len(sens) + 1))
    ax = fig.add_subplot(1, 1, 1)
    names = [f"{r['group']} ({r['type']})" for r in sens][::-1]
    vals = [r["rel_l2"] for r in sens][::-1]
    ax.barh(names, vals, color="C3")
    ax.set_xlabel("relative L2 error of the final latent (one group quantized)")
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path)


# -- markdown --------------------------------------------------------------------------------------

def comparison_table(evaluation: Mapping[str, Any]) -> list[str]:
    """Markdown rows: one per method, cosine / max-abs / PSNR per format."""
    formats = evaluation["formats"]
    head = ["method"]
    for f in formats:
        lab = _FMT_LABEL.get(f, f)
        head += [f"{lab} cosine", f"{lab} max-abs", f"{lab} PSNR (dB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["method"], r["format"]): r for r in evaluation["comparison"]}
    for m in evaluation["methods"]:
        cells = [f"{m}{' (chosen)' if m == evaluation['sensitivity_method'] else ''}"]
        for f in formats:
            r = by.get((m, f))
            cells += ["-", "-", "-"] if r is None else [f"{r['cosine']:.6f}", f"{r['max_abs']:.4g}",
                                                       _f(r["psnr_db"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _per_step_section(evaluation: Mapping[str, Any], figs: Path) -> list[str]:
    """Per-step sensitivity (teacher-forced calls, windows quantized alone) and the quality-vs-speed
    table with the recommended recipe setting."""
    per_step, windows, trade = (evaluation.get(k) for k in ("per_step", "step_windows", "tradeoff"))
    if not per_step:
        return []
    L = ["## Per-step sensitivity", "",
         "One held-out trajectory; at every call the fake-quantized model gets the unquantized model's inputs "
         "(teacher forcing): the worst call's cosine / PSNR per step, and the error its update writes into the "
         "latents (sigma step x velocity error, PSNR against the final latents' peak). Then each window of steps "
         "quantized alone (the others unquantized): its share of the final error.", "",
         "| step | t | sigma step | worst call cosine | worst call PSNR (dB) | update contribution (dB) |",
         "|---|---|---|---|---|---|"]
    for r in per_step:
        L.append(f"| {r['step']} | {r['timestep']:.1f} | {r['sigma'] - r['sigma_next']:.4f} | {r['call_cosine']:.5f} | "
                 f"{_f(r['call_psnr_db'], '.1f')} | {_f(r['contribution_db'], '.1f')} |")
    if windows:
        L += ["", "| steps quantized (others unquantized) | final cosine | final PSNR (dB) |", "|---|---|---|"]
        L += [f"| {w['steps'][0]}-{w['steps'][1] - 1} | {w['cosine']:.6f} | {_f(w['psnr_db'], '.2f')} |"
              for w in windows]
    _per_step_figure(per_step, figs / "per_step.png")
    L += ["", "![per-step](figures/per_step.png)", ""]
    if trade:
        L += ["## Quality vs speed", "",
              "Final-latent PSNR against the unquantized model (same trajectories and peak as above) and the share "
              "of the linear layers' FLOPs that still run quantized.", "",
              "| option | quantized linear FLOPs | cosine | PSNR (dB) |", "|---|---|---|---|"]
        L += [f"| {t['option']} | {100 * t['fp8_linear_flop_fraction']:.1f}% | {t['cosine']:.6f} | "
              f"{_f(t['psnr_db'], '.2f')} |" for t in trade]
        target = evaluation.get("target_psnr_db")
        ok = [t for t in trade if target is not None and t["psnr_db"] >= target]
        best = max(ok, key=lambda t: t["fp8_linear_flop_fraction"]) if ok else max(trade, key=lambda t: t["psnr_db"])
        rec = best.get("recipe")
        why = (f"the most quantized option at or above the {target:g} dB target" if ok else
               f"no option reaches the {target:g} dB target; the best PSNR" if target is not None else "the best PSNR")
        L += ["", f"Recommended: **{best['option']}**" + (f" (`{rec}`)" if rec else " (the recipe as it is)") +
              f": {why}.", ""]
    return L


def _per_step_figure(rows, path: Path) -> None:
    fig = _figure(7.0, 3.5)
    ax = fig.add_subplot(1, 1, 1)
    x = [r["step"] for r in rows]
    ax.plot(x, [r["call_psnr_db"] for r in rows], "o-", label="worst call PSNR")
    ax.plot(x, [r["contribution_db"] for r in rows], "s--", label="update contribution")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("dB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _steps_note(ev: dict) -> str:
    """Says so when the evaluation ran fewer steps than users sample (``calibration.eval_steps``)."""
    model = ev.get("model_num_steps")
    if model and ev["num_steps"] < model:
        return f" (**shortened**: the model samples {model} steps; calibration.eval_steps)"
    return ""


def write_report(out_dir: str | Path, stats, evaluation: Mapping[str, Any] | None, *, preset=None, options=None,
                 quant_format: str = "fp8_e4m3", weight_rounding: str | None = None) -> Path:
    """Write ``out_dir/report.md`` and ``out_dir/figures/*.png``; returns the report path.

    Args:
        out_dir: the calibration artifact folder.
        stats: the :class:`~trt_sora.calibrate.stats.CalibStats`.
        evaluation: :func:`trt_sora.calibrate.evaluate.evaluate`'s result, or None (tables from
            the stats only).
        preset: the :class:`CalibPreset` (for the header).
        options: :class:`trt_sora.calibrate.run.ReportOptions` (``top_k``).
        quant_format: the recipe's format (named in the header).
        weight_rounding: how the weights were rounded (GPTQ passes and why, or nearest and why).
    """
    out_dir = Path(out_dir)
    figs = out_dir / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    top_k = getattr(options, "top_k", 6)
    md = stats.metadata
    quantized = evaluation["quantized_sites"] if evaluation else []
    rows = layer_rows(stats, quantized)
    L: list[str] = []
    L += [f"# Calibration report: {md.model}", ""]
    L += ["| | |", "|---|---|",
          f"| model | `{md.model}` (hash `{md.model_hash}`) |",
          f"| method (`<site>.amax`) | **{md.method}** (others kept as `<site>.amax_<method>`) |",
          f"| engine format | {quant_format} |",
          f"| preset | `{md.preset}`: {md.num_samples} samples from `{md.prompt_set}`, {md.num_steps} steps, "
          f"guidance {md.guidance_scale}, shift {md.shift}, seed {md.seed} |",
          f"| sampling | {md.extra.get('sampling', 'not recorded')} |",
          f"| CFG branches | {', '.join(md.branches)} |",
          f"| shapes (latent) | {'; '.join(str(s) for s in md.shapes)} |",
          f"| timesteps | {', '.join(f'{t:.1f}' for t in md.timesteps)} |",
          f"| sites | {len(rows)} activation sites ({len(quantized)} quantized by the recipe's policy), "
          f"{len(md.extra.get('weight_sites', []))} weight sites |",
          f"| observers | {', '.join(f'{m}: {s}' for m, s in md.observers.items())} |",
          *([f"| weight rounding | {weight_rounding} |"] if weight_rounding else []), ""]

    if evaluation:
        ev = evaluation["eval"]
        L += ["## Calibrator comparison", "",
              f"Final latent of a {ev['num_steps']}-step trajectory{_steps_note(ev)} (guidance "
              f"{ev['guidance_scale']}, shift {ev['shift']}) at latent shape {ev['shape']} on held-out prompts "
              f"{', '.join(ev['prompt_ids'])}: "
              "the fake-quantized model (PyTorch; every quantized linear's input per tensor at the method's "
              "amax, weights per output channel) against the unquantized model. "
              f"**PSNR peak = {ev['psnr_peak']:.4g} ({ev['psnr_peak_def']})**. "
              f"{len(quantized)} linears quantized; excluded by policy: "
              f"{', '.join(f'`{s}`' for s in evaluation['excluded_sites']) or 'none'}.", ""]
        L += comparison_table(evaluation)
        if "mse" in evaluation["methods"]:
            L += ["", f"(`mse` amax minimises the {md.observers.get('mse', {}).get('fmt', quant_format)} "
                      "error; its other-format column uses the same amax.)"]
        L += [""]
        sens = evaluation["sensitivity"]
        if sens:
            _sens_figure(sens, figs / "sensitivity.png")
            L += ["## Sensitivity ranking", "",
                  f"One layer group quantized at a time ({evaluation['sensitivity_method']}, "
                  f"{evaluation['sensitivity_format']}), worst first; same trajectories and peak as above.", "",
                  "| rank | group | type | linears | cosine | max-abs | rel L2 | PSNR (dB) |",
                  "|---|---|---|---|---|---|---|---|"]
            for i, r in enumerate(sens, 1):
                L.append(f"| {i} | `{r['group']}` | {r['type']} | {r['num_sites']} | {r['cosine']:.6f} | "
                         f"{r['max_abs']:.4g} | {r['rel_l2']:.4g} | {_f(r['psnr_db'], '.2f')} |")
            L += ["", "![sensitivity](figures/sensitivity.png)", ""]
        skip = evaluation["skip"]
        L += ["## Suggested skip list", "", f"Rule: {skip['rule']}.", "", "```yaml", skip["yaml"].rstrip(), "```", ""]
        if skip.get("with_skip") and skip.get("all_quantized"):
            a, b = skip["all_quantized"], skip["with_skip"]
            L += [f"Checked: all {len(quantized)} quantized: cosine {a['cosine']:.6f}, PSNR "
                  f"{_f(a['psnr_db'], '.2f')} dB; with these exclusions ({skip['num_sites_kept']} quantized): "
                  f"cosine {b['cosine']:.6f}, PSNR {_f(b['psnr_db'], '.2f')} dB.", ""]

        L += _per_step_section(evaluation, figs)

    if evaluation and evaluation.get("peer"):
        from trt_sora.calibrate.peer import report_section

        L += report_section(evaluation["peer"])
    # drift
    drift = sorted((r for r in rows if r.get("drift")), key=lambda r: -r["drift"])[:top_k]
    if drift:
        _drift_figure(stats, [r["site"] for r in drift], figs / "drift.png")
        L += ["## Drift over denoising steps", "",
              "Sites whose per-step abs-max varies most (max/min over steps, both branches).", "",
              "| site | max/min over steps | chosen amax |", "|---|---|---|"]
        L += [f"| `{r['site']}` | {r['drift']:.3g} | {r['chosen']:.4g} |" for r in drift]
        L += ["", "![drift](figures/drift.png)", ""]
    # outliers
    outl = sorted((r for r in rows if r.get("outlier") and r["site"] in stats.histograms),
                  key=lambda r: -r["outlier"])[:top_k]
    if outl:
        _hist_figure(stats, outl, figs / "histograms.png")
        L += ["## Outlier layers", "", f"Largest max|x| / chosen amax ({md.method}); histograms of |x| "
              "(log counts) with each method's amax.", "",
              "| site | minmax / chosen | clipped at chosen | FP8 SQNR (dB) | INT8 SQNR (dB) |",
              "|---|---|---|---|---|"]
        L += [f"| `{r['site']}` | {r['outlier']:.3g} | {100 * r.get('clipped_fraction', 0):.4f}% | "
              f"{_f(r.get('sqnr_fp8_e4m3'), '.1f')} | {_f(r.get('sqnr_int8'), '.1f')} |" for r in outl]
        L += ["", "![histograms](figures/histograms.png)", ""]
    # CFG
    cfg = sorted((r for r in rows if r.get("cfg_ratio")), key=lambda r: -abs(math.log(r["cfg_ratio"])))[:top_k]
    if cfg:
        _cfg_figure(rows, stats, figs / "cfg.png")
        L += ["## CFG branch differences", "", "cond / uncond amax (max over steps); largest differences first.",
              "", "| site | cond / uncond |", "|---|---|"]
        L += [f"| `{r['site']}` | {r['cfg_ratio']:.3g} |" for r in cfg]
        L += ["", "![cfg](figures/cfg.png)", ""]
    # per-layer table
    methods = [md.method] + sorted({m for r in rows for m in r["amax"] if m != md.method})
    L += ["## Per-layer summary", "",
          f"amax per method; clipped fraction and SQNR at the chosen amax ({md.method}) from the stored "
          "|x| histogram (to one bin). `q` = quantized by the recipe's policy.", "",
          "| site | q | " + " | ".join(f"amax {m}" for m in methods)
          + " | clipped | FP8 SQNR (dB) | INT8 SQNR (dB) | drift | cond/uncond |",
          "|" + "---|" * (len(methods) + 7)]
    for r in rows:
        L.append(f"| `{r['site']}` | {'y' if r['quantized'] else ''} | "
                 + " | ".join(_f(r["amax"].get(m), ".4g") for m in methods)
                 + f" | {100 * r.get('clipped_fraction', 0):.3f}% | {_f(r.get('sqnr_fp8_e4m3'), '.1f')} | "
                   f"{_f(r.get('sqnr_int8'), '.1f')} | {_f(r.get('drift'), '.3g')} | {_f(r.get('cfg_ratio'), '.3g')} |")
    L.append("")
    path = out_dir / CALIB_REPORT
    path.write_text("\n".join(L), encoding="utf-8")
    log.info("wrote calibration report %s", path)
    return path
