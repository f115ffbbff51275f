"""The backend registry: one :class:`Backend` per name a user can check or serve.

A backend says which files it loads from a run folder, what a parity report must have vouched for
before it serves, and how its runner is opened. ``trt-sora check`` opens its candidate and
``trt_sora.runtime.load`` opens the served runner through the same :meth:`Backend.open`, so what was
checked and what is served are built by one call.

Options flow in two groups (:class:`OpenOptions`):

* checked (``cuda_graphs``, ``attention``, ``fast_accum``, ``sparse``): how the backend computes. The check takes
  them from the recipe (:func:`check_options`) and records them in the report's candidate (``open``);
  the runtime opens the served runner with the recorded values (:func:`served_options`), never its own.
* resources (``device``, ``dtype``, ``compile``, ``threads``, ``contexts``): where and how wide it runs.
  The check uses one context, the default dtype and its ``--device``; ``load`` takes them from its
  arguments (``contexts`` = ``concurrency``). ``dtype`` and ``compile`` reach only the ``torch``
  backend, which serves the PyTorch reference itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trt_sora.config.recipe import TorchFp8Config
from trt_sora.errors import ArtifactError, BackendMissingError, ConfigError
from trt_sora.runfolder import RunFolder
from trt_sora.sm import device_sm, sm_dotted, sm_int
from trt_sora.sparse import SparsePlan

#: the run-folder files a backend can load, by artifact key (the engine is the one its manifest lists)
ARTIFACT_SUFFIXES = {"export": "export/model.onnx", "qdq": "quant/model.qdq.onnx", "qdq_map": "quant/qdq_map.json",
                     "stats": "calib/stats.safetensors", "engine": ".plan"}

#: the options a parity report vouches for; the runtime serves these as recorded
CHECKED = ("cuda_graphs", "attention", "fast_accum", "sparse")
#: the backends that run sparse self-attention (the ONNX graph and the engine hold dense attention)
SPARSE_BACKENDS = ("torch", "torch-fp8")


def find_artifacts(run_dir: str | Path) -> dict[str, Path | None]:
    """Paths of one run's artifacts (``None`` where a stage has not run). The engine is the one its
    manifest lists (not whatever ``*.plan`` lies in the folder)."""
    rf = RunFolder(run_dir)
    if not rf.onnx_model.is_file():
        raise ArtifactError(f"{rf} has no export/model.onnx; run `trt-sora export --out {rf.export}` first")
    q, stats = rf.qdq_model, rf.calib_stats
    return {"export": rf.onnx_model,
            "qdq": q if q.is_file() else None,
            "qdq_map": rf.qdq_map if q.is_file() else None,
            "stats": stats if stats.is_file() else None,
            "engine": rf.engine_plan()}


def artifacts_from_files(files: Mapping[str, Path]) -> dict[str, Path]:
    """``{artifact key: path}`` of verified files (``{path relative to the run: path}``, as a parity
    report's candidate lists them); files no backend loads directly (external data) are skipped."""
    out = {}
    for rel, path in files.items():
        for key, suffix in ARTIFACT_SUFFIXES.items():
            if str(rel).replace("\\", "/").endswith(suffix):
                out[key] = path
    return out


@dataclasses.dataclass(frozen=True)
class OpenOptions:
    """How a backend's runner is opened (see the module docstring for which group comes from where)."""

    device: str | None = None  # torch-style; None: the backend's default (CUDA when there is one)
    dtype: str = "fp32"  # torch: compute dtype
    compile: bool = False  # torch: torch.compile the forward
    threads: int | None = None  # ort: intra-op threads
    contexts: int = 1  # trt: execution contexts
    cuda_graphs: bool = True  # trt, torch-fp8: capture and replay CUDA graphs
    attention: Mapping[str, Any] | None = None  # torch-fp8: the 8-bit attention policy (None: its default)
    fast_accum: bool = TorchFp8Config.gemm_fast_accum  # torch-fp8: cuBLASLt fast accumulation
    sparse: Mapping[str, Any] | None = None  # torch, torch-fp8: a trt_sora.sparse.SparsePlan's dict (None: dense)

    def checked(self) -> dict[str, Any]:
        """The options a parity report records and vouches for (``sparse`` only when on: a dense report reads
        as before it existed)."""
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in dataclasses.asdict(self).items()
                if k in CHECKED and not (k == "sparse" and v is None)}


