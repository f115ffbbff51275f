"""Where a model's weights come from, one tensor at a time.

A :class:`WeightSource` maps state-dict names (``blocks.0.attn1.to_q.weight``) to
tensors, reading or generating each on request, so no stage needs the whole
model in memory:

* :class:`CheckpointSource`: a diffusers folder of ``*.safetensors`` files
  (single file or shards with an index), read with plain file I/O;
* :class:`RandomInitSource`: a named architecture's deterministic random weights
  (:mod:`~trt_sora.weights.random_init`), drawn per parameter;
* :class:`StateDictSource`: tensors already in memory (tests, small models).

:func:`materialize` fills an empty (meta-parameter) model from a source;
:func:`streamed` runs an empty model's forward with one block's weights resident
at a time.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from trt_sora.errors import ModelError
from trt_sora.weights.random_init import FamilyRule, init_parameter, owners
from trt_sora.weights.safetensors_io import SafetensorsFile

log = logging.getLogger("trt_sora")


class WeightSource:
    """``names()``, ``shape(name)``, ``dtype(name)``, ``get(name) -> torch.Tensor`` (a fresh CPU tensor)."""

    #: ``get`` may run in several threads at once (:func:`materialize` then makes tensors in parallel)
    thread_safe = False

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def describe(self) -> str:
        return type(self).__name__


class CheckpointSource(WeightSource):
    """The ``*.safetensors`` of a diffusers model folder (``config.json`` beside them).

    Sharded checkpoints are read through ``*.safetensors.index.json`` when present,
    else every ``*.safetensors`` file in the folder is indexed; a name in two files
    is an error.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{self.folder} has no *.safetensors weight files; trt_sora streams weights from "
                             "safetensors only (convert .bin checkpoints with diffusers' save_pretrained)")
        self._files = {f.name: SafetensorsFile(f) for f in files}
        self._where: dict[str, SafetensorsFile] = {}
        for f in self._files.values():
            for name in f.entries:
                if name in self._where:
                    raise ModelError(f"{self.folder}: tensor {name!r} is in both {self._where[name].path.name} and "
                                     f"{f.path.name}; remove the stale file")
                self._where[name] = f
        for index in self.folder.glob("*.safetensors.index.json"):
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, json.JSONDecodeError) as exc:
                raise ModelError(f"{index} is not a valid safetensors index ({exc}); re-save the checkpoint") from None
            missing = sorted(set(wmap) - set(self._where))
            if missing:
                raise ModelError(f"{index} lists {missing[0]!r} (+{len(missing) - 1} more) but no shard holds it; "
                                 "the checkpoint is incomplete - re-download it")

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name].entries[name][0]

    def get(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ModelError(f"checkpoint {self.folder} has no tensor {name!r}; it does not match the model config")
        return f.read(name)

    def describe(self) -> str:
        return f"checkpoint {self.folder}"


class RandomInitSource(WeightSource):
    """Deterministic per-parameter random weights of ``model``'s architecture (fp32).

    Args:
        model: the architecture (parameters may be on the meta device).
        seed: model seed.
        family_rule: init for parameters that are not Linear/Conv/norm weights (see random_init).
    """

    #: every parameter draws from its own generator: workers may make several at once
    thread_safe = True

    def __init__(self, model: nn.Module, seed: int, family_rule: FamilyRule | None = None):
        self._owners = owners(model)
        self._shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.seed = int(seed)
        self.family_rule = family_rule

    def names(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def get(self, name: str) -> torch.Tensor:
        if name not in self._owners:
            raise ModelError(f"the architecture has no parameter {name!r}")
        mod, attr = self._owners[name]
        return init_parameter(mod, attr, name, self._shapes[name], self.seed, self.family_rule)

    def describe(self) -> str:
        return f"random init (seed {self.seed})"


class StateDictSource(WeightSource):
    """Tensors in memory (``{name: tensor}``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._t = dict(tensors)

    def names(self) -> list[str]:
        return list(self._t)

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._t[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self._t[name].detach().clone()


def check_covers(model: nn.Module, source: WeightSource, *, optional: Mapping[str, str] | None = None) -> None:
    """Every parameter of ``model`` is in ``source`` with its shape; raise ModelError naming the first that is not.

    ``optional``: ``{name: reason}`` parameters a checkpoint may lack (left at their empty-model value).
    """
    optional = optional or {}
    for name, p in model.named_parameters():
        if name not in source:
            if name in optional:
                continue
            raise ModelError(f"{source.describe()} has no tensor {name!r}; the checkpoint does not match the model "
                             "config (wrong folder, or an incomplete download)")
        if tuple(source.shape(name)) != tuple(p.shape):
            raise ModelError(f"{source.describe()}: {name!r} has shape {tuple(source.shape(name))} but the model "
                             f"config expects {tuple(p.shape)}; the config.json and the weights disagree")


def read_as(source: WeightSource, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``source.get(name)`` in ``dtype``."""
    t = source.get(name)
    return t if t.dtype == dtype else t.to(dtype)


def _set_param(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def materialize(model: nn.Module, source: WeightSource, device: str | torch.device = "cpu",
                names: set[str] | None = None) -> nn.Module:
    """Give ``model``'s (meta) parameters real values from ``source``, each in the dtype it has in ``model``.

    ``names``: only these parameters (default: all). Buffers are left as they are.
    """
    todo = [(name, mod, attr) for name, (mod, attr) in owners(model).items() if names is None or name in names]

    def value(item) -> torch.Tensor:
        name, mod, attr = item
        return read_as(source, name, mod._parameters[attr].dtype).to(device)

    # each tensor is made and moved by a worker, so at most `workers` host temporaries exist at once
    workers = min(8, os.cpu_count() or 1) if source.thread_safe else 1
    with ThreadPoolExecutor(workers) as pool:
        for (_, mod, attr), t in zip(todo, pool.map(value, todo)):
            _set_param(mod, attr, t)
    return model


def _release(module: nn.Module) -> None:
    for mod in module.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and p.device.type != "meta":
                _set_param(mod, attr, torch.empty_like(p, device="meta"))


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules :func:`streamed` loads one at a time: every child, each element of a ModuleList child."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            out += [(f"{name}.{i}", m) for i, m in enumerate(child)]
        else:
            out.append((name, child))
    return out


@contextlib.contextmanager
def streamed(model: nn.Module, source: WeightSource, device: str | torch.device = "cpu", *,
             concurrent: int = 1) -> Iterator[nn.Module]:
    """Run ``model`` (meta parameters) with each unit's weights read from ``source`` just before its forward
    and dropped after it. Parameters owned by ``model`` itself stay loaded for the duration.

    ``concurrent``: that many threads run forwards of ``model`` at once, in lockstep: each unit's weights
    are read once for all of them (a barrier before and after every unit), so checking N inputs costs
    one pass over the weights (see :func:`run_lockstep`). Every thread must run the same units in the
    same order (one model, one code path: true for diffusers' Wan at any input shape).

    Peak memory: the largest unit (Wan 14B fp32: one block, ~1.4 GB) plus activations.
    Every parameter must be used inside its unit's forward (true for diffusers' Wan).
    """
    import threading

    prefix = {id(m): name for name, m in units(model)}
    own = {n for n, _ in model.named_parameters(recurse=False)}
    materialize(model, source, device, names=own)
    handles = []
    pending: list = [None]
    barrier = threading.Barrier(concurrent, action=lambda: pending[0]()) if concurrent > 1 else None

    def run_once(fn) -> None:
        if barrier is None:
            fn()
        else:  # every thread arrives with the same unit; the barrier's action runs fn once
            pending[0] = fn
            barrier.wait()

    def load(mod, _args):
        run_once(lambda: materialize(mod, _Prefixed(source, prefix[id(mod)] + "."), device))

    def release(mod, _args, _out):
        run_once(lambda: _release(mod))

    for _, m in units(model):
        handles.append(m.register_forward_pre_hook(load))
        handles.append(m.register_forward_hook(release))
    model._trt_sora_barrier = barrier
    try:
        yield model
    finally:
        del model._trt_sora_barrier
        for h in handles:
            h.remove()
        for _, m in units(model):
            _release(m)
        for name in own:
            mod, attr = owners(model)[name]
            _set_param(mod, attr, torch.empty_like(mod._parameters[attr], device="meta"))


def run_lockstep(model: nn.Module, fns: list) -> list:
    """Call every ``fn()`` (each runs one forward of ``model``) in its own thread inside
    ``streamed(model, ..., concurrent=len(fns))``; returns their results in order. If one fails, the
    barrier is broken so the others stop too, and the first error is raised."""
    import concurrent.futures

    barrier = getattr(model, "_trt_sora_barrier", None)
    if barrier is None:
        return [fn() for fn in fns]

    def guarded(fn):
        try:
            return fn()
        except BaseException:
            barrier.abort()
            raise

    with concurrent.futures.ThreadPoolExecutor(len(fns), thread_name_prefix="trt_sora-lockstep") as pool:
        futures = [pool.submit(guarded, fn) for fn in fns]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    real = [e for e in errors if not isinstance(e, __import__("threading").BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return [f.result() for f in futures]


class _Prefixed(WeightSource):
    def __init__(self, inner: WeightSource, prefix: str):
        self.inner, self.prefix = inner, prefix

    def get(self, name: str) -> torch.Tensor:
        return self.inner.get(self.prefix + name)
