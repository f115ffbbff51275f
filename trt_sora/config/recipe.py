"""Stage configs and the ``Recipe`` that bundles them (one flat YAML per target)."""
from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

from trt_sora.config.base import did_you_mean, enum_member, from_dict, to_dict
from trt_sora.config.shapes import DIM_NAMES, DimRange, ShapeProfile
from trt_sora.errors import ConfigError
from trt_sora.sm import sm_dotted, sm_int

RECIPE_FORMAT_VERSION = 1


def _in_range(where: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
              meaning: str = "") -> None:
    """ConfigError unless ``lo <(=) value <(=) hi`` (``None`` = gate off passes). NaN never passes."""
    if value is None:
        return
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):  # NaN fails both comparisons
        lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ConfigError(f"{where}={value!r} is outside {lb}{lo:g}, {hi:g}{hb}{meaning}; "
                          f"set a value in that range (or remove the key for the default)")


class Backend(str, enum.Enum):
    TENSORRT = "tensorrt"
    TENSORRT_RTX = "tensorrt_rtx"


class DType(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


class QuantFormat(str, enum.Enum):
    NONE = "none"
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"


class CalibMethod(str, enum.Enum):
    MINMAX = "minmax"
    EMA = "ema"
    PERCENTILE = "percentile"
    MSE = "mse"


class CacheMethod(str, enum.Enum):
    NONE = "none"
    MAGCACHE = "magcache"
    EXTRAPOLATE = "extrapolate"


class CachePlan(str, enum.Enum):
    """How ``method: extrapolate`` spends ``caching.threshold`` (see :class:`CachingConfig`)."""
    RUNS = "runs"
    GLOBAL = "global"


class AttentionMode(str, enum.Enum):
    NATIVE = "native"
    PLUGIN = "plugin"


class AttentionKernel(str, enum.Enum):
    """torch-fp8's 8-bit self-attention kernel."""

    INT8 = "int8"  # INT8 Q K^T per 128-token block, FP8 P V (Triton)
    CUDNN_FP8 = "cudnn-fp8"  # per-tensor FP8 Q, K, V: cuDNN's fused FP8 SDPA (the cudnn-fp8 extra)
    INT8_CUTE = "int8-cute"  # the int8 recipe on the CuTe DSL kernel (SM 9.0, dense, head dim 128; the cute extra)


#: The attention kernels that take a key length per sample (masked keys): ``int8``, and ``int8-cute`` by running
#: such calls on the ``int8`` kernel. cuDNN's has no mask (such a call runs BF16 attention).
KEY_LENGTH_KERNELS = (AttentionKernel.INT8.value, AttentionKernel.INT8_CUTE.value)


class ExternalData(str, enum.Enum):
    AUTO = "auto"  # only when the model is over 2 GB (protobuf limit)
    ALWAYS = "always"
    NEVER = "never"


def _default_dynamic() -> dict:
    # Wide export ranges: the ONNX graph is dynamic over these; buckets must lie inside.
    return {
        "batch": DimRange(1, 2, 8),
        "latent_frames": DimRange(1, 4, 64),
        "latent_height": DimRange(2, 8, 256),
        "latent_width": DimRange(2, 8, 256),
        "text_len": DimRange(1, 16, 1024),
    }


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model the recipe is for by default (``MODEL=`` overrides) and its load dtype."""

    default: str = "wan-tiny"
    dtype: DType = DType.FP32


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """torch -> ONNX. ``dynamic`` gives the exported range of each named latent dim."""

    opset: int = 20
    dtype: DType = DType.FP32
    external_data: ExternalData = ExternalData.AUTO
    dynamic: Mapping[str, DimRange] = dataclasses.field(default_factory=_default_dynamic)
    # Verification: ONNX Runtime vs PyTorch at >= 2 points differing in every dim.
    verify: bool = True
    verify_points: tuple[Mapping[str, int], ...] = ()
    min_cosine: float = 0.99999
    max_abs: float = 1e-4  # relative to the reference's max |y| when > 1

    def __post_init__(self) -> None:
        if self.opset < 19:
            raise ConfigError(f"export.opset={self.opset}: FP8 Q/DQ needs opset >= 19; use 20")
        unknown = set(self.dynamic) - set(DIM_NAMES)
        if unknown:
            k = sorted(unknown)[0]
            raise ConfigError(f"export.dynamic: unknown dim {k!r}{did_you_mean(k, DIM_NAMES)}")
        merged = {**_default_dynamic(), **dict(self.dynamic)}
        object.__setattr__(self, "dynamic", merged)
        for i, p in enumerate(self.verify_points):
            missing = set(DIM_NAMES) - set(p)
            if missing:  # a model family's own dims may be given too (the exporter checks them)
                raise ConfigError(f"export.verify_points[{i}]: needs the dims {DIM_NAMES} (missing "
                                  f"{sorted(missing)})")
        _in_range("export.min_cosine", self.min_cosine, 0.0, 1.0, lo_open=True, meaning=" (a cosine is at most 1)")
        _in_range("export.max_abs", self.max_abs, 0.0, math.inf, hi_open=True)


@dataclasses.dataclass(frozen=True)
class CalibConfig:
    """Calibration: which preset (prompt set, steps, shapes) and which observer."""

    preset: str = "tiny"
    method: CalibMethod = CalibMethod.PERCENTILE
    # Denoising steps of the calibration trajectories; None = the model's own step count (what
    # users run). A smaller number is an explicit shortening, stated in the report.
    num_steps: int | None = None
    # How weights are rounded onto their per-channel grid: "nearest", "gptq" (each weight column's
    # rounding error compensated on the next columns through the calibration inputs' Hessian; written
    # to calib/weights.safetensors and used by quantize, parity and the runtime), or "auto": gptq
    # whenever the largest single input Hessian fits in gptq_max_hessian_gb (GiB of fp64 Hessians held
    # at once; when all do not fit, the trajectories rerun once per group that does), else nearest
    # (the manifest and the log say which, how many passes ran and the smallest workable budget);
    # "gptq" refuses where "auto" falls back.
    weight_rounding: str = "auto"
    gptq_damp: float = 0.01
    gptq_max_hessian_gb: float = 4.0
    percentile: float = 99.99
    ema_constant: float = 0.01
    num_bins: int = 2048
    # The calibration report's PyTorch evaluation (held-out trajectories, fake-quantized model):
    eval_prompts: int = 2
    eval_steps: int | None = None  # None: the calibration trajectories' steps (the model's by default)
    sensitivity: str = "both"  # layer groups quantized one at a time: kind | block | both | none

    def __post_init__(self) -> None:
        if self.sensitivity not in ("kind", "block", "both", "none"):
            raise ConfigError(f"calibration.sensitivity={self.sensitivity!r}: use kind, block, both or none")
        if self.weight_rounding not in ("nearest", "gptq", "auto"):
            raise ConfigError(f"calibration.weight_rounding={self.weight_rounding!r}: use auto, gptq or nearest")
        if not self.gptq_damp > 0 or not self.gptq_max_hessian_gb > 0:
            raise ConfigError("calibration.gptq_damp and gptq_max_hessian_gb must be > 0")
        if self.eval_prompts < 1 or any(v is not None and v < 1 for v in (self.eval_steps, self.num_steps)):
            raise ConfigError("calibration.eval_prompts, eval_steps and num_steps must be >= 1")
        if not 0.0 < self.percentile <= 100.0:
            raise ConfigError(f"calibration.percentile={self.percentile} must be in (0, 100]")
        if not 0.0 < self.ema_constant <= 1.0:
            raise ConfigError(f"calibration.ema_constant={self.ema_constant} must be in (0, 1]")
        if self.num_bins < 2 or self.num_bins & (self.num_bins - 1):
            raise ConfigError(f"calibration.num_bins={self.num_bins} must be a power of two (e.g. 2048): histograms "
                              "use power-of-two ranges so that batches and shards merge exactly")
        if self.num_bins < 16:
            raise ConfigError(f"calibration.num_bins={self.num_bins}: a histogram needs at least 16 bins "
                              "(default 2048)")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Q/DQ policy. ``exclude``/``include`` are fnmatch patterns over module paths."""

    format: QuantFormat = QuantFormat.FP8_E4M3
    graph_dtype: DType = DType.FP16
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    default_excludes: bool = True  # patch embedding, time/text embedders, AdaLN, final proj
    fused_qkv: bool = True
    fp8_attention: bool = False
    external_data: ExternalData = ExternalData.AUTO  # model.qdq.onnx.data: auto = only over 2 GB


@dataclasses.dataclass(frozen=True)
class BuildRequirements:
    """What the built engine must prove in its build report, else the build fails."""

    min_fp8_gemm_fraction: float = 0.0
    min_int8_gemm_fraction: float = 0.0
    require_fused_attention: bool = False
    require_fused_qkv: bool = False

    def __post_init__(self) -> None:
        for k in ("min_fp8_gemm_fraction", "min_int8_gemm_fraction"):
            _in_range(f"build.requirements.{k}", getattr(self, k), 0.0, 1.0, meaning=" (a fraction of the GEMMs)")


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """TensorRT / TensorRT-RTX builder settings."""

    optimization_level: int = 3
    workspace_gb: float = 8.0
    timing_cache: bool = True
    separate_engines: bool = False  # one engine per bucket instead of one profile per bucket
    attention: AttentionMode = AttentionMode.NATIVE
    plugins: tuple[str, ...] = ()
    requirements: BuildRequirements = BuildRequirements()

    def __post_init__(self) -> None:
        if not 0 <= self.optimization_level <= 5:
            raise ConfigError(f"build.optimization_level={self.optimization_level} must be 0..5")
        _in_range("build.workspace_gb", self.workspace_gb, 0.0, 4096.0, lo_open=True,
                  meaning=" (GiB of builder scratch memory)")


@dataclasses.dataclass(frozen=True)
class TorchFp8Config:
    """The GPU FP8 backend (``torch-fp8``: PyTorch + Triton on SM >= 8.9 where TensorRT is absent).

    The GEMMs follow ``quantization`` (the same sites and scales as the Q/DQ graph); this section
    holds what only that backend has: the 8-bit self-attention (INT8 QK^T, FP8 PV, per-block
    scales, K smoothing), switched off per block (``attention_exclude``, fnmatch over ``blocks.N``)
    or outside a timestep range (``attention_timesteps: [lo, hi]`` in 0..1000), its kernel
    (``attention_kernel``: ``int8``; ``int8-cute``, the same operands on the CuTe DSL kernel, SM 9.0; or
    ``cudnn-fp8``, cuDNN's FP8 SDPA), CUDA graphs, and
    ``gemm_fast_accum``: the FP8 GEMMs accumulate in the tensor cores' own accumulator (cuBLASLt fast
    accumulation, no periodic promotion to fp32). ``check`` runs the candidate with these settings
    and the runtime loads it with the settings the check ran.
    """

    fp8_attention: bool = True
    attention_exclude: tuple[str, ...] = ()
    attention_timesteps: tuple[float, float] = (0.0, 1000.0)
    attention_kernel: AttentionKernel = AttentionKernel.INT8
    cuda_graphs: bool = True
    gemm_fast_accum: bool = True

    def __post_init__(self) -> None:
        lo, hi = self.attention_timesteps
        if not 0.0 <= lo <= hi <= 1000.0:
            raise ConfigError(f"torch_fp8.attention_timesteps={[lo, hi]}: need 0 <= lo <= hi <= 1000")
        object.__setattr__(self, "attention_kernel",
                           enum_member(AttentionKernel, self.attention_kernel, "torch_fp8.attention_kernel"))

    def attention_policy(self) -> dict:
        """As :meth:`trt_sora.runners.fp8_runner.AttentionPolicy.from_dict` reads it."""
        d = {"enabled": self.fp8_attention, "exclude": list(self.attention_exclude),
             "timesteps": list(self.attention_timesteps)}
        return d | ({"kernel": self.attention_kernel.value} if self.attention_kernel != AttentionKernel.INT8 else {})


#: The CFG branches a caching schedule decides for (the sampler's labels).
CACHE_BRANCHES = ("cond", "uncond")


@dataclasses.dataclass(frozen=True)
class CachingConfig:
    """Step caching: which denoising steps reuse a branch's last transformer output instead of a call.

    ``method: magcache``: per step and CFG branch, the calibrated magnitude ratio of the transformer
    output to the previous step's (``calib/step_ratios.safetensors``, written by the calibrate stage)
    is multiplied up since the branch's last computed step; the step reuses that output while the
    accumulated error ``sum |1 - prod ratio|`` stays <= ``threshold`` and at most ``max_skips`` steps
    in a row reuse. ``method: extrapolate``: a skipped step's output continues the line through the
    branch's last two computed outputs (in the timestep); one decision per step for all ``branches``,
    which reuse while the summed calibrated relative errors of that prediction (same file; the worse
    branch's) stay <= ``threshold`` and at most ``max_skips`` (<= 4) steps in a row reuse. The first
    ``warmup_steps``, the last ``final_steps`` and the first step of each expert of a pair always
    compute; only the ``branches`` listed may reuse. ``check`` gates the
    cached clip (``parity.loop`` / ``parity.frames``) and records the curve over ``sweep``; the
    runtime serves only the setting its check passed. ``method: none`` (the default) is off.

    ``cfg_reuse`` (0: off): on a step where both branches would compute, the uncond branch is instead
    estimated as this step's cond output plus the branch difference ``uncond - cond`` of the last steps
    of this expert where both computed (continued in the timestep at ``cfg_order`` 1, the last one
    reused at 0), while the summed calibrated relative errors of that estimate since the last
    step computing both stay <= ``cfg_reuse`` (at most 4 steps apart); the step then calls cond alone. A
    step skipped whole after such a step takes its uncond the same way, from its cond estimate.

    ``plan`` (``method: extrapolate`` only): ``runs`` (the default) spends ``threshold`` per run of reused
    steps, as above; ``global`` makes ``threshold`` the whole trajectory's budget: the schedule reuses the
    most steps whose least summed errors (each reused step's, the worse branch's, at its place in its run)
    stay within it, so the calls saved never fall as the budget grows.

    ``damping`` (``method: extrapolate`` only; 1, the default: the line): a reused step takes ``newest +
    damping (line - newest)``, the line shrunk toward plain reuse. The planner still budgets the line's
    calibrated errors (the damped estimate's are smaller on wan-shapes at 37-39 of 39 reused steps), and
    ``check`` gates the damped clip like any other setting.
    """

    method: CacheMethod = CacheMethod.NONE
    threshold: float = 0.1
    max_skips: int = 2
    warmup_steps: int = 2
    final_steps: int = 1
    branches: tuple[str, ...] = CACHE_BRANCHES
    sweep: tuple[float, ...] = ()
    cfg_reuse: float = 0.0
    cfg_order: int = 0
    plan: CachePlan = CachePlan.RUNS
    damping: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", enum_member(CacheMethod, self.method, "caching.method"))
        object.__setattr__(self, "plan", enum_member(CachePlan, self.plan, "caching.plan"))
        object.__setattr__(self, "branches", tuple(self.branches))
        object.__setattr__(self, "sweep", tuple(self.sweep))
        _in_range("caching.threshold", self.threshold, 0.0, 10.0, lo_open=True,
                  meaning=" (the accumulated magnitude or prediction error a reuse may reach)")
        for v in self.sweep:
            _in_range("caching.sweep[]", v, 0.0, 10.0, lo_open=True, meaning=" (thresholds of the check's curve)")
        if self.max_skips < 1:
            raise ConfigError(f"caching.max_skips={self.max_skips} must be >= 1 (consecutive steps that may reuse); "
                              "switch caching off with method: none")
        if self.warmup_steps < 1 or self.final_steps < 0:
            raise ConfigError(f"caching.warmup_steps={self.warmup_steps} must be >= 1 (the first step computes) and "
                              f"final_steps={self.final_steps} >= 0")
        bad = [b for b in self.branches if b not in CACHE_BRANCHES]
        if bad or not self.branches or len(set(self.branches)) != len(self.branches):
            hint = did_you_mean(bad[0], CACHE_BRANCHES) if bad else ""
            raise ConfigError(f"caching.branches={list(self.branches)}{hint}: list each CFG branch that may reuse "
                              f"once, from {list(CACHE_BRANCHES)}")
        self._check_cfg_reuse()
        _in_range("caching.damping", self.damping, 0.0, 1.0, lo_open=True,
                  meaning=" (the share of the line's step a reused output takes; 1: the line)")
        if self.damping != 1.0 and self.method is not CacheMethod.EXTRAPOLATE:
            raise ConfigError(f"caching.damping shrinks the line of method: extrapolate, not method: "
                              f"{self.method.value}; set caching.method: extrapolate or damping: 1")
        if self.plan is CachePlan.GLOBAL and self.method is not CacheMethod.EXTRAPOLATE:
            raise ConfigError(f"caching.plan=global budgets the extrapolation errors of method: extrapolate, not "
                              f"method: {self.method.value}; set caching.method: extrapolate or plan: runs")

    def _check_cfg_reuse(self) -> None:
        if self.cfg_reuse != 0.0:
            _in_range("caching.cfg_reuse", self.cfg_reuse, 0.0, 10.0, lo_open=True,
                      meaning=" (the summed error of the uncond estimates between steps computing both; 0: off)")
        if isinstance(self.cfg_order, bool) or self.cfg_order not in (0, 1):
            raise ConfigError(f"caching.cfg_order={self.cfg_order!r} must be 0 (reuse the last branch difference) "
                              "or 1 (continue the last two in the timestep)")
        if self.cfg_reuse and not self.enabled:
            raise ConfigError("caching.cfg_reuse needs a step method to compose with; set caching.method to "
                              "extrapolate or magcache (a tiny threshold reuses no whole step) or cfg_reuse: 0")
        if self.cfg_reuse and "uncond" not in self.branches:
            raise ConfigError(f"caching.cfg_reuse estimates the uncond branch but caching.branches="
                              f"{list(self.branches)} keeps it computing; add uncond or set cfg_reuse: 0")

    def setting(self) -> dict:
        """The setting as a plain dict, the CFG-reuse keys only when it is on, ``plan`` only when it is
        not ``runs`` and ``damping`` only when it is not 1 (so a record or fingerprint of a recipe without
        them stays what it was before the keys existed)."""
        d = to_dict(self)
        if self.plan is CachePlan.RUNS:
            del d["plan"]
        if self.damping == 1.0:
            del d["damping"]
        return d if self.cfg_reuse else {k: v for k, v in d.items() if k not in ("cfg_reuse", "cfg_order")}

    @property
    def enabled(self) -> bool:
        return self.method is not CacheMethod.NONE


_Window = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
    """Sparse self-attention: a 3-D tile pattern over latent frames x height x width tokens.

    Tokens are grouped into tiles of ``tile`` (frames, height, width) tokens and ordered tile by tile;
    that order is cut into blocks of ``tile``'s volume. A query block attends a key block when one of
    their tiles lies within ``window`` tile distances of the other on every axis, or when the key block
    holds a token of the first ``global_frames`` latent frames (:mod:`trt_sora.sparse`). The first
    ``dense_steps`` denoising steps and the layers matching ``dense_layers`` (fnmatch over block paths,
    ``blocks.0``) stay dense. ``window`` fixes every other layer's window; without it the calibrate
    stage measures, per layer, the attention mass outside each of ``candidates`` (narrowest first) and
    each layer takes the narrowest whose mass stays <= ``mass_budget`` (none: the layer stays dense).
    ``check`` runs the candidate with the pattern and gates its clip; ``enabled: false`` is off.
    """

    enabled: bool = False
    tile: _Window = (1, 8, 16)
    window: _Window | None = None
    candidates: tuple[_Window, ...] = ((0, 1, 1), (1, 1, 1), (1, 2, 2), (2, 2, 2))
    mass_budget: float = 0.05
    dense_steps: int = 2
    dense_layers: tuple[str, ...] = ()
    global_frames: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile", tuple(self.tile))
        object.__setattr__(self, "candidates", tuple(tuple(c) for c in self.candidates))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.window is not None:
            object.__setattr__(self, "window", tuple(self.window))
        if len(self.tile) != 3 or min(self.tile) < 1:
            raise ConfigError(f"sparse_attention.tile={list(self.tile)} must be 3 positive token counts "
                              "(latent frames, height, width after patching)")
        for where, w in [("window", self.window)] + [(f"candidates[{i}]", c) for i, c in enumerate(self.candidates)]:
            if w is not None and (len(w) != 3 or min(w) < 0):
                raise ConfigError(f"sparse_attention.{where}={list(w)} must be 3 tile distances >= 0 "
                                  "(frames, height, width)")
        if self.window is None and not self.candidates:
            raise ConfigError("sparse_attention: give a window or candidates for the calibrate stage to choose from")
        _in_range("sparse_attention.mass_budget", self.mass_budget, 0.0, 1.0, lo_open=True,
                  meaning=" (the attention mass a layer's window may leave out)")
        if self.dense_steps < 0 or self.global_frames < 0:
            raise ConfigError(f"sparse_attention.dense_steps={self.dense_steps} and global_frames="
                              f"{self.global_frames} must be >= 0")


@dataclasses.dataclass(frozen=True)
class ParityGate:
    """Thresholds for one comparison; ``None`` disables that metric's gate."""

    min_cosine: float | None = None
    min_psnr_db: float | None = None
    max_abs: float | None = None
    max_rel_l2: float | None = None
    min_ssim: float | None = None  # decoded frames only (worst frame)
    # Q/DQ level only: ``min_cosine`` is relaxed, per sample, to ``max_floor_ratio`` x the rounding
    # floor, the distance between two correct references (PyTorch fake-quant in fp32 and in the
    # graph's dtype). FP8 rounds to 3 mantissa bits, so fp16-vs-fp32 differences flip some roundings;
    # on a trained model near the end of sampling that alone costs more than 1e-3 in cosine.
    max_floor_ratio: float | None = None
    # Trajectory level only: a step whose calls miss min_cosine / min_psnr_db passes when the error
    # it alone writes into the final latents (measured by re-running the reference from there) is
    # at least this PSNR (dB, peak = final latents' max - min). None: every call must pass.
    min_contribution_db: float | None = None

    def check_ranges(self, where: str) -> None:
        """Every threshold must be passable and mean something: a gate that can never pass, or passes
        anything, is a typo (``min_cosine: 7``)."""
        _in_range(f"{where}.min_cosine", self.min_cosine, 0.0, 1.0, lo_open=True,
                  meaning=" (a cosine is at most 1; <= 0 passes anything)")
        _in_range(f"{where}.min_psnr_db", self.min_psnr_db, 0.0, 200.0, lo_open=True, meaning=" (dB)")
        _in_range(f"{where}.max_abs", self.max_abs, 0.0, math.inf, hi_open=True)
        _in_range(f"{where}.max_rel_l2", self.max_rel_l2, 0.0, math.inf, hi_open=True)
        _in_range(f"{where}.min_ssim", self.min_ssim, 0.0, 1.0, lo_open=True, meaning=" (SSIM is at most 1)")
        _in_range(f"{where}.max_floor_ratio", self.max_floor_ratio, 0.0, 1e6, lo_open=True)
        _in_range(f"{where}.min_contribution_db", self.min_contribution_db, 0.0, 200.0, lo_open=True, meaning=" (dB)")


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    """Gates per comparison level (see trt_sora.parity)."""

    export: ParityGate = ParityGate(min_cosine=0.99999)
    qdq: ParityGate = ParityGate(min_cosine=0.999, max_floor_ratio=4.0)
    quality: ParityGate = ParityGate(min_cosine=0.99, min_psnr_db=30.0)
    trajectory: ParityGate = ParityGate(min_cosine=0.99, min_contribution_db=45.0)
    loop: ParityGate = ParityGate(min_psnr_db=25.0)
    frames: ParityGate = ParityGate(min_psnr_db=25.0)
    num_samples: int = 2
    # The sampling-loop level's trajectory: None = the model's own steps / CFG (what users run);
    # a smaller loop_steps is an explicit shortening and the report says so.
    loop_steps: int | None = None
    guidance_scale: float | None = None
    jump_factor: float = 10.0    # localisation: a layer whose error grows this much over the layers before it

    def __post_init__(self) -> None:
        for level in ("export", "qdq", "quality", "trajectory", "loop", "frames"):
            getattr(self, level).check_ranges(f"parity.{level}")
        for k in ("num_samples", "loop_steps"):
            if getattr(self, k) is not None and getattr(self, k) < 1:
                raise ConfigError(f"parity.{k}={getattr(self, k)} must be >= 1")
        _in_range("parity.guidance_scale", self.guidance_scale, 0.0, 100.0)
        _in_range("parity.jump_factor", self.jump_factor, 1.0, 1e6, lo_open=True,
                  meaning=" (how many times a layer's error must grow to count as the jump)")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One build target. Flat, self-contained YAML; see ``recipes/``."""

    name: str
    backend: Backend
    compute_capability: str
    buckets: tuple[ShapeProfile, ...]
    description: str = ""
    format_version: int = RECIPE_FORMAT_VERSION
    model: ModelConfig = ModelConfig()
    export: ExportConfig = ExportConfig()
    calibration: CalibConfig = CalibConfig()
    quantization: QuantConfig = QuantConfig()
    build: BuildConfig = BuildConfig()
    parity: ParityConfig = ParityConfig()
    torch_fp8: TorchFp8Config = TorchFp8Config()
    caching: CachingConfig = CachingConfig()
    sparse_attention: SparseAttentionConfig = SparseAttentionConfig()

    def __post_init__(self) -> None:
        if self.format_version != RECIPE_FORMAT_VERSION:
            raise ConfigError(
                f"recipe {self.name!r}: format_version {self.format_version} is not supported "
                f"(this trt_sora reads {RECIPE_FORMAT_VERSION})"
            )
        try:
            dotted = sm_dotted(self.compute_capability) == str(self.compute_capability)
        except ConfigError:
            dotted = False
        if not dotted:
            raise ConfigError(
                f"recipe {self.name!r}: compute_capability {self.compute_capability!r} must look like '8.9'")
        if not self.buckets:
            raise ConfigError(f"recipe {self.name!r}: needs at least one bucket")
        names = [b.name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ConfigError(f"recipe {self.name!r}: bucket names must be unique, got {names}")
        for b in self.buckets:
            for dim, r in b.dims():
                ex = self.export.dynamic[dim]
                if r.min < ex.min or r.max > ex.max:
                    raise ConfigError(
                        f"recipe {self.name!r}: bucket {b.name!r} {dim} {r.min}..{r.max} lies outside "
                        f"the exported range {ex.min}..{ex.max}; widen export.dynamic.{dim} or shrink the bucket"
                    )

    @property
    def sm(self) -> int:
        """Compute capability as an int, e.g. ``89``."""
        return sm_int(self.compute_capability)


def recipe_from_dict(data: dict) -> Recipe:
    return from_dict(Recipe, data, where="")


def recipe_to_dict(recipe: Recipe) -> dict:
    d = to_dict(recipe)
    d["buckets"] = [b.to_yaml() for b in recipe.buckets]
    d["export"]["dynamic"] = {k: v.to_yaml() for k, v in recipe.export.dynamic.items()}
    return d