def check_options(backend: str, recipe, device: str | None) -> OpenOptions:
    """The options ``trt-sora check`` opens ``backend``'s candidate with: the recipe's ``torch_fp8``
    policy for ``torch-fp8``, the defaults elsewhere."""
    if backend != "torch-fp8":
        return OpenOptions(device=device)
    tf = recipe.torch_fp8
    return OpenOptions(device=device, cuda_graphs=tf.cuda_graphs, attention=tf.attention_policy(),
                       fast_accum=tf.gemm_fast_accum)


def served_options(rep: Mapping[str, Any] | None, **resources) -> OpenOptions:
    """The options ``runtime.load`` opens the served runner with: the checked ones the report's candidate
    recorded, ``resources`` (device, dtype, compile, threads, contexts) from the caller. A report written
    before ``open`` was recorded: the torch-fp8 policy from where it executed, CUDA graphs on."""
    cand = (rep or {}).get("candidate") or {}
    if isinstance(cand.get("open"), Mapping):
        checked = {k: cand["open"][k] for k in CHECKED if k in cand["open"]}
    else:
        ran = cand.get("device") or {}
        checked = {"attention": ran.get("attention_policy"), "fast_accum": bool(ran.get("gemm_fast_accum", False))}
    return OpenOptions(**resources, **checked)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: what it loads, what a report must vouch for, and how its runner opens.

    ``files``: the artifact keys (:data:`ARTIFACT_SUFFIXES`) it loads (``first_of``: only the first one the
    run has, as ORT opens the Q/DQ graph over the plain export); ``checked_as``: the backend a
    passed report's candidate must name (None: any passed report of the same model vouches, the backend
    serves the reference itself); ``same_sm``: the check must have run on a GPU of the serving SM;
    ``min_sm``: the least SM it runs on.
    """

    name: str
    files: tuple[str, ...]
    checked_as: str | None
    same_sm: bool
    min_sm: int | None
    _open: Callable[..., Any] = dataclasses.field(repr=False)
    first_of: bool = False

    def loads(self, arts: Mapping[str, Path | None]) -> tuple[str, ...]:
        """The keys of ``arts`` its runner loads."""
        keys = tuple(k for k in self.files if arts.get(k) is not None)
        return keys[:1] if self.first_of else keys

    @property
    def check_with(self) -> str:
        """The ``trt-sora check --backend`` that vouches for this backend."""
        return self.checked_as or "ort"

    def open(self, root: Path, arts: Mapping[str, Path | None], family, options: OpenOptions, *,
             name: str | None = None, model=None):
        """The activated runner over ``arts`` (``find_artifacts``' keys; a missing key is a stage that did not
        run) of the run (or expert) folder ``root``. ``model``: a loaded PyTorch model to share (torch only)."""
        return self._open(Path(root), arts, family, options, name=name, model=model)


def _dense_only(backend: str, options: OpenOptions) -> None:
    if options.sparse:
        raise ConfigError(f"backend {backend!r} runs the dense attention its graph holds; sparse attention runs on "
                          f"{' and '.join(SPARSE_BACKENDS)}: check and serve with one of them, or set "
                          "sparse_attention.enabled: false")


def _open_trt(root: Path, arts, family, options: OpenOptions, *, name, model):
    from trt_sora.runners.trt_runner import TrtRunner

    _dense_only("trt", options)

    plan = arts.get("engine")
    if plan is None:
        raise ArtifactError(f"{root}/engine has no engine; run `trt-sora build` or use backend='ort'")
    gpu_check(root)
    dev = int(str(options.device).split(":")[-1]) if options.device and ":" in str(options.device) else 0
    flavor = RunFolder(root).read_manifest("engine", check_stage=False).get("results", {}).get("backend")
    return TrtRunner(plan, device=dev, contexts=options.contexts, cuda_graphs=options.cuda_graphs, flavor=flavor,
                     name=name).activate()


def _open_torch_fp8(root: Path, arts, family, options: OpenOptions, *, name, model):
    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

    if arts.get("qdq_map") is None or arts.get("stats") is None:
        raise ArtifactError(f"backend torch-fp8 runs the calibrated Q/DQ sites; {root} has no quant/qdq_map.json "
                            "or calib/stats.safetensors - run `trt-sora quantize` first")
    return TorchFp8Runner(family, arts["qdq_map"], arts["stats"], device=options.device or "cuda",
                          attention=AttentionPolicy.from_dict(options.attention), cuda_graphs=options.cuda_graphs,
                          fast_accum=options.fast_accum, name=name,
                          sparse=SparsePlan.from_dict(options.sparse)).activate()


def _open_ort(root: Path, arts, family, options: OpenOptions, *, name, model):
    """ONNX Runtime on the Q/DQ graph when there is one, else the plain export (ORT's run() is thread-safe:
    one session serves every caller)."""
    from trt_sora.runners.ort_runner import OrtRunner, providers_for

    _dense_only("ort", options)

    qdq, export = arts.get("qdq"), arts.get("export")
    onnx = qdq if qdq is not None else export
    if onnx is None:
        raise ArtifactError(f"{root} has no export/model.onnx; run `trt-sora export --out {root}/export` first")
    return OrtRunner(onnx, threads=options.threads, providers=providers_for(options.device),
                     probe_source=export if qdq is not None else None, name=name).activate()


def _open_torch(root: Path, arts, family, options: OpenOptions, *, name, model):
    from trt_sora.runners.torch_runner import TorchRunner

    device = options.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None:
        model = family.load(options.dtype, device)
    return TorchRunner(family, dtype=options.dtype, device=device, model=model, compile=options.compile,
                       name=name, sparse=SparsePlan.from_dict(options.sparse)).activate()


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("trt", ("engine",), "trt", same_sm=True, min_sm=None, _open=_open_trt),
    Backend("ort", ("qdq", "export"), "ort", same_sm=False, min_sm=None, _open=_open_ort, first_of=True),
    Backend("torch", (), None, same_sm=False, min_sm=None, _open=_open_torch),
    Backend("torch-fp8", ("qdq_map", "stats"), "torch-fp8", same_sm=True, min_sm=89, _open=_open_torch_fp8),
)}


def get_backend(name: str) -> Backend:
    """The registered backend ``name``; ConfigError naming the registered ones otherwise."""
    if name not in BACKENDS:
        from trt_sora.config.base import did_you_mean

        raise ConfigError(f"unknown backend {name!r}{did_you_mean(name, tuple(BACKENDS))}; use one of "
                          f"{tuple(BACKENDS)}")
    return BACKENDS[name]


def gpu_check(run: Path) -> None:
    """The engine manifest's ``results.sm`` and TensorRT version against this machine's GPU and TensorRT."""
    man = RunFolder(run).read_manifest("engine", check_stage=False)
    res = man.get("results", {})
    import torch

    if not torch.cuda.is_available():
        raise BackendMissingError("backend 'trt' needs an NVIDIA GPU; none is visible - use backend='ort' or 'torch'")
    here = device_sm()
    sm = res.get("sm") or res.get("compute_capability") or man.get("config", {}).get("compute_capability")
    if sm is not None:
        want = sm_int(sm)
        if want != here:
            raise ArtifactError(f"the engine was built for SM{want} but this GPU is SM{here} "
                                f"({torch.cuda.get_device_name()}); rebuild with a recipe for compute_capability "
                                f"{sm_dotted(here)}")
    built = res.get("backend_version") or res.get("tensorrt_version") or man.get("tools", {}).get(
        "tensorrt") or man.get("tools", {}).get("tensorrt-rtx-cu13")
    from trt_sora.runners.trt_runner import import_tensorrt

    trt = import_tensorrt(res.get("backend"))
    if built and str(built).split(".")[:2] != str(trt.__version__).split(".")[:2]:
        raise ArtifactError(f"the engine was built with TensorRT {built} but this machine has {trt.__version__}; "
                            "rebuild the engine here or install the matching TensorRT")
