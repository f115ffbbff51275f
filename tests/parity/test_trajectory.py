"""The trajectory level on toy transformers: per-call metrics on every call, the update contribution
(estimate vs measurement), and the gate's exemption rule."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trt_sora.config import ParityGate  # noqa: E402
from trt_sora.parity.trajectory import judge  # noqa: E402
from trt_sora.sampling import SamplingSettings, gaussian_noise  # noqa: E402
from trt_sora.teacher_forcing import measured_contribution, reference_with_candidate  # noqa: E402

ST = SamplingSettings(num_steps=6, guidance_scale=4.0, shift=2.0)


def _sched():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=ST.shift)


def _ref(inputs):
    x, t, e = inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
    return torch.tanh(0.5 * x) + (t / 1000.0).view(-1, 1, 1, 1, 1) * e.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)


def _bad_below(timestep: float, amount: float):
    """The reference, with a large error on calls at timesteps below ``timestep`` (the last steps)."""
    def call(inputs):
        y = _ref(inputs)
        if float(inputs["timestep"][0]) < timestep:
            y = y + amount * torch.sin(7 * inputs["hidden_states"])
        return y
    return call


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    return gaussian_noise((1, 3, 2, 8, 8), 1), torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)


def _run(cand, inputs, cfg="batched"):
    noise, c, u = inputs
    return reference_with_candidate(_ref, cand, noise, c, u, scheduler=_sched(), settings=ST, cfg=cfg,
                                    keep_inputs=(0, 5))


@pytest.mark.parametrize("cfg, calls", [("batched", 6), ("split", 12)])
def test_every_call_is_compared(inputs, cfg, calls):
    run = _run(_bad_below(200.0, 0.5), inputs, cfg)
    assert len(run.calls) == calls and [s["step"] for s in run.steps] == list(range(6))
    last = [c for c in run.calls if c["step"] == 5]
    assert all(c["cosine"] < 0.99 for c in last) and all(c["cosine"] > 0.999999 for c in run.calls if c["step"] < 5)
    assert set(run.inputs) == {0, 5} and run.inputs[5]["hidden_states"].shape[0] == (2 if cfg == "batched" else 1)


def test_last_step_contribution_estimate_equals_the_measurement(inputs):
    """At the last step nothing follows the update: the measured contribution is the estimate."""
    noise, c, u = inputs
    cand = _bad_below(200.0, 0.5)
    run = _run(cand, inputs)
    meas = measured_contribution(run, _ref, cand, 5, noise, c, u, scheduler=_sched(), settings=ST, cfg="batched")
    assert meas == pytest.approx(run.steps[5]["contribution_db"], abs=1e-3)
    # an error at step 0 travels through the remaining steps: measured, not just estimated
    cand0 = _bad_below(2000.0, 0.05)
    run0 = _run(cand0, inputs)
    m0 = measured_contribution(run0, _ref, cand0, 0, noise, c, u, scheduler=_sched(), settings=ST, cfg="batched")
    assert 0 < m0 < 200 and m0 != pytest.approx(run0.steps[0]["contribution_db"], abs=1e-3)


def test_gate_exempts_only_a_measured_small_contribution(inputs):
    noise, c, u = inputs
    cand = _bad_below(200.0, 0.5)
    run = _run(cand, inputs)
    meas = {5: measured_contribution(run, _ref, cand, 5, noise, c, u, scheduler=_sched(), settings=ST,
                                     cfg="batched")}
    strict = ParityGate(min_cosine=0.99)
    checks, rows = judge(run, strict, meas)
    assert not all(ch["passed"] for ch in checks) and not rows[5]["exempt"]
    loose = ParityGate(min_cosine=0.99, min_contribution_db=meas[5] - 1.0)
    checks, rows = judge(run, loose, meas)
    assert all(ch["passed"] for ch in checks) and rows[5]["exempt"] and "1 step(s) exempt" in checks[0]["metric"]
    tight = ParityGate(min_cosine=0.99, min_contribution_db=meas[5] + 1.0)
    checks, rows = judge(run, tight, meas)
    assert not rows[5]["exempt"] and not all(ch["passed"] for ch in checks)
    checks, rows = judge(run, loose, {})  # a failing step never measured is never exempt
    assert not all(ch["passed"] for ch in checks)
