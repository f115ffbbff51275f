"""Observers against independent references on adversarial data.

References: torch.ao.quantization observers (MinMax, PerChannelMinMax,
MovingAverage*), numpy (percentile, histogram, EMA in float64) and brute-force
MSE search on the raw data.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from torch.ao.quantization import (
    MinMaxObserver as AoMinMax,
)
from torch.ao.quantization import (
    MovingAverageMinMaxObserver as AoEma,
)
from torch.ao.quantization import (
    MovingAveragePerChannelMinMaxObserver as AoEmaPerChannel,
)
from torch.ao.quantization import (
    PerChannelMinMaxObserver as AoPerChannel,
)

from trt_sora.calibrate.fake_quant import quant_error
from trt_sora.calibrate.observers import (
    EmaObserver,
    MinMaxObserver,
    MseObserver,
    PercentileObserver,
    SiteStats,
    make_observer,
    observer_from_state_dict,
)
from trt_sora.config import CalibMethod
from trt_sora.errors import CalibrationError, ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batches(kind: str) -> list[torch.Tensor]:
    """Adversarial batch streams (fp32, except the fp16 case)."""
    # a fixed seed per stream: str hash() is salted per process (PYTHONHASHSEED), so it is not a seed
    g = _gen(zlib.crc32(kind.encode()))
    if kind == "gaussian":
        return [torch.randn(4, 64, generator=g) for _ in range(6)]
    if kind == "cauchy":
        return [torch.empty(512).cauchy_(generator=g) for _ in range(5)]
    if kind == "student_t2":
        d = torch.distributions.StudentT(2.0)
        torch.manual_seed(1)
        return [d.sample((3, 200)) for _ in range(5)]
    if kind == "single_spike":
        bs = [torch.randn(300, generator=g) * 0.01 for _ in range(4)]
        bs[2][137] = 1e4
        return bs
    if kind == "all_negative":
        return [-(torch.rand(128, generator=g) * 5 + 0.5) for _ in range(4)]
    if kind == "constant":
        return [torch.full((50,), 3.25) for _ in range(3)]
    if kind == "zeros":
        return [torch.zeros(10, 10) for _ in range(3)]
    if kind == "zeros_then_data":
        return [torch.zeros(40), torch.zeros(7), torch.randn(100, generator=g) * 2]
    if kind == "tiny_batches":
        return [torch.randn(1, generator=g) * (i + 1) for i in range(9)]
    if kind == "many_small":
        return [torch.randn(3, generator=g) for _ in range(400)]
    if kind == "growing_range":  # every batch exceeds the histogram's range so far
        return [torch.randn(200, generator=g) * 3.0 ** i for i in range(8)]
    if kind == "shrinking_range":
        return [torch.randn(200, generator=g) * 3.0 ** -i for i in range(6)]
    if kind == "fp16":
        return [(torch.randn(64, 8, generator=g) * 30).half() for _ in range(4)]
    raise KeyError(kind)


KINDS = ["gaussian", "cauchy", "student_t2", "single_spike", "all_negative", "constant", "zeros",
         "zeros_then_data", "tiny_batches", "many_small", "growing_range", "shrinking_range", "fp16"]
NONZERO_KINDS = [k for k in KINDS if k != "zeros"]


def _ao_amax(obs) -> torch.Tensor:
    return torch.maximum(obs.min_val.abs(), obs.max_val.abs())


# -- MinMax -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_minmax_equals_torch_ao(kind):
    ours, ref = MinMaxObserver("site"), AoMinMax(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    for x in _batches(kind):
        ours.collect(x)
        ref(x.float())
    torch.testing.assert_close(ours.compute_amax(), _ao_amax(ref), rtol=0, atol=0)
    assert ours.compute_amax().dtype == torch.float32 and ours.compute_amax().shape == ()


@pytest.mark.parametrize("shape,axis", [((16, 32), 0), ((3, 5, 7), 1), ((4, 6, 8), -1)])
@pytest.mark.parametrize("kind", ["gaussian_w", "spiky_w", "negative_rows"])
def test_minmax_per_channel_equals_torch_ao(shape, axis, kind):
    g = _gen(3)
    ours = MinMaxObserver("w", axis=axis)
    ref = AoPerChannel(ch_axis=axis % len(shape), dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    for i in range(3):
        x = torch.randn(*shape, generator=g)
        if kind == "spiky_w":
            x.view(-1)[i * 7] = 500.0 * (-1) ** i
        if kind == "negative_rows":
            x = -x.abs()
        ours.collect(x)
        ref(x)
    a = ours.compute_amax()
    assert a.shape == (shape[axis],)
    torch.testing.assert_close(a, _ao_amax(ref), rtol=0, atol=0)


# -- EMA ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [0.01, 0.3, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_ema_minmax_track_equals_torch_ao(kind, c):
    ours = EmaObserver("site", averaging_constant=c, track="minmax")
    ref = AoEma(averaging_constant=c, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    for x in _batches(kind):
        ours.collect(x)
        ref(x.float())
    torch.testing.assert_close(ours.compute_amax(), _ao_amax(ref), rtol=1e-6, atol=0)


@pytest.mark.parametrize("c", [0.05, 0.5])
def test_ema_minmax_per_channel_equals_torch_ao(c):
    g = _gen(5)
    ours = EmaObserver("w", axis=1, averaging_constant=c, track="minmax")
    ref = AoEmaPerChannel(averaging_constant=c, ch_axis=1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    for i in range(5):
        x = torch.randn(2, 6, 9, generator=g) * (i + 1) - i
        ours.collect(x)
        ref(x)
    torch.testing.assert_close(ours.compute_amax(), _ao_amax(ref), rtol=1e-6, atol=0)


@pytest.mark.parametrize("c", [0.01, 0.2])
@pytest.mark.parametrize("kind", KINDS)
def test_ema_amax_track_equals_float64_reference(kind, c):
    ours = EmaObserver("site", averaging_constant=c)  # default track="amax"
    ref = None
    for x in _batches(kind):
        ours.collect(x)
        a = float(np.abs(x.double().numpy()).max())
        ref = a if ref is None else ref + c * (a - ref)  # first batch initialises
    assert float(ours.compute_amax()) == pytest.approx(ref, rel=1e-5, abs=0)


@pytest.mark.parametrize("kind", KINDS)
def test_ema_amax_track_never_below_torch_ao_style(kind):
    """Documented difference: EMA of amax >= max(|EMA min|, |EMA max|) (triangle inequality)."""
    amax_t, mm_t = EmaObserver("s", averaging_constant=0.3), EmaObserver("s", averaging_constant=0.3, track="minmax")
    for x in _batches(kind):
        amax_t.collect(x)
        mm_t.collect(x)
    assert float(amax_t.compute_amax()) >= float(mm_t.compute_amax()) * (1 - 1e-6)


def test_ema_tracks_agree_when_one_side_dominates_and_differ_when_it_alternates():
    one_sided = [torch.tensor([-1.0, 10.0]), torch.tensor([-2.0, 4.0]), torch.tensor([0.5, 7.0])]
    alternating = [torch.tensor([-10.0, 1.0]), torch.tensor([-1.0, 10.0])]
    for data, expect_equal in ((one_sided, True), (alternating, False)):
        a, m = EmaObserver("s", averaging_constant=0.5), EmaObserver("s", averaging_constant=0.5, track="minmax")
        for x in data:
            a.collect(x)
            m.collect(x)
        if expect_equal:
            assert float(a.compute_amax()) == pytest.approx(float(m.compute_amax()), rel=1e-7)
    # alternating: EMA(amax) = 10; torch.ao: min -10 -> -5.5, max 1 -> 5.5, amax 5.5
    assert float(a.compute_amax()) == 10.0
    assert float(m.compute_amax()) == 5.5


def test_ema_first_batch_initialises_to_batch_stats():
    for track in ("amax", "minmax"):
        o = EmaObserver("s", averaging_constant=0.01, track=track)
        o.collect(torch.tensor([-3.0, 2.0]))
        assert float(o.compute_amax()) == 3.0  # not 0.03: no zero-initialised bias


# -- Percentile ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_bins", [64, 2048])
@pytest.mark.parametrize("p", [50.0, 99.0, 99.99, 100.0])
@pytest.mark.parametrize("kind", NONZERO_KINDS)
def test_percentile_within_one_bin_of_numpy(kind, p, num_bins):
    obs = PercentileObserver("site", percentile=p, num_bins=num_bins)
    bs = _batches(kind)
    for x in bs:
        obs.collect(x)
    absx = np.abs(np.concatenate([x.float().numpy().ravel() for x in bs]).astype(np.float64))
    ref = float(np.percentile(absx, p))
    got = float(obs.compute_amax())
    w = obs.bin_width
    # one bin width at most, plus the fp32 rounding of the returned amax (data on a bin edge, e.g. fp16
    # values on a power-of-two range, sit exactly one width below the bin's upper edge)
    assert -1e-6 * ref <= got - ref <= w * (1 + 1e-5) + 1.2e-7 * ref + 1e-12, (got, ref, w)
    assert got <= absx.max() * (1 + 1e-7)


@pytest.mark.parametrize("kind", ["growing_range", "cauchy", "zeros_then_data", "many_small"])
def test_grown_histogram_equals_one_pass_numpy_histogram(kind):
    """Re-binning on range growth must give the histogram of all data at the final range."""
    obs = PercentileObserver("site", num_bins=256)
    bs = _batches(kind)
    for x in bs:
        obs.collect(x)
    hist, rng = obs.histogram()
    absx = np.abs(np.concatenate([x.numpy().ravel() for x in bs])).astype(np.float64)
    ref, _ = np.histogram(absx, bins=256, range=(0.0, rng))
    assert int(hist.sum()) == absx.size
    assert np.abs(hist.numpy() - ref).sum() <= 2  # only values landing exactly on a bin edge may move


def test_percentile_state_is_constant_size():
    obs = PercentileObserver("site", num_bins=128)
    g = _gen(0)
    for i in range(300):
        obs.collect(torch.randn(50, generator=g) * (1 + i % 17))
    tensors = [v for v in obs.state_dict()["tensors"].values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() for t in tensors) <= 128 + 2  # counts, the range exponent, the exact abs-max
    assert obs.num_elements == 300 * 50


def test_percentile_all_zeros_gives_zero():
    obs = PercentileObserver("site")
    obs.collect(torch.zeros(5))
    assert float(obs.compute_amax()) == 0.0


# -- MSE ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("kind", ["gaussian_outliers", "student_t2", "laplace"])
def test_mse_amax_near_brute_force_optimum_on_raw_data(fmt, kind):
    if kind == "gaussian_outliers":
        x = torch.randn(20000, generator=_gen(7))
        x[:5] = torch.tensor([40.0, -35.0, 50.0, 30.0, -45.0])
    elif kind == "laplace":
        torch.manual_seed(3)
        x = torch.distributions.Laplace(0.0, 1.0).sample((20000,))
    else:
        torch.manual_seed(2)
        x = torch.distributions.StudentT(2.0).sample((20000,))
    obs = MseObserver("site", fmt=fmt, num_bins=2048, num_candidates=512)
    for chunk in x.split(5000):
        obs.collect(chunk)
    chosen = float(obs.compute_amax())
    amax_max = float(x.abs().max())
    grid = np.linspace(amax_max / 200, amax_max, 200)
    best = min(quant_error(x, float(a), fmt).mse for a in grid)
    got = quant_error(x, chosen, fmt).mse
    assert got <= best * 1.01, (chosen, got, best)
    if fmt == "int8" and kind != "gaussian_outliers":  # discriminates: plain max would fail the bound above
        assert quant_error(x, amax_max, fmt).mse > best * 1.03


# -- errors -------------------------------------------------------------------------------------------

BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("method,kw", [("minmax", {}), ("minmax", {"axis": 0}), ("ema", {}), ("percentile", {}),
                                       ("mse", {})])
def test_non_finite_raises_calibration_error_naming_the_layer(method, kw, bad):
    obs = make_observer(method, "blocks.3.attn1.to_k", **kw)
    obs.collect(torch.randn(4, 4))
    x = torch.randn(4, 4)
    x[2, 1] = bad
    with pytest.raises(CalibrationError, match=r"blocks\.3\.attn1\.to_k") as ei:
        obs.collect(x)
    assert ("NaN" if math.isnan(bad) else "inf") in str(ei.value)
    assert "exclude" in str(ei.value)  # names a fix


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_finite_low_precision_raises(dtype):
    """SiteStats (the hot path) only raises a device flag per batch; check_finite reads every site's flag
    in one host sync, and no amax is computed from a poisoned site."""
    from trt_sora.calibrate.observers import check_finite

    ok, site = SiteStats("blocks.0.attn1", ["minmax"]), SiteStats("blocks.0.ffn", ["minmax", "percentile"])
    x = torch.ones(8, dtype=dtype)
    ok.collect(x, step=0, branch="cond")
    x[3] = float("nan")
    site.collect(x, step=0, branch="cond")  # no sync, no raise here
    check_finite([ok])
    with pytest.raises(CalibrationError, match=r"blocks\.0\.ffn.* at step 0"):
        check_finite([ok, site], " at step 0")
    with pytest.raises(CalibrationError, match="blocks.0.ffn"):
        site.compute_all()


def test_compute_before_collect_and_channel_change_raise():
    with pytest.raises(CalibrationError, match="l1"):
        MinMaxObserver("l1").compute_amax()
    o = MinMaxObserver("l2", axis=0)
    o.collect(torch.randn(4, 3))
    with pytest.raises(CalibrationError, match="l2.*shape changed"):
        o.collect(torch.randn(5, 3))


def test_registry_errors_and_enum():
    with pytest.raises(ConfigError, match="did you mean 'percentile'"):
        make_observer("percentil")
    with pytest.raises(ConfigError, match="did you mean 'averaging_constant'"):
        make_observer("ema", averaging_constnt=0.1)
    with pytest.raises(ConfigError, match="per-tensor only"):
        make_observer("percentile", axis=0)
    with pytest.raises(ConfigError):
        make_observer("ema", averaging_constant=0.0)
    with pytest.raises(ConfigError):
        make_observer("percentile", percentile=0.0)
    for m in CalibMethod:
        assert make_observer(m, "x").method == m.value


@pytest.mark.parametrize("method,kw", [("minmax", {}), ("minmax", {"axis": 1}), ("ema", {"track": "minmax"}),
                                       ("ema", {}), ("percentile", {"num_bins": 128}), ("mse", {"fmt": "int8"})])
def test_state_dict_resume_equals_single_pass(method, kw):
    bs = _batches("growing_range")
    bs = [b.reshape(20, 10) for b in bs]
    full = make_observer(method, "s", **kw)
    for b in bs:
        full.collect(b)
    half = make_observer(method, "s", **kw)
    for b in bs[:4]:
        half.collect(b)
    resumed = observer_from_state_dict(half.state_dict())
    for b in bs[4:]:
        resumed.collect(b)
    torch.testing.assert_close(resumed.compute_amax(), full.compute_amax(), rtol=0, atol=0)
    with pytest.raises(CalibrationError):
        make_observer("ema", "s", averaging_constant=0.5).load_state_dict(full.state_dict())


# -- SiteStats ----------------------------------------------------------------------------------------

def test_site_stats_per_step_grid_matches_reference_and_methods_match_standalone():
    g = _gen(11)
    site = SiteStats("blocks.1.attn2.to_out.0", ["percentile", "minmax", "ema"],
                     observer_kwargs={"percentile": {"percentile": 99.9, "num_bins": 512},
                                      "ema": {"averaging_constant": 0.1}})
    standalone = {"percentile": PercentileObserver("x", percentile=99.9, num_bins=512),
                  "minmax": MinMaxObserver("x"), "ema": EmaObserver("x", averaging_constant=0.1)}
    ref = np.zeros((5, 2))
    for _prompt in range(3):
        for step in range(5):
            for b, branch in enumerate(("cond", "uncond")):
                x = torch.randn(2, 7, generator=g) * (1 + step) * (1 + 3 * b)
                site.collect(x, step=step, branch=branch)
                for o in standalone.values():
                    o.collect(x)
                ref[step, b] = max(ref[step, b], float(x.abs().max()))
    np.testing.assert_allclose(site.amax_per_step.numpy(), ref, rtol=1e-6)
    assert site.count_per_step.tolist() == [[3, 3]] * 5
    for m, o in standalone.items():
        torch.testing.assert_close(site.compute_amax(m), o.compute_amax(), rtol=0, atol=0)
    assert site.primary == "percentile"
    torch.testing.assert_close(site.compute_amax(), standalone["percentile"].compute_amax())
    with pytest.raises(ConfigError, match="branch"):
        site.collect(torch.ones(2), step=0)
    with pytest.raises(ConfigError, match="did you mean 'uncond'"):
        site.collect(torch.ones(2), step=0, branch="uncon")


def test_site_stats_cfg_batched_splits_branches():
    x_cond = torch.tensor([[1.0, -2.0]])
    x_uncond = torch.tensor([[7.0, 0.5]])
    site = SiteStats("s", ["minmax"])
    site.collect_cfg_batch(torch.cat([x_uncond, x_cond]), step=2, order=("uncond", "cond"))
    grid = site.amax_per_step
    assert grid.shape == (3, 2)
    assert grid[2].tolist() == [2.0, 7.0] and grid[:2].abs().sum() == 0
    assert float(site.compute_amax()) == 7.0 and site.num_batches == 1
    with pytest.raises(CalibrationError, match="cannot be split"):
        site.collect_cfg_batch(torch.ones(3, 2), step=0)


def test_site_stats_state_round_trip():
    site = SiteStats("s", ["minmax", "percentile"], branches=("cond",))
    for step in range(4):
        site.collect(torch.randn(30, generator=_gen(step)), step=step)
    back = SiteStats.from_state_dict(site.state_dict())
    torch.testing.assert_close(back.amax_per_step, site.amax_per_step)
    for m in ("minmax", "percentile"):
        torch.testing.assert_close(back.compute_amax(m), site.compute_amax(m))
