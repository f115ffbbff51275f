"""``trt-sora generate --run DIR "caption" -o clip.mp4``: captions -> clips with a checked artifact."""
from __future__ import annotations

import sys
from pathlib import Path

from trt_sora.cli.common import add_cfg_arg, add_runtime_args


def add_sampling_args(p) -> None:
    """Per-clip settings (default: the artifact's)."""
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the artifact's)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the artifact's; <= 1: no CFG)")
    p.add_argument("--shift", type=float, default=None, help="flow-matching sigma shift (default: the artifact's)")
    p.add_argument("--negative-prompt", default=None, help="text of the unconditional branch (default: the model's own "
                   "unconditional conditioning, what it was checked with)")
    p.add_argument("--frames", type=int, default=None, help="num_frames in pixels (default: first bucket's opt)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    add_cfg_arg(p)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="captions -> video clips (MP4 / GIF / PNG contact sheet / npy)",
                       description="Generate one clip per caption with a checked run folder; the text encoder, "
                                   "sampling settings and decoder come from the artifact. Writes OUT and OUT's "
                                   "metadata beside it (.json).")
    add_runtime_args(p)
    p.add_argument("captions", nargs="+", help="one or more captions")
    p.add_argument("-o", "--out", required=True, help="output file: .mp4, .gif, .png (contact sheet) or .npy; with "
                   "several captions, clip.mp4 becomes clip-0.mp4, clip-1.mp4, ...")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the first caption (caption i: seed + i)")
    p.add_argument("--truncate", action="store_true", help="cut a caption longer than the text encoder's tokens "
                   "(default: refuse it; the clip's metadata says what was cut)")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="conditioning image of an image-to-video model (Wan 2.1 I2V: required; Wan 2.2 TI2V: "
                        "optional): one for every caption, or repeat it once per caption; resized to the clip's size")
    add_sampling_args(p)
    p.add_argument("--scale", type=int, default=1, help="pixel-repeat upscaling of the written file (e.g. 4 for 32x32)")
    p.add_argument("--preset", default=None, choices=video_presets(), help="x264 preset of an MP4 at crf 18 "
                   "(default: fast; benchmarks/README.md, \"The clip's tail\", compares them)")
    p.add_argument("--sheet", default=None, help="also write a PNG contact sheet of all clips (one row each)")
    p.add_argument("--probe", action="store_true", help="read each clip back against its caption with the model's "
                   "own checker (wan-shapes) and print the verdict")
    p.set_defaults(func=run)


def video_presets() -> tuple:
    from trt_sora.runtime.video import PRESETS

    return PRESETS


def load_runner(args):
    """The run folder's runner; with ``--parallel``, ranks != 0 follow rank 0's calls and exit here."""
    import trt_sora.runtime as rt

    parallel = parallel_from_args(args)
    runner = rt.load(args.run, backend=args.backend, force=args.force, device=args.device, threads=args.threads,
                     parallel=parallel)
    if parallel is not None:
        import atexit

        import torch.distributed as dist

        if dist.get_rank() != 0:
            runner.follow()
            raise SystemExit(0)
        atexit.register(runner.close)  # releases the followers however rank 0's command ends
    return runner


def parallel_from_args(args):
    """The ``--parallel`` option's ``ParallelConfig`` once this torchrun rank joined its process group, or None."""
    import os

    if not getattr(args, "parallel", None):
        return None
    from trt_sora.errors import ConfigError
    from trt_sora.parallel import ParallelConfig, init_process_group

    config = ParallelConfig.parse(args.parallel)
    if "RANK" not in os.environ:
        raise ConfigError(f"--parallel {args.parallel} needs a torchrun job: torchrun --nproc-per-node "
                          f"{config.world_size} -m trt_sora {' '.join(_argv())}")
    init_process_group(args.device or ("cuda" if _has_cuda() else "cpu"))
    return config


