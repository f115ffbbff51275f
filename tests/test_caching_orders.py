"""benchmarks/caching_orders.py's error tables on a hand trajectory: outputs a * s^2 in the timestep
``t = 100 s`` (s = 10 - step), where order 2 is exact and order 1's errors have a closed form."""
from __future__ import annotations

import numpy as np
import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")

A = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)


def _parabola(n: int) -> dict:
    return {i: (100.0 * (10 - i), A * float(10 - i) ** 2) for i in range(n)}


def test_relative_errors_of_each_order():
    """Step i from steps i-h-1, i-h (order 1): (1 + h) y(s + h) - h y(s + h + 1) = y(s) - h (h + 1) a, a
    relative error of h (h + 1) / s^2; order 2 is exact; NaN until the order's steps exist."""
    errors = load_script("benchmarks/caching_orders.py").relative_errors(_parabola(8), 8, 3)
    for i in range(8):
        s = 10 - i
        for h in (1, 2, 3):
            o1, o2 = errors[0, i, h - 1], errors[1, i, h - 1]
            assert np.isnan(o1) == (i - h - 1 < 0) and np.isnan(o2) == (i - h - 2 < 0)
            if i - h - 1 >= 0:
                assert o1 == pytest.approx(h * (h + 1) / s ** 2, rel=1e-12)
            if i - h - 2 >= 0:
                assert o2 < 1e-12


def test_scheduled_errors_use_the_computed_steps_only():
    """Reused {3, 5, 6}: step 3 from 1, 2 (2 / 7^2); steps 5 and 6 from 2, 4 (the line through 64 a and
    36 a gives 22 a at s = 5, 8 a at s = 4: errors 3/25 and 8/16) and order 2 from 1, 2, 4 (exact)."""
    errors = load_script("benchmarks/caching_orders.py").scheduled_errors(_parabola(8), {3, 5, 6})
    assert errors[0, 3] == pytest.approx(2 / 49, rel=1e-12)
    assert errors[0, 5] == pytest.approx(3 / 25, rel=1e-12)
    assert errors[0, 6] == pytest.approx(8 / 16, rel=1e-12)
    assert (errors[1, [3, 5, 6]] < 1e-12).all()
    assert np.isnan(errors[:, [0, 1, 2, 4, 7]]).all()


# A damped line on y_i = i D + (-1)^i B (D, B orthogonal, |D|^2 = 8, |B|^2 = 1, timesteps evenly spaced): from
# steps i - h - 1, i - h, with Y = y_i - newest and L = line - newest: Y = h D + s ((-1)^h - 1) B and
# L = h (D + 2 s B) (s = +-1), so the least-squares alpha <Y, L> / |L|^2 is (d - 4b) / (d + 4b) = 1/3 at
# h = 1, d / (d + 4b) = 2/3 at h = 2 and (3d - 4b) / (3d + 12b) = 5/9 at h = 3, and |alpha L - Y|^2 is
# (1 - a)^2 d + 4 (1 + a)^2 b, 4 ((1 - a)^2 d + 4 a^2 b) and 9 (1 - a)^2 d + (6a + 2)^2 b.
D = torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
B = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
BEST = (1 / 3, 2 / 3, 5 / 9)


def _squared_miss(h: int, a: float, d: float = 8.0, b: float = 1.0) -> float:
    return ((1 - a) ** 2 * d + 4 * (1 + a) ** 2 * b, 4 * ((1 - a) ** 2 * d + 4 * a ** 2 * b),
            9 * (1 - a) ** 2 * d + (6 * a + 2) ** 2 * b)[h - 1]


def _zigzag(n: int, slope=D, noise=B) -> dict:
    return {i: (1000.0 - 10.0 * i, i * slope + (-1) ** i * noise) for i in range(n)}


def test_fitted_alpha_is_the_least_squares_one():
    m = load_script("benchmarks/caching_orders.py")
    alphas = m.fit_alphas(m.alpha_sums(_zigzag(8), 8, 3))
    for i in range(8):
        for h in (1, 2, 3):
            if i - h - 1 < 0:
                assert np.isnan(alphas[i, h - 1])
            else:
                assert alphas[i, h - 1] == pytest.approx(BEST[h - 1], rel=1e-12)


