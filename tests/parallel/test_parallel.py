"""CFG-parallel x Ulysses on CPU processes joined by gloo: the split call equals the one-process
call within fp32 rounding, at a token count that no degree divides (padding exercised)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import parallel_workers  # noqa: E402  (this folder; spawned children import it too)
import prefork  # noqa: E402  (tests/)

from trt_sora.errors import ConfigError  # noqa: E402
from trt_sora.parallel import ParallelConfig, spawn  # noqa: E402

# 3 latent frames x (6/2) x (6/2) = 27 tokens: a multiple of neither 2 nor 4; inside wan-tiny's bucket.
POINT = {"batch": 2, "latent_frames": 3, "latent_height": 6, "latent_width": 6, "text_len": 5}

#: name -> (world, cfg, ulysses, kind)
CASES = {
    "torch-cfg2": (2, 2, 1, "torch"),
    "torch-u2": (2, 1, 2, "torch"),
    "fp8-u2": (2, 1, 2, "fp8"),
    "fp8-attn8-u2": (2, 1, 2, "fp8-attn8"),
    "fp8-attn8-cfg2": (2, 2, 1, "fp8-attn8"),
    "leader-u2": (2, 1, 2, "leader"),
    "torch-cfg2-u2": (4, 2, 2, "torch"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory, base_run, checked_run):
    """Every case, one spawn per world size; ``{name: npz}`` plus the feeds."""
    from trt_sora.models import get_adapter

    prefork.context()  # the workers fork from the server that imported torch and diffusers once per xdist worker
    root = tmp_path_factory.mktemp("parallel")
    f = get_adapter("wan-tiny").example_inputs(POINT, seed=11)
    f["timestep"] = torch.tensor([700.0, 700.0])  # one CFG pair: same step, two conditionings
    feeds = root / "feeds.npz"
    np.savez(feeds, **{k: v.numpy() for k, v in f.items()})
    for world in sorted({c[0] for c in CASES.values()}):
        cases = [(n, c, u, k) for n, (w, c, u, k) in CASES.items() if w == world]
        spawn(parallel_workers.run_cases, world, cases, str(base_run), str(checked_run), str(feeds), str(root),
              init_file=str(root / f"rdv{world}"), start_method="forkserver")
    return {n: dict(np.load(root / f"{n}.npz")) for n in CASES} | {"feeds": dict(np.load(feeds))}


def _single(kind, run, feeds):
    r = parallel_workers.make_runner(kind, run).activate()
    out = r.infer(feeds)["sample"]
    r.deactivate()
    return out


@pytest.mark.parametrize("name", ["torch-cfg2", "torch-u2", "torch-cfg2-u2", "leader-u2"])
def test_torch_backend_split_equals_one_process(results, name):
    want = _single("torch", None, results["feeds"])
    got = results[name]
    for key in ("a", "b") if "leader" in name else ("sample",):
        assert got[key].shape == want.shape
        np.testing.assert_allclose(got[key], want, rtol=0, atol=2e-6 * np.abs(want).max())
    if name in ("torch-u2", "torch-cfg2-u2"):
        assert int(got["local_tokens"]) == 14  # 27 tokens over 2 ranks: 14 + 14 (one padded)


@pytest.mark.parametrize("name", ["fp8-u2", "fp8-attn8-u2", "fp8-attn8-cfg2"])
def test_torch_fp8_blocks_split_equal_one_process(results, base_run, name):
    """The fused FP8 blocks: RMS statistics before the all-to-all, the per-head epilogue (and the
    8-bit attention's per-block Q/K scales and K mean over all tokens) after it."""
    kind = CASES[name][3]
    want = _single(kind, str(base_run), results["feeds"])
    got = results[name]["sample"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())
    cos = float((got * want).sum() / np.sqrt((got * got).sum() * (want * want).sum()))
    assert cos > 0.99999, cos


def test_bad_parallel_configs_are_typed_errors(checked_run):
    import trt_sora.runtime as rt

    with pytest.raises(ConfigError, match="use 1 or 2"):
        ParallelConfig(cfg=3)
    with pytest.raises(ConfigError, match="cfg=2,ulysses=2"):
        ParallelConfig.parse("cfg=two")
    assert ParallelConfig.parse("cfg=2,ulysses=4") == ParallelConfig(2, 4)
    with pytest.raises(ConfigError, match="divisor of 2"):
        ParallelConfig(ulysses=3).check_heads(2)
    with pytest.raises(ConfigError, match="torch backends"):
        rt.load(checked_run, backend="ort", parallel=ParallelConfig(cfg=2))
