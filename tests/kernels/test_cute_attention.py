"""The CuTe DSL attention kernel's register plan (:func:`trt_sora.kernels.cute_attention.p_operand_source`)
against V^T's key order (:func:`trt_sora.kernels.reference.vt_key_order`) and, where the DSL is installed, against
the DSL's own WGMMA layouts; the kernel's GPU agreement with the Triton kernel is
benchmarks/cute_attention.py's (it runs where the DSL and an SM 9.0 GPU are)."""
import pytest
from script_loader import load_script

from trt_sora.kernels import cute_attention as ca
from trt_sora.kernels import reference as ref


def a_operand_position(q: int, c: int, h: int, k: int) -> int:
    """Key position (along K) of register (k, ., h) of chunk c in lane q of the 8-bit m64k32 A fragment:
    the PTX ISA's layout, lane q of each quad holding 4q..4q+3 and 16+4q..19+4q of every 32."""
    return 32 * c + 16 * h + 4 * q + k


def accumulator_key(q: int, e: int, n: int) -> int:
    """Key (column) of value (e, ., n) in lane q of the m64nN accumulator: 8n + 2q + e."""
    return 8 * n + 2 * q + e


def test_every_p_register_holds_the_key_that_vt_holds_at_its_position():
    order = ref.vt_key_order(128).tolist()
    seen = set()
    for q in range(4):
        for c in range(4):
            for h in range(2):
                for k in range(4):
                    e, n = ca.p_operand_source(c, h, k)
                    key = accumulator_key(q, e, n)
                    assert order[a_operand_position(q, c, h, k)] == key, (q, c, h, k)
                    seen.add(key)
    assert seen == set(range(128))  # each key of the tile once


def test_the_dsl_layouts_are_the_ones_the_plan_assumes():
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import warpgroup

    k_major = cute.nvgpu.OperandMajorMode.K
    got = {}

    @cute.jit
    def layouts():
        qk = sm90.make_trivial_tiled_mma(cutlass.Int8, cutlass.Int8, k_major, k_major, cutlass.Int32, (1, 1, 1),
                                         (64, 128))
        pv = sm90.make_trivial_tiled_mma(cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, k_major, k_major,
                                         cutlass.Float32, (1, 1, 1), (64, 128), a_source=warpgroup.OperandSource.RMEM)
        got["c"], got["a"] = str(qk.tv_layout_C), str(pv.tv_layout_A)

    cute.compile(layouts)
    # (thread, value) -> m + 64 * column: quad lane q at column 2q (C) / 4q (A), value strides as the plan reads them
    assert got["c"] == "((4,8,4),(2,2,16)):((128,1,16),(64,8,512))"
    assert got["a"] == "((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))"


