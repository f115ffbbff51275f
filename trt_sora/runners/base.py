"""The runner protocol shared by the parity checker and the runtime (Polygraphy's lifecycle).

A runner turns named input arrays into named output arrays::

    with OrtRunner("model.onnx") as r:        # activate(): sessions, weights, contexts
        out = r.infer({"hidden_states": x, "timestep": t, "encoder_hidden_states": e})
    # deactivate(): released

``infer`` takes ``numpy.ndarray`` or ``torch.Tensor`` values and returns the
same kind it was given (numpy in -> numpy out, torch in -> torch out), keyed by
output name. Runners may expose intermediate tensors for localising a parity
failure through ``infer_probes`` (``{probe_name: array}``, probe names are module
paths such as ``blocks.0.attn1.to_q``).

No heavy imports here: this module loads with the standard library and numpy.
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from trt_sora.errors import TrtSoraError
from trt_sora.metrics import is_torch, to_numpy  # noqa: F401 (the runners' array helpers)

log = logging.getLogger("trt_sora")


class RunnerStateError(TrtSoraError, RuntimeError):
    """A runner was used while inactive (call ``activate()`` or use ``with runner:``)."""


class Runner(abc.ABC):
    """Base runner: ``activate() -> infer(feeds)* -> deactivate()``; a context manager.

    Attributes:
        name: human-readable label used in reports (e.g. ``"ort:model.qdq.onnx"``).
        input_names / output_names: the model's I/O names (``hidden_states``, ``timestep``,
            ``encoder_hidden_states`` -> ``sample`` for Wan).
    """

    name: str = "runner"
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._active = False

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def is_active(self) -> bool:
        return self._active

    def activate(self) -> Runner:
        """Load what ``infer`` needs (idempotent). Returns ``self``."""
        if not self._active:
            self._activate_impl()
            self._active = True
        return self

    def deactivate(self) -> None:
        """Release sessions / contexts / weights (idempotent)."""
        if self._active:
            try:
                self._deactivate_impl()
            finally:
                self._active = False

    def __enter__(self) -> Runner:
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _check_active(self) -> None:
        if not self._active:
            raise RunnerStateError(f"{self.name} is not active; call activate() or use `with runner:` first")

    # -- inference ---------------------------------------------------------------------------
    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run once. ``feeds``: ``{input_name: array}``; returns ``{output_name: array}``
        of the same kind (numpy or torch) as ``feeds['hidden_states']`` / the first feed."""
        self._check_active()
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            from trt_sora.errors import ShapeError

            raise ShapeError(f"{self.name}: missing input(s) {missing}; pass all of {list(self.input_names)}")
        return self._infer_impl(feeds)

    def infer_probes(self, feeds: Mapping[str, Any], probes: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run once and also return intermediate tensors ``{probe: numpy array}`` for the
        probes this runner can see (others are left out). Default: no probes."""
        return self.infer(feeds), {}

    @abc.abstractmethod
    def _activate_impl(self) -> None: ...

    @abc.abstractmethod
    def _deactivate_impl(self) -> None: ...

    @abc.abstractmethod
    def _infer_impl(self, feeds: Mapping[str, Any]) -> dict[str, Any]: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {'active' if self._active else 'inactive'}>"
