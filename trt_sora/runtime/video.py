"""Clip files: MP4 (H.264 through the ffmpeg that ships in the ``imageio-ffmpeg`` wheel), GIF,
a PNG contact sheet, and raw ``.npy`` frames.

Frames are uint8 ``[num_frames, height, width, 3]`` RGB (:class:`trt_sora.runtime.Clip.frames`).
Every writer is atomic: it writes a temp file beside the target and renames it when complete, so a
killed process never leaves a half-written clip under the final name.

``IMAGEIO_FFMPEG_EXE`` points imageio-ffmpeg (and so this module) at another ffmpeg build.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from trt_sora.errors import ConfigError, TrtSoraError, require

__all__ = ["FORMATS", "VideoError", "check_frames", "check_image_path", "contact_sheet", "ffmpeg_exe",
           "has_ffmpeg_filter", "read_image", "read_video", "upscale_frames", "write_clip", "write_gif", "write_mp4",
           "write_png_sheet"]

#: File suffix -> what is written.
FORMATS = {".mp4": "H.264 MP4 (yuv420p)", ".gif": "animated GIF", ".png": "PNG contact sheet of the frames",
           ".npy": "raw uint8 frames [F, H, W, 3]"}
PIP = "pip install 'trt_sora[serve]'  (or: pip install imageio-ffmpeg)"


class VideoError(TrtSoraError):
    """ffmpeg is missing or failed to encode/decode a clip."""


def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary of the imageio-ffmpeg wheel (or ``IMAGEIO_FFMPEG_EXE``)."""
    iio = require("imageio_ffmpeg", extra="serve", pip=PIP)
    try:
        return iio.get_ffmpeg_exe()
    except RuntimeError as exc:
        raise VideoError(f"no ffmpeg binary found ({exc}); {PIP}") from None


def has_ffmpeg_filter(name: str) -> bool:
    """True when this ffmpeg build has the filter ``name`` (e.g. ``libvmaf``)."""
    out = subprocess.run([ffmpeg_exe(), "-hide_banner", "-filters"], capture_output=True, text=True, check=False)
    return any(line.split()[1:2] == [name] for line in out.stdout.splitlines() if line.strip())


def check_frames(frames) -> np.ndarray:
    """``frames`` as a contiguous uint8 ``[num_frames, height, width, 3]`` array (ConfigError otherwise)."""
    x = np.asarray(frames)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or x.shape[0] < 1:
        raise ConfigError(f"frames must be uint8 [num_frames, height, width, 3], got {x.dtype} {tuple(x.shape)}")
    return np.ascontiguousarray(x)


def upscale_frames(x: np.ndarray, scale: int) -> np.ndarray:
    """``x`` ``[F, H, W, 3]`` with each pixel repeated ``scale`` times along height and width."""
    if scale < 1:
        raise ConfigError(f"scale={scale} must be an integer >= 1")
    return x if scale == 1 else x.repeat(scale, axis=1).repeat(scale, axis=2)


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """A temp path with ``path``'s suffix beside it; renamed onto ``path`` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_mp4(frames, path, fps: float, *, scale: int = 1, crf: int = 18) -> Path:
    """H.264 MP4 (yuv420p, odd sizes padded to even, ``+faststart``); ``scale`` upsamples by
    pixel repetition first (a 32x32 clip is hard to see). Returns ``path``."""
    x = upscale_frames(check_frames(frames), scale)
    f, h, w, _ = x.shape
    with _atomic(Path(path)) as tmp:
        cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24",
               "-s", f"{w}x{h}", "-r", f"{fps:g}", "-i", "-", "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2",
               "-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", str(int(crf)), "-movflags", "+faststart", str(tmp)]
        res = subprocess.run(cmd, input=x.tobytes(), capture_output=True, check=False)
        if res.returncode != 0:
            raise VideoError(f"ffmpeg could not write {path}: {res.stderr.decode(errors='replace').strip()[-400:]}")
    return Path(path)


def write_gif(frames, path, fps: float, *, scale: int = 1) -> Path:
    """Animated GIF (looping); ``scale`` as in :func:`write_mp4`."""
    from PIL import Image

    x = upscale_frames(check_frames(frames), scale)
    images = [Image.fromarray(fr) for fr in x]
    with _atomic(Path(path)) as tmp:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                       duration=max(20, round(1000 / fps)), loop=0)
    return Path(path)


def contact_sheet(clips: Sequence, *, scale: int = 1, gap: int = 2) -> np.ndarray:
    """One image of clips: row ``i`` holds clip ``i``'s frames left to right, white gaps. uint8 ``[H', W', 3]``."""
    xs = [upscale_frames(check_frames(c), scale) for c in clips]
    f = max(x.shape[0] for x in xs)
    h = max(x.shape[1] for x in xs)
    w = max(x.shape[2] for x in xs)
    sheet = np.full((len(xs) * (h + gap) - gap, f * (w + gap) - gap, 3), 255, np.uint8)
    for i, x in enumerate(xs):
        for j, fr in enumerate(x):
            sheet[i * (h + gap):i * (h + gap) + fr.shape[0], j * (w + gap):j * (w + gap) + fr.shape[1]] = fr
    return sheet


