"""GPTQ weight rounding: on the per-channel grid, lower output error than nearest rounding on the
inputs it was fit to, file round trip; end to end on wan-tiny: calibrate -> weights.safetensors ->
quantize uses them -> ONNX Runtime matches the fake-quant runner that reads the same map."""
from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from trt_sora.calibrate.fake_quant import fake_quant  # noqa: E402
from trt_sora.calibrate.gptq import HessianHooks, gptq_round, load_rounded_weights, save_rounded_weights  # noqa: E402


def _layer(seed=0, out=48, inp=64, tokens=2048):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / inp ** 0.5
    # correlated inputs with a few large channels, as a DiT block's activations have
    mix = torch.randn(inp, inp, generator=g) * (torch.rand(inp, generator=g) < 0.3)
    x = torch.randn(tokens, inp, generator=g) @ (torch.eye(inp) + 0.5 * mix)
    x[:, :3] *= 8.0
    return w, x


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_on_the_grid_and_lower_output_error(fmt):
    w, x = _layer()
    amax = w.abs().amax(1)
    h = (x.double().T @ x.double())
    wq = gptq_round(w, h, amax, fmt)
    assert torch.equal(fake_quant(wq, amax, fmt, axis=0), wq)  # exactly representable: re-quantizing is a no-op
    nearest = fake_quant(w, amax, fmt, axis=0)
    err = lambda q: float(((q - w).double() @ x.double().T).square().sum())  # noqa: E731
    gain_db = 10 * torch.log10(torch.tensor(err(nearest) / err(wq))).item()
    assert gain_db > 3.0, gain_db
    # ... while staying a rounding of w: in weight space at most a few times nearest rounding's error
    rel = lambda q: float((q - w).norm() / w.norm())  # noqa: E731
    assert rel(wq) < 4 * rel(nearest), (rel(wq), rel(nearest))


def test_the_column_loop_on_one_thread_changes_no_bit(monkeypatch):
    """gptq_round runs its column loop on one CPU thread (latency-bound small ops): the same codes as
    with the caller's thread pool, whose size it restores."""
    import contextlib

    from trt_sora.calibrate import gptq

    w, x = _layer(seed=2, out=32, inp=96)
    h, amax = x.double().T @ x.double(), w.abs().amax(1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with gptq._one_cpu_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        one = gptq_round(w, h, amax, "fp8_e4m3")
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(gptq, "_one_cpu_thread", lambda device: contextlib.nullcontext())
        assert torch.equal(one, gptq_round(w, h, amax, "fp8_e4m3"))  # on the caller's two threads
    finally:
        torch.set_num_threads(before)


def test_hessian_hooks_and_file_round_trip(tmp_path):
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(5, 7, 16)
    with HessianHooks(torch.nn.Sequential(lin), ["0"]) as hh:
        lin(x)
    flat = x.reshape(-1, 16).double()
    torch.testing.assert_close(hh.hessians["0"], flat.T @ flat)
    assert hh.tokens["0"] == 35
    amax = lin.weight.detach().abs().amax(1)
    for fmt in ("fp8_e4m3", "int8"):
        wq = gptq_round(lin.weight, hh.hessians["0"], amax, fmt)
        p = save_rounded_weights(tmp_path / f"w_{fmt}.safetensors", {"0": wq}, {"0": amax}, fmt, {"method": "gptq"})
        assert torch.equal(load_rounded_weights(p)["0"], wq)


def test_plan_budget_and_smallest_workable_value():
    from trt_sora.calibrate.gptq import plan_hessians
    from trt_sora.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(64, 4), torch.nn.Linear(4, 32), torch.nn.Linear(32, 4))
    leader = {"0": "0", "1": "1", "2": "2"}
    sizes = {"0": 64 * 64 * 8, "1": 4 * 4 * 8, "2": 32 * 32 * 8}
    gib = lambda n: n / 2 ** 30  # noqa: E731
    one = plan_hessians(model, leader, gib(sum(sizes.values())))
    assert one.groups == (("0", "1", "2"),)
    two = plan_hessians(model, leader, gib(sizes["0"]))  # consecutive groups, each within the budget
    assert two.groups == (("0",), ("1", "2")) and max(two.group_bytes(g) for g in range(2)) <= sizes["0"]
    with pytest.raises(ConfigError, match=r"input Hessian of 0 alone.*gptq_max_hessian_gb: .*at least 3.06e-05"):
        plan_hessians(model, leader, gib(sizes["0"] - 1))


