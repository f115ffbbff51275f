"""The TensorRT backend on a GPU: an engine built for this GPU is checked on it, then served.

Needs an NVIDIA GPU plus the runtime that builds for it: full TensorRT (``trt`` marker) or
TensorRT-RTX on an RTX GPU (``trt_rtx``). Skipped with the reason elsewhere, never a silent pass.
"""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from trt_sora.sm import sm_int

pytestmark = pytest.mark.gpu

RTX_SMS = (75, 86, 89, 120)  # what TensorRT-RTX 1.7 targets (no Hopper / datacenter SMs)


@pytest.mark.parametrize("flavor", [pytest.param("tensorrt", marks=pytest.mark.trt),
                                    pytest.param("tensorrt_rtx", marks=pytest.mark.trt_rtx)])
def test_engine_checked_on_this_gpu_is_served_and_matches_ort(flavor, base_run, tmp_path):
    import torch

    import trt_sora.runtime as rt
    from trt_sora.build import build_engine
    from trt_sora.config import Backend, load_recipe
    from trt_sora.errors import ArtifactError
    from trt_sora.models import get_adapter
    from trt_sora.parity import check_artifacts
    from trt_sora.parity.metrics import compare

    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    if flavor == "tensorrt_rtx" and sm not in RTX_SMS:
        pytest.skip(f"TensorRT-RTX does not target SM{sm}")
    recipe = dataclasses.replace(load_recipe("rtx4090-fp8"), backend=Backend(flavor),
                                 compute_capability=f"{major}.{minor}")
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    buckets = get_adapter("wan-tiny").buckets_for(recipe)[0]
    build_engine(run / "quant" / "model.qdq.onnx", recipe, run / "engine", buckets=buckets,
                 export_manifest=run / "export", model_name="wan-tiny")

    # a report from ONNX Runtime does not vouch for the engine
    assert check_artifacts(run, recipe, backend="ort")["passed"]
    with pytest.raises(ArtifactError, match="'ort', not 'trt'"):
        rt.load(run, backend="trt", warmup=False)

    rep = check_artifacts(run, recipe, backend="trt")
    assert rep["passed"], rep["failed"]
    cand = rep["candidate"]
    assert cand["backend"] == "trt" and cand["executed"] and rep["engine"]["executed"]
    assert sm_int(cand["device"]["sm"]) == sm and cand["device"]["runtime"] == flavor
    assert list(cand["files"]) == [rep["engine"]["path"]]

    served = rt.load(run, backend="trt")
    assert served.backend == "trt" and served.verified
    g = np.random.default_rng(1)
    feeds = {"hidden_states": g.standard_normal((2, 16, 3, 4, 6)).astype(np.float32),
             "timestep": np.full((2,), 700.0, np.float32),
             "encoder_hidden_states": g.standard_normal((2, 16, 64)).astype(np.float32)}
    got = served.infer(feeds)["sample"]
    assert np.array_equal(served.infer(feeds)["sample"], got)  # CUDA-graph replay == first (eager) call
    # the engine against the checked Q/DQ graph on ONNX Runtime (same calibration, fp16 vs fp32 math)
    from trt_sora.runners import OrtRunner

    with OrtRunner(run / "quant" / "model.qdq.onnx") as ort:
        assert compare(ort.infer(feeds)["sample"], got)["cosine"] > 0.999
    # 8 threads on the pooled execution contexts give the single-threaded result
    import threading

    pooled = rt.load(run, backend="trt", concurrency=4, warmup=False)
    ref = pooled.infer(feeds)["sample"]
    bad = []

    def work():
        for _ in range(25):
            if not np.array_equal(pooled.infer(feeds)["sample"], ref):
                bad.append(1)

    ts = [threading.Thread(target=work) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not bad
