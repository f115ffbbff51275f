"""``make engine``: export -> calibrate -> quantize -> build -> check, reusing unchanged stages.

Stages meet only through their artifact folders under ``<out>/<model>/<recipe>/``.
A stage is redone only when its *fingerprint* changed: the hash of its config
section, the trt_sora version and the sha256 of the files it reads. Fingerprints
are kept in ``pipeline.json`` beside the stage folders.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

from trt_sora import __version__
from trt_sora.config import Recipe, load_recipe, to_dict
from trt_sora.errors import ConfigError
from trt_sora.manifest import MANIFEST, sha256_file, write_json

log = logging.getLogger("trt_sora")

STAGES = ("export", "calibrate", "quantize", "build", "check")
STATE = "pipeline.json"


@dataclasses.dataclass
class StageOutcome:
    stage: str
    status: str            # "ran" | "reused" | "skipped" | "failed"
    seconds: float = 0.0
    folder: str = ""
    detail: str = ""


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _file_hashes(*paths: Path) -> list[str]:
    out = []
    for p in paths:
        out.append(sha256_file(p) if p.is_file() else "missing")
        data = p.with_name(p.name + ".data")
        if data.is_file():
            out.append(sha256_file(data))
    return out


class EnginePipeline:
    """Runs the stages for one (model, recipe) under ``out_root/<model>/<recipe>/``."""

    def __init__(self, recipe: Recipe | str, model: str | None = None, out_root: str | Path = "build", *,
                 force: bool = False, progress: Callable[[StageOutcome], None] | None = None):
        from trt_sora.models import get_adapter

        self.recipe = load_recipe(recipe) if isinstance(recipe, str) else recipe
        self.adapter = get_adapter(model or self.recipe.model.default)
        self.buckets, self.bucket_source = self.adapter.buckets_for(self.recipe)
        self.run_dir = Path(out_root) / self.adapter.name / self.recipe.name
        self.force = force
        self.progress = progress or (lambda o: None)
        self._model = None
        self.state_path = self.run_dir / STATE
        self.state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}

    # -- helpers -------------------------------------------------------------------------
    @property
    def calib_preset_name(self) -> str:
        """The recipe's preset, unless the model declares its own (toy models: tiny shapes)."""
        return self.adapter.spec.defaults.get("calib_preset") or self.recipe.calibration.preset

    def folder(self, stage: str) -> Path:
        return self.run_dir / {"calibrate": "calib", "quantize": "quant", "build": "engine",
                               "check": "parity"}.get(stage, stage)

    @property
    def model(self):
        if self._model is None:
            self._model = self.adapter.load(self.recipe.model.dtype.value, "cpu")
        return self._model

    def _reusable(self, stage: str, fp: str) -> bool:
        return (not self.force and self.state.get(stage) == fp
                and (self.folder(stage) / MANIFEST).is_file())

    def _record(self, stage: str, fp: str) -> None:
        self.state[stage] = fp
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, self.state)

    def _run(self, stage: str, fp: str, fn: Callable[[], str]) -> StageOutcome:
        if self._reusable(stage, fp):
            out = StageOutcome(stage, "reused", folder=str(self.folder(stage)), detail="inputs unchanged")
            self.progress(out)
            return out
        self.state.pop(stage, None)
        t0 = time.perf_counter()
        detail = fn() or ""
        self._record(stage, fp)
        out = StageOutcome(stage, "ran", time.perf_counter() - t0, str(self.folder(stage)), detail)
        self.progress(out)
        return out

    # -- stages --------------------------------------------------------------------------
    def export(self) -> StageOutcome:
        from trt_sora.export import export_onnx

        fp = _fingerprint("export", __version__, self.adapter.describe(), to_dict(self.recipe.export))

        def go():
            res = export_onnx(self.adapter, self.recipe.export, self.folder("export"), model=self.model)
            worst = min(p["cosine"] for p in res.parity) if res.parity else float("nan")
            return f"ORT parity at {len(res.parity)} shapes, worst cosine {worst:.7f}"

        return self._run("export", fp, go)

    def calibrate(self) -> StageOutcome:
        from trt_sora.calibrate.data import load_preset
        from trt_sora.calibrate.run import calibrate

        preset = load_preset(self.calib_preset_name)
        fp = _fingerprint("calibrate", __version__, self.adapter.spec.model_hash(),
                          to_dict(self.recipe.calibration), to_dict(preset),
                          to_dict(self.recipe.quantization), self.adapter.sampling.to_dict())

        def go():
            res = calibrate(self.adapter, self.recipe.calibration, self.folder("calibrate"), model=self.model,
                            preset=preset, quant_format=self.recipe.quantization.format,
                            quant_config=self.recipe.quantization)
            return f"{len(res.stats.sites)} sites -> {res.stats_path.name}"

        return self._run("calibrate", fp, go)

    def quantize(self) -> StageOutcome:
        from trt_sora.quantize import quantize_onnx

        onnx = self.folder("export") / "model.onnx"
        # unquantized recipes (bf16): the graph is only cast to the graph dtype, no stats
        stats = self.folder("calibrate") / "stats.safetensors" if self.quantized else None
        fp = _fingerprint("quantize", __version__, to_dict(self.recipe.quantization),
                          _file_hashes(onnx, *([stats] if stats else [])))

        def go():
            res = quantize_onnx(onnx, stats, self.recipe.quantization, self.folder("quantize"),
                                model_hash=self.adapter.spec.model_hash())
            c = res.counts
            return (f"{c['quantized_linears']} of {c['graph_linears']} linears quantized "
                    f"({self.recipe.quantization.format.value}), {c['fused_groups']} fused groups")

        return self._run("quantize", fp, go)

    def build(self) -> StageOutcome:
        from trt_sora.build import build_engine

        qdq = self.folder("quantize") / "model.qdq.onnx"
        fp = _fingerprint("build", __version__, self.recipe.backend.value, self.recipe.compute_capability,
                          to_dict(self.recipe.build), [b.to_yaml() for b in self.buckets], _file_hashes(qdq))

        def go():
            res = build_engine(qdq, self.recipe, self.folder("build"), buckets=self.buckets,
                               export_manifest=self.folder("export"), model_name=self.adapter.name)
            a = res.report["analysis"]
            return (f"{len(res.engine_paths)} engine(s), {res.report['profiles']['built']} profile(s); "
                    f"GEMMs {a['gemm_counts']}, FP8 fraction of quantized {a['fp8_gemm_fraction']:.2f}; "
                    f"attention fused: {a['attention']['fused']}")

        return self._run("build", fp, go)

    def check(self) -> StageOutcome:
        from trt_sora.parity import check_artifacts

        inputs = [self.folder(s) / MANIFEST for s in ("export", "calibrate", "quantize", "build")]
        fp = _fingerprint("check", __version__, to_dict(self.recipe.parity), self.adapter.sampling.to_dict(),
                          _file_hashes(*inputs))

        def go():
            rep = check_artifacts(self.run_dir, self.recipe, model=self.adapter)
            return f"passed={rep.get('passed')}" if isinstance(rep, dict) else ""

        return self._run("check", fp, go)

    @property
    def quantized(self) -> bool:
        return self.recipe.quantization.format.value != "none"

    def run(self, stages: Sequence[str] = STAGES) -> list[StageOutcome]:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
        outcomes = []
        for stage in (s for s in STAGES if s in stages):
            if stage == "calibrate" and not self.quantized:
                outcome = StageOutcome(stage, "skipped", detail="recipe has quantization.format none")
                self.progress(outcome)
            else:
                outcome = getattr(self, stage)()
            outcomes.append(outcome)
        return outcomes


def run_engine(recipe: Recipe | str, model: str | None = None, out_root: str | Path = "build", *,
               force: bool = False, stages: Sequence[str] = STAGES,
               progress: Callable[[StageOutcome], None] | None = None) -> list[StageOutcome]:
    """Run every stage for ``(model, recipe)``; see :class:`EnginePipeline`."""
    return EnginePipeline(recipe, model, out_root, force=force, progress=progress).run(stages)