def test_require_names_the_install_command_without_the_dsl(monkeypatch):
    from trt_sora.errors import BackendMissingError

    real = ca.importlib.util.find_spec
    monkeypatch.setattr(ca.importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    with pytest.raises(BackendMissingError, match="pip install nvidia-cutlass-dsl==4.8.1"):
        ca.require()
    assert not ca.available()


def test_require_refuses_a_gpu_that_is_not_sm90(monkeypatch):
    import torch

    from trt_sora.errors import ConfigError

    monkeypatch.setattr(ca.importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    with pytest.raises(ConfigError, match="SM 9.0 .* not on NVIDIA L40S; use torch_fp8.attention_kernel: int8"):
        ca.require("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ca.require("cuda")  # an H100 / H200 with the DSL passes


def test_an_unknown_schedule_option_is_named_before_any_launch():
    with pytest.raises(TypeError, match=r"schedule options \['look_ahead'\]; known: .*'lookahead'"):
        ca.attention_fp8(None, None, None, None, None, None, look_ahead=True)


def test_schedules_that_cannot_run_are_named_before_any_launch():
    import torch

    buf = torch.zeros(ca.TRACE_SHAPE, dtype=torch.int64)
    with pytest.raises(ValueError, match="overlap or lookahead schedule; got .*overlap=False"):
        ca.attention_fp8(None, None, None, None, None, None, trace=buf, overlap=False)
    with pytest.raises(ValueError, match=r"got \(4, 8, 64\)"):
        ca.attention_fp8(None, None, None, None, None, None, trace=buf[..., 0])


def test_ablations_are_refused_outside_a_traced_overlap_run():
    """``ablate`` leaves work out, so its output is wrong: only a traced overlap schedule (a timing tool) takes
    it, and only the names the kernel knows; the bench's ``--trace NAME@a+b`` parses to the same names."""
    import torch

    buf = torch.zeros(ca.TRACE_SHAPE, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"ablate takes .* with trace=.*traced=False"):
        ca.attention_fp8(None, None, None, None, None, None, ablate=("exp",))
    with pytest.raises(ValueError, match=r"got ablate=\('qk',\)"):
        ca.attention_fp8(None, None, None, None, None, None, trace=buf, ablate=("qk",))
    with pytest.raises(ValueError, match="lookahead=True"):
        ca.attention_fp8(None, None, None, None, None, None, trace=buf, ablate=("pv",), overlap=False,
                         lookahead=True)
    trace_spec = load_script("benchmarks/cute_attention.py").trace_spec
    assert trace_spec("overlap_lazy_epssim@pv+exp") == ("overlap_lazy_epssim", ("pv", "exp"))
    assert trace_spec("overlap_lazy") == ("overlap_lazy", ())
    with pytest.raises(SystemExit, match="ABLATION in"):
        trace_spec("overlap_lazy@qk")
    with pytest.raises(SystemExit, match="NAME in VARIANTS"):
        trace_spec("overlap_lazzy@exp")


def test_every_bench_variant_names_every_schedule_option():
    """A variant that left an option out would take SCHEDULE's value, and change when the default does."""
    variants = load_script("benchmarks/cute_attention.py").VARIANTS
    assert {name: sorted(v) for name, v in variants.items()} == {name: sorted(ca.SCHEDULE) for name in variants}


def test_the_bench_schedule_flag_keeps_each_options_type():
    parse_schedule = load_script("benchmarks/fp8_bench.py").parse_schedule
    assert parse_schedule("overlap=0,lookahead=1,stages=3", ca.SCHEDULE) == {
        "overlap": False, "lookahead": True, "stages": 3}
    with pytest.raises(SystemExit, match="unknown key 'look'"):
        parse_schedule("look=1", ca.SCHEDULE)


def _gpu_ops(b, s, h):
    pytest.importorskip("cutlass")
    from trt_sora.kernels import triton_ops as t

    if not ca.available("cuda"):
        pytest.skip("the CuTe kernel needs an SM 9.0 GPU")
    return t, t.qkv_rmsnorm_rope(*ref.example_qkv(b, s, h, seed=1), h, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [{}, {"lazy_rescale": False}, {"split_sum": False}, {"overlap": False},
                                      {"overlap": False, "lookahead": True}],
                         ids=["default", "not-lazy", "one-sum-chain", "in-order", "lookahead"])
@pytest.mark.parametrize("s", [1000, 640, 129, 100])  # 8 key tiles (even), 5 (odd: the lookahead's tails), 2, 1
def test_gpu_kernel_agrees_with_the_triton_kernel(schedule, s):
    """Batch 2, ragged (1000; 129: one key in the last tile; 100: the one tile) and whole tiles (640): only the
    last tile is masked (a peeled step), in each schedule. The same operands on both kernels, bf16 and FP8 output
    (their sums differ in order, and the ragged tile keeps the one FMA here: a few bf16 ulps,
    benchmarks/README.md)."""
    import torch

    t, ops = _gpu_ops(2, s, 2)
    want, got = t.attention_fp8(*ops, ws=False).float(), ca.attention_fp8(*ops, **schedule).float()
    q8, qs, k8, ks, vt8, vs = ops
    exact = ref.attention_fp8(q8, qs, k8, ks, ref.vt_natural(vt8, s), vs).transpose(1, 2).reshape(got.shape)
    # no farther from the fp32 reference than the Triton kernel, give or take one bf16 step of the output
    assert torch.isfinite(got).all()
    assert (got - exact).abs().max() <= (want - exact).abs().max() + exact.abs().max() * 2**-8
    # the ragged tile's logits take another (equally exact) formula in each kernel: on one tile, all of them
    assert (got == want).float().mean() >= (0.97 if s < ca.TILE else 0.98)
    sc = torch.tensor(float(want.abs().max()) / 448, device="cuda")
    w8 = t.attention_fp8(*ops, out_scale=sc, ws=False).view(torch.uint8)
    g8 = ca.attention_fp8(*ops, out_scale=sc, **schedule).view(torch.uint8)
    assert (g8 == w8).float().mean() >= 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [{}, {"overlap": False, "lookahead": True}], ids=["overlap", "lookahead"])
def test_gpu_lazy_rescale_changes_no_bit(schedule):
    """Skipping O's rescale where no row of a warp has a new max multiplies by exactly 1 less often: the same
    bits, bf16 and FP8."""
    import torch

    _, ops = _gpu_ops(1, 4133, 2)
    for out in ({}, {"out_scale": torch.tensor(0.001, device="cuda")}):
        assert torch.equal(ca.attention_fp8(*ops, **schedule, lazy_rescale=False, **out).view(torch.uint8),
                           ca.attention_fp8(*ops, **schedule, lazy_rescale=True, **out).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["early_pack", "int_max"])
def test_gpu_options_that_only_move_work_change_no_bit(option):
    """Packing P of tile j-1 after Q K^T of j is issued, or taking the row max over the int32 products (the
    magic add is exact and monotonic), moves instructions, not arithmetic: the same bits with the option on and
    off (the rest of the default schedule), bf16 and FP8, ragged and many-tile."""
    import torch

    for s in (1000, 4133):
        _, ops = _gpu_ops(1, s, 2)
        for out in ({}, {"out_scale": torch.tensor(0.001, device="cuda")}):
            assert torch.equal(ca.attention_fp8(*ops, **{option: False}, **out).view(torch.uint8),
                               ca.attention_fp8(*ops, **{option: True}, **out).view(torch.uint8)), (option, s)


@pytest.mark.gpu
def test_gpu_kernel_replays_in_a_cuda_graph():
    import torch

    _, ops = _gpu_ops(1, 4133, 2)
    eager = ca.attention_fp8(*ops, overlap=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ca.attention_fp8(*ops, overlap=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
