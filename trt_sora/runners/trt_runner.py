"""TensorRT engine runner (full TensorRT or TensorRT-RTX runtime; needs an NVIDIA GPU).

Untested on the CPU-only CI machines (no runtime can run there); the GPU tests are
marked ``gpu``. Inputs/outputs are torch CUDA tensors; numpy feeds are copied to the GPU.
"""
from __future__ import annotations

import logging
import queue
from collections.abc import Mapping
from pathlib import Path

from trt_sora.errors import ArtifactError, BackendMissingError, ShapeError
from trt_sora.runners.base import Runner, is_torch, to_numpy

log = logging.getLogger("trt_sora")


def import_tensorrt(flavor: str | None = None):
    """The TensorRT runtime module for an engine built by ``flavor`` (``"tensorrt"`` or ``"tensorrt_rtx"``,
    as the engine manifest's ``results.backend`` says: an engine runs only on the runtime that built
    it); without a flavor, ``tensorrt`` if installed, else ``tensorrt_rtx``. BackendMissingError names
    the install command."""
    import importlib

    mods = (flavor,) if flavor else ("tensorrt", "tensorrt_rtx")
    if flavor not in (None, "tensorrt", "tensorrt_rtx"):
        raise ArtifactError(f"unknown TensorRT flavor {flavor!r} in the engine manifest; rebuild the engine")
    for mod in mods:
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    from trt_sora.build.backend import INSTALL  # the install commands live with the backends
    from trt_sora.config.recipe import Backend

    what = f"the {flavor} runtime (this engine was built by it)" if flavor else "no TensorRT runtime"
    cmd = INSTALL[Backend(flavor or "tensorrt")]
    raise BackendMissingError(f"{what} is not installed: {cmd} (or use backend='ort' / 'torch')")