def test_calibrate_quantize_parity_use_the_rounded_weights(tiny_adapter, tiny_model, tiny_export, tmp_path):
    import dataclasses

    import numpy as np

    from trt_sora.calibrate.run import calibrate
    from trt_sora.config import load_recipe
    from trt_sora.config.recipe import CalibConfig, DType
    from trt_sora.quantize import quantize_onnx
    from trt_sora.runners import OrtRunner, TorchFakeQuantRunner

    cal = calibrate(tiny_adapter, CalibConfig(method="minmax", weight_rounding="gptq", num_steps=2), tmp_path / "calib",
                    model=tiny_model, preset="tiny", report=False)
    assert cal.manifest["outputs"]["weights"] == "weights.safetensors"
    rounded = load_rounded_weights(tmp_path / "calib" / "weights.safetensors")
    assert len(rounded) == cal.manifest["results"]["weight_rounding"]["sites"] > 0
    cfg = dataclasses.replace(load_recipe("rtx4090-fp8").quantization, graph_dtype=DType.FP32)
    plain = quantize_onnx(tiny_export.onnx_path, cal.stats_path, cfg, tmp_path / "q_nearest")
    gq = quantize_onnx(tiny_export.onnx_path, cal.stats_path, cfg, tmp_path / "q_gptq",
                       weights=tmp_path / "calib" / "weights.safetensors")
    qmap = json.loads(gq.map_path.read_text())
    assert qmap["rounded_weights"]["sha256"] == gq.manifest["inputs"]["weights"]["sha256"]
    feeds = {k: v.numpy() for k, v in tiny_adapter.example_inputs(
        {"batch": 2, "latent_frames": 2, "latent_height": 4, "latent_width": 4, "text_len": 8}, seed=3).items()}
    with OrtRunner(gq.onnx_path) as ort_g, OrtRunner(plain.onnx_path) as ort_n, \
            TorchFakeQuantRunner(tiny_adapter, gq.map_path, cal.stats_path, model=tiny_model) as fq:
        y_g, y_n, y_fq = (next(iter(r.infer(feeds).values())) for r in (ort_g, ort_n, fq))
    # the graph with rounded weights is the fake-quant runner's model (which read them through the map) ...
    assert np.abs(y_g - y_fq).max() < 1e-4 * max(1.0, np.abs(y_fq).max())
    # ... and not the nearest-rounding graph
    assert np.abs(y_g - y_n).max() > 1e-3 * np.abs(y_n).max()
    # the backends that quantize the module's own weight (torch-fp8) load the same rounded weights
    import copy

    from trt_sora.runners.torch_runner import read_qdq_map, use_rounded_weights

    m = copy.deepcopy(tiny_model)
    assert use_rounded_weights(m, read_qdq_map(gq.map_path)[1]) == len(rounded)
    mods = dict(m.named_modules())
    assert all(torch.equal(mods[s].weight.detach(), w) for s, w in rounded.items())


