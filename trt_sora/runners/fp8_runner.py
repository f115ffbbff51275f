"""``torch-fp8``: the calibrated artifact on a GPU with real FP8 tensor-core work (PyTorch + Triton).

Where no TensorRT engine can run (a data-center GPU without full TensorRT: TensorRT-RTX refuses
SM 9.0), this runner executes **the same calibration** the Q/DQ graph holds: the quantized sites
of ``qdq_map.json`` (fused and shared groups included), their input amax from the calibration
stats (one per shared tensor, :func:`trt_sora.runners.torch_runner.site_amaxes`, the function the
fake-quant reference uses), per-output-channel weight scales, and the exclusions - as FP8 E4M3
GEMMs (``torch._scaled_mm``) with the activation quantization fused into the Triton kernel that
produces each input, an FP8 self-attention kernel (per-block Q/K scales, K smoothing) switchable
per block and timestep range, and a CUDA graph per input shape.

It says what really ran (:meth:`TorchFp8Runner.report`): FP8 and BF16 GEMMs per call, FP8 and BF16
attention layers, graphs captured - so a silent no-op cannot pass for FP8.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import threading
from collections.abc import Mapping
from typing import Any

from trt_sora.config.recipe import KEY_LENGTH_KERNELS, AttentionKernel, TorchFp8Config
from trt_sora.errors import ArtifactError, BackendMissingError, ConfigError
from trt_sora.runners.base import Runner, is_torch, to_numpy
from trt_sora.sm import FP8_MIN_SM, device_sm, sm_dotted

log = logging.getLogger("trt_sora")

__all__ = ["AttentionPolicy", "SitePlan", "TorchFp8Runner", "fp8_plan"]


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """One quantized linear as the Q/DQ graph has it: input amax (per tensor, shared-group max)
    and the per-output-channel weight amax from the stats (None: ``max |W|`` per row)."""

    module: str
    act_amax: float
    weight_amax: Any = None


def fp8_plan(qdq_map, stats) -> dict[str, SitePlan]:
    """``{module path: SitePlan}`` for every quantized linear of ``qdq_map`` (path or parsed dict),
    amax from ``stats`` (path / ``CalibStats``; None: the map's recorded amax)."""
    from trt_sora.runners.torch_runner import load_stats, read_qdq_map, site_amaxes

    sites, _ = read_qdq_map(qdq_map)
    other = sorted({s.format for s in sites} - {"fp8_e4m3"})
    if other:
        raise ArtifactError(f"backend torch-fp8 runs FP8 E4M3 artifacts, this one is quantized as {other[0]}; "
                            "serve it with backend='ort' (or 'trt' where TensorRT is installed)")
    stats = load_stats(stats)
    return {s.module: SitePlan(s.module, a, w) for s, (a, w) in zip(sites, site_amaxes(sites, stats))}


@dataclasses.dataclass(frozen=True)
class AttentionPolicy:
    """Where the self-attention runs in FP8 (elsewhere cuDNN BF16 SDPA).

    Attributes:
        enabled: FP8 attention at all.
        exclude: fnmatch patterns over block paths (``blocks.0``, ``blocks.3?``) kept in BF16.
        timesteps: ``(lo, hi)``: FP8 only for calls whose timestep lies in ``[lo, hi]`` (0-1000;
            e.g. ``(200, 1000)`` keeps the low-noise end of the trajectory in BF16). A call with a
            timestep per frame (Wan 2.2 TI2V) is at its largest one, the step's.
        kernel: the 8-bit kernel (:class:`~trt_sora.config.recipe.AttentionKernel`): ``int8`` (the
            default), ``int8-cute`` (the same operands on the CuTe DSL kernel: SM 9.0 and
            nvidia-cutlass-dsl; dense attention of head dim 128, other calls on the ``int8`` kernel) or
            ``cudnn-fp8`` (cuDNN's FP8 SDPA: needs the cuDNN frontend, dense only).
    """

    enabled: bool = True
    exclude: tuple[str, ...] = ()
    timesteps: tuple[float, float] = (0.0, 1000.0)
    kernel: str = "int8"

    def __post_init__(self) -> None:
        kernels = [k.value for k in AttentionKernel]
        if self.kernel not in kernels:
            raise ConfigError(f"attention kernel {self.kernel!r}: use one of {kernels}")
        object.__setattr__(self, "kernel", AttentionKernel(self.kernel).value)  # a plain str in reports

    def on(self, block: str, timestep: float) -> bool:
        lo, hi = self.timesteps
        return (self.enabled and lo <= timestep <= hi
                and not any(fnmatch.fnmatchcase(block, p) for p in self.exclude))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> AttentionPolicy:
        d = dict(d or {})
        return cls(enabled=bool(d.get("enabled", True)), exclude=tuple(d.get("exclude", ())),
                   timesteps=tuple(float(x) for x in d.get("timesteps", (0.0, 1000.0))),
                   kernel=str(d.get("kernel", "int8")))

    def to_dict(self) -> dict:
        d = {"enabled": self.enabled, "exclude": list(self.exclude), "timesteps": list(self.timesteps)}
        return d | ({"kernel": self.kernel} if self.kernel != "int8" else {})


def check_device(device: str) -> str:
    """The CUDA device name if it can run FP8 tensor-core GEMMs; typed errors otherwise."""
    import torch

    if not str(device).startswith("cuda"):
        return str(device)
    if not torch.cuda.is_available():
        raise BackendMissingError("backend torch-fp8 needs an NVIDIA GPU (SM >= 8.9) and a CUDA build of torch; "
                                  "none is visible - use backend='ort' here")
    sm = device_sm(device)
    if sm < FP8_MIN_SM:
        raise BackendMissingError(f"backend torch-fp8 needs FP8 tensor cores (SM >= 8.9); this GPU is SM{sm} "
                                  f"({torch.cuda.get_device_name(torch.device(device))}) - use backend='ort'")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise BackendMissingError("backend torch-fp8 needs Triton (it ships with CUDA builds of torch): "
                                  "pip install triton") from None
    return str(device)


class TorchFp8Runner(Runner):
    """The adapter's model with FP8 GEMMs at the Q/DQ sites, fused quantization, FP8 attention.

    Args:
        model_ref: registry name, checkpoint folder or :class:`ModelAdapter`.
        qdq_map / stats: the quantize stage's ``qdq_map.json`` and the calibration stats it used
            (``qdq_map=None`` with ``plan=``: a ready ``{module: SitePlan}``, e.g. for benchmarks).
        device: ``cuda[:N]`` (the product), or ``cpu``: the same blocks with the pure-torch
            reference kernels (slow; for CPU tests of the wiring).
        mode: ``"fused"`` (fused quantization + Triton kernels, the product) or ``"gemm"`` (only
            the linears swapped for FP8 GEMMs that quantize their input eagerly; a benchmark rung).
        attention: :class:`AttentionPolicy` (``mode="fused"`` only).
        sparse: a :class:`trt_sora.sparse.SparsePlan`: block-sparse self-attention per call (None: dense).
        cuda_graphs: capture one CUDA graph per input shape and attention pattern, replay after.
        fast_accum: the FP8 GEMMs accumulate with cuBLASLt's fast accumulation (recipe
            ``torch_fp8.gemm_fast_accum``, whose default is this one's; CUDA only: the CPU reference
            accumulates in fp32).
        load_dtype: precision the weights are quantized from (default fp32 when they fit in a
            third of the GPU's memory, else bf16).
        model: the adapter's model, already loaded (tests, benchmarks): moved to ``device`` and rewritten
            in place (the caller's module is the runner's from then on).

    ``infer`` feeds as :class:`~trt_sora.runners.torch_runner.TorchRunner`; calls are serialised
    (one set of graph buffers).
    """

    def __init__(self, model_ref, qdq_map, stats=None, *, device: str = "cuda", mode: str = "fused",
                 attention: AttentionPolicy | None = None, cuda_graphs: bool = True,
                 fast_accum: bool = TorchFp8Config.gemm_fast_accum,
                 load_dtype: str | None = None, name: str | None = None, plan: Mapping[str, SitePlan] | None = None,
                 model=None, sparse=None):
        super().__init__()
        from trt_sora.runners.torch_runner import as_adapter

        if mode not in ("fused", "gemm"):
            raise ValueError(f"mode {mode!r}: use 'fused' or 'gemm'")
        self.adapter = as_adapter(model_ref)
        self.qdq_map, self.stats, self._given_plan, self._given_model = qdq_map, stats, plan, model
        self.device, self.mode = device, mode
        self.attention = attention or AttentionPolicy(enabled=mode == "fused")
        self.sparse = sparse
        self.cuda_graphs = cuda_graphs
        self.fast_accum = bool(fast_accum)
        self.load_dtype = load_dtype
        self.input_names = tuple(self.adapter.input_names)
        self.output_names = tuple(self.adapter.output_names)
        self.name = name or f"torch-fp8:{self.adapter.name}"
        self.counters: dict[str, int] = {}
        self.last_counts: dict[str, int] = {}
        self.keys_padded = False  # the last call had masked attention keys
        self.graphs: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------------
    def _activate_impl(self) -> None:
        import torch

        rewrite = self.adapter.torch_fp8_rewrite()  # before loading: a family without it fails at once
        check_device(self.device)
        if self.attention.kernel == "int8-cute" and str(self.device).startswith("cuda"):
            from trt_sora.kernels import cute_attention

            cute_attention.require(self.device)  # before loading too: the DSL, an SM 9.0 GPU
        self.plan = dict(self._given_plan) if self._given_plan is not None else fp8_plan(self.qdq_map, self.stats)
        model = self._given_model
        if model is None:
            model = self.adapter.load(self.load_dtype or self._default_load_dtype(), self.device)
        else:
            model = model.to(self.device)  # a given model is this runner's now: moved, then rewritten in place
        self._given_model = None  # rewritten in place below: never reuse it
        missing = [m for m in self.plan if m not in dict(model.named_modules())]
        if missing:
            raise ArtifactError(f"qdq_map site {missing[0]!r} is not a module of {self.adapter.name}; the map belongs "
                                "to another model - re-run `trt-sora quantize` on this model's export")
        if self.qdq_map is not None:  # GPTQ-rounded weights the Q/DQ graph was built with, if any
            from trt_sora.runners.torch_runner import read_qdq_map, use_rounded_weights

            use_rounded_weights(model, read_qdq_map(self.qdq_map)[1])
        self.blocks = rewrite(model, self.plan, fused=self.mode == "fused", counters=self.counters,
                              fast_accum=self.fast_accum)
        if self.sparse is not None and self.attention.kernel != "int8":
            raise ConfigError(f"sparse attention runs on the 'int8' attention kernel, not {self.attention.kernel!r}")
        for b in self.blocks:
            b.attention_kernel = self.attention.kernel
        self.model = model
        self._fwd = self.adapter.export_module(model).eval()
        self._sites = self.adapter.sparse_attention_sites(model) if self.sparse is not None else {}
        self._pool = torch.cuda.graph_pool_handle() if self._graphs_on() else None
        log.info("%s: %d FP8 sites, mode %s, attention %s", self.name, len(self.plan), self.mode,
                 self.attention.to_dict())

    def _default_load_dtype(self) -> str:
        import torch

        if not str(self.device).startswith("cuda"):
            return "fp32"
        free, _ = torch.cuda.mem_get_info(torch.device(self.device))
        return "fp32" if 4 * self.adapter.num_params() < free / 3 else "bf16"

    def _deactivate_impl(self) -> None:
        self.graphs.clear()
        self.model = self._fwd = self.blocks = None

    def _graphs_on(self) -> bool:
        return self.cuda_graphs and str(self.device).startswith("cuda")

    # -- inference ----------------------------------------------------------------------------------------
    def _to_torch(self, feeds: Mapping[str, Any]) -> list:
        import torch

        out = []
        for n in self.input_names:
            v = feeds[n]
            t = v if is_torch(v) else torch.from_numpy(to_numpy(v).copy())
            out.append(t.to(self.device, torch.float32 if n == "timestep" else torch.bfloat16).contiguous())
        return out

    def _set_attention(self, timestep: float, inputs: list) -> tuple:
        """Each block's attention for one call: FP8 or BF16 by the policy, and its sparse seam; the graph
        key part. Where the family masks keys the ``int8`` kernel takes key lengths (``int8-cute`` runs such
        calls on it); cuDNN's kernel has no mask, so such a call runs BF16 attention."""
        self.keys_padded = not self.adapter.attention_keys_all_valid(dict(zip(self.input_names, inputs)))
        masks_ok = not self.keys_padded or self.attention.kernel in KEY_LENGTH_KERNELS
        flags = tuple(self.mode == "fused" and masks_ok and self.attention.on(b.name, timestep) for b in self.blocks)
        for b, f in zip(self.blocks, flags):
            b.fp8_attention = f
        if self.sparse is None:  # dense (the check's qdq level turns a sparse plan off for a while)
            for site in self._sites.values():
                site.sparse = None
            return flags
        return flags + self.sparse.set(self._sites, self.adapter.token_grid(inputs[0].shape), timestep, self.device)

    def _infer_impl(self, feeds):
        import torch

        as_torch = is_torch(next(iter(feeds.values())))
        inputs = self._to_torch(feeds)
        t = float(inputs[self.input_names.index("timestep")].max())  # per-frame timesteps: the step's
        with self._lock, torch.inference_mode():
            flags = self._set_attention(t, inputs)
            if self._graphs_on():
                y = self._replay(inputs, flags)
            else:
                y = self._eager(inputs)
        return {self.output_names[0]: y if as_torch else to_numpy(y, "float32")}

    def _eager(self, inputs):
        self.counters.clear()
        y = self._fwd(*inputs)
        self.last_counts = dict(self.counters)
        return y

    def _replay(self, inputs, flags):
        import torch

        key = (tuple(tuple(x.shape) for x in inputs), flags)
        entry = self.graphs.get(key)
        if entry is None:
            static = [x.clone() for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: autotuning, cuBLAS handles, caches
                for _ in range(2):
                    self._eager(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._fwd(*static)
            entry = self.graphs[key] = (graph, static, out, dict(self.last_counts))
            log.info("%s: captured a CUDA graph for %s", self.name, key[0])
        graph, static, out, counts = entry
        for s, x in zip(static, inputs):
            s.copy_(x)
        graph.replay()
        self.last_counts = counts  # what this replay ran (a capture's counts, not the last capture's)
        return out.clone()

    # -- what ran -------------------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What the last call executed (eager, or the capture of the graph it replayed), and its policy."""
        import torch

        dev = str(self.device)
        info: dict[str, Any] = {"backend": "torch-fp8", "mode": self.mode, "device": dev,
                                "quantized_sites": len(getattr(self, "plan", {})),
                                "attention_policy": self.attention.to_dict(),
                                "sparse_attention": None if self.sparse is None else self.sparse.to_dict(),
                                "gemm_fast_accum": self.fast_accum and dev.startswith("cuda"),
                                "cuda_graphs": len(self.graphs),
                                "fp8_gemms_per_call": self.last_counts.get("fp8_gemm", 0),
                                "bf16_gemms_per_call": self.last_counts.get("bf16_gemm", 0),
                                "fp8_attention_layers": self.last_counts.get("fp8_attention", 0),
                                "bf16_attention_layers": self.last_counts.get("bf16_attention", 0),
                                "attention_keys_padded": self.keys_padded}
        if dev.startswith("cuda") and torch.cuda.is_available():
            info.update({"gpu": torch.cuda.get_device_name(torch.device(dev)), "sm": sm_dotted(device_sm(dev)),
                         "torch": torch.__version__})
            if info["fp8_attention_layers"]:
                info.update(self._attention_kernel_report(torch.device(dev)))
        return info

    def _attention_kernel_report(self, device) -> dict[str, Any]:
        """Which 8-bit attention kernel ran: ``cudnn-fp8`` (with the cuDNN versions), ``cute`` (with the DSL's
        version), ``triton`` or ``gluon-ws``."""
        if self.attention.kernel == "int8-cute":
            from trt_sora.kernels import cute_attention

            return {"attention_kernel": "cute", "cutlass_dsl": cute_attention.version(),
                    "cute_schedule": dict(cute_attention.SCHEDULE)}
        if self.attention.kernel == "cudnn-fp8":
            from trt_sora.kernels import cudnn_attention

            return {"attention_kernel": "cudnn-fp8", "cudnn": cudnn_attention.versions()}
        from trt_sora.kernels.triton_ops import attention_kernel

        return {"attention_kernel": attention_kernel(device)}

    def expected_gemms(self) -> int:
        """FP8 GEMM launches one call must make under the plan (fused QKV / KV count once)."""
        from trt_sora.kernels.fp8_linear import Gemm

        return sum(int(m.fp8) for m in self.model.modules() if isinstance(m, Gemm))
