"""Calibration statistics file: ``stats.safetensors`` (+ JSON metadata in its header).

Layout (every tensor on CPU, keys ``"<site>.<field>"``; ``<site>`` is the
module path and may contain dots, ``<field>`` never does):

=============================  =========  ===================================================
key                            dtype      shape / meaning
=============================  =========  ===================================================
``<site>.amax``                fp32       ``[]`` per tensor or ``[C]`` per channel: the chosen
                                          method's clipping bound (> 0, finite). Required.
``<site>.amax_per_step``       fp32       ``[steps]`` (one branch) or ``[steps, branches]``
                                          (CFG; columns = ``metadata.branches``): abs-max per
                                          denoising step; 0 where never seen. Optional.
``<site>.count_per_step``      int64      same shape as ``amax_per_step``: batches seen. Optional.
``<site>.amax_<method>``       fp32       amax of another method collected in the same pass
                                          (``minmax``, ``ema``, ``percentile``, ``mse``). Optional.
``<site>.hist``                int64      ``[num_bins]`` histogram of ``|x|``. Optional.
``<site>.hist_range``          fp32       ``[]``: upper edge of the last ``hist`` bin (a power of two).
``<site>.hist_absmax``         fp32       ``[]``: exact ``max|x|`` behind ``hist``. Optional.
``<site>.ema_history``         fp32       ``[batches, 2]``: each batch's min and max, in collection
                                          order (the EMA observer's state). Optional.
=============================  =========  ===================================================

``hist``, ``hist_absmax``, ``amax_minmax`` and ``ema_history`` are the observers' full
states: :func:`sites_from_stats` rebuilds the per-site observers from them, so the
statistics of calibration shards merge exactly (:mod:`trt_sora.calibrate.shards`).

The safetensors header metadata holds ``{"format": "trt_sora.calib_stats",
"format_version": "1", "trt_sora.calib": "<json of StatsMetadata>"}``;
:func:`read_metadata` reads it without loading tensors.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trt_sora.errors import CalibrationError

log = logging.getLogger("trt_sora")

__all__ = ["STATS_FORMAT", "STATS_FORMAT_VERSION", "CalibStats", "StatsMetadata", "read_metadata"]

STATS_FORMAT = "trt_sora.calib_stats"
STATS_FORMAT_VERSION = 1
_META_KEY = "trt_sora.calib"
_KEY_RE = re.compile(r"^(?P<site>.+)\.(?P<field>amax|amax_per_step|count_per_step|hist|hist_range|hist_absmax|"
                     r"ema_history|amax_[a-z0-9]+)$")
_RECALIBRATE = "re-run calibration (trt-sora calibrate ... --out DIR) to regenerate it"


@dataclasses.dataclass
class StatsMetadata:
    """What produced the statistics (JSON in the safetensors header).

    Attributes:
        method: method of ``<site>.amax`` (``minmax``/``ema``/``percentile``/``mse``).
        observers: ``{method: settings}`` of every observer collected (see ``Observer.settings()``).
        num_samples: calibration trajectories run (prompts x shapes).
        num_steps: denoising steps per trajectory.
        timesteps: scheduler timestep of each step index (floats, len ``num_steps``).
        branches: CFG branch names = columns of ``amax_per_step`` (``["cond", "uncond"]``).
        shapes: latent shapes calibrated, dicts with ``batch, latent_frames, latent_height,
            latent_width, text_len``.
        model: model reference (name or path); ``model_hash``: its weights' hash (hex), "" if unknown.
        preset, prompt_set, seed, guidance_scale, shift: the calibration preset's values.
        extra: anything else (tool versions, timings), JSON-safe.
        format_version: of the file; checked on load.
    """

    method: str
    observers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    num_samples: int = 0
    num_steps: int = 0
    timesteps: list[float] = dataclasses.field(default_factory=list)
    branches: list[str] = dataclasses.field(default_factory=lambda: ["cond", "uncond"])
    shapes: list[dict[str, int]] = dataclasses.field(default_factory=list)
    model: str = ""
    model_hash: str = ""
    preset: str = ""
    prompt_set: str = ""
    seed: int | None = None
    guidance_scale: float | None = None
    shift: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = STATS_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "stats metadata") -> StatsMetadata:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CalibrationError(f"{where}: unknown metadata key(s) {unknown} for format_version "
                                   f"{data.get('format_version')}; the file was written by a newer trt_sora - "
                                   f"upgrade, or {_RECALIBRATE}")
        if "method" not in data:
            raise CalibrationError(f"{where}: metadata lacks 'method'; {_RECALIBRATE}")
        return cls(**dict(data))


def _site_error(path: Any, site: str, problem: str) -> CalibrationError:
    return CalibrationError(
        f"{path}: site {site!r} {problem}; {_RECALIBRATE}, or exclude the site from quantization "
        "(quantization.exclude in the recipe) if it legitimately sees only zeros")


@dataclasses.dataclass
class CalibStats:
    """Per-site calibration statistics; the artifact of the calibration stage.

    Attributes:
        amax: ``{site: fp32 [] or [C]}`` clipping bounds of ``metadata.method``.
        metadata: :class:`StatsMetadata`.
        amax_per_step: ``{site: fp32 [steps] or [steps, branches]}`` drift over denoising steps.
        count_per_step: ``{site: int64}`` batches behind each ``amax_per_step`` entry.
        method_amax: ``{site: {method: fp32 amax}}`` other methods from the same pass.
        histograms: ``{site: (int64 [num_bins] counts, range)}`` of ``|x|``.
        hist_absmax: ``{site: fp32 []}`` exact ``max|x|`` behind each histogram.
        ema_history: ``{site: fp32 [batches, 2]}`` per-batch min/max (the EMA observer's state).
    """

    amax: dict[str, Tensor]
    metadata: StatsMetadata
    amax_per_step: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    count_per_step: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    method_amax: dict[str, dict[str, Tensor]] = dataclasses.field(default_factory=dict)
    histograms: dict[str, tuple[Tensor, float]] = dataclasses.field(default_factory=dict)
    hist_absmax: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    ema_history: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    @property
    def sites(self) -> list[str]:
        """Site names in file order."""
        return list(self.amax)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_sites(cls, sites: Mapping[str, Any], metadata: StatsMetadata, *, keep_per_step: bool = True,
                   keep_histograms: bool = True) -> CalibStats:
        """Reduce ``{site: SiteStats}`` to stats: ``amax`` of ``metadata.method`` plus the rest.

        Every site must have collected ``metadata.method``. ``metadata.observers``
        and ``metadata.branches`` are filled from the sites when empty.
        """
        from trt_sora.calibrate.observers import HistogramObserver

        out = cls(amax={}, metadata=metadata)
        for key, site in sites.items():
            all_amax = site.compute_all()
            if metadata.method not in all_amax:
                raise CalibrationError(f"site {key!r} collected {list(all_amax)} but the stats method is "
                                       f"{metadata.method!r}; add it to the site's methods")
            out.amax[key] = all_amax.pop(metadata.method)
            if all_amax:
                out.method_amax[key] = all_amax
            if keep_per_step and site.count_per_step.numel():
                grid, count = site.amax_per_step, site.count_per_step
                if grid.shape[1] == 1:
                    grid, count = grid[:, 0], count[:, 0]
                out.amax_per_step[key], out.count_per_step[key] = grid, count
            if keep_histograms:
                hobs = next((o for o in site.observers.values() if isinstance(o, HistogramObserver)), None)
                if hobs is not None and hobs.num_batches:
                    out.histograms[key] = hobs.histogram()
                    out.hist_absmax[key] = hobs.absmax.float().cpu().reshape(())
                ema = site.observers.get("ema")
                if ema is not None and ema.num_batches:
                    out.ema_history[key] = ema.history
            for m, o in site.observers.items():
                metadata.observers.setdefault(m, o.settings())
            metadata.branches = list(site.branches)
        return out

    # -- validation -------------------------------------------------------------------------------
    def validate(self, path: Any = "stats") -> CalibStats:
        """Check every amax is fp32, finite and > 0 and per-step arrays are finite and >= 0.

        Raises CalibrationError naming the site and the fix. Returns ``self``.
        """
        if self.metadata.format_version != STATS_FORMAT_VERSION:
            raise CalibrationError(f"{path}: format_version {self.metadata.format_version} is not supported "
                                   f"(this trt_sora reads {STATS_FORMAT_VERSION}); {_RECALIBRATE}")
        if not self.amax:
            raise CalibrationError(f"{path}: holds no site; {_RECALIBRATE} and check that hooks matched modules")
        for site, a in self.amax.items():
            if not isinstance(a, Tensor) or a.dtype != torch.float32 or a.dim() > 1:
                raise _site_error(path, site, f"amax must be an fp32 tensor of shape [] or [C], got "
                                              f"{getattr(a, 'dtype', type(a))} {tuple(getattr(a, 'shape', ()))}")
            if not bool(torch.isfinite(a).all()):
                raise _site_error(path, site, "has a non-finite amax (NaN/inf activations during calibration)")
            if not bool((a > 0).all()):
                raise _site_error(path, site, f"has amax {float(a.min()):g} <= 0 (it only saw zeros, or the "
                                              "statistics are corrupt)")
        for site, g in self.amax_per_step.items():
            if site not in self.amax:
                raise _site_error(path, site, "has amax_per_step but no amax")
            if g.dim() not in (1, 2) or not bool(torch.isfinite(g).all()) or bool((g < 0).any()):
                raise _site_error(path, site, f"has an invalid amax_per_step (shape {tuple(g.shape)}; must be "
                                              "[steps] or [steps, branches], finite, >= 0)")
            c = self.count_per_step.get(site)
            if c is not None and c.shape != g.shape:
                raise _site_error(path, site, f"count_per_step shape {tuple(c.shape)} != amax_per_step "
                                              f"shape {tuple(g.shape)}")
        for site, per_method in self.method_amax.items():
            for m, a in per_method.items():
                if not re.fullmatch(r"[a-z0-9]+", m):
                    raise _site_error(path, site, f"has method name {m!r}; method names are [a-z0-9]+")
                if not bool(torch.isfinite(a).all()):
                    raise _site_error(path, site, f"has a non-finite {m} amax")
        for site, (h, r) in self.histograms.items():
            if h.dim() != 1 or not math.isfinite(r) or r < 0:
                raise _site_error(path, site, f"has an invalid histogram (shape {tuple(h.shape)}, range {r})")
        return self

    # -- IO ---------------------------------------------------------------------------------------
    def to_tensors(self) -> dict[str, Tensor]:
        """The flat ``{key: tensor}`` dict written to safetensors (CPU, contiguous)."""
        def c(t: Tensor) -> Tensor:
            return t.detach().to("cpu").contiguous().clone()

        out: dict[str, Tensor] = {}
        for site, a in self.amax.items():
            out[f"{site}.amax"] = c(a)
            if site in self.amax_per_step:
                out[f"{site}.amax_per_step"] = c(self.amax_per_step[site]).float()
            if site in self.count_per_step:
                out[f"{site}.count_per_step"] = c(self.count_per_step[site]).long()
            for m, ma in self.method_amax.get(site, {}).items():
                out[f"{site}.amax_{m}"] = c(ma).float()
            if site in self.histograms:
                h, r = self.histograms[site]
                out[f"{site}.hist"] = c(h).long()
                out[f"{site}.hist_range"] = torch.tensor(r, dtype=torch.float32)
            if site in self.hist_absmax:
                out[f"{site}.hist_absmax"] = c(self.hist_absmax[site]).float()
            if site in self.ema_history:
                out[f"{site}.ema_history"] = c(self.ema_history[site]).float()
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Validate, then write ``path`` atomically (temp file in the same folder + ``os.replace``).

        Parent folders are created. Returns the path. A crash never leaves a half-written file.
        """
        from safetensors.torch import save_file

        path = Path(path)
        self.validate(path)
        tensors = self.to_tensors()
        meta = {"format": STATS_FORMAT, "format_version": str(STATS_FORMAT_VERSION),
                _META_KEY: json.dumps(self.metadata.to_dict(), sort_keys=True)}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("wrote %d sites to %s", len(self.amax), path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, validate: bool = True) -> CalibStats:
        """Read a ``stats.safetensors``; validates by default (see :meth:`validate`).

        Raises CalibrationError: missing/unreadable file, wrong format or version,
        unknown keys, invalid amax (naming the site and the fix).
        """
        from safetensors.torch import load_file

        path = Path(path)
        metadata = read_metadata(path)
        tensors = load_file(str(path))
        out = cls(amax={}, metadata=metadata)
        ranges: dict[str, float] = {}
        for key, t in tensors.items():
            m = _KEY_RE.match(key)
            if m is None:
                raise CalibrationError(f"{path}: unexpected tensor {key!r} (keys are '<site>.amax', "
                                       f"'<site>.amax_per_step', ...); {_RECALIBRATE}")
            site, field = m["site"], m["field"]
            if field == "amax":
                out.amax[site] = t
            elif field == "amax_per_step":
                out.amax_per_step[site] = t
            elif field == "count_per_step":
                out.count_per_step[site] = t
            elif field == "hist":
                out.histograms[site] = (t, math.nan)
            elif field == "hist_range":
                ranges[site] = float(t)
            elif field == "hist_absmax":
                out.hist_absmax[site] = t
            elif field == "ema_history":
                out.ema_history[site] = t
            else:
                out.method_amax.setdefault(site, {})[field[len("amax_"):]] = t
        for site, (h, _) in list(out.histograms.items()):
            if site not in ranges:
                raise _site_error(path, site, "has 'hist' without 'hist_range'")
            out.histograms[site] = (h, ranges[site])
        orphans = sorted((set(out.amax_per_step) | set(out.method_amax) | set(out.histograms) | set(out.hist_absmax)
                          | set(out.ema_history)) - set(out.amax))
        if orphans:
            raise _site_error(path, orphans[0], "has statistics but no '<site>.amax'")
        return out.validate(path) if validate else out


def read_metadata(path: str | os.PathLike) -> StatsMetadata:
    """The :class:`StatsMetadata` of a stats file, read from its header only (no tensors loaded).

    Raises CalibrationError: file missing, not safetensors, not a trt_sora stats
    file, or a format version this trt_sora does not read.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"calibration stats {path} do not exist; {_RECALIBRATE} or pass the right --stats")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError types
        raise CalibrationError(f"{path}: not a readable safetensors file ({exc}); {_RECALIBRATE}") from None
    if header.get("format") != STATS_FORMAT:
        raise CalibrationError(f"{path}: not a trt_sora calibration stats file (header format "
                               f"{header.get('format')!r}); {_RECALIBRATE}")
    version = header.get("format_version")
    if version != str(STATS_FORMAT_VERSION):
        raise CalibrationError(f"{path}: stats format_version {version!r} is not supported (this trt_sora reads "
                               f"{STATS_FORMAT_VERSION}); {_RECALIBRATE}")
    try:
        data = json.loads(header[_META_KEY])
    except (KeyError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: metadata {_META_KEY!r} is missing or not JSON ({exc}); {_RECALIBRATE}"
                               ) from None
    meta = StatsMetadata.from_dict(data, where=str(path))
    if meta.format_version != STATS_FORMAT_VERSION:
        raise CalibrationError(f"{path}: metadata format_version {meta.format_version} is not supported "
                               f"(this trt_sora reads {STATS_FORMAT_VERSION}); {_RECALIBRATE}")
    return meta


def sites_from_stats(stats: CalibStats) -> dict[str, Any]:
    """Rebuild ``{site: SiteStats}`` (observers with their full states, the per-step grid) from a stats
    file's tensors, for merging shards. Raises CalibrationError when a state is missing (a file written
    without observer states, or by an older trt_sora)."""
    from trt_sora.calibrate.histogram import exponent_of
    from trt_sora.calibrate.observers import SiteStats

    meta = stats.metadata
    weight_sites = set(meta.extra.get("weight_sites", []))
    out = {}
    for site, amax in stats.amax.items():
        if site in weight_sites:
            continue
        methods = {meta.method: amax, **stats.method_amax.get(site, {})}
        kwargs = {m: {k: v for k, v in st.items() if k not in ("method", "axis")} for m, st in meta.observers.items()}
        ss = SiteStats(site, [m for m in meta.observers if m in methods], branches=meta.branches,
                       observer_kwargs=kwargs)
        n = int(stats.count_per_step[site].sum()) if site in stats.count_per_step else 0
        for m, o in ss.observers.items():
            o.num_batches = n
            if m == "minmax":
                a = methods[m].float()
                o.min_val, o.max_val = -a, a.clone()
            elif m == "ema":
                if site not in stats.ema_history:
                    raise _site_error("stats", site, "has no ema_history (the EMA observer's state)")
                o._load_state_tensors({"history": stats.ema_history[site]})
                o.num_batches = stats.ema_history[site].shape[0]
            elif site not in stats.histograms or site not in stats.hist_absmax:
                raise _site_error("stats", site, f"has no histogram state for its {m} observer")
        if site in stats.histograms:
            h, r = stats.histograms[site]
            hobs = next(o for o in ss.observers.values() if hasattr(o, "_h"))
            hobs._h.counts = h.long().clone()
            hobs._h.exponent = exponent_of(torch.tensor(r, dtype=torch.float32) * 0.5) if r > 0 else \
                exponent_of(torch.tensor(0.0))
            hobs._h.absmax = stats.hist_absmax[site].float().reshape(()).clone()
        if site in stats.amax_per_step:
            g, c = stats.amax_per_step[site], stats.count_per_step[site]
            ss._grid, ss._count = (g[:, None], c[:, None]) if g.dim() == 1 else (g.clone(), c.clone())
        out[site] = ss
    return out
