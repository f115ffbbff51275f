import numpy as np
import pytest

from trt_sora.parity.metrics import compare, frame_metrics, ssim


def test_compare_states_peak_and_identity():
    x = np.linspace(-1, 3, 100, dtype=np.float32)
    m = compare(x, x)
    assert m["cosine"] == pytest.approx(1.0) and m["psnr_db"] == float("inf") and m["psnr_peak"] == pytest.approx(4.0)
    m = compare(x, x + 0.01)
    assert m["psnr_db"] == pytest.approx(10 * np.log10(16 / 1e-4), rel=1e-4)
    assert m["psnr_peak_def"] == "reference max - min"


def test_ssim_properties():
    r = np.random.default_rng(0)
    x = np.clip(r.normal(0.3, 0.3, (3, 32, 32)), -1, 1)
    assert ssim(x, x, data_range=2.0) == pytest.approx(1.0)
    y = x + 0.05 * r.normal(size=x.shape)
    z = x + 0.3 * r.normal(size=x.shape)
    assert ssim(x, y, data_range=2.0) == pytest.approx(ssim(y, x, data_range=2.0))  # symmetric
    assert 1.0 > ssim(x, y, data_range=2.0) > ssim(x, z, data_range=2.0) > 0.0     # monotone in noise


def test_ssim_matches_closed_form_for_constant_images():
    # constant images: sigma = 0, SSIM = (2 mu_x mu_y + C1) / (mu_x^2 + mu_y^2 + C1)
    a, b, L = 0.2, 0.5, 2.0
    c1 = (0.01 * L) ** 2
    want = (2 * a * b + c1) / (a * a + b * b + c1)
    assert ssim(np.full((16, 16), a), np.full((16, 16), b), data_range=L) == pytest.approx(want, rel=1e-9)


def test_frame_metrics_mean_and_worst():
    r = np.random.default_rng(1)
    v = r.uniform(-1, 1, (1, 3, 4, 16, 16))
    w = v.copy()
    w[0, :, 2] += 0.2
    fm = frame_metrics(v, w)
    assert fm["frames"] == 4 and fm["worst_psnr_frame"] == 2 and fm["worst_ssim_frame"] == 2
    assert fm["psnr_peak"] == 2.0 and fm["worst_psnr_db"] == pytest.approx(10 * np.log10(4 / 0.04))


@pytest.mark.parametrize("image", ["astronaut", "camera"])
@pytest.mark.parametrize("degrade", ["noise", "blur", "jpeg"])
def test_ssim_matches_scikit_image_on_real_images(image, degrade):
    """Our SSIM against scikit-image's (an independent implementation) on photographs it ships,
    degraded three ways; windows, constants and sample covariance follow its gaussian_weights mode."""
    import io

    from PIL import Image
    from scipy.ndimage import gaussian_filter
    from skimage import data
    from skimage.metrics import structural_similarity

    x = getattr(data, image)().astype(np.float64)[96:352, 128:384]  # 256 x 256 (x 3 for RGB): a face / a man
    rgb = x.ndim == 3
    if degrade == "noise":
        y = np.clip(x + np.random.default_rng(0).normal(0, 12, x.shape), 0, 255)
    elif degrade == "blur":
        y = gaussian_filter(x, (2, 2, 0) if rgb else 2)
    else:
        buf = io.BytesIO()
        Image.fromarray(x.astype(np.uint8)).save(buf, "JPEG", quality=15)
        y = np.asarray(Image.open(buf)).astype(np.float64)
    want = structural_similarity(x, y, data_range=255.0, gaussian_weights=True, sigma=1.5,
                                 use_sample_covariance=True, channel_axis=-1 if rgb else None)
    ours = ssim(np.moveaxis(x, -1, 0) if rgb else x, np.moveaxis(y, -1, 0) if rgb else y, data_range=255.0)
    assert 0.3 < want < 0.95
    assert ours == pytest.approx(want, abs=1e-10)
