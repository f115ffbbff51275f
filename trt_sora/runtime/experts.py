"""A pair of experts served as one transformer: each call goes to the expert serving its timestep.

Wan 2.2 A14B denoises with two transformers: the high-noise expert for ``timestep >= boundary``
(``boundary_ratio * 1000``), the low-noise expert after. :class:`ExpertsRunner` holds one backend
runner per expert and routes every call by its ``timestep`` input (diffusers' ``WanPipeline``
rule), so a server, the one sampler or a diffusers pipeline (``transformer`` and ``transformer_2``
both set to the same drop-in) drive the pair exactly as they drive one model.

No heavy imports: numpy, and torch only when given torch tensors.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trt_sora.errors import ShapeError

__all__ = ["ExpertsRunner"]


class ExpertsRunner:
    """``{expert: runner}`` behind one runner interface, switched at ``boundary_timestep``.

    Args:
        runners: ``{"high": runner, "low": runner}`` (activated backend runners).
        boundary_timestep: calls with ``timestep >= boundary_timestep`` go to ``"high"``.

    Attributes: ``calls`` (``{expert: number of calls served}``), ``last_expert``.
    """

    def __init__(self, runners: Mapping[str, Any], boundary_timestep: float):
        self.runners = dict(runners)
        self.boundary_timestep = float(boundary_timestep)
        first = next(iter(self.runners.values()))
        self.input_names = tuple(getattr(first, "input_names", ()))
        self.output_names = tuple(getattr(first, "output_names", ()))
        self.name = "experts(" + ", ".join(f"{e}: {getattr(r, 'name', type(r).__name__)}"
                                           for e, r in self.runners.items()) + ")"
        self.calls = {e: 0 for e in self.runners}
        self.last_expert: str | None = None

    def expert_for(self, feeds: Mapping[str, Any]) -> str:
        """The expert serving these inputs; ShapeError when the batch's rows lie on both sides of the
        boundary (one call is one denoising step: every row has the step's timestep)."""
        import numpy as np

        t = feeds["timestep"]
        t = t.detach().float().cpu().numpy() if hasattr(t, "detach") else np.asarray(t, dtype=np.float32)
        per_row = t.reshape(t.shape[0], -1).max(axis=1)  # per-frame timesteps: the row's step timestep
        high = per_row >= self.boundary_timestep
        if high.any() and not high.all():
            raise ShapeError(f"timestep rows {per_row.tolist()} lie on both sides of the experts' boundary "
                             f"{self.boundary_timestep:g}; call once per denoising step (one timestep per call)")
        return "high" if bool(high.all()) else "low"

    def infer(self, feeds: Mapping[str, Any], stream=None) -> dict[str, Any]:
        e = self.expert_for(feeds)
        self.calls[e] += 1
        self.last_expert = e
        r = self.runners[e]
        return r.infer(feeds, stream=stream) if stream is not None else r.infer(feeds)

    __call__ = infer

    def activate(self) -> ExpertsRunner:
        for r in self.runners.values():
            r.activate()
        return self

    def deactivate(self) -> None:
        for r in self.runners.values():
            r.deactivate()