def test_sharded_gptq_equals_one_pass_and_auto_falls_back(tiny_adapter, tiny_model, tmp_path):
    """Shards save their input Hessians and the merge sums them: the rounded weights equal the one-pass
    run's. ``auto`` rounds to nearest (and says why) when the Hessians exceed the memory limit; an explicit
    ``gptq`` refuses there."""
    from trt_sora.calibrate.run import calibrate
    from trt_sora.calibrate.shards import shard_folder
    from trt_sora.config.recipe import CalibConfig
    from trt_sora.errors import ConfigError

    cfg = CalibConfig(method="minmax", weight_rounding="auto", num_steps=2)
    kw = dict(model=tiny_model, preset="tiny", report=False)
    one = calibrate(tiny_adapter, cfg, tmp_path / "one", **kw)
    assert one.manifest["results"]["weight_rounding"]["method"] == "gptq"
    folders = [shard_folder(tmp_path / "two", i, 2) for i in range(2)]
    for i, f in enumerate(folders):
        part = calibrate(tiny_adapter, cfg, f, shard=(i, 2), **kw)
        assert part.manifest["outputs"]["hessians"] == ["hessians.safetensors"]
        assert "weights" not in part.manifest["outputs"]
    calibrate(tiny_adapter, cfg, tmp_path / "two", from_shards=folders, **kw)
    a = load_rounded_weights(tmp_path / "one" / "weights.safetensors")
    b = load_rounded_weights(tmp_path / "two" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[s], b[s]) for s in a)

    tight = dataclasses.replace(cfg, gptq_max_hessian_gb=1e-6)
    near = calibrate(tiny_adapter, tight, tmp_path / "near", **kw)
    wr = near.manifest["results"]["weight_rounding"]
    assert wr["method"] == "nearest" and "gptq_max_hessian_gb: 1e-06; set it to at least" in wr["note"]
    assert "weights" not in near.manifest["outputs"] and not (tmp_path / "near" / "weights.safetensors").exists()
    with pytest.raises(ConfigError, match="gptq_max_hessian_gb"):
        calibrate(tiny_adapter, dataclasses.replace(tight, weight_rounding="gptq"), tmp_path / "refused", **kw)
    assert not (tmp_path / "refused").exists()


