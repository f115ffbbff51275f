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
