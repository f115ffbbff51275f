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

The model sees ``hidden_states`` in ``dtype``, ``timestep`` ``[N]`` fp32 (``sigma * 1000``
for Wan) and every conditioning tensor in ``dtype``; its output is read back as fp32.

Hook: ``hook(call: CallInfo)`` runs before every transformer call and may return a
context manager that is entered around the call (calibration labels its observers
with ``call.step`` / ``call.branches`` this way). :class:`CallInfo` names the step,
the number of steps, the timestep, sigma and the CFG branch of each batch row group
(``("cond",)``, ``("uncond",)`` or ``("cond", "uncond")`` for a batched call).

No heavy imports at module load: torch is imported inside the functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Sequence

from trt_sora.errors import ConfigError, ShapeError, TrtSoraError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["CFG_MODES", "CallInfo", "ModelCall", "SampleResult", "SamplingSettings", "StepRecord", "adapter_call",
           "gaussian_noise", "runner_call", "sample"]

#: How the two CFG branches reach the model: two calls, or one call at twice the batch.
CFG_MODES = ("split", "batched")

#: ``call(inputs) -> output``: ``inputs`` holds ``hidden_states``, ``timestep`` and the conditioning
#: tensors; the output has ``hidden_states``' shape (any float dtype, any device).
ModelCall = Callable[[Mapping[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How a model is sampled: what users run, so what calibration and parity measure.

    Attributes:
        num_steps: denoising steps (scheduler timesteps).
        guidance_scale: classifier-free guidance ``g``; ``<= 1`` runs the cond branch only.
        shift: the flow-matching sigma shift of the scheduler.
    """

    num_steps: int
    guidance_scale: float
    shift: float

    def __post_init__(self) -> None:
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ConfigError(f"sampling num_steps={self.num_steps!r} must be an integer >= 1")
        if not math.isfinite(self.guidance_scale) or self.guidance_scale < 0:
            raise ConfigError(f"sampling guidance_scale={self.guidance_scale} must be a finite number >= 0")
        if not math.isfinite(self.shift) or self.shift <= 0:
            raise ConfigError(f"sampling shift={self.shift} must be a finite number > 0")

    @property
    def uses_cfg(self) -> bool:
        """True when the unconditional branch runs too (``guidance_scale > 1``)."""
        return self.guidance_scale > 1.0

    @property
    def branches(self) -> tuple[str, ...]:
        """CFG branch labels per step: ``("cond", "uncond")`` or ``("cond",)``."""
        return ("cond", "uncond") if self.uses_cfg else ("cond",)

    def override(self, *, num_steps: int | None = None, guidance_scale: float | None = None,
                 shift: float | None = None) -> "SamplingSettings":
        """These settings with the given (non-None) values replaced."""
        given = {"num_steps": num_steps, "guidance_scale": guidance_scale, "shift": shift}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    """

    step: int
    num_steps: int
    timestep: float
    sigma: float
    branches: tuple[str, ...]
    inputs: Mapping[str, Any]

    @property
    def branch(self) -> str:
        """The branches as one label: ``"cond"``, ``"uncond"`` or ``"cond+uncond"``."""
        return "+".join(self.branches)


@dataclasses.dataclass
class StepRecord:
    """One denoising step: ``step``, ``timestep``, ``sigma`` (input latents) and ``sigma_next``
    (after the update; the Euler update is ``x + (sigma_next - sigma) v``), plus, when asked for
    with ``keep``: ``latents`` after the step and the guided ``velocity`` (fp32, the latents' device)."""

    step: int
    timestep: float
    sigma: float
    sigma_next: float
    latents: Any = None
    velocity: Any = None


@dataclasses.dataclass
class SampleResult:
    """What :func:`sample` returns: final ``latents`` ``[B, C, F, H, W]`` fp32 and one
    :class:`StepRecord` per step."""

    latents: Any
    steps: list[StepRecord]


_KEEP = ("latents", "velocity")


def gaussian_noise(shape: Sequence[int], seed: int, device: Any = "cpu") -> "torch.Tensor":
    """Seeded standard-normal latents ``shape`` fp32, drawn on the CPU (so every device gets the
    same numbers for a seed), then moved to ``device``."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(tuple(int(s) for s in shape), generator=g).to(device)


def adapter_call(adapter, model) -> ModelCall:
    """A :data:`ModelCall` running a loaded PyTorch transformer through its family adapter."""
    return lambda inputs: adapter.forward(model, inputs)


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


def sample(call: ModelCall, noise, cond, uncond=None, *, scheduler, settings: SamplingSettings,
           cfg: str = "split", dtype=None, hook: Callable[[CallInfo], ContextManager | None] | None = None,
           keep: Sequence[str] = (), label: str = "", start_step: int = 0) -> SampleResult:
    """Denoise ``noise`` over ``settings.num_steps`` steps with classifier-free guidance.

    Args:
        call: the transformer as a :data:`ModelCall` (:func:`adapter_call`, :func:`runner_call`).
        noise: initial latents ``[B, C, F, H, W]`` (any float dtype; the loop runs in fp32 on its device).
        cond, uncond: conditioning per branch: a mapping ``{input name: [B, ...] tensor}`` or one
            text-embedding tensor ``[B, L, D]`` (``encoder_hidden_states``). ``uncond`` is needed
            when ``settings.guidance_scale > 1`` and ignored otherwise.
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

    Returns:
        :class:`SampleResult` (final latents fp32, per-step records).

    Raises:
        ConfigError: unknown ``cfg`` / ``keep`` entry, or CFG without ``uncond``.
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
    conds = {"cond": _conditioning(cond)}
    if settings.uses_cfg:
        if uncond is None:
            raise ConfigError(f"guidance_scale {settings.guidance_scale} > 1 needs the unconditional "
                              "conditioning (uncond=); pass it or sample with guidance_scale <= 1")
        conds["uncond"] = _conditioning(uncond)
    dtype = dtype or next(iter(conds["cond"].values()), noise).dtype
    groups = [settings.branches] if cfg == "batched" and settings.uses_cfg else [(b,) for b in settings.branches]
    if not 0 <= start_step < settings.num_steps:
        raise ConfigError(f"start_step={start_step} must be in 0..{settings.num_steps - 1}")
    scheduler.set_timesteps(settings.num_steps, device=noise.device)
    if start_step:
        scheduler.set_begin_index(start_step)  # diffusers schedulers: step() continues from there
    latents = noise.float().clone()
    records: list[StepRecord] = []
    with torch.inference_mode():
        for i, t in enumerate(scheduler.timesteps[start_step:], start_step):
            sigma = _sigma(scheduler, i)
            out: dict[str, torch.Tensor] = {}
            for branches in groups:
                out.update(_call(call, latents, t, conds, branches, dtype, hook,
                                 (i, settings.num_steps, sigma), label))
            v = out["cond"] if not settings.uses_cfg else \
                out["uncond"] + settings.guidance_scale * (out["cond"] - out["uncond"])
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
            records.append(StepRecord(step=i, timestep=float(t), sigma=sigma, sigma_next=_sigma(scheduler, i + 1),
                                      latents=latents.clone() if "latents" in keep else None,
                                      velocity=v if "velocity" in keep else None))
    return SampleResult(latents=latents, steps=records)


def _call(call: ModelCall, latents, t, conds, branches: tuple[str, ...], dtype, hook, where, label):
    """One model call for ``branches`` (one or both CFG branches); returns ``{branch: v fp32}``."""
    import torch

    step, num_steps, sigma = where
    n = len(branches)
    x = latents if n == 1 else torch.cat([latents] * n)
    inputs: dict[str, Any] = {"hidden_states": x.to(dtype),
                              "timestep": t.to(torch.float32).reshape(1).expand(x.shape[0]).contiguous()}
    for name in conds[branches[0]]:
        parts = [conds[b][name] for b in branches]
        inputs[name] = (parts[0] if n == 1 else torch.cat(parts)).to(dtype)
    info = CallInfo(step=step, num_steps=num_steps, timestep=float(t), sigma=sigma, branches=branches,
                    inputs=inputs)
    where_txt = (f"denoising step {step}/{num_steps} (timestep {float(t):.2f}), CFG branch "
                 f"{info.branch!r}{', ' + label if label else ''}")
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