def test_fitted_alpha_sums_over_captions_and_clips():
    """A second caption on the plain line 2 D (<Y, L> = |L|^2 = 4 h^2 |D|^2 = 32 h^2) at h = 1: (8 - 4 + 32) /
    (8 + 4 + 32) = 9/11, not the mean of 1/3 and 1; |B|^2 = 4 makes h = 1's (8 - 16) / 24 negative (0), and
    y_i = i^2 D (Y / L = (2i - h) / (2i - 2h - 1) > 1) clips to 1."""
    m = load_script("benchmarks/caching_orders.py")
    two = m.fit_alphas(m.alpha_sums(_zigzag(8), 8, 3) + m.alpha_sums(_zigzag(8, noise=0 * B, slope=2 * D), 8, 3))
    assert two[5, 0] == pytest.approx(9 / 11, rel=1e-12)
    assert m.fit_alphas(m.alpha_sums(_zigzag(8, noise=2 * B), 8, 3))[5, 0] == 0.0
    accelerating = {i: (1000.0 - 10.0 * i, i ** 2 * D) for i in range(8)}
    assert (m.fit_alphas(m.alpha_sums(accelerating, 8, 3))[4:] == 1.0).all()


def test_damped_errors_in_closed_form():
    """Fixed alpha 0.5, the calibrated alpha (the smallest miss of any alpha) and order 1 (alpha 1)."""
    m = load_script("benchmarks/caching_orders.py")
    outputs = _zigzag(8)
    ests = m.estimates([0.5], calibrated=True)
    assert [e.name for e in ests] == ["order1", "order2", "alpha0.5", "calibrated"]
    errors = m.relative_errors(outputs, 8, 3, ests, m.fit_alphas(m.alpha_sums(outputs, 8, 3)))
    for i in range(4, 8):
        norm = float((i * D + (-1) ** i * B).norm())
        for h in (1, 2, 3):
            for k, a in ((0, 1.0), (2, 0.5), (3, BEST[h - 1])):
                assert errors[k, i, h - 1] == pytest.approx(_squared_miss(h, a) ** 0.5 / norm, rel=1e-12)
            assert errors[3, i, h - 1] < errors[2, i, h - 1] < errors[0, i, h - 1]


def test_scheduled_damped_errors_take_the_alpha_of_their_horizon():
    """Reused {4, 5}: step 4 from 2, 3 at h = 1, step 5 from 2, 3 at h = 2, each with that horizon's
    calibrated alpha; a schedule reusing further than the fitted horizons is refused."""
    m = load_script("benchmarks/caching_orders.py")
    outputs = _zigzag(8)
    ests = m.estimates([], calibrated=True)
    alphas = m.fit_alphas(m.alpha_sums(outputs, 8, 3))
    errors = m.scheduled_errors(outputs, {4, 5}, ests, alphas)
    for i, h in ((4, 1), (5, 2)):
        norm = float((i * D + (-1) ** i * B).norm())
        assert errors[2, i] == pytest.approx(_squared_miss(h, BEST[h - 1]) ** 0.5 / norm, rel=1e-12)
        assert errors[0, i] == pytest.approx(_squared_miss(h, 1.0) ** 0.5 / norm, rel=1e-12)
    assert np.isnan(errors[:, [0, 1, 2, 3, 6, 7]]).all()
    with pytest.raises(SystemExit, match="--horizons 4"):
        m.scheduled_errors(outputs, {4, 5, 6, 7}, ests, alphas)


def test_damped_cache_takes_its_rows_alpha_at_the_horizon():
    """The sampling hook: after cond computes steps 0..3, step 5 (h = 2 back to step 3) shrinks the line
    through steps 2, 3 by alphas[row][cond][5, 1]; cond computing step 0 again starts the next row's alphas."""
    m = load_script("benchmarks/caching_orders.py")
    from trt_sora.caching import CacheSchedule

    alphas = [{"cond": np.full((8, 3), 0.25)}, {"cond": np.full((8, 3), 0.75)}]
    alphas[0]["cond"][5, 1] = 0.5
    cache = m.Damped(CacheSchedule(8, {"cond": (4, 5)}, order=1), alphas)
    history = {"cond": [(980.0, torch.ones(2)), (970.0, 3 * torch.ones(2))]}  # line: +2 per step
    for want in (3 + 0.5 * 4, 3 + 0.75 * 4):  # rows 0 and 1
        for step in range(4):
            cache.observe(step, "cond", None, 1000.0 - 10 * step)
        assert cache.reuse(5, "cond") and not cache.reuse(3, "cond")
        assert torch.equal(cache.estimate(5, "cond", history, 950.0, {}), torch.full((2,), want, dtype=torch.float32))
    assert cache.to_dict()["reused"] == {"cond": [4, 5]}


def test_fit_folds_never_score_a_fit_caption():
    m = load_script("benchmarks/caching_orders.py")
    assert m.fit_folds(4, 4, False) == [(range(4), range(4, 8))]
    assert m.fit_folds(8, 0, True) == [(range(4), range(4, 8)), (range(4, 8), range(4))]
    assert m.fit_folds(4, 0, False) == []
    with pytest.raises(SystemExit, match="drop --fit-captions"):
        m.fit_folds(8, 4, True)
