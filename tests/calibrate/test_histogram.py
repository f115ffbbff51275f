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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_counts_equal_the_torch_path(dtype):
    """Counts with the Triton ``|x| * 2**-e`` pass equal the torch path's bin for bin: ragged sizes, more than
    one histc chunk, zeros, outliers, bin counts from 16 to 8192, a tiny range and an all-zero batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trt_sora.calibrate.histogram import CHUNK, batch_counts, exponent_of

    g = torch.Generator(device="cuda").manual_seed(5)
    for n in (1, 4095, 4096 * 7 + 3, CHUNK + 4097):
        x = torch.randn(n, device="cuda", generator=g) * torch.logspace(-4, 1, n, device="cuda")
        x[:: 97] = 0.0
        x[n // 2] = 300.0  # one outlier: most values land in the first bins
        x = x.to(dtype)
        e = exponent_of(x.float().abs().amax())
        for bins in (16, 2048, 8192):
            got, want = batch_counts(x, e, bins), batch_counts(x, e, bins, kernel=False)
            assert got.dtype == torch.int64 and int(got.sum()) == n
            assert torch.equal(got, want), (n, bins)
    tiny = (torch.rand(5000, device="cuda", generator=g) * 1e-30).to(dtype)
    for x in (tiny, torch.zeros(777, device="cuda", dtype=dtype)):
        e = exponent_of(x.float().abs().amax())
        assert torch.equal(batch_counts(x, e, 2048), batch_counts(x, e, 2048, kernel=False))
