"""benchmarks/sparse_cpu.py on wan-tiny: a setting that resumes the dense trajectory after its dense steps
gives the clip of sampling with its plan from the first step (written out here), and its attention computed
counts the dense steps whole."""
from __future__ import annotations

import json
import math

import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")

from trt_sora.config import SparseAttentionConfig  # noqa: E402
from trt_sora.models import get_adapter  # noqa: E402
from trt_sora.parity.loop import loop_inputs  # noqa: E402
from trt_sora.sampling import adapter_call, sample  # noqa: E402
from trt_sora.sparse import plan_sparse  # noqa: E402

SEED = 7


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    mod = load_script("benchmarks/sparse_cpu.py")
    out = tmp_path_factory.mktemp("sc") / "c.json"
    mod.main(["--model", "wan-tiny", "--captions", "1", "--calib-prompts", "1", "--tile", "1-1-1", "--threads", "1",
              "--candidates", "0-0-0,1-1-1", "--seed", str(SEED), "--configs", "window=0-0-0/dense=2,budget=0.000001",
              "--out", str(out)])
    return json.loads(out.read_text())


def test_a_resumed_setting_is_its_plan_sampled_from_the_start(curve):
    a = get_adapter("wan-tiny")
    model = a.load("fp32", "cpu")
    sites = a.sparse_attention_sites(model)
    s = a.sampling
    noise, cond, uncond = loop_inputs(a, {**{"latent_frames": 2, "latent_height": 8, "latent_width": 8,
                                             "text_len": 16}, "batch": 1}, seed=SEED, prompts=(curve["captions"][0],))
    grid = a.token_grid(noise.shape)
    sched = a.scheduler(s.shift)
    sched.set_timesteps(s.num_steps)
    plan, _ = plan_sparse(SparseAttentionConfig(enabled=True, tile=(1, 1, 1), window=(0, 0, 0), dense_steps=2),
                          [float(t) for t in sched.timesteps])

    def clip(hook):
        return sample(adapter_call(a, model), noise, cond, uncond, scheduler=a.scheduler(s.shift), settings=s,
                      cfg="batched", conditioner=a, hook=hook).latents

    ref = clip(None)
    got = clip(lambda c: plan.applied(sites, grid, c.timestep, "cpu"))
    mse = float((ref.double() - got.double()).square().mean())
    row = curve["curve"][0]
    peak = float(ref.max() - ref.min())  # equal latents, equal fp64 MSE: the dB agree to fp64 rounding
    assert row["latents_psnr_db"]["worst"] == pytest.approx(10.0 * math.log10(peak ** 2 / mse), rel=1e-12)
    tokens = grid[0] * grid[1] * grid[2]
    assert row["attention_computed"] == round((2 + 2 / tokens) / s.num_steps, 4)  # each token attends itself


def test_a_budget_no_candidate_meets_stays_dense(curve):
    row = curve["curve"][1]
    assert row["attention_computed"] == 1.0 and row["clip_psnr_db"]["worst"] == math.inf and row["gate_passed"]
