"""What servers import: load a checked artifact, pick the bucket, warm up, run thread-safely.

::

    import trt_sora.runtime as rt
    runner = rt.load("build/wan-tiny/rtx4090-fp8", backend="auto")   # serves only what parity verified
    out = runner.infer({"hidden_states": x, "timestep": t, "encoder_hidden_states": e})["sample"]
    pipe.transformer = rt.as_diffusers_transformer(runner)         # WanPipeline, unchanged
    clips = rt.generate(runner, ["a red circle moving right"])     # prompts -> uint8 clips + metadata
    pipe = rt.diffusers_pipeline(runner)                           # a ready WanPipeline over the runner

Importing this module loads neither torch nor onnx (standard library, numpy, trt_sora.config).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from trt_sora.errors import ConfigError, NumericsError
from trt_sora.runfolder import RunFolder
from trt_sora.runners import registry
from trt_sora.runtime.assemble import parallel_runners, served_runners
from trt_sora.runtime.served_caching import ServedCache, caching_mismatch, served_caching
from trt_sora.runtime.serving import InputError, ServingRunner
from trt_sora.runtime.verify import (
    auto_backend,
    buckets_of,
    mismatch,
    read_report,
    served_buckets,
    vouched_files,
)
from trt_sora.sm import device_sm

log = logging.getLogger("trt_sora")

__all__ = ["Clip", "ClipRequest", "Generator", "InputError", "NumericsError", "ServedCache", "ServingRunner",
           "as_diffusers_transformer", "caching_mismatch",
           "buckets_of", "diffusers_pipeline", "generate", "load", "mismatch", "read_report"]

BACKENDS = ("auto", *registry.BACKENDS)


def load(artifact_dir, backend: str = "auto", *, force: bool = False, concurrency: int = 1,
         device: str | None = None, dtype: str = "fp32", warmup: bool = True, compile: bool = False,
         threads: int | None = None, check_finite: bool = True, parallel=None, caching: bool = True) -> ServingRunner:
    """Load a run folder (``build/<model>/<recipe>/``) for serving - only what its parity check verified.

    The parity report (``parity/report.json``, re-hashed against its manifest) must have passed with
    this backend as its candidate, on this GPU's SM for ``trt`` / ``torch-fp8``; every file that
    candidate loaded is re-hashed (sha256, cached by size + mtime + ctime) before it is loaded, so a
    copy, a symlink or an absolute path of the run folder serves exactly the checked bytes.

    Args:
        artifact_dir: run folder with ``export/``, ``parity/`` and optionally ``quant/``, ``engine/``.
        backend: ``"trt"`` (engine; GPU + TensorRT), ``"ort"`` (the checked ONNX), ``"torch"`` (the
            PyTorch reference itself), ``"torch-fp8"`` (the calibrated sites as FP8 tensor-core GEMMs +
            Triton kernels; SM >= 8.9) or ``"auto"`` (the backend the report was checked on; an error
            naming the GPU it needs when that cannot run here).
        force: load even when the report is missing, failed, for another backend/GPU, or a file changed;
            every such problem is logged as a WARNING (``LOADING UNVERIFIED ARTIFACT``).
        concurrency: pooled runners (TensorRT execution contexts / ORT sessions / torch replicas
            share one model) = concurrent callers served at once; more callers wait.
        device: torch backends' device (default ``cuda`` when available else ``cpu``); trt: ``cuda:N``;
            ort: ``cpu`` (CPU provider only), ``cuda[:N]`` (the CUDA provider of onnxruntime-gpu, required),
            default CUDA when onnxruntime-gpu has it, else CPU.
        dtype: torch backend compute dtype (``fp32``/``bf16``/``fp16``).
        warmup: run every bucket once at load (timings in ``warmup_seconds``).
        compile: torch backend: ``torch.compile`` the forward.
        check_finite: reject NaN/inf inputs (InputError) and NaN/inf outputs (NumericsError) on every
            call; ``False`` for servers that check upstream. Cost: a max and a min over each input and
            the output (numpy / CPU tensors), one ``isfinite`` kernel + sync per tensor on CUDA.
        parallel: a :class:`trt_sora.parallel.ParallelConfig` (CFG-parallel x Ulysses) for the
            ``torch`` / ``torch-fp8`` backends, inside a ``torch.distributed`` job (``torchrun``;
            :func:`trt_sora.parallel.init_process_group`). Call ``load`` on every rank: rank 0 serves
            (``infer``), the other ranks call ``follow()`` until rank 0 closes.
        caching: serve the run folder's step caching (its ``recipe.yaml``'s ``caching`` section; without
            one, the setting its check passed) - only when the parity report checked exactly that setting
            with this backend, else ArtifactError (see :func:`caching_mismatch`); False: every step computes.

    Raises ArtifactError (unchecked/failed/changed artifact, report of another backend or GPU),
    BackendMissingError (backend not installed / no GPU), ConfigError (unknown backend).
    """
    t0 = time.perf_counter()
    run = Path(artifact_dir)
    if backend not in BACKENDS:
        from trt_sora.config.base import did_you_mean

        raise ConfigError(f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; use one of {BACKENDS}")
    rf = RunFolder(run)
    pair = rf.read_pair()  # a pair of experts (Wan 2.2 A14B): high/ and low/ expert folders
    exp = rf.export_side(pair).read_manifest("export")
    rep = read_report(run)
    if backend == "auto":
        backend = auto_backend(run, rep, device)
    res = exp["results"]
    model_hash = pair["model_hash"] if pair else (res.get("model") or {}).get("model_hash")
    here = device_sm(device if backend != "trt" else (device or "cuda"))
    files, verified = vouched_files(run, rep, backend, here, model_hash, force)
    buckets = served_buckets(run, rep)
    from trt_sora.models import adapter_for_manifest

    cfg = dict(res["model"].get("config") or {})
    family = adapter_for_manifest(res["model"])  # input ranks, fixed feature dims and patch are family facts
    ranks, channels = family.input_ranks(), family.fixed_axes()
    options = registry.served_options(rep, device=device, dtype=dtype, compile=compile, threads=threads,
                                      contexts=concurrency)
    runners = served_runners(run, backend, files, family, pair, options)
    if parallel is not None:
        runners = parallel_runners(runners, backend, parallel, concurrency)
    pooled = runners * concurrency if len(runners) == 1 else runners
    sr = ServingRunner(pooled, backend=backend, buckets=buckets, model_config=cfg, run_dir=run,
                       input_ranks=ranks, channels=channels, patch=tuple(family.patch_size),
                       check_finite=check_finite, input_dims=family.input_dims(), mask_inputs=family.mask_inputs)
    sr._runners = runners  # warm-up/close once per distinct runner
    sr.verified = verified
    sr.caching = served_caching(run, rep, backend, force) if caching else None
    sr.load_seconds = time.perf_counter() - t0
    if warmup and getattr(runners[0], "rank", 0) == 0:  # followers warm up by following rank 0's calls
        sr.warm_up()
    log.info("runtime: %s backend, %d bucket(s), loaded in %.2f s%s", backend, len(buckets), sr.load_seconds,
             "" if verified else " (UNVERIFIED, force=True)")
    return sr


def as_diffusers_transformer(runner, *, dtype=None, device=None):
    """A stand-in for ``WanTransformer3DModel`` in a diffusers pipeline, backed by ``runner``.

    ``pipe.transformer = as_diffusers_transformer(runner)``: the object has ``config`` (the
    exported transformer's diffusers config), ``dtype``, ``device``, ``cache_context(name, ...)`` and
    ``__call__(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
    return_dict=True, attention_kwargs=None)`` returning ``Transformer2DModelOutput(sample=...)``
    (or a 1-tuple). Imports torch/diffusers when called.
    """
    from trt_sora.runtime._diffusers import make_transformer

    return make_transformer(runner, dtype=dtype, device=device)


def diffusers_pipeline(runner, **kwargs):
    """A ready diffusers pipeline over ``runner`` (see
    :func:`trt_sora.runtime._diffusers_pipeline.make_pipeline`)."""
    from trt_sora.runtime._diffusers_pipeline import make_pipeline  # not "diffusers_pipeline": importing
    # that submodule would rebind this function's name on the package to the module (a second call fails)

    return make_pipeline(runner, **kwargs)


from trt_sora.runtime.generate import Clip, ClipRequest, Generator, generate  # noqa: E402  (numpy + stdlib only)

