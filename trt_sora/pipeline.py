"""``make engine``: export -> calibrate -> quantize -> build -> check, reusing unchanged stages.

Stages meet only through their artifact folders under ``<out>/<model>/<recipe>/``.
A stage is reused only when

* its *fingerprint* is unchanged: the hash of its config section, the trt_sora version and the
  sha256 of the files it reads (kept in ``pipeline.json`` beside the stage folders), and
* its folder still holds what it wrote: every file its ``manifest.json`` lists re-hashes to the
  recorded sha256 (cached by size, mtime and ctime; see :mod:`trt_sora.manifest`).

Otherwise it reruns, and the reason is logged (``engine/x.plan: sha256 differs ...``). A failed
parity check raises :class:`ParityError` (the CLI exits 1) and is never recorded as done. One
run at a time holds the run folder (a lock; a second run waits, then reuses what the first made),
and temp folders of runs that died (kill -9) are removed when the next run starts.
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
from trt_sora.errors import ArtifactError, ConfigError, ParityError
from trt_sora.manifest import (MANIFEST, folder_lock, read_json, sha256_file, sweep_dead_temps, verify_folder,
                               write_json)

log = logging.getLogger("trt_sora")

STAGES = ("export", "calibrate", "quantize", "build", "check")
STATE = "pipeline.json"
FOLDERS = {"export": "export", "calibrate": "calib", "quantize": "quant", "build": "engine", "check": "parity"}
RECIPE_FILE = "recipe.yaml"


@dataclasses.dataclass
class StageOutcome:
    stage: str
    status: str            # "ran" | "reused" | "skipped" | "failed"
    seconds: float = 0.0
    folder: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class PlannedStage:
    """What :meth:`EnginePipeline.plan` would do with a stage: ``action`` is ``reuse``, ``run`` or ``skip``."""

    stage: str
    action: str
    reason: str


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
                 force: bool = False, progress: Callable[[StageOutcome], None] | None = None,
                 on_wait: Callable[[str], None] | None = None, calib_shards: int = 1):
        from trt_sora.models import get_adapter

        self.recipe = load_recipe(recipe) if isinstance(recipe, str) else recipe
        self.adapter = get_adapter(self.recipe.model.default if model is None else model)
        self.buckets, self.bucket_source = self.adapter.buckets_for(self.recipe)
        self.run_dir = Path(out_root) / self.adapter.name / self.recipe.name
        self.force = force
        self.progress = progress or (lambda o: None)
        self.on_wait = on_wait
        self.calib_shards = int(calib_shards)  # calibrate as N shards + exact merge (same stats as one pass)
        self._model = None
        self.state_path = self.run_dir / STATE
        self.state = self._read_state()

    # -- helpers -------------------------------------------------------------------------
    @property
    def calib_preset_name(self) -> str:
        """The recipe's preset, unless the model declares its own (toy models: tiny shapes)."""
        return self.adapter.spec.defaults.get("calib_preset") or self.recipe.calibration.preset

    def folder(self, stage: str) -> Path:
        return self.run_dir / FOLDERS.get(stage, stage)

    @property
    def model(self):
        if self._model is None:
            self._model = self.adapter.load(self.recipe.model.dtype.value, "cpu")
        return self._model

    @property
    def quantized(self) -> bool:
        return self.recipe.quantization.format.value != "none"

    def _read_state(self) -> dict:
        if not self.state_path.is_file():
            return {}
        try:
            state = read_json(self.state_path, what="pipeline state")
        except ArtifactError as exc:
            log.warning("%s; every stage reruns", exc)
            return {}
        return state if isinstance(state, dict) else {}

    def _record(self, stage: str, fp: str | None) -> None:
        if fp is None:
            self.state.pop(stage, None)
        else:
            self.state[stage] = fp
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.state_path, self.state)

    # -- fingerprints: what each stage reads ------------------------------------------------
    def _fingerprint(self, stage: str) -> str:
        r = self.recipe
        if stage == "export":
            return _fingerprint("export", __version__, self.adapter.describe(), to_dict(r.export))
        if stage == "calibrate":
            from trt_sora.calibrate.data import load_preset

            return _fingerprint("calibrate", __version__, self.adapter.spec.model_hash(), to_dict(r.calibration),
                                to_dict(load_preset(self.calib_preset_name)), to_dict(r.quantization),
                                self.adapter.sampling.to_dict())
        if stage == "quantize":
            stats = [self.folder("calibrate") / "stats.safetensors"] if self.quantized else []
            weights = self._calib_output("weights") if self.quantized else None  # GPTQ-rounded weights, if any
            return _fingerprint("quantize", __version__, to_dict(r.quantization),
                                _file_hashes(self.folder("export") / "model.onnx", *stats, *([weights] if weights else [])))
        if stage == "build":
            return _fingerprint("build", __version__, r.backend.value, r.compute_capability, to_dict(r.build),
                                [b.to_yaml() for b in self.buckets],
                                _file_hashes(self.folder("quantize") / "model.qdq.onnx"))
        inputs = [self.folder(s) / MANIFEST for s in ("export", "calibrate", "quantize", "build")]
        return _fingerprint("check", __version__, to_dict(r.parity), self.adapter.sampling.to_dict(),
                            _file_hashes(*inputs))

    def _why_not_reuse(self, stage: str, fp: str) -> str | None:
        """None when the stage can be reused, else the reason it reruns."""
        if self.force:
            return "--force"
        if stage not in self.state:
            return "not run yet (or its last run failed)"
        if self.state[stage] != fp:
            return "its inputs or config changed"
        try:
            verify_folder(self.folder(stage))
        except ArtifactError as exc:
            return str(exc)
        return None

    def plan(self, stages: Sequence[str] = STAGES) -> list[PlannedStage]:
        """What :meth:`run` would do, without running anything (re-hashes the artifacts)."""
        out: list[PlannedStage] = []
        upstream_runs: list[str] = []
        for stage in self._selected(stages):
            if stage == "calibrate" and not self.quantized:
                out.append(PlannedStage(stage, "skip", "recipe has quantization.format none"))
                continue
            why = self._why_not_reuse(stage, self._fingerprint(stage))
            if why is None and upstream_runs:
                why = f"after {', '.join(upstream_runs)} rerun(s) (reused if they write the same bytes)"
            out.append(PlannedStage(stage, "reuse" if why is None else "run", why or "inputs and outputs verified"))
            if why is not None:
                upstream_runs.append(stage)
        return out

    def _run(self, stage: str, fn: Callable[[], str]) -> StageOutcome:
        fp = self._fingerprint(stage)
        why = self._why_not_reuse(stage, fp)
        if why is None:
            out = StageOutcome(stage, "reused", folder=str(self.folder(stage)),
                               detail="inputs unchanged, outputs verified (sha256)")
            self.progress(out)
            return out
        log.info("%s runs: %s", stage, why)
        # Other stages keep the previous fingerprint until their new folder is in place: it is swapped
        # in whole (staged_dir), so an interrupted or failed rerun leaves the old artifact valid. A
        # check voids its old verdict as it starts and writes a failed report too: forget it now.
        if stage == "check" and stage in self.state:
            self._record(stage, None)
        t0 = time.perf_counter()
        detail = fn() or ""
        self._record(stage, fp)
        out = StageOutcome(stage, "ran", time.perf_counter() - t0, str(self.folder(stage)), detail)
        self.progress(out)
        return out

    # -- stages --------------------------------------------------------------------------
    def export(self) -> StageOutcome:
        from trt_sora.export import export_onnx

        def go():
            # weightless: traced without weights, streamed from the checkpoint (same bytes as with them in memory)
            res = export_onnx(self.adapter, self.recipe.export, self.folder("export"))
            worst = min(p["cosine"] for p in res.parity) if res.parity else float("nan")
            return f"ORT parity at {len(res.parity)} shapes, worst cosine {worst:.7f}"

        return self._run("export", go)

    def calibrate(self) -> StageOutcome:
        from trt_sora.calibrate.data import load_preset
        from trt_sora.calibrate.run import calibrate

        def go():
            from trt_sora.calibrate.shards import shard_folder

            kw = dict(model=self.model, preset=load_preset(self.calib_preset_name),
                      quant_format=self.recipe.quantization.format, quant_config=self.recipe.quantization)
            out, n = self.folder("calibrate"), self.calib_shards
            folders = [shard_folder(out, i, n) for i in range(n)] if n > 1 else None
            for i, f in enumerate(folders or []):
                calibrate(self.adapter, self.recipe.calibration, f, shard=(i, n), **kw)
            res = calibrate(self.adapter, self.recipe.calibration, out, from_shards=folders, **kw)
            return f"{len(res.stats.sites)} sites -> {res.stats_path.name}" + (f" ({n} shards merged)" if n > 1 else "")

        return self._run("calibrate", go)

    def quantize(self) -> StageOutcome:
        from trt_sora.quantize import quantize_onnx

        # unquantized recipes (bf16): the graph is only cast to the graph dtype, no stats
        stats = self.folder("calibrate") / "stats.safetensors" if self.quantized else None
        weights = self._calib_output("weights") if self.quantized else None  # GPTQ-rounded weights, if any

        def go():
            res = quantize_onnx(self.folder("export") / "model.onnx", stats, self.recipe.quantization,
                                self.folder("quantize"), model_hash=self.adapter.spec.model_hash(), weights=weights)
            c = res.counts
            return (f"{c['quantized_linears']} of {c['graph_linears']} linears quantized "
                    f"({self.recipe.quantization.format.value}), {c['fused_groups']} fused groups")

        return self._run("quantize", go)

    def _calib_output(self, key: str):
        """A file the calibration stage's manifest lists under ``outputs`` (None when it wrote none)."""
        from trt_sora.errors import ArtifactError
        from trt_sora.manifest import read_manifest

        folder = self.folder("calibrate")
        try:
            name = read_manifest(folder, stage="calibrate").get("outputs", {}).get(key)
        except ArtifactError:  # no calibration manifest: nothing listed
            return None
        return folder / name if name else None

    def build(self) -> StageOutcome:
        from trt_sora.build import build_engine

        def go():
            res = build_engine(self.folder("quantize") / "model.qdq.onnx", self.recipe, self.folder("build"),
                               buckets=self.buckets, export_manifest=self.folder("export"),
                               model_name=self.adapter.name)
            a = res.report["analysis"]
            return (f"{len(res.engine_paths)} engine(s), {res.report['profiles']['built']} profile(s); "
                    f"GEMMs {a['gemm_counts']}, FP8 fraction of quantized {a['fp8_gemm_fraction']:.2f}; "
                    f"attention fused: {a['attention']['fused']}")

        return self._run("build", go)

    def check(self) -> StageOutcome:
        from trt_sora.parity import check_artifacts

        def go():
            rep = check_artifacts(self.run_dir, self.recipe, model=self.adapter)
            if not rep["passed"]:
                raise ParityError(f"parity gates failed: {', '.join(rep['failed'])} (see {self.folder('check')}/"
                                  "report.md); fix the artifact (recalibrate, or exclude the layer the report names) "
                                  "and run again - nothing is served from this run until the check passes")
            return "passed: " + ", ".join(c["level"] for c in rep["comparisons"])

        return self._run("check", go)

    def _record_recipe(self) -> None:
        """``recipe.yaml`` in the run folder: the recipe as run (``trt-sora check`` / ``ls`` read it)."""
        import os

        from trt_sora.config import dump_recipe

        path = self.run_dir / RECIPE_FILE
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(dump_recipe(self.recipe))
        os.replace(tmp, path)

    # -- running -------------------------------------------------------------------------
    def _selected(self, stages: Sequence[str]) -> list[str]:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
        return [s for s in STAGES if s in stages]

    def run(self, stages: Sequence[str] = STAGES) -> list[StageOutcome]:
        """Run (or reuse) ``stages`` in order, holding the run folder's lock."""
        selected = self._selected(stages)
        outcomes = []
        with folder_lock(self.run_dir, on_wait=self.on_wait):
            self.state = self._read_state()  # another run may have finished while we waited
            sweep_dead_temps(self.run_dir)
            self._record_recipe()
            for stage in selected:
                if stage == "calibrate" and not self.quantized:
                    outcome = StageOutcome(stage, "skipped", detail="recipe has quantization.format none")
                    self.progress(outcome)
                else:
                    outcome = getattr(self, stage)()
                outcomes.append(outcome)
        return outcomes


def run_engine(recipe: Recipe | str, model: str | None = None, out_root: str | Path = "build", *,
               force: bool = False, stages: Sequence[str] = STAGES,
               progress: Callable[[StageOutcome], None] | None = None, calib_shards: int = 1) -> list[StageOutcome]:
    """Run every stage for ``(model, recipe)``; see :class:`EnginePipeline`."""
    return EnginePipeline(recipe, model, out_root, force=force, progress=progress,
                          calib_shards=calib_shards).run(stages)
