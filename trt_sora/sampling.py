"""The one sampler: a flow-matching denoising loop with classifier-free guidance.

Calibration, the parity checker, the model's own samples and generation all run
this loop, so they agree on what a trajectory is::

    from trt_sora.sampling import adapter_call, gaussian_noise, sample

    settings = adapter.sampling                    # the model's deployment settings: 20 steps, CFG 4, shift 2
    noise = gaussian_noise((1, 3, 9, 32, 32), seed=0)
    res = sample(adapter_call(adapter, model), noise,
                 cond={"encoder_hidden_states": e_c}, uncond={"encoder_hidden_states": e_u},
                 scheduler=adapter.scheduler(settings.shift), settings=settings,
                 cfg="split", hook=my_hook, keep=("latents",))
    res.latents            # [B, C, F, H, W] fp32, the final latents
    res.steps[-1].sigma    # per-step records: step, timestep, sigma, sigma_next (+ what ``keep`` asked for)

One step ``i`` with timestep ``t_i`` (``scheduler.timesteps``) and guidance ``g``:

* ``cfg="split"``: two calls, ``v_c = f(x, t_i, cond)`` then ``v_u = f(x, t_i, uncond)``;
* ``cfg="batched"``: one call on ``cat([x, x])`` with ``cat([cond, uncond])`` (batch ``2B``),
  split back into ``v_c, v_u`` (the bucket must allow batch ``2B``);
* ``v = v_u + g (v_c - v_u)`` (``g <= 1``: only the cond branch runs, ``v = v_c``);
* ``x = scheduler.step(v, t_i, x)`` in fp32.

Two experts (Wan 2.2 A14B): with ``settings.boundary_ratio`` set, ``call`` is a mapping
``{"high": call_h, "low": call_l}``; a step with ``t_i >= boundary_ratio * 1000`` runs the
high-noise expert with ``guidance_scale``, every later step the low-noise one with
``guidance_scale_2`` (diffusers' ``WanPipeline`` rule). ``CallInfo.expert`` names it.

How latents and conditioning become the model's inputs is the family's fact: ``conditioner``
(the adapter) builds them (``model_inputs``: e.g. image-to-video concatenates the image latents
on the channel axis, Wan 2.2 TI2V replaces the first latent frame and gives every latent frame
its own timestep) and fixes the final latents (``final_latents``). Without one, the model gets
``hidden_states`` = the latents, ``timestep`` ``[N]`` and the conditioning tensors as they are.

The model sees ``hidden_states`` in ``dtype``, ``timestep`` ``[N]`` fp32 (``sigma * 1000``
for Wan) and every conditioning tensor in ``dtype``; its output is read back as fp32.

Hook: ``hook(call: CallInfo)`` runs before every transformer call and may return a
context manager that is entered around the call (calibration labels its observers
with ``call.step`` / ``call.branches`` this way). :class:`CallInfo` names the step,
the number of steps, the timestep, sigma and the CFG branch of each batch row group
(``("cond",)``, ``("uncond",)`` or ``("cond", "uncond")`` for a batched call).

Step caching: ``cache`` (:mod:`trt_sora.caching`) is asked ``cache.reuse(step, branch)`` before each
step's calls; a reused branch gets ``cache.estimate(step, branch, history, timestep, computed)`` after
the step's calls (a batched step whose one branch is reused calls the other alone): ``history`` maps
each branch, and :data:`CFG_DELTA` (``uncond - cond`` at the steps of this expert computing both), to
its last two ``(timestep, output)``, oldest first; ``computed`` holds this step's computed outputs.
``cache.observe(step, branch, output, timestep)`` sees every output computed. ``StepRecord.reused``
names the reused branches.

No heavy imports at module load: torch is imported inside the functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from trt_sora.errors import ConfigError, ShapeError, TrtSoraError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CFG_DELTA", "CFG_MODES", "EXPERTS", "CallInfo", "Conditioner", "ModelCall", "SampleResult",
           "SamplingSettings", "StepRecord", "adapter_call", "expert_calls", "gaussian_noise", "resolve_sampling",
           "runner_call", "sample"]

#: How the two CFG branches reach the model: two calls, or one call at twice the batch.
CFG_MODES = ("split", "batched")

#: The two experts of a boundary-switched model (Wan 2.2 A14B): high-noise steps first.
EXPERTS = ("high", "low")

#: A step cache's history key of the CFG branch difference ``uncond - cond``.
CFG_DELTA = "uncond-cond"

#: ``call(inputs) -> output``: ``inputs`` holds ``hidden_states``, ``timestep`` and the conditioning
#: tensors; the output has ``hidden_states``' shape (any float dtype, any device).
ModelCall = Callable[[Mapping[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a model is sampled: what users run, so what calibration and parity measure.

    Attributes:
        num_steps: denoising steps (scheduler timesteps).
        guidance_scale: classifier-free guidance ``g``; ``<= 1`` runs the cond branch only. With two
            experts: the high-noise expert's.
        shift: the flow-matching sigma shift of the scheduler.
        boundary_ratio: two experts (Wan 2.2 A14B): steps with ``timestep >= boundary_ratio * 1000``
            run the high-noise expert, the others the low-noise one; None = one model.
        guidance_scale_2: the low-noise expert's guidance (None = ``guidance_scale``).
    """

    num_steps: int
    guidance_scale: float
    shift: float
    boundary_ratio: float | None = None
    guidance_scale_2: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigError(f"sampling num_steps={self.num_steps!r} must be an integer >= 1")
        for k in ("guidance_scale", "guidance_scale_2"):
            v = getattr(self, k)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise ConfigError(f"sampling {k}={v} must be a finite number >= 0")
        if not math.isfinite(self.shift) or self.shift <= 0:
            raise ConfigError(f"sampling shift={self.shift} must be a finite number > 0")
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ConfigError(f"sampling boundary_ratio={self.boundary_ratio} must lie in (0, 1) (Wan 2.2: 0.875 "
                              "text-to-video, 0.9 image-to-video)")
        if self.guidance_scale_2 is not None and self.boundary_ratio is None:
            raise ConfigError("sampling guidance_scale_2 is the low-noise expert's guidance; it needs boundary_ratio")

    @property
    def experts(self) -> tuple[str, ...]:
        """``("high", "low")`` for a boundary-switched pair, else ``()``."""
        return EXPERTS if self.boundary_ratio is not None else ()

    @property
    def boundary_timestep(self) -> float | None:
        """The switching timestep ``boundary_ratio * 1000`` (flow matching's 1000 train timesteps)."""
        return None if self.boundary_ratio is None else self.boundary_ratio * 1000.0

    def expert_at(self, timestep: float) -> str | None:
        """The expert serving ``timestep``: ``"high"`` when ``timestep >= boundary``, else ``"low"``."""
        if self.boundary_ratio is None:
            return None
        return "high" if float(timestep) >= self.boundary_timestep else "low"

    def guidance_at(self, timestep: float) -> float:
        """The guidance scale of the step at ``timestep`` (the low-noise expert's past the boundary)."""
        if self.expert_at(timestep) == "low" and self.guidance_scale_2 is not None:
            return self.guidance_scale_2
        return self.guidance_scale

    @property
    def uses_cfg(self) -> bool:
        """True when the unconditional branch runs too (a guidance scale ``> 1``)."""
        return max(self.guidance_scale, self.guidance_scale_2 or 0.0) > 1.0

    @property
    def branches(self) -> tuple[str, ...]:
        """CFG branch labels per step: ``("cond", "uncond")`` or ``("cond",)``."""
        return ("cond", "uncond") if self.uses_cfg else ("cond",)

    def override(self, *, num_steps: int | None = None, guidance_scale: float | None = None,
                 shift: float | None = None, guidance_scale_2: float | None = None) -> SamplingSettings:
        """These settings with the given (non-None) values replaced. A new ``guidance_scale`` of a
        two-expert model also sets the low-noise expert's unless ``guidance_scale_2`` is given."""
        given = {"num_steps": num_steps, "guidance_scale": guidance_scale, "shift": shift,
                 "guidance_scale_2": guidance_scale_2}
        if guidance_scale is not None and guidance_scale_2 is None and self.guidance_scale_2 is not None:
            given["guidance_scale_2"] = guidance_scale
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The settings as a dict (the two-expert fields only when set, so one-model records stay as
        they were)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None or k not in ("boundary_ratio", "guidance_scale_2")}