def _argv() -> list:
    return sys.argv[1:] if sys.argv and sys.argv[0].endswith(("trt-sora", "__main__.py")) else ["..."]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _images(args):
    """``--image``: None, one image for every caption, or one per caption."""
    if not args.image:
        return None
    if len(args.image) == 1:
        return args.image[0]
    if len(args.image) != len(args.captions):
        from trt_sora.errors import ConfigError

        raise ConfigError(f"--image given {len(args.image)} times for {len(args.captions)} captions; give one image "
                          "for all of them or one per caption")
    return list(args.image)


def outputs_for(out: str, n: int) -> list:
    path = Path(out)
    return [path] if n == 1 else [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(n)]


def check_args(args) -> list:
    """Every argument ``generate`` can judge without the model: the clips' requests (captions, seeds,
    sampling floats, sizes, images) and the files to write. Returns the requests; ConfigError names the
    argument and the fix."""
    from trt_sora.errors import ConfigError
    from trt_sora.runtime import video
    from trt_sora.runtime.generate import MAX_SCALE, clip_requests

    paths = outputs_for(args.out, len(args.captions))
    if paths[0].suffix.lower() not in video.FORMATS:
        raise ConfigError(f"-o {args.out}: unknown suffix; use one of {', '.join(video.FORMATS)}")
    if args.sheet is not None and not args.sheet.lower().endswith(".png"):
        raise ConfigError(f"--sheet {args.sheet}: a contact sheet is a PNG; name it *.png")
    if not 1 <= args.scale <= MAX_SCALE:
        raise ConfigError(f"--scale {args.scale}: give an integer from 1 to {MAX_SCALE} (pixel repetition)")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: give 1 or more (or leave it out)")
    for p in [*paths, *([args.sheet] if args.sheet else [])]:
        parent = Path(p).parent
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"cannot write {p}: {parent} is a file, not a folder; pick another -o/--sheet")
    reqs = clip_requests(args.captions, seed=args.seed, image=_images(args), negative_prompt=args.negative_prompt,
                         steps=args.steps, guidance=args.guidance, shift=args.shift, num_frames=args.frames,
                         height=args.height, width=args.width, truncate=args.truncate)
    for r in reqs:
        if isinstance(r.image, str) and not r.image.startswith("data:"):
            video.check_image_path(r.image)
    return reqs


def run(args) -> int:
    from trt_sora.manifest import write_json
    from trt_sora.runtime import video
    from trt_sora.runtime.generate import generator_for, run_to_files

    reqs = check_args(args)  # before the model loads (seconds to minutes)
    paths = outputs_for(args.out, len(args.captions))
    runner = load_runner(args)
    clips = run_to_files(generator_for(runner, text_encoder=args.text_encoder), reqs, paths, scale=args.scale,
                         preset=args.preset, cfg=args.cfg)  # an MP4 is encoded while its clip decodes
    probe = generator_for(runner).adapter.caption_probe() if args.probe else None
    passed = 0
    for clip, path in zip(clips, paths):
        meta = dict(clip.metadata)
        if probe is not None:
            meta["probe"] = probe(clip.prompt, clip.frames)
            passed += bool(meta["probe"]["passes"])
        write_json(path.with_suffix(path.suffix + ".json"), meta)
        m = clip.metadata
        line = (f"{path}  {m['size']['num_frames']}x{m['size']['height']}x{m['size']['width']}  seed {clip.seed}  "
                f"{m['sampling']['num_steps']} steps, CFG {m['sampling']['guidance_scale']:g} ({m['cfg']})  "
                f"{m['seconds']['total']:.2f} s  {clip.prompt!r}")
        if probe is not None:
            v = meta["probe"]
            line += (f"  probe: colour={v['colour']} motion={v['motion']} background={v['background']} -> "
                     f"{'pass' if v['passes'] else 'FAIL' if v['passes'] is False else 'n/a'}")
        print(line)
    if args.sheet:
        video.write_png_sheet([c.frames for c in clips], args.sheet, scale=args.scale)
        print(args.sheet)
    if probe is not None:
        print(f"probe: colour and motion right on {passed}/{len(clips)}")
    elif args.probe:
        print(f"--probe: model {clips[0].metadata['model']['ref']} ships no caption checker", file=sys.stderr)
    return 0
