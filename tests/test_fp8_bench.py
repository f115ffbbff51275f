"""benchmarks/fp8_bench.py's models part on the CPU (wan-tiny, the reference kernels): the sparse rung runs
once per window beside the dense full rung, records its pattern, and its output is the dense rung's where
the window covers the grid and another where it does not (a dry run of the GPU part ``m14sparse``)."""
from __future__ import annotations

import json

import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")



def _bench():
    return load_script("benchmarks/fp8_bench.py")


@pytest.fixture(scope="module")
def rungs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fb") / "m.json"
    # 64 x 128 pixels, 9 frames: wan-tiny's latent 3 x 8 x 16, tokens 3 x 4 x 8; a tile of 1 x 4 x 8 is a frame
    _bench().main(["--parts", "models", "--models", "wan-tiny", "--points", "64x128:1", "--frames", "9",
                   "--iters", "1", "--eager-iters", "1", "--no-profile", "--device", "cpu",
                   "--rungs", "fp8_fused_attn8_graph,fp8_fused_attn8_graph_sparse", "--sparse-tile", "1-4-8",
                   "--sparse-global-frames", "0", "--sparse-windows", "0-0-0,2-0-0", "--out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    return run["rungs"]


def test_each_window_is_a_rung_beside_the_dense_one(rungs):
    assert list(rungs) == ["eager_bf16", "fp8_fused_attn8_graph", "fp8_fused_attn8_graph_sparse_0-0-0",
                           "fp8_fused_attn8_graph_sparse_2-0-0"]
    for name in ("fp8_fused_attn8_graph_sparse_0-0-0", "fp8_fused_attn8_graph_sparse_2-0-0"):
        r = rungs[name]
        assert r["token_grid"] == [3, 4, 8]
        assert r["sparse_attention"]["windows"] == {"*": r["window"]}
        assert r["fp8_attention_layers"] == 2 and r["speedup_vs_dense_full_rung"] > 0


def test_the_pattern_is_applied(rungs):
    narrow, whole = rungs["fp8_fused_attn8_graph_sparse_0-0-0"], rungs["fp8_fused_attn8_graph_sparse_2-0-0"]
    assert narrow["density"] == pytest.approx(1 / 3, abs=1e-6)  # each frame's tile attends itself: 3 of 9
    assert whole["density"] == 1.0
    assert whole["cosine_vs_dense_full_rung"] > 1 - 1e-9  # every key block: the dense attention
    assert narrow["cosine_vs_dense_full_rung"] < 0.99999


@pytest.mark.gpu
def test_the_sparse_rung_runs_graphed_on_cuda(tmp_path):
    """The GPU part's path: the block-sparse kernel in CUDA graphs (a tile of 128 tokens, the kernel's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "m.json"
    # 128 x 256 pixels, 17 frames: tokens 5 x 8 x 16; a tile of 1 x 8 x 16 (128 tokens) is a frame
    _bench().main(["--parts", "models", "--models", "wan-tiny", "--points", "128x256:1", "--frames", "17",
                   "--iters", "2", "--eager-iters", "1", "--no-profile",
                   "--rungs", "fp8_fused_attn8_graph,fp8_fused_attn8_graph_sparse", "--sparse-tile", "1-8-16",
                   "--sparse-global-frames", "0", "--sparse-windows", "0-0-0,4-0-0", "--out", str(out)])
    rungs = json.loads(out.read_text())["runs"][0]["rungs"]
    narrow, whole = rungs["fp8_fused_attn8_graph_sparse_0-0-0"], rungs["fp8_fused_attn8_graph_sparse_4-0-0"]
    assert narrow["cuda_graphs"] == 1 and narrow["density"] == pytest.approx(0.2, abs=1e-6)
    # every key tile, in tile order: the dense attention up to the order the online softmax sums its keys in
    assert whole["density"] == 1.0 and whole["cosine_vs_dense_full_rung"] > 1 - 1e-6
    assert narrow["cosine_vs_dense_full_rung"] < 0.99999
