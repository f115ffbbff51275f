"""The clip's tail alone: VAE decode and MP4 encode of one Wan 2.1 480p x 81 clip, several ways (issue 30).

Wan 2.1's ``AutoencoderKLWan`` at its real size (random weights, as ``e2e_bench.vae_for`` builds it; timing
only), bf16 on the GPU, one latent ``1 x 16 x 21 x 60 x 104`` (480p x 81). Each way runs once untimed
(autotuning, allocator), then ``--reps`` timed runs (the JSON keeps each):

* ``serial``: today's tail before issue 30's change: diffusers' ``vae.decode`` of the whole clip, frames to
  uint8 on the GPU (``runtime.generate.to_uint8``), to the host, then ``runtime.video.write_mp4``;
* ``streamed``: the runtime's tail: the family's ``frame_decoder`` groups (a latent frame at a time), each to
  uint8 and into an ``Mp4Writer`` (x264 at ``runtime.video.DEFAULT_PRESET``) as it is made, so libx264
  encodes while the GPU decodes; its decode alone (groups, no MP4) is timed too;
* ``streamed_cudnn_benchmark``: the same with ``torch.backends.cudnn.benchmark = True``;
* ``streamed_<preset>``: the streamed way once more at each ``--presets`` preset (cudnn.benchmark off);
* ``presets``: libx264 at crf 18 with each ``--presets`` preset on the decoded uint8 frames: seconds, MP4
  bytes and the PSNR of the decoded MP4 against those frames, and against them after the yuv420p
  conversion alone (the encoder's own loss; a random-weight VAE's frames are not a real clip's: the CPU
  section of benchmarks/README.md measures the presets on structured content too).

``--presets-only`` measures just the presets, on ``--content`` frames ffmpeg makes (lavfi sources), at the
clip's size: the CPU measurement; with ``--paced S`` also the streamed tail against a decode of ``S`` seconds
simulated by pacing the groups (what the streaming can hide on this CPU).

    python benchmarks/tail_bench.py --out $OUT/tail.json                           # GPU, < 120 s on an H100
    python benchmarks/tail_bench.py --small --device cpu --out /tmp/tail.json      # CPU dry run, small latent
    python benchmarks/tail_bench.py --presets-only --out benchmarks/results/cpu_tail_presets_2026-12-06.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_bench import frame_decoder, sync, vae_for  # noqa: E402

from trt_sora.runtime.generate import to_uint8  # noqa: E402
from trt_sora.runtime.video import DEFAULT_PRESET, Mp4Writer, ffmpeg_exe, read_video, write_mp4  # noqa: E402

MODEL = "wan2.1-t2v-14b"
LATENT = (1, 16, 21, 60, 104)  # 480p x 81
SMALL = (1, 16, 3, 8, 12)  # 64 x 96 x 9: the CPU dry run
FPS = 16.0
#: lavfi sources for --presets-only: fine detail in motion, a test card, a smooth gradient with grain.
CONTENT = {"mandelbrot": "mandelbrot=size={w}x{h}:rate=16",
           "testsrc2": "testsrc2=size={w}x{h}:rate=16",
           "gradient_grain": "gradients=size={w}x{h}:rate=16:speed=0.05:seed=1,format=yuv444p,"
                             "noise=c0s=8:c0f=t:c0_seed=1"}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of uint8 clips ``a`` and ``b`` over every value (one MSE for the clip)."""
    from trt_sora.metrics import psnr_from_mse

    return psnr_from_mse(float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)), 255.0)


def yuv420(frames: np.ndarray, tmp: Path) -> np.ndarray:
    """``frames`` after the MP4's colour conversion alone (RGB -> yuv420p -> RGB, lossless x264: crf 0)."""
    write_mp4(frames, tmp / "tail_lossless.mp4", FPS, crf=0, preset="ultrafast")
    return read_video(tmp / "tail_lossless.mp4")[:, :frames.shape[1], :frames.shape[2]]


def encode(frames: np.ndarray, preset: str, tmp: Path, ref420: np.ndarray) -> dict:
    """libx264 crf 18 at ``preset`` on uint8 ``frames``: seconds, bytes, PSNR of the decoded MP4 vs ``frames``
    (``psnr_db``, the colour conversion's loss included) and vs ``ref420`` (the encoder's loss alone)."""
    path = tmp / f"tail_{preset}.mp4"
    t0 = time.perf_counter()
    write_mp4(frames, path, FPS, preset=preset)
    seconds = time.perf_counter() - t0
    back = read_video(path)[:, :frames.shape[1], :frames.shape[2]]
    return {"encode_s": seconds, "mp4_bytes": path.stat().st_size, "psnr_db": psnr(back, frames),
            "psnr_vs_yuv420_db": psnr(back, ref420), "fps": frames.shape[0] / seconds}