def resolve_sampling(adapter, source: str, *, num_steps: int | None = None, guidance_scale: float | None = None,
                     shift: float | None = None) -> tuple[SamplingSettings, str]:
    """``(settings, note)``: the model's deployment settings (``adapter.sampling``) with the given
    (non-None) values of ``source`` (``"the recipe"``, ``"the preset/recipe"``) replacing them.

    ``note`` names the model's settings when nothing changed, else each changed value beside the
    model's, and flags a trajectory shorter than users sample (reports and stats carry it).
    """
    model = adapter.sampling
    settings = model.override(num_steps=num_steps, guidance_scale=guidance_scale, shift=shift)
    changed = [f"{k} {getattr(settings, k):g} (model: {getattr(model, k):g})"
               for k in ("num_steps", "guidance_scale", "guidance_scale_2", "shift")
               if getattr(settings, k) != getattr(model, k)]
    if not changed:
        return settings, (f"the model's sampling settings ({adapter.name}: {model.num_steps} steps, CFG "
                          f"{model.guidance_scale:g}, shift {model.shift:g})")
    short = " - SHORTER than users sample" if settings.num_steps < model.num_steps else ""
    return settings, f"overridden by {source}: {', '.join(changed)}{short}"

@dataclasses.dataclass(frozen=True)
class CallInfo:
    """One transformer call inside :func:`sample` (what a hook sees).

    Attributes:
        step: denoising step index, ``0 .. num_steps - 1``.
        num_steps: steps of this trajectory.
        timestep: the scheduler's timestep ``t`` (Wan: ``sigma * 1000``).
        sigma: the noise level of the step's input latents (``nan`` if the scheduler has no sigmas).
        branches: CFG branch of each ``B``-row group of the call's batch, in order.
        inputs: the tensors passed to the model (``hidden_states``, ``timestep``, conditioning).
        expert: the expert serving this step (``"high"`` / ``"low"``), None for one model.
    """

    step: int
    num_steps: int
    timestep: float
    sigma: float
    branches: tuple[str, ...]
    inputs: Mapping[str, Any]
    expert: str | None = None

    @property
    def branch(self) -> str:
        """The branches as one label: ``"cond"``, ``"uncond"`` or ``"cond+uncond"``."""
        return "+".join(self.branches)


