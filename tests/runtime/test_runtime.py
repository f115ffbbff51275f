"""trt_sora.runtime: refusal of unchecked/failed artifacts, input validation, threads, diffusers drop-in."""
import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from run_folders import RECIPE, corrupt_scale

from trt_sora.errors import ArtifactError, ShapeError


def test_import_is_light():
    code = ("import sys, trt_sora.runtime; bad=[m for m in ('torch','onnx','onnxruntime','diffusers','tensorrt') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_refuses_unchecked_and_failed(base_run, tmp_path, caplog):
    import logging

    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    with pytest.raises(ArtifactError, match="trt-sora check"):
        rt.load(base_run, backend="ort")
    run = tmp_path / "failed"
    shutil.copytree(base_run, run)
    corrupt_scale(run, "blocks.1.ffn.net.0.proj", 0.02)
    assert not check_artifacts(run, RECIPE)["passed"]
    with pytest.raises(ArtifactError, match="failed its parity gates"):
        rt.load(run, backend="ort")
    with caplog.at_level(logging.WARNING, logger="trt_sora"):
        r = rt.load(run, backend="ort", force=True, warmup=False)
    assert r.backend == "ort" and not r.verified
    assert any("LOADING UNVERIFIED ARTIFACT" in rec.message for rec in caplog.records)
    # a report written by hand (no parity manifest) is no report
    (run / "parity" / "manifest.json").unlink()
    (run / "parity" / "report.json").write_text(json.dumps({"passed": True, "candidate": {"backend": "ort"}}))
    with pytest.raises(ArtifactError, match="no manifest.json"):
        rt.load(run, backend="ort")


def _rescale_a_qdq_scale(path, factor=0.5):
    """Edit one activation scale of a Q/DQ graph in place, behind the manifests' back (the graph stays valid)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear")
    init = next(i for i in m.graph.initializer if i.name == q.input[1])
    a = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((a * factor).astype(a.dtype), init.name))
    onnx.save(m, str(path))


@pytest.mark.parametrize("how", ["in-place", "copied-folder", "symlink"])
def test_refuses_a_checked_file_changed_after_the_check(checked_run, tmp_path, how):
    """Every file the check ran is re-hashed at load: a Q/DQ graph edited after the check (still a valid
    graph) is refused with a typed error naming the file, whether the run folder is the checked one, a
    copy, or reached through a symlink; ``force=True`` loads it, marked unverified."""
    import trt_sora.runtime as rt

    run = tmp_path / "run"
    shutil.copytree(checked_run, run)
    files = json.loads((run / "parity" / "report.json").read_text())["candidate"]["files"]
    assert "quant/model.qdq.onnx" in files
    rt.load(run, backend="ort", warmup=False).close()  # the untouched copy verifies
    _rescale_a_qdq_scale(run / "quant" / "model.qdq.onnx")
    target = run
    if how == "copied-folder":
        target = tmp_path / "copy"
        shutil.copytree(run, target)
    elif how == "symlink":
        target = tmp_path / "link"
        target.symlink_to(run, target_is_directory=True)
    with pytest.raises(ArtifactError, match=r"model\.qdq\.onnx.*(sha256|changed|differs)") as exc:
        rt.load(target, backend="ort", warmup=False)
    assert "re-run" in str(exc.value)
    r = rt.load(target, backend="ort", warmup=False, force=True)
    assert not r.verified
    r.close()


def _feeds(b=2, f=3, h=4, w=6, l=16, dtype=np.float32):
    g = np.random.default_rng(0)
    return {"hidden_states": g.standard_normal((b, 16, f, h, w)).astype(dtype),
            "timestep": np.full((b,), 500.0, np.float32),
            "encoder_hidden_states": g.standard_normal((b, l, 64)).astype(dtype)}


def test_bad_inputs_are_typed_and_process_survives(checked_run):
    import trt_sora.runtime as rt

    r = rt.load(checked_run, backend="ort")
    assert set(r.warmup_seconds) == {b.name for b in r.buckets}
    bad = _feeds()
    bad["hidden_states"] = bad["hidden_states"].astype(np.int64)
    with pytest.raises(rt.InputError, match="dtype"):
        r.infer(bad)
    bad = _feeds()
    bad["hidden_states"] = bad["hidden_states"][0]
    with pytest.raises(rt.InputError, match="rank"):
        r.infer(bad)
    with pytest.raises(ShapeError, match="tiny-small") as e:
        r.infer(_feeds(f=12))  # 12 latent frames: outside every bucket
    assert "tiny-large" in str(e.value)
    assert r.infer(_feeds())["sample"].shape == (2, 16, 3, 4, 6)  # still serving


def test_threads_match_single_threaded(checked_run):
    import trt_sora.runtime as rt

    r = rt.load(checked_run, backend="ort", concurrency=2)
    feeds = [_feeds(b=1 + i % 2) for i in range(4)]
    want = [r.infer(f)["sample"] for f in feeds]
    got = [None] * 8

    def work(i):
        got[i] = r.infer(feeds[i % 4])["sample"]

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for i in range(8):
        np.testing.assert_array_equal(got[i], want[i % 4])


def test_diffusers_drop_in(checked_run):
    """WanPipeline with the ORT-backed runtime produces the PyTorch video within the frames gate."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    import trt_sora.runtime as rt
    from trt_sora.config import load_recipe
    from trt_sora.models import get_adapter
    from trt_sora.parity.metrics import frame_metrics

    adapter = get_adapter("wan-tiny")
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=adapter.scheduler(),
                       transformer=adapter.load("fp32", "cpu"))
    enc = adapter.text_encoder()
    pe, ne = enc(["a red kite over a beach"], 16), enc([""], 16)
    kw = dict(prompt_embeds=pe, negative_prompt_embeds=ne, height=32, width=48, num_frames=9,
              num_inference_steps=4, guidance_scale=5.0, output_type="np")
    ref = pipe(generator=torch.Generator().manual_seed(3), **kw).frames
    runner = rt.load(checked_run, backend="ort")
    pipe.transformer = rt.as_diffusers_transformer(runner)
    got = pipe(generator=torch.Generator().manual_seed(3), **kw).frames
    assert pipe.transformer.calls == 8
    # frames are [B, F, H, W, C] in [0, 1]: to [B, C, F, H, W] in [-1, 1]
    to = lambda v: np.transpose(np.asarray(v), (0, 4, 1, 2, 3)) * 2 - 1  # noqa: E731
    fm = frame_metrics(to(ref), to(got))
    assert fm["worst_psnr_db"] >= load_recipe("rtx4090-fp8").parity.frames.min_psnr_db, fm


