"""``check_artifacts``: the parity matrix over one run folder, gates from the recipe, report files.

Each comparison isolates one failure:

==========  ===============================  ====================================  ============
level       reference                        candidate                             gate
==========  ===============================  ====================================  ============
export      PyTorch fp32                     ORT on ``export/model.onnx``          parity.export
qdq         PyTorch fake-quant (same stats)  ORT / TRT on ``quant/model.qdq.onnx``  parity.qdq
quality     PyTorch fp32                     the deployable candidate              parity.quality
trajectory  every call of the reference      the candidate on the same inputs      parity.trajectory
            sampling loop (model's settings)  (teacher-forced), + step contribution
loop        sampling loop, PyTorch           same loop, candidate as transformer   parity.loop
frames      decoded reference video          decoded candidate video               parity.frames
==========  ===============================  ====================================  ============

The sampling levels run the model's own sampling settings (``adapter.sampling``: the steps and
CFG users run; ``parity.loop_steps`` / ``guidance_scale`` override them and the report says so),
so the last, low-noise steps - where quantization error is largest - are always judged.

When a single-call gate fails, the report names the first layer where the error jumps
(per-linear and per-block intermediate tensors, PyTorch hooks vs extra ONNX outputs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trt_sora.errors import ArtifactError
from trt_sora.metrics import compare, frame_metrics
from trt_sora.parity.metrics import gate_check
from trt_sora.runfolder import PARITY_REPORT, PARITY_REPORT_MD, RunFolder
from trt_sora.runners.registry import OpenOptions, check_options, find_artifacts, get_backend
from trt_sora.sm import device_sm, sm_dotted

log = logging.getLogger("trt_sora")

REPORT_JSON = PARITY_REPORT
REPORT_MD = PARITY_REPORT_MD


# -- artifacts ----------------------------------------------------------------------------------------
def verify_run(run: Path, arts: dict[str, Path | None], recipe) -> None:
    """Before comparing anything: every stage folder holds what its manifest says, each stage was made
    from the files beside it (a quant/ from another export is stale), and an FP8/INT8 recipe has its
    Q/DQ graph and statistics (else there is nothing quantized to check)."""
    from trt_sora.manifest import MANIFEST, verify_folder, verify_inputs

    rf = RunFolder(run)
    fmt = recipe.quantization.format.value
    if fmt != "none" and (arts["qdq"] is None or arts["stats"] is None):
        missing = "quant/model.qdq.onnx" if arts["qdq"] is None else "calib/stats.safetensors"
        raise ArtifactError(f"recipe {recipe.name} quantizes to {fmt} but {run}/{missing} is missing: there is no "
                            "Q/DQ candidate to check; run `trt-sora engine` (or calibrate + quantize) first")
    for folder, fix in (("export", "re-run `trt-sora export`"), ("calib", "re-run `trt-sora calibrate`"),
                        ("quant", "re-run `trt-sora quantize`"), ("engine", "re-run `trt-sora build`")):
        if rf.has_manifest(folder):
            verify_folder(rf.stage(folder), fix=fix)
            if folder != "export":
                verify_inputs(rf.stage(folder), fix=fix)
        elif folder == "export" or (folder == "quant" and arts["qdq"] is not None):
            raise ArtifactError(f"{run}/{folder} has no {MANIFEST}: its files cannot be verified; {fix}")


def effective_buckets(recipe, adapter) -> tuple:
    """The buckets the run was built for (see :meth:`ModelAdapter.buckets_for`)."""
    return adapter.buckets_for(recipe)[0]


def _adapter_for(run: Path, model):
    from trt_sora.models import ModelAdapter, adapter_for_manifest, get_adapter

    if isinstance(model, ModelAdapter):
        return model
    if model is None:
        rf = RunFolder(run)
        if rf.is_pair:  # a pair: its experts share one registry entry
            pair = rf.read_manifest("experts")["results"]
            return adapter_for_manifest(next(iter(pair["experts"].values()))["model"])
        find_artifacts(run)  # names the missing export first
        return adapter_for_manifest(rf.read_manifest("export")["results"]["model"])
    return get_adapter(model)


# -- localisation -------------------------------------------------------------------------------------
def probe_names(model, container: str) -> list[str]:
    """Module paths to compare inside the transformer: every ``nn.Linear`` and every block
    (``<container>.N``: the family's ``block_container``)."""
    import torch

    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or (name.startswith(f"{container}.") and name.count(".") == 1):
            out.append(name)
    return out


def localize(ref_runner, cand_runner, feeds, probes: Sequence[str], *, container: str, jump_factor: float = 10.0,
             floor: float = 1e-3) -> dict[str, Any]:
    """Compare intermediate tensors in execution order; name the first layer where error jumps.

    A probe "jumps" when its relative L2 error exceeds ``jump_factor`` x the largest error of every
    probe before it (floored at ``floor``). Without a clear jump the largest relative increase wins;
    its block is ``<container>.N`` (the family's ``block_container``).
    Returns ``{"first_jump": name|None, "block": "<container>.N"|None, "layers": [{"name", "rel_l2", "cosine",
    "ratio"}], "reference", "candidate"}``.
    """
    _, ref_p = ref_runner.infer_probes(feeds, probes)
    _, cand_p = cand_runner.infer_probes(feeds, probes)
    layers, worst_before, first = [], 0.0, None
    for name in ref_p:  # insertion order = execution order (forward hooks)
        if name not in cand_p or ref_p[name].size != cand_p[name].size:
            continue
        m = compare(ref_p[name], cand_p[name].reshape(ref_p[name].shape))
        ratio = m["rel_l2"] / max(worst_before, floor)
        layers.append({"name": name, "rel_l2": m["rel_l2"], "cosine": m["cosine"], "ratio": ratio})
        if first is None and ratio >= jump_factor:
            first = name
        worst_before = max(worst_before, m["rel_l2"])
    if first is None and layers:
        first = max(layers, key=lambda x: x["ratio"])["name"]
    m = re.match(rf"^({re.escape(container)}\.\d+)(\.|$)", first or "")
    block = m.group(1) if m else None
    return {"first_jump": first, "block": block, "layers": layers, "reference": ref_runner.name,
            "candidate": cand_runner.name, "compared": len(layers)}


# -- the matrix -----------------------------------------------------------------------------------------
def _worst(per_sample: list[dict]) -> dict:
    keys_min = ("cosine", "psnr_db")
    keys_max = ("rel_l2", "max_abs")
    out = {}
    for k in keys_min:
        out[k] = min(m[k] for m in per_sample)
    for k in keys_max:
        out[k] = max(m[k] for m in per_sample)
    out["psnr_peak"] = per_sample[0]["psnr_peak"]
    out["psnr_peak_def"] = per_sample[0]["psnr_peak_def"]
    return out


def _single_call(ref, cand, samples, gate, level: str, what: str, floor_ref=None, exempt=None) -> dict:
    """One level over the samples. With ``floor_ref`` (a second correct reference, e.g. fake-quant in
    the graph's dtype) and ``gate.max_floor_ratio``, the cosine gate is judged per sample against
    ``max(1 - min_cosine, max_floor_ratio * (1 - cosine(ref, floor_ref)))``.

    ``exempt``: ``{sample index: (step, measured contribution dB, limit)}`` for samples that are
    calls of the deployed trajectory; such a sample that misses the gate passes only on its step's
    measured contribution to the final latents, the trajectory level's rule, reported as a check."""
    import dataclasses

    use_floor = floor_ref is not None and getattr(gate, "max_floor_ratio", None) and gate.min_cosine is not None
    per = []
    for i, (point, feeds) in enumerate(samples):
        y_ref = next(iter(ref.infer(feeds).values()))
        y_c = next(iter(cand.infer(feeds).values()))
        m = compare(y_ref, y_c)
        m.update({"sample": i, "point": dict(point)})
        if use_floor:
            floor = max(0.0, 1.0 - compare(y_ref, next(iter(floor_ref.infer(feeds).values())))["cosine"])
            allowed = max(1.0 - gate.min_cosine, gate.max_floor_ratio * floor)
            m.update({"floor_1_minus_cosine": floor, "allowed_1_minus_cosine": allowed,
                      "distance_over_allowed": (1.0 - m["cosine"]) / allowed})
        per.append(m)
    exempt_checks = []
    for i, (step, db, limit) in (exempt or {}).items():
        if not all(c["passed"] for c in gate_check(per[i], gate)):
            per[i].update({"exempt": db >= limit, "step": step, "measured_contribution_db": db})
            exempt_checks.append({"metric": f"sample {i} (trajectory step {step}) misses the gate: its step's measured "
                                            "contribution to the final latents, dB", "value": db, "threshold": limit,
                                  "op": ">=", "passed": bool(db >= limit)})
    judged = [m for m in per if not m.get("exempt")] or per
    worst = _worst(judged)
    if use_floor:
        checks = gate_check(worst, dataclasses.replace(gate, min_cosine=None))
        ratio = max(m["distance_over_allowed"] for m in judged)
        worst["distance_over_allowed"] = ratio
        checks.insert(0, {
            "metric": f"(1 - cosine) / max(1 - {gate.min_cosine:g}, {gate.max_floor_ratio:g} x rounding floor)",
            "value": ratio, "threshold": 1.0, "op": "<=",
            "passed": bool(ratio <= 1.0 and not math.isnan(ratio))})
    else:
        checks = gate_check(worst, gate)
    checks += exempt_checks
    out = {"level": level, "what": what, "reference": ref.name, "candidate": cand.name,
           "metrics": worst, "per_sample": per, "checks": checks, "passed": all(c["passed"] for c in checks)}
    if use_floor:
        out["floor_reference"] = floor_ref.name
    return out


def _sample_steps(num: int, steps: int) -> list[int]:
    """``num`` step indices spread over a ``steps``-step trajectory, first and last included."""
    return sorted({int(round(i * (steps - 1) / max(1, num - 1))) for i in range(num)})


def _samples(adapter, traj, point: dict, buckets, seed: int):
    """Held-out single-call inputs: the transformer inputs the reference trajectory met at the
    sampled steps (held-out prompts, first bucket's opt point, its CFG batch), plus one random
    point per other bucket."""
    out = [({**point, "batch": int(f["hidden_states"].shape[0])}, f) for _, f in sorted(traj.inputs.items())]
    for j, bucket in enumerate(buckets[1:], 1):
        pt = bucket.point("opt")
        inputs = adapter.example_inputs(pt, seed=seed + 100 + j)
        out.append((pt, {k: v.numpy() for k, v in inputs.items()}))
    return out


def _loop_point(buckets) -> tuple[dict, bool]:
    """The sampling loop's point (first bucket's opt point, at most half its max batch per branch)
    and whether both CFG branches fit one call."""
    point = buckets[0].point("opt")
    b = min(max(1, buckets[0].batch.max // 2), point["batch"])
    return {**point, "batch": b}, 2 * b <= buckets[0].batch.max


def _trajectory_level(traj, gate, measured, settings, note, ref_name: str, cand_name: str, lp) -> dict:
    from trt_sora.parity.trajectory import judge

    checks, rows = judge(traj, gate, measured)
    return {"level": "trajectory",
            "what": f"every transformer call of the deployed loop ({settings.num_steps} steps, CFG "
                    f"{settings.guidance_scale:g}; {note}): the candidate on the reference trajectory's inputs",
            "reference": ref_name, "candidate": cand_name, "point": lp,
            "sampling": {**settings.to_dict(), "note": note},
            "metrics": {"cosine": min(c["cosine"] for c in traj.calls),
                        "psnr_db": min(c["psnr_db"] for c in traj.calls),
                        "worst_step": min(traj.calls, key=lambda c: c["cosine"])["step"],
                        "psnr_peak_def": "reference output max - min (per call); contribution: final latents "
                                         "max - min", "contribution_peak": traj.peak},
            "per_step": rows, "calls": traj.calls, "checks": checks, "passed": all(c["passed"] for c in checks)}


@contextlib.contextmanager
def _without_8bit_attention(cand):
    """The qdq level isolates the GEMM calibration (what the Q/DQ graph holds): a torch-fp8
    candidate runs it with dense BF16 attention; every other level runs the deployed policy and
    sparse pattern."""
    pol, sparse = getattr(cand, "attention", None), getattr(cand, "sparse", None)
    if pol is None:
        yield
        return
    import dataclasses

    cand.attention, cand.sparse = dataclasses.replace(pol, enabled=False), None
    try:
        yield
    finally:
        cand.attention, cand.sparse = pol, sparse


@dataclasses.dataclass
class _Side:
    """One transformer under check: the single model, or one expert of a pair (``root`` = its folder)."""

    expert: str | None
    root: Path
    adapter: Any
    arts: dict
    ref: Any = None
    export_ort: Any = None
    cand: Any = None
    fq: Any = None
    fq_floor: Any = None
    probes: list = dataclasses.field(default_factory=list)

    def level(self, name: str) -> str:
        """``qdq`` for one model, ``qdq[high]`` for an expert."""
        return f"{name}[{self.expert}]" if self.expert else name

    def rel(self, path: str) -> str:
        return f"{self.expert}/{path}" if self.expert else path

    def runners(self) -> list:
        return [r for r in (self.ref, self.export_ort, self.cand, self.fq, self.fq_floor) if r is not None]


def _open_side(side: _Side, backend: str, recipe, options: OpenOptions) -> _Side:
    """The side's reference (PyTorch fp32), export ORT, candidate and fake-quant runners. The candidate
    opens through the registry with ``options``: the call and options ``runtime.load`` serves it with."""
    from trt_sora.runners import TorchFakeQuantRunner

    arts, adapter, pc, root = side.arts, side.adapter, recipe.parity, side.root
    ref_model = adapter.load("fp32", "cpu")
    side.ref = get_backend("torch").open(root, {}, adapter, OpenOptions(device="cpu"), model=ref_model,
                                         name=side.level("torch-fp32"))
    side.export_ort = get_backend("ort").open(root, {"export": arts["export"]}, adapter, OpenOptions(),
                                              name=f"ort:{side.rel('export/model.onnx')}")
    side.probes = probe_names(ref_model, adapter.block_container)
    if backend == "ort" and arts["qdq"] is None:  # the plain export is the candidate: one session
        side.cand = side.export_ort
    else:
        side.cand = get_backend(backend).open(root, arts, adapter, options, name=_candidate_name(side, backend))
    if arts["qdq"] is not None:
        side.fq = TorchFakeQuantRunner(adapter, arts["qdq_map"], arts["stats"], model=ref_model,
                                       name=side.level("torch-fakequant")).activate()
        graph_dtype = "bf16" if backend == "torch-fp8" else side.fq.qdq_meta.get("graph_dtype", "fp32")
        if pc.qdq.max_floor_ratio and graph_dtype in ("fp16", "bf16"):
            # the same simulation with every quantized input rounded to the graph's dtype first: how far
            # rounding alone moves a correct result, close to a full fp16 simulation at fp32 kernels' speed
            side.fq_floor = TorchFakeQuantRunner(adapter, arts["qdq_map"], arts["stats"], model=ref_model,
                                                 round_inputs=graph_dtype,
                                                 name=side.level(f"torch-fakequant-{graph_dtype}-inputs")).activate()
    return side


def _candidate_name(side: _Side, backend: str) -> str:
    if backend == "trt":
        return f"trt:{side.arts['engine'].name}" if side.arts["engine"] is not None else "trt"
    return f"ort:{side.rel('quant/model.qdq.onnx')}" if backend == "ort" else backend


def _sides(run: Path, adapter, recipe) -> dict:
    """``{expert or None: _Side}`` with verified artifacts: the run itself, or each expert's folder of a
    pair (after the ``experts/`` folder that ties them is verified too)."""
    from trt_sora.manifest import MANIFEST, verify_folder

    rf = RunFolder(run)
    if not adapter.experts:
        arts = find_artifacts(run)
        verify_run(run, arts, recipe)
        return {None: _Side(None, run, adapter, arts)}
    if not rf.is_pair:
        raise ArtifactError(f"{run} is a run of the pair {adapter.name} but has no experts/{MANIFEST}; re-run "
                            "`trt-sora engine` (its export stage writes it)")
    verify_folder(rf.experts_dir, stage="experts", fix="re-run `trt-sora engine`")
    out = {}
    for e in adapter.experts:
        side = rf.expert(e).path
        arts = find_artifacts(side)
        verify_run(side, arts, recipe)
        out[e] = _Side(e, side, adapter.expert(e), arts)
    return out


def _loop_timesteps(adapter, settings) -> list[float]:
    """The sampling loop's timesteps at ``settings`` (the family's scheduler, its shift and step count)."""
    sched = adapter.scheduler(settings.shift)
    sched.set_timesteps(settings.num_steps)
    return [float(t) for t in sched.timesteps]


def _plan_caching(recipe, adapter, settings, sides: dict):
    """The recipe's cache schedules at the loop's settings (None when caching is off), planned before the
    trajectories run so a calibration without step ratios is refused first."""
    if not recipe.caching.enabled:
        return None
    from trt_sora.parity.caching import plan_caching

    return plan_caching(recipe.caching, settings, _loop_timesteps(adapter, settings),
                        {side.rel("step_ratios"): RunFolder(side.root).calib for side in sides.values()})


def _plan_sparse(recipe, adapter, settings, sides: dict, backend: str):
    """The recipe's sparse attention at the loop's settings (None when off), resolved before any runner opens
    so a backend or calibration that cannot carry it is refused first."""
    if not recipe.sparse_attention.enabled:
        return None
    from trt_sora.parity.sparse import plan_sparse_check

    return plan_sparse_check(recipe.sparse_attention, backend, _loop_timesteps(adapter, settings),
                             {side.rel("attention_mass"): RunFolder(side.root).calib for side in sides.values()})


def _expert_steps(adapter, settings) -> dict:
    """``{expert or None: [steps it serves]}`` of the sampling loop."""
    out: dict = {}
    for i, t in enumerate(_loop_timesteps(adapter, settings)):
        out.setdefault(settings.expert_at(t), []).append(i)
    return out


@dataclasses.dataclass(frozen=True)
class CheckPlan:
    """What :func:`check_artifacts` runs, decided before a runner opens.

    Attributes:
        backend: the candidate backend.
        levels: the comparisons of the report, in order: per side ``export``, ``qdq`` (with a Q/DQ
            graph), ``quality``; then ``trajectory``, ``loop``, ``frames`` and ``caching`` (when the
            recipe caches). Each is judged by its own comparator and gate (``recipe.parity.<level>``).
        buckets: the shape buckets (the first one's opt point is the loop's).
        settings, sampling_note: the sampling loop's settings and what overrides them.
        loop_point, batched: the loop's point and whether both CFG branches run as one call.
        served: ``{expert or None: [steps it serves]}``.
        keep: the trajectory steps whose call inputs the single-call levels reuse.
        caching: the recipe's cache schedules at the loop's settings (None: caching off).
        sparse: the recipe's sparse attention at the loop's settings, opened on the candidate (None: dense).
    """

    backend: str
    levels: tuple[str, ...]
    buckets: tuple
    settings: Any
    sampling_note: str
    loop_point: dict
    batched: bool
    served: dict
    keep: tuple[int, ...]
    caching: Any = None
    sparse: Any = None

    @property
    def cfg(self) -> str:
        return "batched" if self.batched else "split"


def check_plan(run_dir: str | Path, recipe, *, model=None, backend: str = "ort") -> CheckPlan:
    """The :class:`CheckPlan` of :func:`check_artifacts` on ``run_dir`` (artifacts verified, nothing run
    or written)."""
    from trt_sora.config import load_recipe

    run = Path(run_dir)
    recipe = recipe if hasattr(recipe, "parity") else load_recipe(recipe)
    adapter = _adapter_for(run, model)
    return _plan(adapter, recipe, _sides(run, adapter, recipe), backend)


def _plan(adapter, recipe, sides: dict, backend: str) -> CheckPlan:
    from trt_sora.sampling import resolve_sampling

    pc = recipe.parity
    buckets = effective_buckets(recipe, adapter)
    settings, sampling_note = resolve_sampling(adapter, "the recipe", num_steps=pc.loop_steps,
                                               guidance_scale=pc.guidance_scale)
    caching = _plan_caching(recipe, adapter, settings, sides)
    lp, batched = _loop_point(buckets)
    served = _expert_steps(adapter, settings)
    keep = sorted({s for steps in served.values()
                   for s in (steps[i] for i in _sample_steps(pc.num_samples, len(steps)))})
    levels = [side.level(name) for side in sides.values() for name in ("export", "qdq", "quality")
              if name != "qdq" or side.arts["qdq"] is not None]
    levels += ["trajectory", "loop", "frames"] + (["caching"] if caching is not None else [])
    return CheckPlan(backend, tuple(levels), tuple(buckets), settings, sampling_note, lp, batched, served,
                     tuple(keep), caching, _plan_sparse(recipe, adapter, settings, sides, backend))


def check_artifacts(run_dir: str | Path, recipe, *, model=None, backend: str = "ort", write: bool = True,
                    seed: int = 0, localize_always: bool = False, device: str | None = None,
                    text_encoder: str | None = None) -> dict[str, Any]:
    """Run the parity matrix on ``run_dir`` (``build/<model>/<recipe>/``) and write ``parity/``.

    A pair of experts (Wan 2.2 A14B; ``high/`` and ``low/`` expert folders) is checked as one run:
    the single-call levels per expert (``export[high]``, ``qdq[low]``, ... on the inputs of the steps
    that expert serves), the trajectory, loop and frames levels on the switched loop (each call on
    the expert serving its step), one report whose candidate lists both experts' files.

    Args:
        run_dir: run folder holding ``export/`` and optionally ``calib/``, ``quant/``, ``engine/``
            (or a pair's ``experts/``, ``high/``, ``low/``).
        recipe: a :class:`Recipe` or its name/path; gates from ``recipe.parity``.
        model: override the model (name, folder, adapter); default: the export manifest's.
        backend: candidate backend, ``"ort"`` (ONNX Runtime on the Q/DQ ONNX, else the plain export),
            ``"trt"`` (the engine; needs a GPU and TensorRT) or ``"torch-fp8"`` (the calibrated sites
            as FP8 tensor-core GEMMs + Triton kernels on this GPU; needs SM >= 8.9).
        device: the candidate's device (``torch-fp8``: default ``cuda``; ``trt``: ``cuda:N``; ``ort``: its
            providers, see :func:`trt_sora.runners.ort_runner.providers_for`).
        text_encoder: the loop's prompt encoder (None: the model's own; a ``.safetensors`` written by
            :func:`trt_sora.models.text.save_embeddings` holding the model's held-out prompts, for a GPU
            machine without the text encoder package).
        write: write ``parity/report.json``, ``report.md``, ``manifest.json`` (atomically).
        seed: noise / sample seed.

    Returns the report dict: ``passed``, ``comparisons`` (each with metrics, thresholds, checks),
    ``localization`` for failed single-call comparisons, ``buckets``, ``artifacts``.
    """
    from trt_sora.config import load_recipe
    from trt_sora.manifest import invalidate

    t0 = time.perf_counter()
    run = Path(run_dir)
    recipe = recipe if hasattr(recipe, "parity") else load_recipe(recipe)
    if write:  # a check that starts voids the old verdict: a crash or a refusal must not leave "passed" behind
        invalidate(RunFolder(run).parity)
    adapter = _adapter_for(run, model)
    sides = _sides(run, adapter, recipe)
    plan = _plan(adapter, recipe, sides, backend)
    options = check_options(backend, recipe, device)
    if plan.sparse is not None:
        options = dataclasses.replace(options, sparse=plan.sparse.plan.to_dict())
    for side in sides.values():
        _open_side(side, backend, recipe, options)
    loop = _Loop.run(adapter, sides, plan, recipe.parity, seed, text_encoder)
    comparisons, localization = _compare(adapter, sides, plan, recipe.parity, loop, seed, localize_always)
    executed = _executed_on(backend, loop.lead.cand)
    if plan.sparse is not None:
        loop.sparse_record = plan.sparse.record(list(adapter.sparse_attention_sites(loop.lead.ref.model)),
                                                adapter.token_grid(loop.noise.shape))
    for side in sides.values():
        for r in {id(x): x for x in side.runners()}.values():
            r.deactivate()
    report, inputs = _report(run, recipe, adapter, sides, plan, options, comparisons, localization, executed, loop,
                             t0)
    if write:
        _write(run, recipe, report, inputs)
    log.info("parity %s: %s", "passed" if report["passed"] else "FAILED", ", ".join(
        f"{c['level']}={'ok' if c['passed'] else 'fail'}" for c in comparisons))
    return report


@dataclasses.dataclass
class _Loop:
    """The deployed sampling loop's inputs and the reference trajectory with the candidate on every
    call's inputs (teacher-forced), shared by every level."""

    adapter: Any
    plan: CheckPlan
    sides: dict
    noise: Any
    cond: Any
    uncond: Any
    ref_calls: Any
    cand_calls: Any
    traj: Any = None
    cache_result: Any = None
    sparse_record: Any = None

    @classmethod
    def run(cls, adapter, sides: dict, plan: CheckPlan, pc, seed: int, text_encoder) -> _Loop:
        from trt_sora.parity.loop import loop_inputs
        from trt_sora.sampling import runner_call
        from trt_sora.teacher_forcing import reference_with_candidate

        def calls(attr):  # the transformer call of each side: one call, or {expert: call}
            if None in sides:
                return runner_call(getattr(sides[None], attr))
            return {e: runner_call(getattr(s, attr)) for e, s in sides.items()}

        noise, cond, uncond = loop_inputs(adapter, plan.loop_point, seed=seed, text_encoder=text_encoder)
        loop = cls(adapter, plan, sides, noise, cond, uncond, calls("ref"), calls("cand"))
        loop.traj = reference_with_candidate(loop.ref_calls, loop.cand_calls, noise, cond, uncond,
                                             **loop.kwargs(), keep_inputs=list(plan.keep))
        return loop

    def kwargs(self) -> dict:
        settings = self.plan.settings
        return {"scheduler": self.adapter.scheduler(settings.shift), "settings": settings, "cfg": self.plan.cfg,
                "conditioner": self.adapter}

    @property
    def lead(self):
        return next(iter(self.sides.values()))

    @property
    def ref_name(self) -> str:
        return "+".join(s.ref.name for s in self.sides.values())

    @property
    def cand_name(self) -> str:
        return "+".join(s.cand.name for s in self.sides.values())


def _compare(adapter, sides: dict, plan: CheckPlan, pc, loop: _Loop, seed: int,
             localize_always: bool) -> tuple[list[dict], dict]:
    """Every level of ``plan``, in order: ``(comparisons, localization)``."""
    comparisons: list[dict] = []
    localization: dict[str, Any] = {}
    measured = _measured(loop, pc)
    limit = pc.trajectory.min_contribution_db
    for e, side in sides.items():
        mine = {st: f for st, f in loop.traj.inputs.items() if st in plan.served[e]}
        samples = _samples(side.adapter, dataclasses.replace(loop.traj, inputs=mine), plan.loop_point, plan.buckets,
                           seed)
        # the quality level judges trajectory calls by the trajectory level's rule (one rule, two levels)
        exempt = {i: (st, measured[st], limit) for i, st in enumerate(sorted(mine)) if st in measured}
        _single_call_levels(side, samples, pc, comparisons, localization, localize_always, plan.backend, exempt)
    comparisons.append(_trajectory_level(loop.traj, pc.trajectory, measured, plan.settings, plan.sampling_note,
                                         loop.ref_name, loop.cand_name, plan.loop_point))
    loop_cmp, lat_c = _loop_level(loop, pc)
    comparisons.append(loop_cmp)
    decode, ddesc = adapter.decoder()
    ref_frames = decode(loop.traj.reference.latents)
    comparisons.append(_frames_level(loop, ref_frames, decode(lat_c), ddesc, pc))
    if not all(c["passed"] for c in comparisons[-3:]):
        _localize_loop(loop, localization, pc)
    if plan.caching is not None:
        comparisons.append(_caching_level(loop, ref_frames, decode, pc))
    return comparisons, localization


def _measured(loop: _Loop, pc) -> dict:
    """What a step alone does to the clip, measured, for every step whose calls miss the per-call gate."""
    from trt_sora.parity.trajectory import judge
    from trt_sora.teacher_forcing import measured_contribution

    measured = {}
    if pc.trajectory.min_contribution_db is not None:
        for row in judge(loop.traj, pc.trajectory, {})[1]:
            if not row["calls_pass"]:
                measured[row["step"]] = measured_contribution(loop.traj, loop.ref_calls, loop.cand_calls, row["step"],
                                                              loop.noise, loop.cond, loop.uncond, **loop.kwargs())
    return measured


def _loop_level(loop: _Loop, pc) -> tuple[dict, Any]:
    """The candidate's own free-running loop vs the reference's final latents; returns its latents too."""
    from trt_sora.sampling import sample

    plan, settings, note = loop.plan, loop.plan.settings, loop.plan.sampling_note
    res_c = sample(loop.cand_calls, loop.noise, loop.cond, loop.uncond, **loop.kwargs(), keep=("latents",))
    lat_ref, lat_c = loop.traj.reference.latents, res_c.latents
    per_step = [{"step": a.step, **{k: v for k, v in compare(a.latents, c.latents).items()
                                    if k in ("cosine", "rel_l2", "psnr_db")}}
                for a, c in zip(loop.traj.reference.steps, res_c.steps)]
    final = compare(lat_ref, lat_c)
    checks = gate_check(final, pc.loop)
    served = plan.served
    switch = (f"; switched at t >= {settings.boundary_timestep:g} -> high-noise expert (steps {served.get('high')}), "
              f"else low-noise (steps {served.get('low')})") if settings.experts else ""
    out = {"level": "loop", "what": f"sampling loop: {settings.num_steps} steps, CFG "
           f"{settings.guidance_scale:g} ({'one batch-2 call' if plan.batched else 'two calls'} per step; "
           f"{note}{switch}), final latents of the candidate's own trajectory",
           "reference": loop.ref_name, "candidate": loop.cand_name, "point": plan.loop_point, "metrics": final,
           "sampling": {**settings.to_dict(), "note": note},
           "per_step": per_step, "checks": checks, "passed": all(c["passed"] for c in checks)}
    if settings.experts:
        out["experts"] = {e: {"steps": served.get(e, [])} for e in settings.experts}
    return out, lat_c


def _frames_level(loop: _Loop, ref_frames, cand_frames, ddesc: str, pc) -> dict:
    """Decoded frames of both loops; the gate applies to the worst frame."""
    fr = frame_metrics(ref_frames, cand_frames)
    fm = {**fr, "psnr_db": fr["worst_psnr_db"], "worst_frame_ssim": fr["worst_ssim"]}
    checks = gate_check(fm, pc.frames, ssim_key="worst_frame_ssim")
    for c in checks:
        c["metric"] = {"psnr_db": "worst_frame_psnr_db"}.get(c["metric"], c["metric"])
    return {"level": "frames", "what": f"decoded frames ({ddesc}); gate on the worst frame",
            "reference": loop.ref_name, "candidate": loop.cand_name, "metrics": fr, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


def _localize_loop(loop: _Loop, localization: dict, pc) -> None:
    """Where a failing loop goes wrong: the layers of the worst trajectory call (unless a single-call
    quality level was localised already)."""
    traj, served = loop.traj, loop.plan.served
    worst_call = min(traj.calls, key=lambda c: c["cosine"])
    side = loop.sides.get(worst_call.get("expert"), loop.lead)
    if not any(k.startswith("quality") for k in localization) and hasattr(side.cand, "infer_probes"):
        near = [st for st in traj.inputs if st in served.get(side.expert, traj.inputs)] or list(traj.inputs)
        feeds = traj.inputs[min(near, key=lambda st: abs(st - worst_call["step"]))]  # the worst call's inputs
        localization["loop"] = localize(side.fq or side.ref, side.cand, feeds, side.probes,
                                        container=side.adapter.block_container, jump_factor=pc.jump_factor)


def _caching_level(loop: _Loop, ref_frames, decode, pc) -> dict:
    """The served loop: the candidate with the recipe's cache schedule, against the uncached reference."""
    from trt_sora.parity.caching import caching_level
    from trt_sora.sampling import sample

    def run_loop(schedule):
        return sample(loop.cand_calls, loop.noise, loop.cond, loop.uncond, **loop.kwargs(), cache=schedule).latents

    level, loop.cache_result = caching_level(loop.plan.caching, run_loop, loop.traj.reference.latents, ref_frames,
                                             decode, pc)
    return {**level, "reference": loop.ref_name, "candidate": loop.cand_name + " (cached)",
            "point": loop.plan.loop_point}


def _report(run: Path, recipe, adapter, sides: dict, plan: CheckPlan, options, comparisons: list,
            localization: dict, executed: dict, loop: _Loop, t0: float) -> tuple[dict, dict]:
    """``(report, inputs)``: the report's content and the artifacts it vouches for."""
    from trt_sora.manifest import file_entry

    passed = all(c["passed"] for c in comparisons)
    settings, backend = plan.settings, plan.backend
    inputs = {side.rel(k): file_entry(v, run) for side in sides.values() for k, v in side.arts.items()
              if v is not None}
    if plan.caching is not None:
        inputs.update({name: file_entry(path, run) for name, path in plan.caching.files.items()})
    if plan.sparse is not None:
        inputs.update({name: file_entry(path, run) for name, path in plan.sparse.files.items()})
    candidate = _merge_candidates({e: _candidate_entry(backend, options, s.cand.name, s.arts,
                                                       {k: file_entry(v, run) for k, v in s.arts.items()
                                                        if v is not None}, executed)
                                   for e, s in sides.items()}, settings)
    report = {
        "passed": passed,
        "recipe": recipe.name,
        "model": adapter.describe()["ref"],
        "model_hash": adapter.spec.model_hash(),
        "backend": backend,
        "candidate": candidate,
        "artifacts": inputs,
        "buckets": [bk.to_yaml() for bk in plan.buckets],
        "engine": _engine_status(loop.lead.arts["engine"], backend, run),
        "comparisons": comparisons,
        "localization": localization,
        "failed": [c["level"] for c in comparisons if not c["passed"]],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if settings.experts:
        report["experts"] = {e: {"model_hash": s.adapter.spec.model_hash(), "steps": plan.served.get(e, []),
                                 "engine": _engine_status(s.arts["engine"], backend, run)} for e, s in sides.items()}
        report["boundary_ratio"] = settings.boundary_ratio
    if loop.cache_result is not None:
        report["caching"] = loop.cache_result
    if loop.sparse_record is not None:
        report["sparse_attention"] = loop.sparse_record
    return report, inputs


def _write(run: Path, recipe, report: dict, inputs: dict) -> None:
    """``parity/``: report.json, report.md, the trajectory figure and the manifest, staged."""
    from trt_sora.config import recipe_to_dict
    from trt_sora.manifest import staged_dir, write_json, write_manifest
    from trt_sora.parity.trajectory import plot

    with staged_dir(RunFolder(run).parity) as tmp:
        write_json(tmp / REPORT_JSON, report)
        (tmp / REPORT_MD).write_text(render_markdown(report))
        levels = {c["level"]: c for c in report["comparisons"]}
        if "trajectory" in levels:
            (tmp / "figures").mkdir()
            plot(tmp / "figures" / "trajectory.png", levels["trajectory"], levels.get("loop"), recipe.parity.trajectory)
        write_manifest(tmp, stage="parity", inputs=inputs, config=recipe_to_dict(recipe)["parity"],
                       results={"passed": report["passed"], "failed": report["failed"], "backend": report["backend"],
                                "candidate": report["candidate"], "buckets": report["buckets"]},
                       outputs={"report": REPORT_JSON, "markdown": REPORT_MD})


def _single_call_levels(side: _Side, samples, pc, comparisons: list, localization: dict, localize_always: bool,
                        backend: str, exempt=None) -> None:
    """The export, qdq and quality levels of one side, with localisation where one fails. ``exempt``
    (see :func:`_single_call`) applies to the quality level: the quantization error judged where the
    trajectory level judges it."""
    ref, cand, fq = side.ref, side.cand, side.fq

    def run_level(level, r, c, gate, what, floor_ref=None, exempt=None):
        res = _single_call(r, c, samples, gate, side.level(level), what, floor_ref=floor_ref, exempt=exempt)
        if side.expert:
            res["expert"] = side.expert
        comparisons.append(res)
        if (not res["passed"] or localize_always) and hasattr(c, "infer_probes"):
            pair = (r, c)
            if level == "quality" and fq is not None:  # a Q/DQ bug shows against fake-quant; else the quant error
                qdq = next((x for x in comparisons if x["level"] == side.level("qdq")), None)
                pair = (fq, c) if qdq is not None and not qdq["passed"] else (r, fq)
            worst = min(range(len(res["per_sample"])), key=lambda i: res["per_sample"][i]["cosine"])
            localization[side.level(level)] = localize(pair[0], pair[1], samples[worst][1], side.probes,
                                                       container=side.adapter.block_container,
                                                       jump_factor=pc.jump_factor)
        return res

    run_level("export", ref, side.export_ort, pc.export,
              "export fidelity: PyTorch vs ONNX Runtime on the exported ONNX")
    if fq is not None:
        with _without_8bit_attention(cand):
            run_level("qdq", fq, cand, pc.qdq, "Q/DQ correctness: PyTorch fake-quant (same stats) vs the Q/DQ "
                      "candidate" + (" (its GEMMs: 8-bit and sparse attention off at this level)"
                                     if backend == "torch-fp8" else ""),
                      floor_ref=side.fq_floor)
        if side.fq_floor is not None:  # only the qdq level needs it: free its model copy now
            side.fq_floor.deactivate()
            side.fq_floor = None
    run_level("quality", ref, cand, pc.quality, "quality: PyTorch fp32 vs the deployable candidate", exempt=exempt)


def _merge_candidates(entries: dict, settings) -> dict[str, Any]:
    """One candidate entry for the report: the single model's, or a pair's (every file of both experts;
    ``experts`` names each one's main file and the timesteps it serves)."""
    if None in entries:
        return entries[None]
    first = next(iter(entries.values()))
    files = {k: v for e in entries.values() for k, v in e["files"].items()}
    return {**first, "runner": "+".join(e["runner"] for e in entries.values()), "files": files,
            "experts": {e: {"path": c["path"], "sha256": c["sha256"], "runner": c["runner"]}
                        for e, c in entries.items()},
            "boundary_ratio": settings.boundary_ratio}


def _executed_on(backend: str, cand) -> dict[str, Any]:
    """Where the candidate ran: the GPU and its SM for torch-fp8 / trt, ORT's providers otherwise."""
    if backend == "torch-fp8":
        return cand.report()
    if backend == "trt":
        import torch

        from trt_sora.runners.trt_runner import import_tensorrt

        trt = cand._trt if hasattr(cand, "_trt") else import_tensorrt()
        return {"device": f"cuda:{cand.device}", "gpu": torch.cuda.get_device_name(cand.device),
                "sm": sm_dotted(device_sm(cand.device)), "runtime": trt.__name__,
                "runtime_version": str(trt.__version__)}
    providers = getattr(cand, "providers_in_use", None) or []
    return {"device": "cuda" if any("CUDA" in p for p in providers) else "cpu", "providers": list(providers)}


def _candidate_entry(backend: str, options: OpenOptions, runner: str, arts, inputs, executed: dict) -> dict[str, Any]:
    """What was checked: the backend, the runner, every file it loaded (paths relative to the run
    folder, sha256), the options it opened with (``open``) and where it executed. ``runtime.load`` serves
    only a match of this entry, opened with these options."""
    def files(*keys):
        out = {}
        for k in keys:
            e = inputs.get(k)
            if e:
                out[e["path"]] = e["sha256"]
                if e.get("external_data"):
                    out[e["external_data"]["path"]] = e["external_data"]["sha256"]
        return out

    keys = get_backend(backend).loads(arts)
    loaded, main = files(*keys), inputs[keys[0]]["path"]
    return {"runner": runner, "backend": backend, "path": main, "sha256": loaded[main], "files": loaded,
            "executed": True, "device": executed, "open": options.checked()}


def _engine_status(plan: Path | None, backend: str, run: Path) -> dict[str, Any]:
    """Whether the engine itself was executed; when not, say why and what stood in for it."""
    from trt_sora.manifest import rel_path

    if plan is None:
        return {"path": None, "executed": False, "note": "no engine built yet"}
    path = rel_path(plan, run)
    if backend == "trt":
        return {"path": path, "executed": True, "note": "the engine is the candidate"}
    return {"path": path, "executed": False,
            "note": "the engine was built but not executed here (needs its GPU and a TensorRT runtime); "
                    "the candidate is " + ("the torch-fp8 backend" if backend == "torch-fp8" else
                                           "ONNX Runtime on the same Q/DQ graph the engine was built from") +
                    ". Re-run `trt-sora check --backend trt` on the target GPU before serving the engine."}


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.6g}"
    return str(v)


def render_markdown(report: dict) -> str:
    """Human-readable ``report.md``: verdict, one table row per check, localisation, per-step errors."""
    lines = [f"# Parity report: {'PASSED' if report['passed'] else 'FAILED'}", "",
             f"model `{report['model']}`, recipe `{report['recipe']}`, candidate `{report['candidate']['runner']}` "
             f"(`{report['candidate']['path']}`)", "",
             f"engine: {report['engine']['note']}", "",
             "PSNR peak: tensor levels use the reference's max - min; decoded frames use the pixel range 2.0 "
             "([-1, 1]).", "",
             "| level | metric | value | threshold | result |", "|---|---|---|---|---|"]
    for c in report["comparisons"]:
        if not c["checks"]:
            lines.append(f"| {c['level']} | (no gate) | | | - |")
        for ch in c["checks"]:
            lines.append(f"| {c['level']} | {ch['metric']} | {_fmt(ch['value'])} | {ch['op']} {_fmt(ch['threshold'])} "
                         f"| {'pass' if ch['passed'] else '**FAIL**'} |")
    lines += ["", "## Comparisons", ""]
    for c in report["comparisons"]:
        m = c["metrics"]
        lines.append(f"- **{c['level']}** ({c['what']}): {c['reference']} vs {c['candidate']}: " + ", ".join(
            f"{k} {_fmt(m[k])}" for k in ("cosine", "rel_l2", "max_abs", "psnr_db", "mean_psnr_db", "worst_psnr_db",
                                          "mean_ssim", "worst_ssim") if k in m))
        if c["level"] == "loop":
            lines.append("  - per step: "
                         + "; ".join(f"{s['step']}: PSNR {_fmt(s['psnr_db'])} dB" for s in c["per_step"]))
    levels = {c["level"]: c for c in report["comparisons"]}
    if "trajectory" in levels:
        from trt_sora.parity.trajectory import step_table

        t = levels["trajectory"]
        lines += ["", "## Every step of the deployed trajectory", "",
                  f"{t['what']}. Per call: the candidate fed the reference trajectory's inputs; contribution: the "
                  "error the step's update writes into the latents (est. = sigma step x velocity error; measured = "
                  "the reference re-run from there with the candidate at that step only), PSNR against the final "
                  f"latents' peak {_fmt(t['metrics']['contribution_peak'])}. Figure: `figures/trajectory.png`.", ""]
        lines += step_table(t, levels.get("loop"))
    if report.get("caching"):
        from trt_sora.parity.caching import render

        lines += render(report["caching"])
    if report.get("sparse_attention"):
        from trt_sora.parity.sparse import render as render_sparse

        lines += render_sparse(report["sparse_attention"])
    for level, loc in report.get("localization", {}).items():
        lines += ["", f"## Where the error starts ({level})", "",
                  f"First layer where the error jumps: **{loc['first_jump']}** (block {loc['block']}); "
                  f"{loc['reference']} vs {loc['candidate']}.", "", "| layer | rel L2 | x before |", "|---|---|---|"]
        for lay in loc["layers"]:
            mark = " <-" if lay["name"] == loc["first_jump"] else ""
            lines.append(f"| {lay['name']}{mark} | {_fmt(lay['rel_l2'])} | {_fmt(lay['ratio'])} |")
    return "\n".join(lines) + "\n"
