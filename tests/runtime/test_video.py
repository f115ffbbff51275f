"""The streaming MP4 writer against ffmpeg run on the whole clip at once, and its failure paths."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

pytest.importorskip("imageio_ffmpeg")

from trt_sora.runtime import video  # noqa: E402
from trt_sora.runtime.video import Mp4Writer, VideoError  # noqa: E402


def clip(frames: int = 17, height: int = 30, width: int = 45) -> np.ndarray:
    """A red square moving over a grey ramp with a little noise: uint8 [F, H, W, 3] (odd width: padded)."""
    yy, xx = np.mgrid[:height, :width]
    x = np.repeat((255 * (xx / width + yy / height) / 2)[None, ..., None], frames, 0).repeat(3, -1)
    for f in range(frames):
        x[f, 5:15, 2 * f % width:2 * f % width + 10] = [230, 60, 20]
    return np.clip(x + np.random.default_rng(0).normal(0, 2, x.shape), 0, 255).astype(np.uint8)


def whole_clip_mp4(x: np.ndarray, path, fps: float, *, threads: int, preset: str = video.DEFAULT_PRESET) -> None:
    """The reference: one ffmpeg run given every frame at once (the writer's H.264 settings)."""
    _, h, w, _ = x.shape
    cmd = [video.ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24",
           "-s", f"{w}x{h}", "-r", f"{fps:g}", "-i", "-", "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264",
           "-preset", preset, "-pix_fmt", "yuv420p", "-crf", "18", "-threads", str(threads), "-movflags", "+faststart",
           str(path)]
    subprocess.run(cmd, input=x.tobytes(), check=True, capture_output=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_groups_decode_to_the_whole_clip_writer_bytes(tmp_path, threads):
    x = clip()
    whole_clip_mp4(x, tmp_path / "ref.mp4", 16.0, threads=threads)
    with Mp4Writer(tmp_path / "s.mp4", 16.0, height=30, width=45, threads=threads) as mp4:
        for a, b in ((0, 1), (1, 5), (5, 9), (9, 13), (13, 17)):  # Wan's causal groups: 1 frame, then 4
            mp4.write(x[a:b])
    ref, got = video.read_video(tmp_path / "ref.mp4"), video.read_video(tmp_path / "s.mp4")
    assert got.shape == (17, 30, 46, 3)
    np.testing.assert_array_equal(got, ref)
    assert 10 * np.log10(255 ** 2 / np.mean((ref[:, :, :45].astype(float) - x) ** 2)) > 25  # the clip (4:2:0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.mp4", "s.mp4"]  # no temp file left


def test_write_mp4_is_the_writer_on_one_group(tmp_path):
    x = clip(9, 16, 24)
    whole_clip_mp4(x.repeat(2, 1).repeat(2, 2), tmp_path / "ref.mp4", 8.0, threads=0, preset="veryfast")
    video.write_mp4(x, tmp_path / "w.mp4", 8.0, scale=2, preset="veryfast")
    np.testing.assert_array_equal(video.read_video(tmp_path / "w.mp4"), video.read_video(tmp_path / "ref.mp4"))


def test_a_wrong_group_leaves_no_file(tmp_path):
    x = clip()
    out = tmp_path / "c.mp4"
    mp4 = Mp4Writer(out, 16.0, height=30, width=45)
    mp4.write(x[:5])
    with pytest.raises(VideoError, match=r"uint8 \(4, 30, 44, 3\).*\[f, 30, 45, 3\]"):
        mp4.write(x[5:9, :, :44])
    assert mp4._proc.poll() is not None  # ffmpeg was stopped
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(VideoError, match="closed"):
        mp4.write(x[5:9])


def test_an_error_in_the_block_or_in_ffmpeg_leaves_no_file(tmp_path):
    x = clip()
    with pytest.raises(KeyError), Mp4Writer(tmp_path / "a.mp4", 16.0, height=30, width=45) as mp4:
        mp4.write(x[:5])
        raise KeyError("the decoder failed")
    with pytest.raises(VideoError, match=r"could not write .*b\.mp4: ffmpeg exited.*framerate"), \
            Mp4Writer(tmp_path / "b.mp4", 0.0, height=30, width=45) as mp4:  # fps 0: ffmpeg refuses its input
        mp4.write(x[:5])
    with pytest.raises(VideoError, match="no frames were written"), \
            Mp4Writer(tmp_path / "c.mp4", 16.0, height=30, width=45):
        pass
    assert list(tmp_path.iterdir()) == []


def test_bad_settings_are_refused_before_ffmpeg_starts(tmp_path):
    from trt_sora.errors import ConfigError

    with pytest.raises(ConfigError, match="not an x264 preset.*veryfast"):
        Mp4Writer(tmp_path / "c.mp4", 16.0, height=8, width=8, preset="quick")


def numpy_uint8(x: np.ndarray) -> np.ndarray:
    """The reference: numpy in float32, ``rint`` rounds half to even."""
    v = (np.clip(x, -1, 1) + 1) * np.float32(127.5)
    return np.transpose(np.rint(v).astype(np.uint8), (1, 2, 3, 0))


def frames_with_halves() -> tuple[np.ndarray, int]:
    """float32 ``[3, F, H, W]`` frames: random values, values past [-1, 1] and values whose float32
    ``(x + 1) * 127.5`` is exactly k + 0.5 (count returned)."""
    k = np.arange(255, dtype=np.float32)
    halves = (np.float32(-1) + (2 * k + 1) / np.float32(255)).astype(np.float32)
    halves = halves[(np.clip(halves, -1, 1) + 1) * np.float32(127.5) % 1 == 0.5]
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.2, 1.2, (3, 5, 8, 12)).astype(np.float32)
    flat = x.reshape(-1)
    flat[:halves.size] = halves
    flat[halves.size:halves.size + 4] = [-1, 1, -3, 2]
    return rng.permutation(flat).reshape(x.shape), halves.size


def to_uint8_on(device: str) -> None:
    import torch

    from trt_sora.runtime.generate import to_uint8

    x, n = frames_with_halves()
    assert n > 100
    ref = numpy_uint8(x)
    half = (np.clip(x, -1, 1) + 1) * np.float32(127.5) % 1 == 0.5
    assert {int(v) % 2 for v in np.rint((np.clip(x, -1, 1)[half] + 1) * np.float32(127.5))} == {0}  # to even
    got = to_uint8(torch.from_numpy(x).to(device))
    assert got.dtype == np.uint8 and got.shape == (5, 8, 12, 3)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(to_uint8(x), ref)  # an array goes the same way


def test_frames_to_uint8_round_half_to_even_as_numpy():
    to_uint8_on("cpu")


@pytest.mark.gpu
def test_frames_to_uint8_on_the_gpu_as_numpy():
    to_uint8_on("cuda")