def test_batched_cfg_allowed_by_bucket(checked_run):
    import trt_sora.runtime as rt

    r = rt.load(checked_run, backend="ort", warmup=False)
    assert r.allows_batched_cfg(1) and not r.allows_batched_cfg(2)


def test_ort_device_picks_the_provider(checked_run):
    """``device`` pins ONNX Runtime's provider: ``cpu`` runs on the CPU provider only; ``cuda`` without a working
    CUDA provider is a typed error naming the fix, not ORT's silent fallback to CPU; an unknown device is refused."""
    import onnxruntime as ort

    import trt_sora.runtime as rt
    from trt_sora.errors import BackendMissingError, ConfigError

    r = rt.load(checked_run, backend="ort", device="cpu")
    assert r._runners[0].providers_in_use == ["CPUExecutionProvider"]
    assert r.infer(_feeds())["sample"].shape == (2, 16, 3, 4, 6)
    with pytest.raises(ConfigError, match="cuda:N"):
        rt.load(checked_run, backend="ort", device="gpu0")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(BackendMissingError, match=r"trt_sora\[ort-gpu\]"):
            rt.load(checked_run, backend="ort", device="cuda")


@pytest.mark.gpu
def test_ort_cuda_matches_cpu(checked_run):
    """onnxruntime-gpu: the CUDA provider runs the checked graph and agrees with the CPU provider."""
    import onnxruntime as ort

    import trt_sora.runtime as rt

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed (pip install 'trt_sora[ort-gpu]')")
    gpu, cpu = rt.load(checked_run, backend="ort", device="cuda"), rt.load(checked_run, backend="ort", device="cpu")
    assert gpu._runners[0].providers_in_use[0] == "CUDAExecutionProvider"
    a, b = gpu.infer(_feeds())["sample"], cpu.infer(_feeds())["sample"]
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-3
