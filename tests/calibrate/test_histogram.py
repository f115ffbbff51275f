"""Power-of-two histograms count exactly, whatever the activations' dtype: against numpy's histogram."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_sora.calibrate.histogram import Histogram  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_counts_equal_numpy_for_every_dtype(dtype):
    """40,000 values in 64 bins (~600 per bin): a count kept in bf16 would stall near 256."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(40_000, generator=g) * 2.5).to(dtype)
    h = Histogram(64)
    h.update(x, x.float().abs().max())
    vals = x.float().abs().numpy().astype(np.float64)
    rng = 2.0 ** int(h.exponent)
    assert vals.max() < rng <= 2 * vals.max()
    want, _ = np.histogram(vals, bins=64, range=(0.0, rng))
    assert h.counts.sum().item() == x.numel()
    np.testing.assert_array_equal(h.counts.numpy(), want)