def test_shared_inputs_on_wan_tiny_are_exact(tiny_adapter, tiny_model):
    """The probe finds the linears fed one tensor: q/k/v of each self-attention, and the cross-attention
    k/v of every block (the text context); their Hessians, accumulated each on its own over a real
    forward at another shape, are equal bit for bit to the shared one."""
    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.calibrate.gptq import shared_inputs

    sites = quantized_sites(tiny_model, None, tiny_adapter.quant_excludes)
    probe = lambda: tiny_adapter.forward(tiny_model, tiny_adapter.example_inputs(  # noqa: E731
        {"batch": 1, "latent_frames": 1, "latent_height": 2, "latent_width": 2, "text_len": 8}, seed=1))
    leader = shared_inputs(tiny_model, sites, probe)
    blocks = sorted({int(s.split(".")[1]) for s in sites if s.startswith("blocks.")})
    assert len(blocks) >= 2
    for b in blocks:
        assert leader[f"blocks.{b}.attn1.to_k"] == leader[f"blocks.{b}.attn1.to_v"] == f"blocks.{b}.attn1.to_q"
        assert leader[f"blocks.{b}.attn2.to_k"] == leader[f"blocks.{b}.attn2.to_v"] == "blocks.0.attn2.to_k"
        for own in ("attn1.to_out.0", "attn2.to_q", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"):
            assert leader[f"blocks.{b}.{own}"] == f"blocks.{b}.{own}"
    shared = {s: ld for s, ld in leader.items() if s != ld}
    assert len(shared) == 2 * len(blocks) + 2 * len(blocks) - 1
    inputs = tiny_adapter.example_inputs({"batch": 2, "latent_frames": 2, "latent_height": 4, "latent_width": 4,
                                          "text_len": 8}, seed=5)
    with HessianHooks(tiny_model, sites) as own, torch.no_grad():
        tiny_adapter.forward(tiny_model, inputs)
    with HessianHooks(tiny_model, sites, shared=leader) as one, torch.no_grad():
        tiny_adapter.forward(tiny_model, inputs)
    assert len(one.hessians) == len(sites) - len(shared)
    for s in sites:
        assert torch.equal(own.hessians[s], one.hessians[leader[s]]), s
        assert own.tokens[s] == one.tokens[leader[s]]


def test_a_member_reading_another_tensor_is_refused():
    from trt_sora.calibrate.gptq import shared_inputs
    from trt_sora.errors import CalibrationError

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    m, x = Two(), torch.randn(3, 8)
    leader = shared_inputs(m, ["a", "b"], lambda: m(x, x))
    assert leader == {"a": "a", "b": "a"}
    with HessianHooks(m, ["a", "b"], shared=leader) as hh:
        m(x, x.clone())  # equal values in another tensor: still one Hessian
        with pytest.raises(CalibrationError, match="b was found to read the input of a"):
            m(x, x + 1)
    assert hh.tokens == {"a": 6}  # the refused call had reached the leader


def test_gptq_in_passes_equals_one_pass_within_the_budget(tiny_adapter, tiny_model, tmp_path, monkeypatch):
    """A budget that forces >= 3 passes over the trajectories: the rounded weights equal the one-pass
    run's bit for bit - also from two shards, each running its passes - while the Hessians alive at
    any time (measured through weak references to every accumulator) stay within the budget."""
    import weakref

    from trt_sora.calibrate import gptq
    from trt_sora.calibrate.run import calibrate
    from trt_sora.calibrate.shards import shard_folder
    from trt_sora.config.recipe import CalibConfig

    alive: list = []
    peak = [0]

    class Measured(gptq.HessianHooks):
        def __enter__(self):
            out = super().__enter__()
            alive.extend(weakref.ref(h) for h in self.hessians.values())
            peak[0] = max(peak[0], sum(r().numel() * 8 for r in alive if r() is not None))
            return out

    monkeypatch.setattr(gptq, "HessianHooks", Measured)
    cfg = CalibConfig(method="minmax", weight_rounding="gptq", num_steps=2)
    kw = dict(model=tiny_model, preset="tiny", report=False)
    one = calibrate(tiny_adapter, cfg, tmp_path / "one", **kw)
    wr1 = one.manifest["results"]["weight_rounding"]
    assert wr1["passes"] == 1 and peak[0] == wr1["peak_hessian_bytes"] == wr1["hessian_bytes"]
    assert wr1["hessian_bytes"] < wr1["unshared_hessian_bytes"]
    budget = wr1["hessian_bytes"] / 3 / 2 ** 30
    peak[0] = 0
    cfg3 = dataclasses.replace(cfg, gptq_max_hessian_gb=budget)
    three = calibrate(tiny_adapter, cfg3, tmp_path / "three", **kw)
    wr = three.manifest["results"]["weight_rounding"]
    assert wr["passes"] >= 3 and f"{wr['passes']} passes" in wr["note"] and "gptq_max_hessian_gb" in wr["note"]
    assert 0 < peak[0] <= budget * 2 ** 30 and peak[0] == wr["peak_hessian_bytes"] == max(wr["group_bytes"])
    assert len(wr["pass_seconds"]) == wr["passes"] and wr["sites"] == wr1["sites"]
    a = load_rounded_weights(tmp_path / "one" / "weights.safetensors")
    b = load_rounded_weights(tmp_path / "three" / "weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[s], b[s]) for s in a)
    sa, sb = one.stats.to_tensors(), three.stats.to_tensors()  # the other statistics: gathered once, unchanged
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    folders = [shard_folder(tmp_path / "two", i, 2) for i in range(2)]
    for i, f in enumerate(folders):
        part = calibrate(tiny_adapter, cfg3, f, shard=(i, 2), **kw)
        assert len(part.manifest["outputs"]["hessians"]) == wr["passes"]
    peak[0] = 0
    merged = calibrate(tiny_adapter, cfg3, tmp_path / "two", from_shards=folders, **kw)
    assert merged.manifest["results"]["weight_rounding"]["passes"] == wr["passes"]
    c = load_rounded_weights(tmp_path / "two" / "weights.safetensors")
    assert a.keys() == c.keys() and all(torch.equal(a[s], c[s]) for s in a)
