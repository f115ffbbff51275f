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
@pytest.mark.parametrize("counting", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_counts_equal_the_torch_path(dtype, counting, monkeypatch):
    """Counts of both GPU paths (the NVRTC counting kernel; the Triton ``|x| * 2**-e`` pass + histc) equal the
    torch path's bin for bin: ragged sizes, more than one histc chunk, zeros, outliers, bin counts from 16 to
    8192, a tiny range and an all-zero batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trt_sora.calibrate import histogram
    from trt_sora.calibrate.histogram import CHUNK, batch_counts, exponent_of
    from trt_sora.kernels import cuda_hist

    if counting == "cuda":
        assert cuda_hist.available(), "NVRTC / torch.cuda._compile_kernel missing on this GPU machine"
    else:
        monkeypatch.setattr(histogram, "CUDA_COPIES", None)

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


@pytest.mark.gpu
@pytest.mark.parametrize("copies", [1, 2, 4])
def test_cuda_counting_equals_histc(copies):
    """The NVRTC kernel with 1, 2 or 4 sub-histograms per block gives ``histc``'s bins: crowded low bins (an
    outlier), a spread batch, a view that starts off the kernel's 16-byte vectors, a size no vector divides,
    NaN skipped as ``histc`` skips it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trt_sora.calibrate.histogram import batch_counts, exponent_of, unit_scale
    from trt_sora.kernels.cuda_hist import abs_histogram

    g = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(3_000_011, device="cuda", generator=g).to(torch.bfloat16)
    crowded = base.clone()
    crowded[12345] = 1000.0
    for x in (crowded, base, base[3:], base[8:-3]):  # whole, off the vectors (copied), a 16-byte-aligned view
        e = exponent_of(x.float().abs().amax())
        got = abs_histogram(x, unit_scale(e), 2048, copies=copies)
        assert torch.equal(got, batch_counts(x, e, 2048, kernel=False)), (copies, x.numel())
    holed = base.clone()
    holed[::1000] = float("nan")
    e = exponent_of(base.float().abs().amax())
    want = batch_counts(holed[~holed.isnan()], e, 2048, kernel=False)
    assert torch.equal(abs_histogram(holed, unit_scale(e), 2048, copies=copies), want)