def write_png_sheet(clips: Sequence, path, *, scale: int = 1) -> Path:
    """PNG of :func:`contact_sheet` (pass one clip's frames as ``[frames]``)."""
    from PIL import Image

    with _atomic(Path(path)) as tmp:
        Image.fromarray(contact_sheet(clips, scale=scale)).save(tmp, format="PNG")
    return Path(path)


def write_clip(frames, path, fps: float, *, scale: int = 1) -> Path:
    """Write ``frames`` in the format named by ``path``'s suffix (:data:`FORMATS`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".mp4":
        return write_mp4(frames, path, fps, scale=scale)
    if suffix == ".gif":
        return write_gif(frames, path, fps, scale=scale)
    if suffix == ".png":
        return write_png_sheet([frames], path, scale=scale)
    if suffix == ".npy":
        with _atomic(path) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, check_frames(frames))
        return path
    raise ConfigError(f"cannot write {path.name}: unknown suffix {suffix or '(none)'!r}; use one of "
                      f"{', '.join(FORMATS)}")


def read_video(path) -> np.ndarray:
    """Decode a video file (MP4, GIF) to uint8 ``[F, H, W, 3]`` with the same ffmpeg."""
    probe = subprocess.run([ffmpeg_exe(), "-hide_banner", "-i", str(path)], capture_output=True, text=True, check=False)
    import re

    m = re.search(r"Video: .*?, (\d+)x(\d+)", probe.stderr)
    if not m:
        raise VideoError(f"{path} has no video stream ffmpeg can read: {probe.stderr.strip()[-300:]}")
    w, h = int(m.group(1)), int(m.group(2))
    res = subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-i", str(path), "-f", "rawvideo",
                          "-pix_fmt", "rgb24", "-"], capture_output=True, check=False)
    if res.returncode != 0:
        raise VideoError(f"ffmpeg could not decode {path}: {res.stderr.decode(errors='replace').strip()[-300:]}")
    return np.frombuffer(res.stdout, np.uint8).reshape(-1, h, w, 3)


def check_image_path(image) -> str:
    """``image`` (a path, not a data URL) as a string; ConfigError where no file is there (checked before
    the work by the generator, and again where the image is read)."""
    ref = str(image)
    if not Path(ref).is_file():
        raise ConfigError(f"image {ref!r} is not a file; pass the path of a PNG/JPEG image (or a "
                          "data:image/...;base64 URL)")
    return ref


def read_image(image, height: int, width: int) -> np.ndarray:
    """A conditioning image as uint8 ``[height, width, 3]`` RGB.

    ``image``: a file path (PNG, JPEG, WebP, ...), a ``data:image/...;base64,`` URL (HTTP bodies), a
    PIL image, or a uint8 array ``[H, W, 3]``. An image of another size is resized to ``width x height``
    with Lanczos filtering, as diffusers' ``VideoProcessor.preprocess`` does. ConfigError for a missing
    or unreadable file or a wrong array.
    """
    import base64
    import binascii
    import io

    Image = require("PIL", extra="serve", pip="pip install pillow").Image
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ConfigError(f"an image array must be uint8 [height, width, 3], got {image.dtype} {image.shape}")
        pil = Image.fromarray(image)
    elif isinstance(image, Image.Image):
        pil = image
    elif isinstance(image, (str, os.PathLike)):
        ref = str(image)
        try:
            if ref.startswith("data:"):
                head, _, body = ref.partition(",")
                if ";base64" not in head:
                    raise ConfigError("an image data URL must be base64 (data:image/png;base64,...)")
                src = io.BytesIO(base64.b64decode(body, validate=True))
            else:
                src = check_image_path(ref)
            with Image.open(src) as im:
                pil = im.convert("RGB")
        except (OSError, binascii.Error, ValueError) as exc:
            what = "the image data URL" if ref.startswith("data:") else f"image {ref!r}"
            raise ConfigError(f"cannot read {what} ({exc}); pass a PNG or JPEG image") from None
    else:
        raise ConfigError(f"image must be a file path, a data: URL, a PIL image or a uint8 array, got "
                          f"{type(image).__name__}")
    pil = pil.convert("RGB")
    if pil.size != (width, height):
        pil = pil.resize((width, height), resample=Image.LANCZOS)
    return np.asarray(pil, dtype=np.uint8).copy()