def lavfi_frames(source: str, frames: int, height: int, width: int) -> np.ndarray:
    """``frames`` uint8 frames ``[F, H, W, 3]`` of the lavfi source ``source`` (:data:`CONTENT`)."""
    spec = CONTENT[source].format(w=width, h=height)
    res = subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-f", "lavfi", "-i", spec,
                          "-frames:v", str(frames), "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
                         capture_output=True, check=True)
    return np.frombuffer(res.stdout, np.uint8).reshape(frames, height, width, 3).copy()


def serial(vae, z: torch.Tensor, tmp: Path, dev: str) -> tuple[dict, np.ndarray]:
    """Decode the whole clip, uint8 on the device, to the host, then one MP4."""
    marks = [time.perf_counter()]
    with torch.inference_mode():
        x = vae.decode(z, return_dict=False)[0]
    sync(dev)
    marks.append(time.perf_counter())
    frames = to_uint8(x[0])
    marks.append(time.perf_counter())
    write_mp4(frames, tmp / "tail_serial.mp4", FPS)
    marks.append(time.perf_counter())
    stages = dict(zip(("vae_decode_s", "to_uint8_host_s", "mp4_s"), np.diff(marks).tolist()))
    return {**stages, "tail_s": marks[-1] - marks[0]}, frames


def streamed(decode_groups, z: torch.Tensor, tmp: Path, dev: str, *, write: bool = True,
             preset: str = DEFAULT_PRESET) -> dict:
    """The family's decoder groups, each to uint8 and (``write``) into a streaming MP4 at x264 ``preset`` as it
    is made."""
    t0 = time.perf_counter()
    h, w = z.shape[-2] * 8, z.shape[-1] * 8
    mp4 = Mp4Writer(tmp / "tail_streamed.mp4", FPS, height=h, width=w, preset=preset) if write else None
    groups = 0
    try:
        for x in decode_groups(z):
            frames = to_uint8(x[0])
            groups += 1
            if mp4 is not None:
                mp4.write(frames)
        t1 = time.perf_counter()
        if mp4 is not None:
            mp4.close()
    except BaseException:
        if mp4 is not None:
            mp4.abort()
        raise
    sync(dev)
    t2 = time.perf_counter()
    out = {"groups": groups, "tail_s": t2 - t0}
    if write:
        out.update({"decode_and_encode_s": t1 - t0, "encode_finish_s": t2 - t1,
                    "mp4_bytes": (tmp / "tail_streamed.mp4").stat().st_size})
    return out


def timed(fn, reps: int) -> dict:
    """One untimed call, then ``reps`` timed: each run's dict and the mean of ``tail_s``."""
    fn()
    runs = [fn() for _ in range(reps)]
    return {"runs": runs, "tail_s_mean": float(np.mean([r["tail_s"] for r in runs]))}


def measure_gpu(args, tmp: Path) -> dict:
    from trt_sora.models import get_adapter

    dev = args.device
    cuda = dev.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SMALL if args.small else LATENT
    res: dict = {"model": MODEL, "latent": list(shape), "default_preset": DEFAULT_PRESET,
                 "dtype": str(dtype).removeprefix("torch."),
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "cpu_count": os.cpu_count(), "weights": "random (timing only)", "reps": args.reps, "ways": {}}

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")

    t0 = time.perf_counter()
    vae = vae_for(MODEL, dev, dtype)
    adapter = get_adapter(MODEL)
    decode_groups = frame_decoder(adapter, vae, dev, dtype)
    res["build_s"] = time.perf_counter() - t0
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev)  # normalised latents
    mean = torch.tensor(vae.config.latents_mean, device=dev).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=dev).view(1, -1, 1, 1, 1)
    zs = (z * std + mean).to(dtype)  # what the frame decoder hands the VAE, for the serial way
    ways = res["ways"]
    frames = None

    def run_serial() -> dict:
        nonlocal frames
        out, frames = serial(vae, zs, tmp, dev)
        return out

    for name, fn in (("serial", run_serial),
                     ("decode_groups_only", lambda: streamed(decode_groups, z, tmp, dev, write=False)),
                     ("streamed", lambda: streamed(decode_groups, z, tmp, dev))):
        ways[name] = timed(fn, args.reps)
        save()
    if cuda:
        torch.backends.cudnn.benchmark = True
        try:
            ways["streamed_cudnn_benchmark"] = timed(lambda: streamed(decode_groups, z, tmp, dev), args.reps)
            ways["decode_groups_only_cudnn_benchmark"] = timed(
                lambda: streamed(decode_groups, z, tmp, dev, write=False), args.reps)
        finally:
            torch.backends.cudnn.benchmark = False
        save()
    res["streamed_mp4_equals_serial_mp4"] = bool(np.array_equal(read_video(tmp / "tail_serial.mp4"),
                                                                 read_video(tmp / "tail_streamed.mp4")))
    ref420 = yuv420(frames, tmp)
    res["presets"] = {p: encode(frames, p, tmp, ref420) for p in args.presets}
    for p in args.presets:  # the streamed tail at each preset: how much of the encode the decode hides
        ways[f"streamed_{p}"] = {"runs": [streamed(decode_groups, z, tmp, dev, preset=p)]}
        ways[f"streamed_{p}"]["tail_s_mean"] = ways[f"streamed_{p}"]["runs"][0]["tail_s"]
        save()
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    return res


