"""Comparison metrics (fp64 numpy): cosine, relative L2, max-abs, PSNR (peak stated), SSIM per frame.

Below every stage: export verification, the calibration report, the parity checker and the
benchmarks all judge with these. PSNR's peak is part of every result: ``psnr_peak`` with ``psnr_peak_def``. Tensor-level
comparisons use the reference's ``max - min``; decoded frames in ``[-1, 1]``
use the pixel range ``2.0``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["PEAK_PIXEL_RANGE", "PEAK_REF_RANGE", "compare", "frame_metrics", "is_torch", "psnr_from_mse", "ssim",
           "to_numpy"]

PEAK_REF_RANGE = "reference max - min"
PEAK_PIXEL_RANGE = "pixel range of [-1, 1] = 2.0"


def is_torch(x: Any) -> bool:
    """True for a ``torch.Tensor`` (without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def to_numpy(x: Any, dtype: str | None = None):
    """``torch.Tensor`` / array-like -> ``numpy.ndarray`` (bf16 goes through fp32)."""
    if is_torch(x):
        t = x.detach()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        x = t.cpu().numpy()
    a = np.asarray(x)
    return a.astype(dtype, copy=False) if dtype else a


def compare(ref: Any, got: Any, *, peak: float | None = None) -> dict[str, float | str]:
    """Metrics of ``got`` against ``ref`` (same shape, any float dtype; computed in fp64).

    Returns ``cosine``, ``rel_l2`` (``|got-ref| / |ref|``), ``max_abs``, ``psnr_db`` (with
    ``psnr_peak`` = ``peak`` or the reference's max - min, and ``psnr_peak_def``), ``ref_max_abs``.
    """
    r = to_numpy(ref).astype(np.float64).ravel()
    g = to_numpy(got).astype(np.float64).ravel()
    if r.shape != g.shape:
        from trt_sora.errors import ParityError

        raise ParityError(f"shapes differ: reference {np.shape(to_numpy(ref))} vs candidate {np.shape(to_numpy(got))}; "
                          "the candidate was built for other I/O - rebuild it from this export")
    if not np.isfinite(g).all():
        return {"cosine": float("nan"), "rel_l2": float("inf"), "max_abs": float("inf"), "psnr_db": float("-inf"),
                "psnr_peak": float(peak or 0.0), "psnr_peak_def": "candidate has NaN/inf",
                "ref_max_abs": float(np.abs(r).max()) if r.size else 0.0}
    diff = g - r
    denom = np.linalg.norm(r) * np.linalg.norm(g)
    cos = float(r @ g / denom) if denom > 0 else float(np.array_equal(r, g))
    mse = float(np.mean(diff ** 2)) if r.size else 0.0
    pk = float(peak) if peak is not None else (float(r.max() - r.min()) if r.size else 0.0)
    return {
        "cosine": cos,
        "rel_l2": float(np.linalg.norm(diff) / max(np.linalg.norm(r), 1e-30)),
        "max_abs": float(np.abs(diff).max()) if r.size else 0.0,
        "psnr_db": psnr_from_mse(mse, pk),
        "psnr_peak": pk,
        "psnr_peak_def": "given" if peak is not None else PEAK_REF_RANGE,
        "ref_max_abs": float(np.abs(r).max()) if r.size else 0.0,
    }


def psnr_from_mse(mse: float, peak: float) -> float:
    """``10 log10(peak^2 / mse)`` in dB; ``inf`` for identical, ``-inf`` for a zero peak."""
    if mse == 0:
        return float("inf")
    if peak <= 0:
        return float("-inf")
    return float(10.0 * math.log10(peak * peak / mse))


def _gaussian_kernel(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2.0
    k = np.exp(-(x ** 2) / (2 * sigma ** 2))
    return k / k.sum()


def _filter2(img: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Separable filter over the last two axes with reflect padding (same size)."""
    pad = len(k) // 2
    out = img
    for axis in (-2, -1):
        n = out.shape[axis]
        mode = "reflect" if n > pad else "edge"
        width = [(0, 0)] * out.ndim
        width[axis] = (pad, pad)
        p = np.pad(out, width, mode=mode)
        acc = np.zeros_like(out)
        for i, w in enumerate(k):
            sl = [slice(None)] * out.ndim
            sl[axis] = slice(i, i + n)
            acc += w * p[tuple(sl)]
        out = acc
    return out


def ssim(ref: np.ndarray, got: np.ndarray, *, data_range: float, win: int = 11, sigma: float = 1.5,
         k1: float = 0.01, k2: float = 0.03) -> float:
    """Structural similarity (Wang et al. 2004) of two images ``[..., H, W]`` (channels averaged).

    Gaussian window ``win`` x ``win`` (sigma 1.5), ``C1 = (k1 L)^2``, ``C2 = (k2 L)^2`` with
    ``L = data_range``; the mean SSIM over pixels whose window lies inside the image (the same
    convention as scikit-image's ``gaussian_weights=True``). 1.0 means identical.
    """
    x = np.asarray(ref, dtype=np.float64)
    y = np.asarray(got, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"ssim: shapes differ {x.shape} vs {y.shape}")
    win = min(win, x.shape[-1], x.shape[-2])
    win = win if win % 2 else win - 1
    k = _gaussian_kernel(win, sigma)
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    mx, my = _filter2(x, k), _filter2(y, k)
    # sample covariance correction, as scikit-image (use_sample_covariance=True)
    npts = win * win
    cov_norm = npts / (npts - 1) if npts > 1 else 1.0
    vx = cov_norm * (_filter2(x * x, k) - mx * mx)
    vy = cov_norm * (_filter2(y * y, k) - my * my)
    cxy = cov_norm * (_filter2(x * y, k) - mx * my)
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    pad = (win - 1) // 2
    crop = s[..., pad:s.shape[-2] - pad, pad:s.shape[-1] - pad] if pad else s
    return float(crop.mean())


def frame_metrics(ref_video: Any, got_video: Any, *, data_range: float = 2.0) -> dict[str, Any]:
    """PSNR (peak ``data_range``) and SSIM per frame of videos ``[B, C, F, H, W]`` or ``[C, F, H, W]``
    in ``[-1, 1]``; frames of every batch item are listed in order (b0f0, b0f1, ...).

    Returns ``{"psnr_db": [...], "ssim": [...], "mean_psnr_db", "worst_psnr_db", "worst_psnr_frame",
    "mean_ssim", "worst_ssim", "worst_ssim_frame", "psnr_peak", "psnr_peak_def", "frames"}``.
    """
    r = to_numpy(ref_video).astype(np.float64)
    g = to_numpy(got_video).astype(np.float64)
    if r.ndim == 4:
        r, g = r[None], g[None]
    psnrs, ssims = [], []
    for b in range(r.shape[0]):
        for f in range(r.shape[2]):
            rf, gf = r[b, :, f], g[b, :, f]
            psnrs.append(psnr_from_mse(float(np.mean((rf - gf) ** 2)), data_range))
            ssims.append(ssim(rf, gf, data_range=data_range))
    wp, ws = int(np.argmin(psnrs)), int(np.argmin(ssims))
    finite = [p for p in psnrs if math.isfinite(p)]
    return {
        "frames": len(psnrs),
        "psnr_db": psnrs, "ssim": ssims,
        "mean_psnr_db": float(np.mean(finite)) if finite else float("inf"),
        "worst_psnr_db": float(psnrs[wp]), "worst_psnr_frame": wp,
        "mean_ssim": float(np.mean(ssims)), "worst_ssim": float(ssims[ws]), "worst_ssim_frame": ws,
        "psnr_peak": data_range, "psnr_peak_def": PEAK_PIXEL_RANGE if data_range == 2.0 else "given",
    }
