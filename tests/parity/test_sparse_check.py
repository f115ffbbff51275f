"""Sparse attention through check on wan-tiny (torch-fp8 candidate on the CPU reference kernels): every level
runs the sparse candidate against the dense fp32 reference, a too-sparse setting fails its gates, the
calibrated mass picks the windows, and backends that cannot run the mask are refused."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
from run_folders import RECIPE

torch = pytest.importorskip("torch")

from trt_sora.config import ParityGate, SparseAttentionConfig, load_recipe  # noqa: E402
from trt_sora.errors import ConfigError  # noqa: E402
from trt_sora.sparse import MASS_FILE, AttentionMass, MassRecorder, SparsePlan  # noqa: E402

#: wan-tiny's loop grid is 3 x 2 x 3 tokens (latent 3 x 4 x 6, patch 1 x 2 x 2).
TOO_SPARSE = dict(enabled=True, tile=(1, 1, 1), window=(0, 0, 0), dense_steps=0)
CANDIDATES = ((0, 0, 0), (1, 1, 1), (3, 3, 3))


def _recipe(**sparse):
    """The CI recipe with ``sparse``, its loop and frames gates at 45 dB: wan-tiny's random attention is
    nearly uniform, so its clip moves little under any mask; the dense candidate clears 45 dB by about 10."""
    r = load_recipe(RECIPE)
    gate = ParityGate(min_psnr_db=45.0)
    return dataclasses.replace(r, sparse_attention=SparseAttentionConfig(**sparse),
                               parity=dataclasses.replace(r.parity, loop=gate, frames=gate))


def _check(base_run, tmp_path_factory, name, **sparse):
    from trt_sora.parity import check_artifacts

    run = tmp_path_factory.mktemp(name) / "run"
    shutil.copytree(base_run, run)
    if sparse.get("window") is None:
        _record_mass(run, SparseAttentionConfig(**sparse))
    return run, check_artifacts(run, _recipe(**sparse), backend="torch-fp8", device="cpu")


def _record_mass(run, config) -> None:
    """calib/attention_mass.safetensors as the calibrate stage records it: a trajectory of the fp32 model
    at its sampling settings with the recorder on every self-attention."""
    from trt_sora.models import get_adapter
    from trt_sora.parity.loop import loop_inputs
    from trt_sora.sampling import adapter_call, sample

    adapter = get_adapter("wan-tiny")
    model, settings = adapter.load("fp32", "cpu"), adapter.sampling
    rec = MassRecorder(config, settings.num_steps)
    sites = adapter.sparse_attention_sites(model)
    point = {"batch": 1, "latent_frames": 3, "latent_height": 4, "latent_width": 6, "text_len": 16}
    noise, cond, uncond = loop_inputs(adapter, point, seed=7, prompts=("a cat walks",))
    grid = adapter.token_grid(noise.shape)
    sample(adapter_call(adapter, model), noise, cond, uncond, scheduler=adapter.scheduler(settings.shift),
           settings=settings, conditioner=adapter, hook=lambda call: rec.at(sites, grid, call.step))
    rec.result().save(run / "calib" / MASS_FILE)


@pytest.fixture(scope="module")
def calibrated(base_run, tmp_path_factory):
    return _check(base_run, tmp_path_factory, "calibrated", enabled=True, tile=(1, 1, 1), candidates=CANDIDATES,
                  mass_budget=0.395, dense_steps=1)


def test_check_runs_the_calibrated_pattern_and_records_it(calibrated):
    run, rep = calibrated
    sp = rep["sparse_attention"]
    assert sp["source"] == "calibrated" and sp["grid"] == [3, 2, 3]
    mass = AttentionMass.load(run / "calib" / MASS_FILE)
    worst = mass.worst(1)
    want = {layer: next((list(c) for c, m in zip(CANDIDATES, row) if m <= 0.395), None)
            for layer, row in zip(mass.layers, worst)}
    assert sp["plan"]["windows"] == want
    assert sorted(map(str, want.values())) == ["[1, 1, 1]", "[3, 3, 3]"]  # the budget splits wan-tiny's layers
    assert rep["candidate"]["open"]["sparse"] == sp["plan"]
    assert "attention_mass" in rep["artifacts"]
    assert {c["level"] for c in rep["comparisons"]} >= {"quality", "loop", "frames"}
    assert min(sp["density"].values()) < 1.0


def test_a_window_over_the_whole_grid_passes(base_run, tmp_path_factory):
    _, rep = _check(base_run, tmp_path_factory, "whole", enabled=True, tile=(1, 1, 1), window=(3, 3, 3))
    assert rep["passed"], rep["failed"]
    assert set(rep["sparse_attention"]["density"].values()) == {1.0}


def test_a_too_sparse_setting_fails_its_gates(base_run, tmp_path_factory):
    _, rep = _check(base_run, tmp_path_factory, "too_sparse", **TOO_SPARSE)
    assert not rep["passed"]
    assert set(rep["failed"]) == {"loop", "frames"}, rep["failed"]  # the qdq level runs dense attention
    assert rep["sparse_attention"]["density"]["blocks.0"] == pytest.approx(1 / 18, abs=1e-6)


def test_backends_with_dense_graphs_are_refused_before_running(base_run):
    from trt_sora.parity import check_artifacts

    with pytest.raises(ConfigError, match="torch-fp8"):
        check_artifacts(base_run, _recipe(enabled=True, window=(1, 1, 1)), backend="ort", write=False)


def test_torch_and_torch_fp8_apply_the_same_mask(base_run):
    """The fp32 runner's masked processors and the torch-fp8 blocks (tile order, CPU reference kernels) apply
    the same mask: what the mask changes in the 8-bit model's output is what it changes in fp32's."""
    from trt_sora.models import get_adapter
    from trt_sora.runners import TorchRunner
    from trt_sora.runners.registry import OpenOptions, find_artifacts, get_backend

    adapter = get_adapter("wan-tiny")
    plan = SparsePlan((1, 1, 2), {"*": (0, 0, 0)})
    feeds = {k: v.numpy() for k, v in adapter.example_inputs(
        {"batch": 1, "latent_frames": 4, "latent_height": 4, "latent_width": 8, "text_len": 5}, seed=3).items()}

    def fp8(sparse):
        opts = OpenOptions(device="cpu", cuda_graphs=False, sparse=sparse)
        return get_backend("torch-fp8").open(base_run, find_artifacts(base_run), adapter, opts).infer(feeds)["sample"]

    def rel(a, b):
        return float(((a - b) ** 2).sum() / (b ** 2).sum()) ** 0.5

    dense = TorchRunner(adapter).activate().infer(feeds)["sample"]
    effect = TorchRunner(adapter, sparse=plan).activate().infer(feeds)["sample"] - dense
    effect8 = fp8(plan.to_dict()) - fp8(None)
    other = TorchRunner(adapter, sparse=SparsePlan((1, 2, 1), {"*": (0, 0, 0)})).activate().infer(feeds)["sample"]
    assert rel(effect8, effect) < 0.2
    assert rel(other - dense, effect) > 0.5  # another mask of the same density changes something else
