"""fake_quantized(): simulated Q/DQ on linear inputs + weights, removed without a trace on exit."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trt_sora.calibrate.fake_quant import fake_quant  # noqa: E402
from trt_sora.calibrate.fakequant_model import fake_quantized, quantized_sites  # noqa: E402
from trt_sora.errors import CalibrationError  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("cache", [True, False])
def test_matches_manual_qdq_and_restores(fmt, cache):
    net = _net()
    x = torch.randn(3, 8)
    ref = net(x)
    w0 = net[2].weight.clone()
    amax = {"2": torch.tensor(0.7)}
    with fake_quantized(net, amax, fmt, cache_weights=cache) as sites:
        y = net(x)
    assert sites == ["2"]
    h = net[1](net[0](x))
    w = fake_quant(w0, w0.abs().amax(dim=1), fmt, axis=0)
    want = torch.nn.functional.linear(fake_quant(h, 0.7, fmt), w, net[2].bias)
    assert torch.equal(y, want)
    assert torch.equal(net(x), ref) and torch.equal(net[2].weight, w0) and "forward" not in net[2].__dict__


def test_selected_site_without_amax_is_an_error():
    with pytest.raises(CalibrationError, match="no activation amax"):
        with fake_quantized(_net(), {"0": 1.0}, "int8", sites=["0", "2"]):
            pass


def test_policy_default_exclusions(tiny_adapter, tiny_model):
    sites = quantized_sites(tiny_model, None, tiny_adapter.quant_excludes)
    assert "blocks.0.attn1.to_q" in sites and "proj_out" not in sites
    assert not any(s.startswith("condition_embedder.") for s in sites)


def test_instance_forward_is_restored():
    """accelerate's hooks give a module its own ``forward``; leaving the context puts that one back."""
    net = _net()
    x = torch.randn(3, 8)
    own = net[2].forward
    calls = []

    def hooked(h):
        calls.append(1)
        return own(h)

    net[2].forward = hooked
    with fake_quantized(net, {"2": torch.tensor(0.7)}, "fp8_e4m3"):
        assert net[2].__dict__["forward"] is not hooked
        net(x)
    assert net[2].__dict__["forward"] is hooked
    assert torch.equal(net(x), net[2](net[1](net[0](x)))) and calls