def paced(frames: np.ndarray, preset: str, decode_s: float, tmp: Path) -> dict:
    """The streamed tail with the decode simulated: Wan's groups (1 frame, then 4) handed to an
    :class:`Mp4Writer` at the pace of a ``decode_s``-second decode (each group when its share of ``decode_s``
    has passed, by sleeping; the CPU is free meanwhile, as it is while the GPU decodes). ``tail_s``: from
    the decode's start to the finished file; ``encode_finish_s``: the wait after the last group."""
    groups = [frames[:1]] + [frames[i:i + 4] for i in range(1, len(frames), 4)]
    t0 = time.perf_counter()
    with Mp4Writer(tmp / "tail_paced.mp4", FPS, height=frames.shape[1], width=frames.shape[2], preset=preset) as mp4:
        for k, group in enumerate(groups):
            time.sleep(max(0.0, t0 + decode_s * (k + 1) / len(groups) - time.perf_counter()))
            mp4.write(group)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    return {"decode_s": decode_s, "groups": len(groups), "tail_s": t2 - t0, "encode_finish_s": t2 - t1}


def measure_presets(args, tmp: Path) -> dict:
    f, h, w = 81, 480, 832
    res: dict = {"frames": [f, h, w], "crf": 18, "cpu_count": os.cpu_count(), "threads": "x264 default (by cores)",
                 "reps": args.reps, "paced_decode_s": args.paced, "content": {}}
    for source in args.content:
        frames = lavfi_frames(source, f, h, w)
        ref420 = yuv420(frames, tmp)
        rows = {}
        for p in args.presets:
            runs = [encode(frames, p, tmp, ref420) for _ in range(args.reps)]
            rows[p] = {**runs[-1], "encode_s": min(r["encode_s"] for r in runs), "encode_s_runs":
                       [r["encode_s"] for r in runs]}
            if args.paced:  # the best of --reps runs, as encode_s
                runs = [paced(frames, p, args.paced, tmp) for _ in range(args.reps)]
                rows[p]["paced"] = {**min(runs, key=lambda r: r["tail_s"]), "tail_s_runs": [r["tail_s"] for r in runs],
                                    "serial_tail_s": args.paced + rows[p]["encode_s"]}
        base = rows.get("medium")
        for r in rows.values():
            if base:
                r["speedup_vs_medium"] = base["encode_s"] / r["encode_s"]
                r["psnr_vs_medium_db"] = r["psnr_db"] - base["psnr_db"]
                r["psnr_vs_yuv420_vs_medium_db"] = r["psnr_vs_yuv420_db"] - base["psnr_vs_yuv420_db"]
                r["bytes_vs_medium"] = r["mp4_bytes"] / base["mp4_bytes"]
        res["content"][source] = rows
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help=f"latent {SMALL} instead of {LATENT} (a dry run)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of each way (after one untimed)")
    ap.add_argument("--presets", default="medium,fast,veryfast", help="x264 presets to compare at crf 18")
    ap.add_argument("--presets-only", action="store_true", help="only the presets, on --content frames (CPU)")
    ap.add_argument("--paced", type=float, default=None, help="--presets-only: also stream each preset's MP4 at the "
                    "pace of a decode of this many seconds (e.g. 2.07, the H100's bf16 480p x 81 decode)")
    ap.add_argument("--content", default=",".join(CONTENT), help=f"lavfi content of --presets-only: {list(CONTENT)}")
    args = ap.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    args.content = [c for c in args.content.split(",") if c]
    with tempfile.TemporaryDirectory() as d:
        res = measure_presets(args, Path(d)) if args.presets_only else measure_gpu(args, Path(d))
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
