"""torch-fp8 quality on the GPU: wan-shapes clips at the model card's settings vs BF16 and fp32.

The default model's held-out captions (``--prompts``: a ``.safetensors`` of their text embeddings
made on a CPU machine with ``--encode``, since the GPU box has no text-encoder package), fixed
noise seeds, 20 steps, CFG 4, shift 2.0; every variant samples from the same noise:

* ``fp32`` / ``bf16``: the PyTorch model (cuDNN SDPA);
* ``fakequant``: the Q/DQ simulation (what ONNX Runtime / TensorRT compute from the artifact);
* ``torch-fp8`` with the 8-bit self-attention off and on (the real kernels; FP8 GEMMs with fast
  accumulation, as the recipes ship), and on with exact accumulation.

Per variant: clip PSNR (peak 2.0: pixels in [-1, 1]) and cosine vs BF16 and vs fp32 (mean and
worst clip), and the probe's verdicts (colour, motion, background, shape) per clip.

    python benchmarks/fp8_quality.py --encode --out build/wan_shapes_heldout.safetensors      # CPU
    (the same file feeds ``trt-sora check --text-embeddings`` on the GPU box)
    python benchmarks/fp8_quality.py --run build/wan-shapes/rtx4090-fp8 \
        --prompts build/wan_shapes_heldout.safetensors --out quality.json                        # GPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def encode(out: str, n: int) -> None:
    from trt_sora.models import get_adapter
    from trt_sora.models import moving_shapes as ms
    from trt_sora.models.text import save_embeddings

    adapter = get_adapter("wan-shapes")
    prompts = adapter.heldout_prompts()[:n]
    emb = adapter.text_encoder()(prompts, ms.TEXT_LEN).float().contiguous()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_embeddings(prompts, emb, out)  # the format `trt-sora check --text-embeddings` reads too


def clip_metrics(a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """Per-clip PSNR (peak 2.0) and cosine of frames [N, 3, F, H, W] in [-1, 1]."""
    from trt_sora.metrics import psnr_from_mse

    out = []
    for x, y in zip(a.double(), b.double()):
        out.append({"psnr_db": psnr_from_mse(float((x - y).square().mean()), 2.0),
                    "cosine": float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encode", action="store_true", help="CPU: write the held-out captions' embeddings to --out")
    ap.add_argument("--num", type=int, default=16)
    ap.add_argument("--run", default="build/wan-shapes/rtx4090-fp8")
    ap.add_argument("--prompts", default="build/wan_shapes_heldout.safetensors")
    ap.add_argument("--steps", type=int, default=None, help="default: the model's sampling settings (20)")
    ap.add_argument("--guidance", type=float, default=None, help="default: the model's (4.0)")
    ap.add_argument("--shift", type=float, default=None, help="default: the model's (2.0)")
    ap.add_argument("--seed", type=int, default=1_000_000_000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.encode:
        encode(a.out, a.num)
        return
    from safetensors import safe_open

    from trt_sora.models import get_adapter
    from trt_sora.models.moving_shapes.data import parse_caption
    from trt_sora.models.moving_shapes.probe import probe_batch
    from trt_sora.runners import TorchFakeQuantRunner, TorchRunner
    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner
    from trt_sora.sampling import runner_call, sample

    with safe_open(a.prompts, "pt") as f:
        prompts = json.loads(f.metadata()["prompts"])[:a.num]
        cond = f.get_tensor("embeddings")[:a.num].to(a.device)
    n = cond.shape[0]
    dev = a.device
    adapter = get_adapter("wan-shapes")
    run = Path(a.run)
    qmap, stats = run / "quant" / "qdq_map.json", run / "calib" / "stats.safetensors"
    c, f_, h, w = 3, 9, 32, 32
    noise = torch.stack([torch.randn(c, f_, h, w, generator=torch.Generator().manual_seed(a.seed + i))
                         for i in range(n)]).to(dev)
    uncond = torch.zeros_like(cond)
    variants = {
        "fp32": lambda: TorchRunner(adapter, dtype="fp32", device=dev),
        "bf16": lambda: TorchRunner(adapter, dtype="bf16", device=dev),
        "fakequant": lambda: TorchFakeQuantRunner(adapter, qmap, stats, device=dev),
        "torch_fp8_attn_bf16": lambda: TorchFp8Runner(adapter, qmap, stats, device=dev,
                                                      attention=AttentionPolicy(enabled=False)),
        "torch_fp8_attn_8bit": lambda: TorchFp8Runner(adapter, qmap, stats, device=dev,
                                                      attention=AttentionPolicy(enabled=True)),
        "torch_fp8_attn_8bit_exactacc": lambda: TorchFp8Runner(adapter, qmap, stats, device=dev, fast_accum=False,
                                                               attention=AttentionPolicy(enabled=True)),
    }
    decode, _ = adapter.decoder()
    settings = adapter.sampling.override(num_steps=a.steps, guidance_scale=a.guidance, shift=a.shift)
    clips, reports = {}, {}
    for name, make in variants.items():
        r = make().activate()
        lat = sample(runner_call(r), noise, cond, uncond, scheduler=adapter.scheduler(settings.shift),
                     settings=settings, cfg="batched").latents
        clips[name] = decode(lat.float().cpu())
        reports[name] = r.report() if hasattr(r, "report") else None
        r.deactivate()
    specs = [parse_caption(p) for p in prompts]
    out = {"prompts": prompts, "steps": settings.num_steps, "guidance": settings.guidance_scale,
           "shift": settings.shift, "seed": a.seed,
           "psnr_peak": "2.0 (pixel range [-1, 1])", "variants": {}}
    for name, x in clips.items():
        probes = probe_batch(x)
        per_attr: dict[str, int] = {}
        for pr, spec in zip(probes, specs):
            for k, ok in pr.matches(spec).items():
                per_attr[k] = per_attr.get(k, 0) + int(ok)
        v = {"probe_pass": sum(pr.passes(s) for pr, s in zip(probes, specs)), "probe_attributes": per_attr,
             "backend_report": reports[name]}
        for ref in ("bf16", "fp32"):
            m = clip_metrics(x, clips[ref])
            v[f"vs_{ref}"] = {"mean_psnr_db": sum(e["psnr_db"] for e in m) / n,
                              "worst_psnr_db": min(e["psnr_db"] for e in m),
                              "mean_cosine": sum(e["cosine"] for e in m) / n, "per_clip": m}
        out["variants"][name] = v
        print(f"{name:22s} probe {v['probe_pass']}/{n}  vs bf16: mean {v['vs_bf16']['mean_psnr_db']:.2f} dB worst "
              f"{v['vs_bf16']['worst_psnr_db']:.2f} dB | vs fp32: mean {v['vs_fp32']['mean_psnr_db']:.2f} dB worst "
              f"{v['vs_fp32']['worst_psnr_db']:.2f} dB", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
