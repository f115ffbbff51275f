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
import queue
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from trt_sora.errors import ConfigError, TrtSoraError, require

__all__ = ["DEFAULT_PRESET", "FORMATS", "PRESETS", "Mp4Writer", "VideoError", "check_frames", "check_image_path",
           "contact_sheet", "ffmpeg_exe", "has_ffmpeg_filter", "read_image", "read_video", "upscale_frames",
           "write_clip", "write_gif", "write_mp4", "write_png_sheet", "x264_args"]

#: File suffix -> what is written.
FORMATS = {".mp4": "H.264 MP4 (yuv420p)", ".gif": "animated GIF", ".png": "PNG contact sheet of the frames",
           ".npy": "raw uint8 frames [F, H, W, 3]"}
PIP = "pip install 'trt_sora[serve]'  (or: pip install imageio-ffmpeg)"
#: libx264 presets a clip may be encoded with (``medium`` is x264's own default).
PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow")
#: The preset every MP4 is encoded with unless asked otherwise: at crf 18 ``fast`` kept ``medium``'s PSNR
#: (within 0.03 dB) in less time; faster presets lost more (benchmarks/README.md, "The clip's tail").
DEFAULT_PRESET = "fast"


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


def _tmp_path(path: Path) -> Path:
    """A temp path with ``path``'s suffix beside it (the parent folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """A temp path with ``path``'s suffix beside it; renamed onto ``path`` when the block succeeds."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def x264_args(width: int, height: int, fps: float, crf: int, preset: str) -> list[str]:
    """ffmpeg's arguments from raw RGB frames on stdin to libx264 (yuv420p, odd sizes padded to even,
    ``crf``, ``preset``): the one encode of every MP4 here, a file (:class:`Mp4Writer`) or a stream
    (``trt_sora.serve.fmp4``), so both decode to the same frames."""
    return ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", f"{fps:g}", "-i", "-",
            "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264", "-preset", preset, "-pix_fmt", "yuv420p",
            "-crf", str(int(crf))]


class Mp4Writer:
    """An H.264 MP4 written as its frames come: ffmpeg starts at once, :meth:`write` hands each group
    of frames to a writer thread that feeds ffmpeg's stdin, so libx264 encodes one group while the
    caller makes the next (a GPU decoding the following latent frame). :meth:`close` waits for
    ffmpeg and renames the temp file onto ``path``; any error (ffmpeg failing, a group of the wrong
    size, an exception in the ``with`` block) kills ffmpeg and removes the temp file, so no
    half-written clip is left. ::

        with Mp4Writer("clip.mp4", fps=16, height=480, width=832) as mp4:
            for group in groups:          # uint8 [f, 480, 832, 3]
                mp4.write(group)
        # clip.mp4 is complete here

    Args:
        path: the MP4 to write.
        fps: frames per second.
        height, width: the frames' size before ``scale`` (odd sizes are padded to even).
        scale: pixel-repeat upsampling of every frame (:func:`upscale_frames`).
        crf: x264's constant rate factor (18: visually near-lossless).
        preset: an x264 preset of :data:`PRESETS` (speed vs size at the same crf).
        threads: x264's threads (0: x264's choice by core count). The bytes of an H.264 stream depend
            on the thread count, not on how the frames were grouped.
    """

    def __init__(self, path, fps: float, *, height: int, width: int, scale: int = 1, crf: int = 18,
                 preset: str = DEFAULT_PRESET, threads: int = 0):
        if preset not in PRESETS:
            raise ConfigError(f"preset={preset!r} is not an x264 preset; use one of {', '.join(PRESETS)}")
        if scale < 1:
            raise ConfigError(f"scale={scale} must be an integer >= 1")
        self.path, self.scale, self.frames = Path(path), scale, 0
        self.shape = (int(height), int(width), 3)
        self._tmp = _tmp_path(self.path)
        h, w = self.shape[0] * scale, self.shape[1] * scale
        cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-y", *x264_args(w, h, fps, crf, preset),
               "-threads", str(int(threads)), "-movflags", "+faststart", str(self._tmp)]
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: ffmpeg never blocks on its log
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._stderr)
        self._queue: queue.Queue = queue.Queue()
        self._broken = threading.Event()  # ffmpeg stopped reading (it failed; close() says why)
        self._thread = threading.Thread(target=self._feed, name="mp4-writer", daemon=True)
        self._thread.start()
        self._open = True

    def _feed(self) -> None:
        """The writer thread: groups from the queue to ffmpeg's stdin until None (end) comes."""
        while (x := self._queue.get()) is not None:
            if self._broken.is_set():
                continue  # drain: the caller learns of the failure at write() or close()
            try:
                self._proc.stdin.write(memoryview(x).cast("B"))
            except (BrokenPipeError, ValueError, OSError):
                self._broken.set()

    def write(self, frames) -> None:
        """Queue a group of frames (uint8 ``[f, height, width, 3]``) for encoding and return at once.
        VideoError (ffmpeg killed, temp file removed) for a group of another size or dtype, or when
        ffmpeg already failed."""
        if not self._open:
            raise VideoError(f"{self.path}: the MP4 writer is closed; open a new one for another clip")
        x = np.asarray(frames)
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != self.shape or x.shape[0] < 1:
            self.abort()
            raise VideoError(f"{self.path}: a group of frames is {x.dtype} {tuple(x.shape)}, the clip's are uint8 "
                             f"[f, {self.shape[0]}, {self.shape[1]}, 3]; give every group the clip's size")
        if self._broken.is_set():
            self.close()  # raises with ffmpeg's message
        self._queue.put(np.ascontiguousarray(upscale_frames(x, self.scale)))
        self.frames += x.shape[0]

    def close(self) -> Path:
        """Wait for ffmpeg to encode every queued frame, then rename the file onto ``path``; returns
        ``path``. VideoError (no file left) when no frame came or ffmpeg failed."""
        if not self._open:
            return self.path
        self._queue.put(None)
        self._thread.join()
        try:
            self._proc.stdin.close()
        except (BrokenPipeError, OSError):
            self._broken.set()
        code = self._proc.wait()
        if code != 0 or self.frames == 0 or self._broken.is_set():
            self._stderr.seek(0)
            log = self._stderr.read().decode(errors="replace").strip()[-400:]
            self.abort()
            why = "no frames were written" if self.frames == 0 else f"ffmpeg exited with {code}: {log}"
            raise VideoError(f"could not write {self.path}: {why}")
        os.replace(self._tmp, self.path)
        self._open = False
        self._stderr.close()
        return self.path

    def abort(self) -> None:
        """Kill ffmpeg and remove the temp file (nothing is written under ``path``)."""
        if not self._open:
            return
        self._open = False
        self._proc.kill()
        self._queue.put(None)
        self._thread.join()
        self._proc.wait()
        for f in (self._proc.stdin, self._stderr):
            with contextlib.suppress(BrokenPipeError, OSError):
                f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_mp4(frames, path, fps: float, *, scale: int = 1, crf: int = 18, preset: str = DEFAULT_PRESET) -> Path:
    """H.264 MP4 (yuv420p, odd sizes padded to even, ``+faststart``) of ``frames`` (uint8 ``[F, H, W, 3]``)
    through one :class:`Mp4Writer`; ``scale`` upsamples by pixel repetition first (a 32x32 clip is hard
    to see). Returns ``path``."""
    x = check_frames(frames)
    with Mp4Writer(path, fps, height=x.shape[1], width=x.shape[2], scale=scale, crf=crf, preset=preset) as mp4:
        mp4.write(x)
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