class _Context:
    """One execution context + its current profile and per-bucket CUDA graphs (static buckets)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.profile = -1
        self.graphs: dict[tuple, tuple] = {}


class TrtRunner(Runner):
    """A serialized TensorRT engine (``.plan``) with one optimization profile per bucket.

    Args:
        engine_path: the ``.plan`` file.
        device: CUDA device index.
        flavor: ``"tensorrt"`` / ``"tensorrt_rtx"``: the runtime that built the engine (default: either).
        contexts: execution contexts in the pool (concurrent callers; one context per caller).
        cuda_graphs: capture one CUDA graph per static-shape profile (min == max) on first use.

    ``infer(feeds, stream=None)``: torch CUDA tensors (numpy is copied over); runs on ``stream``
    (a ``torch.cuda.Stream``; default the caller's current stream) and returns CUDA tensors
    (numpy fp32 for numpy feeds, after a synchronize).
    """

    def __init__(self, engine_path, *, device: int = 0, contexts: int = 1, cuda_graphs: bool = True,
                 name: str | None = None, flavor: str | None = None):
        super().__init__()
        self.path = Path(engine_path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path} does not exist; run `trt-sora build` first")
        self.device, self.num_contexts, self.cuda_graphs = device, contexts, cuda_graphs
        self.flavor = flavor
        self.name = name or f"trt:{self.path.name}"
        self.engine = None
        self._pool: queue.Queue = queue.Queue()
        self._profiles: list[dict[str, tuple]] = []

    def _activate_impl(self) -> None:
        trt = import_tensorrt(self.flavor)
        import torch

        if not torch.cuda.is_available():
            raise BackendMissingError("the TensorRT backend needs an NVIDIA GPU and a CUDA build of torch; "
                                      "none is visible here - use backend='ort' or 'torch'")
        torch.cuda.set_device(self.device)
        self._trt = trt
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if engine is None:
            raise ArtifactError(f"{self.path}: TensorRT could not deserialize the engine (built for another "
                                "GPU or TensorRT version?); rebuild it on this machine's GPU/TensorRT")
        self.engine, self._runtime = engine, runtime
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        mode_in = trt.TensorIOMode.INPUT
        self.input_names = tuple(n for n in names if engine.get_tensor_mode(n) == mode_in)
        self.output_names = tuple(n for n in names if engine.get_tensor_mode(n) != mode_in)
        self._profiles = [
            {n: tuple(tuple(s) for s in engine.get_tensor_profile_shape(n, p)) for n in self.input_names}
            for p in range(engine.num_optimization_profiles)]
        for _ in range(self.num_contexts):
            self._pool.put(_Context(engine.create_execution_context()))

    def _deactivate_impl(self) -> None:
        while not self._pool.empty():
            self._pool.get_nowait()
        self.engine = None

    def profile_for(self, shapes: Mapping[str, tuple]) -> int:
        """Index of the first profile whose min..max holds every input shape; ShapeError otherwise."""
        for i, prof in enumerate(self._profiles):
            if all(len(shapes[n]) == len(prof[n][0]) and
                   all(lo <= v <= hi for v, lo, hi in zip(shapes[n], prof[n][0], prof[n][2]))
                   for n in self.input_names):
                return i
        listing = "; ".join(f"profile {i}: " + ", ".join(f"{n} {p[n][0]}..{p[n][2]}" for n in self.input_names)
                            for i, p in enumerate(self._profiles))
        raise ShapeError(f"{self.name}: input shapes {dict(shapes)} fit no optimization profile [{listing}]; "
                         "use a shape inside one profile or rebuild the engine with a bucket for it")

    def _infer_impl(self, feeds, stream=None):
        import torch

        as_torch = is_torch(feeds[self.input_names[0]])
        dev = torch.device("cuda", self.device)
        tensors = {}
        for n in self.input_names:
            v = feeds[n]
            t = v if is_torch(v) else torch.from_numpy(to_numpy(v).copy())
            want = _torch_dtype(self.engine.get_tensor_dtype(n))
            tensors[n] = t.to(dev, want).contiguous()
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        prof = self.profile_for(shapes)
        stream = stream or torch.cuda.current_stream(dev)
        c = self._pool.get()
        try:
            out = self._run(c, prof, tensors, shapes, stream)
        finally:
            self._pool.put(c)
        if as_torch:
            return out
        stream.synchronize()
        return {k: to_numpy(v, "float32") for k, v in out.items()}

    def infer(self, feeds, stream=None):  # noqa: D102 - documented on the class
        self._check_active()
        return self._infer_impl(feeds, stream)

    def _run(self, c: _Context, prof: int, tensors, shapes, stream):
        import torch

        ctx = c.ctx
        if c.profile != prof:
            ctx.set_optimization_profile_async(prof, stream.cuda_stream)
            c.profile = prof
        static = all(self._profiles[prof][n][0] == self._profiles[prof][n][2] for n in self.input_names)
        key = (prof,) + tuple(shapes[n] for n in self.input_names)
        if static and self.cuda_graphs and key in c.graphs:
            graph, ins, outs = c.graphs[key]
            for n in self.input_names:
                ins[n].copy_(tensors[n], non_blocking=True)
            with torch.cuda.stream(stream):
                graph.replay()
            return {k: v.clone() for k, v in outs.items()}
        for n in self.input_names:
            ctx.set_input_shape(n, shapes[n])
        outs = {}
        for n in self.output_names:
            outs[n] = torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=_torch_dtype(self.engine.get_tensor_dtype(n)),
                                  device=tensors[self.input_names[0]].device)
        for n, t in list(tensors.items()) + list(outs.items()):
            ctx.set_tensor_address(n, t.data_ptr())
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise ArtifactError(f"{self.name}: TensorRT execution failed; see the TensorRT log above")
        if static and self.cuda_graphs:
            self._capture(c, key, tensors, outs, stream)
        return outs

    def _capture(self, c: _Context, key, tensors, outs, stream) -> None:
        """Capture the enqueue into a CUDA graph with static buffers (fallback: stay eager)."""
        import torch

        try:
            ins = {n: t.clone() for n, t in tensors.items()}
            souts = {n: torch.empty_like(t) for n, t in outs.items()}
            for n, t in list(ins.items()) + list(souts.items()):
                c.ctx.set_tensor_address(n, t.data_ptr())
            c.ctx.execute_async_v3(stream.cuda_stream)  # one run after address change, before capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                c.ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)
            c.graphs[key] = (graph, ins, souts)
        except Exception as exc:  # capture is an optimisation: never fail the call for it
            log.warning("%s: CUDA graph capture failed (%s); running this bucket eagerly", self.name, exc)
            self.cuda_graphs = False


def _torch_dtype(trt_dtype):
    import torch

    name = str(trt_dtype).split(".")[-1].upper()
    return {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
            "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8}.get(name, torch.float32)