@dataclasses.dataclass
class StepRecord:
    """One denoising step: ``step``, ``timestep``, ``sigma`` (input latents) and ``sigma_next``
    (after the update; the Euler update is ``x + (sigma_next - sigma) v``), plus, when asked for
    with ``keep``: ``latents`` after the step and the guided ``velocity`` (fp32, the latents' device);
    ``reused``: the CFG branches whose output a step cache supplied instead of a call; ``expert``: the
    expert that served the step (None for one model)."""

    step: int
    timestep: float
    sigma: float
    sigma_next: float
    latents: Any = None
    velocity: Any = None
    reused: tuple[str, ...] = ()
    expert: str | None = None


@dataclasses.dataclass
class SampleResult:
    """What :func:`sample` returns: final ``latents`` ``[B, C, F, H, W]`` fp32 and one
    :class:`StepRecord` per step."""

    latents: Any
    steps: list[StepRecord]


_KEEP = ("latents", "velocity")


def gaussian_noise(shape: Sequence[int], seed: int, device: Any = "cpu") -> torch.Tensor:
    """Seeded standard-normal latents ``shape`` fp32, drawn on the CPU (so every device gets the
    same numbers for a seed), then moved to ``device``."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(tuple(int(s) for s in shape), generator=g).to(device)


class Conditioner:
    """How latents and conditioning become a model's inputs (the default: text-to-video DiTs).

    A family adapter overrides both methods where its model differs (image-to-video channel
    concatenation, replaced first frames, per-frame timesteps); :func:`sample` takes any object
    with these two methods as ``conditioner``.
    """

    def model_inputs(self, latents, timestep, conditioning: Mapping[str, Any]) -> dict[str, Any]:
        """The model's inputs for ``latents`` ``[N, C, F, H, W]`` fp32 at ``timestep`` ``[N]`` fp32 under
        ``conditioning`` (``{name: [N, ...]}``, both CFG branches concatenated for a batched call)."""
        return {"hidden_states": latents, "timestep": timestep, **conditioning}

    def final_latents(self, latents, conditioning: Mapping[str, Any]):
        """The latents the loop returns after its last step (e.g. the given first frame put back)."""
        return latents


_DEFAULT_CONDITIONER = Conditioner()


def adapter_call(adapter, model) -> ModelCall:
    """A :data:`ModelCall` running a loaded PyTorch transformer through its family adapter."""
    return lambda inputs: adapter.forward(model, inputs)


def expert_calls(settings: SamplingSettings, make: Callable[[str], ModelCall]):
    """``make(expert)`` per expert as the ``call`` mapping :func:`sample` switches on (one model:
    ``make(None)``)."""
    return {e: make(e) for e in settings.experts} if settings.experts else make(None)


def runner_call(runner) -> ModelCall:
    """A :data:`ModelCall` over a runner (``runner.infer(feeds) -> {name: array}``; its first output,
    as a torch tensor)."""
    import torch

    def call(inputs):
        out = next(iter(runner.infer(inputs).values()))
        return out if isinstance(out, torch.Tensor) else torch.from_numpy(out)

    return call


def _conditioning(c) -> dict[str, Any]:
    if c is None:
        return {}
    if isinstance(c, Mapping):
        return dict(c)
    return {"encoder_hidden_states": c}  # a tensor: the text embedding of diffusers' DiTs


def _sigma(scheduler, i: int) -> float:
    sig = getattr(scheduler, "sigmas", None)
    return float(sig[i]) if sig is not None and i < len(sig) else float("nan")


def sample(call: ModelCall | Mapping[str, ModelCall], noise, cond, uncond=None, *, scheduler,
           settings: SamplingSettings, cfg: str = "split", dtype=None,
           hook: Callable[[CallInfo], AbstractContextManager | None] | None = None, keep: Sequence[str] = (),
           label: str = "", start_step: int = 0, conditioner: Any = None, cache: Any = None) -> SampleResult:
    """Denoise ``noise`` over ``settings.num_steps`` steps with classifier-free guidance.

    Args:
        call: the transformer as a :data:`ModelCall` (:func:`adapter_call`, :func:`runner_call`); for
            two experts (``settings.boundary_ratio``) a mapping ``{"high": call, "low": call}``.
        noise: initial latents ``[B, C, F, H, W]`` (any float dtype; the loop runs in fp32 on its device).
        cond, uncond: conditioning per branch: a mapping ``{input name: [B, ...] tensor}`` or one
            text-embedding tensor ``[B, L, D]`` (``encoder_hidden_states``). ``uncond`` is needed
            when guidance is on and ignored otherwise. Conditioning both branches share (an image)
            is given in both.
        scheduler: a fresh diffusers scheduler (``adapter.scheduler(settings.shift)``);
            ``set_timesteps(settings.num_steps)`` is called here.
        settings: steps and guidance (the scheduler carries the shift).
        cfg: ``"split"`` (two calls per step, each labelled with its branch) or ``"batched"``.
        dtype: dtype of ``hidden_states`` and the conditioning fed to the model (default: the
            dtype of ``cond``'s first tensor); ``timestep`` is always fp32.
        hook: called before every model call with its :class:`CallInfo`; may return a context
            manager entered around the call.
        keep: what each :class:`StepRecord` keeps: ``"latents"`` (after the step) and/or
            ``"velocity"`` (guided); each costs one latent-sized tensor per step.
        label: what to name in errors (e.g. the prompts and shape).
        start_step: resume the schedule at this step: ``noise`` is taken as the latents *entering*
            step ``start_step`` (e.g. a recorded trajectory's ``steps[start_step - 1].latents``) and
            only steps ``start_step .. num_steps - 1`` run (records keep their schedule indices).
        conditioner: builds the model's inputs from latents + conditioning (the family adapter;
            see :class:`Conditioner`); None = text-to-video inputs.
        cache: a step cache (``reuse(step, branch)``, ``estimate(step, branch, history, timestep, computed)``,
            ``observe(step, branch, output, timestep)``;
            :mod:`trt_sora.caching`); None = every step calls the model for every branch.

    Returns:
        :class:`SampleResult` (final latents fp32, per-step records).

    Raises:
        ConfigError: unknown ``cfg`` / ``keep`` entry, CFG without ``uncond``, a missing expert, a
            cache reusing a branch that has no computed output yet.
        ShapeError: the model's output shape differs from the latents'.
        TrtSoraError: an error from inside the call (e.g. an observer rejecting NaN), re-raised as
            its own type with the step, timestep and branch appended.
    """
    import torch

    if cfg not in CFG_MODES:
        raise ConfigError(f"cfg={cfg!r}; use one of {', '.join(CFG_MODES)}")
    bad = [k for k in keep if k not in _KEEP]
    if bad:
        raise ConfigError(f"keep={list(keep)}: unknown {bad[0]!r}; use any of {', '.join(_KEEP)}")
    calls = _expert_calls(call, settings)
    conds = {"cond": _conditioning(cond)}
    if settings.uses_cfg:
        if uncond is None:
            raise ConfigError(f"guidance_scale {settings.guidance_scale} > 1 needs the unconditional "
                              "conditioning (uncond=); pass it or sample with guidance_scale <= 1")
        conds["uncond"] = _conditioning(uncond)
    dtype = dtype or next(iter(conds["cond"].values()), noise).dtype
    conditioner = conditioner or _DEFAULT_CONDITIONER
    if not 0 <= start_step < settings.num_steps:
        raise ConfigError(f"start_step={start_step} must be in 0..{settings.num_steps - 1}")
    scheduler.set_timesteps(settings.num_steps, device=noise.device)
    if start_step:
        scheduler.set_begin_index(start_step)  # diffusers schedulers: step() continues from there
    latents = noise.float().clone()
    records: list[StepRecord] = []
    history: dict[str, list] = {}  # per branch and CFG_DELTA: a step cache's last two computed (timestep, output)
    with torch.inference_mode():
        for i, t in enumerate(scheduler.timesteps[start_step:], start_step):
            sigma = _sigma(scheduler, i)
            expert = settings.expert_at(float(t))
            if i > start_step and expert != records[-1].expert:
                history.pop(CFG_DELTA, None)  # the branch difference is the expert's own
            g = settings.guidance_at(float(t))
            branches = ("cond", "uncond") if g > 1.0 else ("cond",)
            reused = tuple(b for b in branches if cache is not None and cache.reuse(i, b))
            todo = tuple(b for b in branches if b not in reused)
            groups = [todo] if cfg == "batched" and len(todo) == 2 else [(b,) for b in todo]
            out: dict[str, torch.Tensor] = {}
            for group in groups:
                out.update(_call(calls[expert], latents, t, conds, group, dtype, hook,
                                 (i, settings.num_steps, sigma, expert), label, conditioner))
            if cache is not None:
                out.update(_cached(cache, history, reused, i, float(t), out))
                for b in todo:
                    cache.observe(i, b, out[b], float(t))
                    history[b] = [*history.get(b, [])[-1:], (float(t), out[b])]
                if len(todo) == 2:
                    history[CFG_DELTA] = [*history.get(CFG_DELTA, [])[-1:], (float(t), out["uncond"] - out["cond"])]
            v = out["cond"] if len(branches) == 1 else out["uncond"] + g * (out["cond"] - out["uncond"])
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
            records.append(StepRecord(step=i, timestep=float(t), sigma=sigma, sigma_next=_sigma(scheduler, i + 1),
                                      latents=latents.clone() if "latents" in keep else None,
                                      velocity=v if "velocity" in keep else None, reused=reused, expert=expert))
        latents = conditioner.final_latents(latents, conds["cond"])
    return SampleResult(latents=latents, steps=records)


def _cached(cache, history: Mapping[str, list], reused: tuple[str, ...], step: int, t: float,
            computed: Mapping[str, Any]) -> dict[str, Any]:
    """The cache's estimate of each reused branch's output at timestep ``t`` from the computed history and
    this step's ``computed`` outputs; ConfigError when a branch has no computed output yet."""
    missing = [b for b in reused if b not in history]
    if missing:
        raise ConfigError(f"the step cache reuses branch {missing[0]!r} at step {step}, which has no computed output "
                          "yet; a schedule must compute a branch before reusing it (caching.warmup_steps >= 1)")
    return {b: cache.estimate(step, b, history, t, dict(computed)) for b in reused}


def _expert_calls(call, settings: SamplingSettings) -> dict:
    """``{expert or None: ModelCall}``; ConfigError when a two-expert loop lacks an expert."""
    if not settings.experts:
        if isinstance(call, Mapping):
            raise ConfigError(f"a mapping of calls ({sorted(call)}) needs sampling settings with a "
                              "boundary_ratio (two experts); pass one call")
        return {None: call}
    if not isinstance(call, Mapping):
        return {e: call for e in settings.experts}  # one call serving both (e.g. a routing runner)
    missing = [e for e in settings.experts if e not in call]
    if missing:
        raise ConfigError(f"two-expert sampling needs a call per expert {list(settings.experts)}; missing "
                          f"{missing}")
    return dict(call)


def _call(call: ModelCall, latents, t, conds, branches: tuple[str, ...], dtype, hook, where, label, conditioner):
    """One model call for ``branches`` (one or both CFG branches); returns ``{branch: v fp32}``."""
    import torch

    step, num_steps, sigma, expert = where
    n = len(branches)
    x = latents if n == 1 else torch.cat([latents] * n)
    parts = {}
    for name in conds[branches[0]]:
        vals = [conds[b][name] for b in branches]
        parts[name] = vals[0] if n == 1 else torch.cat(vals)
    tvec = t.to(torch.float32).reshape(1).expand(x.shape[0]).contiguous()
    built = conditioner.model_inputs(x, tvec, parts)
    inputs: dict[str, Any] = {k: (v if k == "timestep" or not v.is_floating_point() else v.to(dtype))
                              for k, v in built.items()}
    info = CallInfo(step=step, num_steps=num_steps, timestep=float(t), sigma=sigma, branches=branches,
                    inputs=inputs, expert=expert)
    where_txt = (f"denoising step {step}/{num_steps} (timestep {float(t):.2f}"
                 f"{', expert ' + expert if expert else ''}), CFG branch {info.branch!r}"
                 f"{', ' + label if label else ''}")
    ctx = (hook(info) if hook else None) or contextlib.nullcontext()
    try:
        with ctx:
            v = call(inputs)
    except TrtSoraError as exc:
        try:
            located = type(exc)(f"{exc} [at {where_txt}]")
        except TypeError:  # an error type with its own constructor: keep it as it is
            raise exc from None
        raise located from exc
    if tuple(v.shape) != tuple(x.shape):
        raise ShapeError(f"the model returned a sample of shape {tuple(v.shape)} at {where_txt} but its input "
                         f"latents are {tuple(x.shape)}; the forward must keep the latent shape at every step - "
                         "check the adapter's forward (patching/unpatching) or the model config")
    v = v.float().to(latents.device)
    b = latents.shape[0]
    return {br: v[k * b:(k + 1) * b] for k, br in enumerate(branches)}
