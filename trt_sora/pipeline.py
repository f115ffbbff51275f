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

A pair of experts (Wan 2.2 A14B: a high-noise and a low-noise transformer switched at a
timestep boundary) is one run with one folder per expert and one parity check over both::

    build/<model>/<recipe>/
        experts/        experts.json + manifest.json: the pair (boundary, which folder serves which
                        timesteps, each expert's identity) - written by the export stage
        high/export  high/calib  high/quant  high/engine     the high-noise expert (t >= boundary)
        low/export   low/calib   low/quant   low/engine      the low-noise expert
        parity/         one report: every level per expert, the switched loop and its frames

Each stage runs for both experts (one calibration pass over shared trajectories writes both
``calib/`` folders) and is reused only when every folder it wrote verifies.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from trt_sora import __version__
from trt_sora.config import Recipe, load_recipe, to_dict
from trt_sora.errors import ArtifactError, ConfigError, ParityError
from trt_sora.manifest import folder_lock, read_json, sha256_file, sweep_dead_temps, verify_folder, write_json
from trt_sora.runfolder import EXPERTS_JSON, RunFolder, manifest_path

log = logging.getLogger("trt_sora")

STAGES = ("export", "calibrate", "quantize", "build", "check")


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
        self.rf = RunFolder(self.run_dir)
        self.force = force
        self.progress = progress or (lambda o: None)
        self.on_wait = on_wait
        self.calib_shards = int(calib_shards)  # calibrate as N shards + exact merge (same stats as one pass)
        self.experts = tuple(self.adapter.experts)
        # {expert: its adapter}; one model is the pair-less {None: adapter}
        self.sides = {e: self.adapter.expert(e) for e in self.experts} or {None: self.adapter}
        self._models: dict = {}
        self.state_path = self.rf.state
        self.state = self._read_state()

    # -- helpers -------------------------------------------------------------------------
    @property
    def calib_preset_name(self) -> str:
        """The recipe's preset, unless the model declares its own (toy models: tiny shapes)."""
        return self.adapter.spec.defaults.get("calib_preset") or self.recipe.calibration.preset

    def folder(self, stage: str, expert: str | None = None) -> Path:
        """A stage's folder (of one expert of a pair: ``<run>/<expert>/<stage folder>``)."""
        if expert is None and self.experts and stage != "check":
            raise ConfigError(f"{self.adapter.name} is a pair of experts {list(self.experts)}: name the expert "
                              f"whose {stage} folder you want (folder({stage!r}, expert))")
        return self.side(None if stage == "check" else expert).stage(stage)

    def side(self, expert: str | None = None) -> RunFolder:
        """The run folder, or one expert's folder of a pair."""
        return self.rf if expert is None else self.rf.expert(expert)

    def folders(self, stage: str) -> list[Path]:
        """Every folder ``stage`` writes (one per expert of a pair; the export also writes ``experts/``)."""
        if stage == "check":
            return [self.folder("check")]
        out = [self.folder(stage, e) for e in self.sides]
        return out + [self.rf.experts_dir] if stage == "export" and self.experts else out

    def model_of(self, expert: str | None = None):
        """The loaded transformer (of one expert), loaded once."""
        if expert not in self._models:
            self._models[expert] = self.sides[expert].load(self.recipe.model.dtype.value, "cpu")
        return self._models[expert]

    @property
    def model(self):
        return self.model_of(None)

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
        sides = list(self.sides)
        if stage == "export":
            return _fingerprint("export", __version__, [a.describe() for a in self.sides.values()], to_dict(r.export),
                                self.adapter.sampling.to_dict() if self.experts else None)
        if stage == "calibrate":
            from trt_sora.calibrate.data import load_preset

            sparse = [to_dict(r.sparse_attention)] if self._measures_mass else []  # off: the fingerprint as before
            return _fingerprint("calibrate", __version__, [a.spec.model_hash() for a in self.sides.values()],
                                to_dict(r.calibration), to_dict(load_preset(self.calib_preset_name)),
                                to_dict(r.quantization), self.adapter.sampling.to_dict(), *sparse)
        if stage == "quantize":
            files = []
            for e in sides:
                files.append(self.side(e).onnx_model)
                if self.quantized:  # the stats, and the GPTQ-rounded weights when the calibration wrote them
                    files += [self.side(e).calib_stats,
                              *filter(None, [self._calib_output("weights", e)])]
            return _fingerprint("quantize", __version__, to_dict(r.quantization), _file_hashes(*files))
        if stage == "build":
            return _fingerprint("build", __version__, r.backend.value, r.compute_capability, to_dict(r.build),
                                [b.to_yaml() for b in self.buckets],
                                _file_hashes(*[self.side(e).qdq_model for e in sides]))
        inputs = [manifest_path(f) for s in ("export", "calibrate", "quantize", "build") for f in self.folders(s)]
        caching = [r.caching.setting()] if r.caching.enabled else []  # off: the fingerprint runs had before
        sparse = [to_dict(r.sparse_attention)] if r.sparse_attention.enabled else []
        return _fingerprint("check", __version__, to_dict(r.parity), self.adapter.sampling.to_dict(),
                            _file_hashes(*inputs), *caching, *sparse)

    @property
    def _measures_mass(self) -> bool:
        """The calibrate stage measures sparse attention's mass (the recipe leaves the windows to it)."""
        sp = self.recipe.sparse_attention
        return sp.enabled and sp.window is None and not self.experts

    def _why_not_reuse(self, stage: str, fp: str) -> str | None:
        """None when the stage can be reused, else the reason it reruns."""
        if self.force:
            return "--force"
        if stage not in self.state:
            return "not run yet (or its last run failed)"
        if self.state[stage] != fp:
            return "its inputs or config changed"
        if stage == "calibrate" and self.recipe.caching.enabled and any(
                self._calib_output("step_ratios", e) is None for e in self.sides):
            return "the recipe enables step caching and the calibration predates its step ratios"
        if stage == "calibrate" and self._measures_mass and self._calib_output("attention_mass") is None:
            return "the recipe calibrates sparse attention and the calibration measured no attention mass"
        try:
            for folder in self.folders(stage):
                verify_folder(folder)
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

    def _shown(self, stage: str) -> str:
        return ", ".join(str(f) for f in self.folders(stage))

    def _run(self, stage: str, fn: Callable[[], str]) -> StageOutcome:
        fp = self._fingerprint(stage)
        why = self._why_not_reuse(stage, fp)
        if why is None:
            out = StageOutcome(stage, "reused", folder=self._shown(stage),
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
        out = StageOutcome(stage, "ran", time.perf_counter() - t0, self._shown(stage), detail)
        self.progress(out)
        return out

    # -- stages --------------------------------------------------------------------------
    def _each(self, run_one) -> list:
        """``run_one(expert, adapter)`` for every side (the one model, or each expert)."""
        return [run_one(e, a) for e, a in self.sides.items()]

    def _tag(self, e: str | None) -> str:
        return f"{e}: " if e else ""

    def export(self) -> StageOutcome:
        from trt_sora.export import export_onnx

        # the experts of a pair share one graph: traced once, copied for the second (one model: nothing to share)
        traces: dict | None = {} if self.experts else None

        def go():
            def one(e, a):
                # weightless: traced without weights, streamed from the checkpoint (same bytes as with them in memory)
                res = export_onnx(a, self.recipe.export, self.folder("export", e), traces=traces)
                worst = min(p["cosine"] for p in res.parity) if res.parity else float("nan")
                return f"{self._tag(e)}ORT parity at {len(res.parity)} shapes, worst cosine {worst:.7f}"

            details = self._each(one)
            if self.experts:
                self._write_experts()
            return "; ".join(details)

        return self._run("export", go)

    def _write_experts(self) -> None:
        """``experts/``: which folder serves which timesteps, and each expert's identity (what the parity
        check and the runtime read to load the pair)."""
        from trt_sora.manifest import file_entry, staged_dir, write_manifest

        st = self.adapter.sampling
        pair = {"model": self.adapter.describe()["ref"], "model_hash": self.adapter.spec.model_hash(),
                "boundary_ratio": st.boundary_ratio,
                "boundary_timestep": st.boundary_timestep, "sampling": st.to_dict(),
                "experts": {e: {"folder": e, "serves": ("timestep >= " if e == self.experts[0] else "timestep < ") +
                                f"{st.boundary_timestep:g}", "model": a.describe()}
                            for e, a in self.sides.items()}}
        with staged_dir(self.rf.experts_dir) as tmp:
            write_json(tmp / EXPERTS_JSON, pair)
            write_manifest(tmp, stage="experts", inputs={e: file_entry(self.side(e).onnx_model,
                                                                       self.run_dir) for e in self.experts},
                           config=st.to_dict(), results=pair, outputs={"experts": EXPERTS_JSON})

    def calibrate(self) -> StageOutcome:
        from trt_sora.calibrate.data import load_preset
        from trt_sora.calibrate.run import calibrate, calibrate_experts

        def go():
            from trt_sora.calibrate.shards import shard_folder

            kw = dict(preset=load_preset(self.calib_preset_name), quant_format=self.recipe.quantization.format,
                      quant_config=self.recipe.quantization)
            n = self.calib_shards
            if self.experts:  # one pass over the shared trajectories (n slices of it), each expert on its steps
                outs = {e: self.folder("calibrate", e) for e in self.experts}
                models = {e: self.model_of(e) for e in self.experts}
                shards = {e: [shard_folder(o, i, n) for i in range(n)] for e, o in outs.items()} if n > 1 else None
                for i in range(n if shards else 0):
                    calibrate_experts(self.adapter, self.recipe.calibration, {e: f[i] for e, f in shards.items()},
                                      models=models, shard=(i, n), **kw)
                res = calibrate_experts(self.adapter, self.recipe.calibration, outs, models=models,
                                        from_shards=shards, **kw)
                return "; ".join(f"{e}: {len(r.stats.sites)} sites over steps "
                                 f"{r.manifest['results']['expert']['steps_served']}" for e, r in res.items()) + \
                    (f" ({n} shards merged)" if shards else "")
            out = self.folder("calibrate")
            folders = [shard_folder(out, i, n) for i in range(n)] if n > 1 else None
            for i, f in enumerate(folders or []):
                calibrate(self.adapter, self.recipe.calibration, f, shard=(i, n), model=self.model, **kw)
            res = calibrate(self.adapter, self.recipe.calibration, out, from_shards=folders, model=self.model,
                            sparse=self.recipe.sparse_attention, **kw)
            return f"{len(res.stats.sites)} sites -> {res.stats_path.name}" + (f" ({n} shards merged)" if n > 1 else "")

        return self._run("calibrate", go)

    def quantize(self) -> StageOutcome:
        from trt_sora.quantize import quantize_onnx

        def go():
            def one(e, a):
                # unquantized recipes (bf16): the graph is only cast to the graph dtype, no stats
                stats = self.side(e).calib_stats if self.quantized else None
                weights = self._calib_output("weights", e) if self.quantized else None  # GPTQ-rounded, if any
                res = quantize_onnx(self.side(e).onnx_model, stats, self.recipe.quantization,
                                    self.folder("quantize", e), model_hash=a.spec.model_hash(), weights=weights)
                c = res.counts
                return (f"{self._tag(e)}{c['quantized_linears']} of {c['graph_linears']} linears quantized "
                        f"({self.recipe.quantization.format.value}), {c['fused_groups']} fused groups")

            return "; ".join(self._each(one))

        return self._run("quantize", go)

    def _calib_output(self, key: str, expert: str | None = None):
        """A file the calibration stage's manifest lists under ``outputs`` (None when it wrote none)."""
        from trt_sora.errors import ArtifactError
        from trt_sora.manifest import read_manifest

        folder = self.folder("calibrate", expert)
        try:
            name = read_manifest(folder, stage="calibrate").get("outputs", {}).get(key)
        except ArtifactError:  # no calibration manifest: nothing listed
            return None
        return folder / name if name else None

    def build(self) -> StageOutcome:
        from trt_sora.build import build_engine

        def go():
            def one(e, a):
                res = build_engine(self.side(e).qdq_model, self.recipe, self.folder("build", e),
                                   buckets=self.buckets, export_manifest=self.folder("export", e),
                                   model_name=f"{self.adapter.name}-{e}" if e else self.adapter.name)
                an = res.report["analysis"]
                return (f"{self._tag(e)}{len(res.engine_paths)} engine(s), {res.report['profiles']['built']} "
                        f"profile(s); GEMMs {an['gemm_counts']}, FP8 fraction of quantized "
                        f"{an['fp8_gemm_fraction']:.2f}; attention fused: {an['attention']['fused']}")

            return "; ".join(self._each(one))

        return self._run("build", go)

    def check(self) -> StageOutcome:
        from trt_sora.parity import check_artifacts

        def go():
            rep = check_artifacts(self.run_dir, self.recipe, model=self.adapter)
            if not rep["passed"]:
                raise ParityError(f"parity gates failed: {', '.join(rep['failed'])} (see "
                                  f"{self.rf.parity_report_md}); fix the artifact (recalibrate, or exclude the "
                                  "layer the report names) and run again - nothing is served from this run until "
                                  "the check passes")
            return "passed: " + ", ".join(c["level"] for c in rep["comparisons"])

        return self._run("check", go)

    def _record_recipe(self) -> None:
        """``recipe.yaml`` in the run folder: the recipe as run (``trt-sora check`` / ``ls`` read it)."""
        import os

        from trt_sora.config import dump_recipe

        path = self.rf.recipe
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
        from trt_sora import tracing

        selected = self._selected(stages)
        outcomes = []
        with folder_lock(self.run_dir, on_wait=self.on_wait), \
                tracing.span("trt-sora engine", run=str(self.run_dir), recipe=self.recipe.name) as root:
            self.state = self._read_state()  # another run may have finished while we waited
            for folder in [self.run_dir, *(self.side(e).path for e in self.experts)]:
                sweep_dead_temps(folder)
            self._record_recipe()
            for stage in selected:
                with tracing.span(f"stage {stage}", parent=root) as s:
                    if stage == "calibrate" and not self.quantized:
                        outcome = StageOutcome(stage, "skipped", detail="recipe has quantization.format none")
                        self.progress(outcome)
                    else:
                        outcome = getattr(self, stage)()
                    if s is not None:
                        s.set_attribute("status", outcome.status)
                outcomes.append(outcome)
        tracing.flush()
        return outcomes


def run_engine(recipe: Recipe | str, model: str | None = None, out_root: str | Path = "build", *,
               force: bool = False, stages: Sequence[str] = STAGES,
               progress: Callable[[StageOutcome], None] | None = None, calib_shards: int = 1) -> list[StageOutcome]:
    """Run every stage for ``(model, recipe)``; see :class:`EnginePipeline`."""
    return EnginePipeline(recipe, model, out_root, force=force, progress=progress,
                          calib_shards=calib_shards).run(stages)
