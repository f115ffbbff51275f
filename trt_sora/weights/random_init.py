"""Deterministic random weights, one parameter at a time, in any order.

Each parameter is drawn from its own generator, seeded by ``(seed, parameter
name)``, with the distribution PyTorch's ``reset_parameters`` gives its module:

* ``nn.Linear`` / ``nn.Conv*d`` weight and bias: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``
  (``kaiming_uniform_(a=sqrt(5))`` and the default bias init);
* ``nn.LayerNorm`` / ``nn.RMSNorm`` / ``nn.GroupNorm``: weight 1, bias 0;
* anything else asks the model family (``family_rule(name, shape)``), e.g. Wan's
  AdaLN ``scale_shift_table`` ``~ N(0, 1) / sqrt(dim)``; no rule is an error.

Because no parameter depends on another's draw, a 14B model can be written to
disk, exported or loaded block by block and every path sees the same values
(drawn in fp32, then cast to the requested dtype).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from trt_sora.errors import ModelError
from trt_sora.weights import RANDOM_INIT_VERSION  # noqa: F401 (re-exported)

#: ``family_rule(param_name, shape, generator) -> fp32 tensor | None``.
FamilyRule = Callable[[str, tuple, torch.Generator], "torch.Tensor | None"]


def param_seed(seed: int, name: str) -> int:
    """63-bit seed of parameter ``name`` under model seed ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()[:8], "little") >> 1


def _uniform(shape, bound: float, g: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=g, dtype=torch.float32).mul_(2.0 * bound).sub_(bound)


def init_parameter(module: nn.Module, attr: str, name: str, shape: tuple, seed: int,
                   family_rule: FamilyRule | None = None) -> torch.Tensor:
    """The fp32 initial value of ``module.<attr>`` (full name ``name``), shape ``shape``."""
    g = torch.Generator().manual_seed(param_seed(seed, name))
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and attr in ("weight", "bias"):
        w = module.weight
        fan_in = w.shape[1] * (math.prod(w.shape[2:]) if w.dim() > 2 else 1)
        return _uniform(shape, 1.0 / math.sqrt(fan_in) if fan_in else 0.0, g)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) and attr in ("weight", "bias"):
        return torch.ones(shape) if attr == "weight" else torch.zeros(shape)
    if family_rule is not None:
        t = family_rule(name, tuple(shape), g)
        if t is not None:
            return t
    raise ModelError(f"no random-init rule for parameter {name!r} of a {type(module).__name__}; "
                     "add one to the model family's random_init rule or load a real checkpoint")


def owners(model: nn.Module) -> Mapping[str, tuple[nn.Module, str]]:
    """``{parameter name: (owning module, attribute)}`` in ``named_parameters`` order."""
    out = {}
    for mname, mod in model.named_modules():
        for attr, _ in mod.named_parameters(recurse=False):
            out[f"{mname}.{attr}" if mname else attr] = (mod, attr)
    return {n: out[n] for n, _ in model.named_parameters()}
