"""``trt-sora random-checkpoint --model wan2.1-t2v-14b --out DIR [--dtype bf16]``."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("random-checkpoint",
                       help="write a named architecture's random-init weights as a diffusers checkpoint folder",
                       description="Write DIR/config.json + DIR/diffusion_pytorch_model*.safetensors (block by block, "
                                   "one parameter in memory at a time), usable as --model DIR by every stage.")
    p.add_argument("--model", required=True, help="a random-init registry name (see `trt-sora info`), e.g. "
                   "wan2.1-t2v-14b")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="checkpoint dtype")
    p.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GiB")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from trt_sora.models import get_adapter
    from trt_sora.weights.checkpoint import write_random_checkpoint

    with tqdm(total=0, unit="B", unit_scale=True, desc="random-checkpoint", mininterval=1.0) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        summary = write_random_checkpoint(get_adapter(args.model), args.out, dtype=args.dtype,
                                          shard_bytes=int(args.shard_gb * (1 << 30)), progress=progress)
    print(f"  {summary['parameters'] / 1e9:.2f} B parameters, {summary['bytes'] / 1e9:.2f} GB in "
          f"{len(summary['files'])} file(s), {summary['seconds']:.0f} s")
    print(args.out)
    return 0
