"""Per-clip quality against a reference clip: worst-frame PSNR and SSIM on the uint8 frames, VMAF
through ffmpeg's libvmaf filter when this ffmpeg build has it (the imageio-ffmpeg wheel's does;
:func:`require_vmaf` refuses a build without it before any work)."""
from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from trt_sora.metrics import psnr_from_mse, ssim
from trt_sora.runtime.video import VideoError, ffmpeg_exe, has_ffmpeg_filter

__all__ = ["VmafUnavailableError", "compare_clips", "require_vmaf", "vmaf"]

#: VMAF's models are trained on large frames; tiny clips are upscaled (nearest) to this height first.
VMAF_MIN_HEIGHT = 256


class VmafUnavailableError(VideoError):
    """VMAF was asked for, and this ffmpeg build has no ``libvmaf`` filter."""


def require_vmaf(asked_by: str = "VMAF") -> str:
    """The ffmpeg binary's path when it has the ``libvmaf`` filter; :class:`VmafUnavailableError`
    naming the filter and the fix otherwise (cheap: one ``ffmpeg -filters``, so callers run it before
    any model loads). ``asked_by`` names the option that wants VMAF in the message."""
    exe = ffmpeg_exe()
    if not has_ffmpeg_filter("libvmaf"):
        raise VmafUnavailableError(
            f"{asked_by} needs ffmpeg's 'libvmaf' filter, and this ffmpeg ({exe}) was built without it "
            f"(`ffmpeg -filters` does not list libvmaf); fix: pip install -U imageio-ffmpeg (its wheel's ffmpeg "
            "has libvmaf), or point IMAGEIO_FFMPEG_EXE at an ffmpeg configured with --enable-libvmaf, or leave "
            "VMAF out (the PSNR and SSIM bars need no ffmpeg)")
    return exe


def compare_clips(ref, got, *, vmaf: bool = False) -> dict:
    """Frames uint8 ``[F, H, W, 3]`` of the reference and the candidate clip.

    Returns ``{"psnr_db": [...], "worst_psnr_db", "mean_psnr_db", "mean_ssim", "worst_ssim",
    "psnr_peak": 255, "identical": bool, "vmaf": float | None, "vmaf_note": str}``
    (PSNR per frame with peak 255, ``inf`` for identical frames; SSIM per frame, channels averaged).
    """
    r = np.asarray(ref)
    g = np.asarray(got)
    if r.shape != g.shape:
        raise ValueError(f"clips differ in shape: reference {r.shape}, candidate {g.shape}")
    rf, gf = r.astype(np.float64), g.astype(np.float64)
    psnrs = [psnr_from_mse(float(np.mean((rf[i] - gf[i]) ** 2)), 255.0) for i in range(r.shape[0])]
    ssims = [ssim(np.moveaxis(rf[i], -1, 0), np.moveaxis(gf[i], -1, 0), data_range=255.0) for i in range(r.shape[0])]
    finite = [p for p in psnrs if math.isfinite(p)]
    out = {"psnr_db": psnrs, "worst_psnr_db": float(min(psnrs)),
           "mean_psnr_db": float(np.mean(finite)) if finite else float("inf"),
           "mean_ssim": float(np.mean(ssims)), "worst_ssim": float(min(ssims)), "psnr_peak": 255,
           "identical": bool(np.array_equal(r, g)), "vmaf": None, "vmaf_note": "not asked"}
    if vmaf:
        out["vmaf"], out["vmaf_note"] = globals()["vmaf"](r, g)
    return out


def vmaf(ref, got, fps: float = 16.0) -> tuple[float | None, str]:
    """``(mean VMAF, note)`` of ``got`` against ``ref`` (uint8 ``[F, H, W, 3]``) with ffmpeg's libvmaf
    (default model), or ``(None, why not)`` when this ffmpeg has no libvmaf."""
    if not has_ffmpeg_filter("libvmaf"):
        return None, f"VMAF not computed: this ffmpeg ({ffmpeg_exe()}) was built without libvmaf"
    r, g = np.ascontiguousarray(ref), np.ascontiguousarray(got)
    _, h, w, _ = r.shape
    k = max(1, math.ceil(VMAF_MIN_HEIGHT / h))
    size = f"{w}x{h}"
    with tempfile.TemporaryDirectory(prefix="trt_sora_vmaf_") as tmp:
        rp, gp, lp = Path(tmp) / "ref.rgb", Path(tmp) / "got.rgb", Path(tmp) / "vmaf.json"
        rp.write_bytes(r.tobytes())
        gp.write_bytes(g.tobytes())
        raw = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", size, "-r", f"{fps:g}"]
        up = f"scale={w * k}:{h * k}:flags=neighbor,format=yuv420p"
        cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", *raw, "-i", str(gp), *raw, "-i", str(rp),
               "-lavfi", f"[0:v]{up}[d];[1:v]{up}[r];[d][r]libvmaf=log_fmt=json:log_path={lp}", "-f", "null", "-"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0 or not lp.is_file():
            return None, f"VMAF failed: {res.stderr.strip()[-300:]}"
        pooled = json.loads(lp.read_text())["pooled_metrics"]["vmaf"]
    note = f"libvmaf default model, frames upscaled {k}x (nearest) to {w * k}x{h * k}" if k > 1 else \
        "libvmaf default model"
    return float(pooled["mean"]), note
