"""The ModelOpt peer table of a calibration folder: NVIDIA ModelOpt's FP8 recipe vs ours (issue 17).

Replays the folder's own calibration (the preset and sampling settings its manifest and stats record)
for ModelOpt's max calibration, then samples held-out prompts at the model's deployment settings
(:func:`trt_sora.calibrate.peer.modelopt_peer`). Two steps, the first on a machine with the model's
text encoder, the second anywhere (a GPU makes the 20-step trajectories quick)::

    # 1. CPU: the prompts' embeddings (calibration prompts, held-out prompts, the negative prompt) of a
    #    calibration folder, or of the preset a fresh calibration of --model will use
    python benchmarks/peer_modelopt.py embed --model wan-shapes --num 16 --out build/wan_shapes_peer_prompts.safetensors
    # 2. GPU: calibrate (those embeddings stand in for the text encoder), then the table
    python -m trt_sora calibrate --model wan-shapes --recipe rtx4090-fp8 --device cuda --no-report \\
        --text-embeddings build/wan_shapes_peer_prompts.safetensors --out /tmp/peer_calib
    python benchmarks/peer_modelopt.py table --calib /tmp/peer_calib --num 16 \\
        --prompts build/wan_shapes_peer_prompts.safetensors --device cuda --out peer.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _setup(calib: Path):
    from trt_sora.calibrate.data import CalibPreset, CalibShape
    from trt_sora.calibrate.stats import CalibStats
    from trt_sora.models import adapter_for_manifest

    man = json.loads((calib / "manifest.json").read_text())  # any format version: only inputs are read
    if man.get("stage") != "calibrate":
        raise SystemExit(f"{calib} is not a calibration folder (stage {man.get('stage')!r})")
    adapter = adapter_for_manifest(man["inputs"]["model"])
    stats = CalibStats.load(calib / "stats.safetensors")
    md = stats.metadata
    if md.model_hash != adapter.spec.model_hash():
        raise SystemExit(f"{calib}: the stats are for model hash {md.model_hash}, {adapter.name} is "
                         f"{adapter.spec.model_hash()}")
    p = dict(man["inputs"]["preset"])
    p["shapes"] = tuple(CalibShape(**s) for s in p["shapes"])
    preset = CalibPreset(**p)  # exactly what the calibration ran with
    settings = adapter.sampling.override(num_steps=md.num_steps, guidance_scale=md.guidance_scale, shift=md.shift)
    return adapter, stats, preset, settings


def _prompts(adapter, preset, num: int) -> list[str]:
    from trt_sora.calibrate.data import prompts_for_preset

    texts = [p.prompt for p in prompts_for_preset(preset)]
    texts += [p.prompt for p in prompts_for_preset(preset, split="heldout", num_prompts=num)]
    neg = adapter.spec.defaults.get("negative_prompt", "")
    texts += [preset.negative_prompt or ""] + ([neg] if neg is not None else [])
    return list(dict.fromkeys(texts))


def embed(args) -> None:
    import torch

    from trt_sora.models.text import save_embeddings

    if args.calib:
        adapter, _, preset, _ = _setup(Path(args.calib))
    else:  # the preset `trt-sora calibrate --model M [--preset P]` will use
        from trt_sora.calibrate.data import load_preset
        from trt_sora.config import load_recipe
        from trt_sora.models import get_adapter

        adapter = get_adapter(args.model)
        preset = load_preset(args.preset or adapter.spec.defaults.get("calib_preset")
                             or load_recipe(args.recipe).calibration.preset)
    texts = _prompts(adapter, preset, args.num)
    text_len = max(s.text_len for s in preset.shapes)
    with torch.inference_mode():
        emb = adapter.text_encoder()(texts, text_len)
    save_embeddings(texts, emb, args.out)
    print(f"{len(texts)} prompts -> {args.out}")


def table(args) -> None:
    import torch

    from trt_sora.calibrate.peer import modelopt_peer, report_section
    from trt_sora.config import load_recipe

    adapter, stats, preset, settings = _setup(Path(args.calib))
    man = json.loads((Path(args.calib) / "manifest.json").read_text())
    qcfg = load_recipe(args.recipe).quantization
    model = adapter.load("fp32", args.device)
    encode = adapter.text_encoder(args.prompts)
    t0 = time.perf_counter()
    from trt_sora.calibrate.gptq import load_rounded_weights

    rounding = man["results"].get("weight_rounding") or {}
    w = man.get("outputs", {}).get("weights")  # the shipped GPTQ-rounded weights, if the calibration wrote them
    rounded = load_rounded_weights(Path(args.calib) / w) if w and rounding.get("format") == "fp8_e4m3" else None
    res = modelopt_peer(adapter, model, stats, preset, qcfg, encode=encode, settings=settings,
                        num_prompts=args.num, num_steps=args.steps, weights=rounded)
    res["wall_seconds"] = round(time.perf_counter() - t0, 1)
    res["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    res["calib"] = {"folder": str(args.calib), "method": stats.metadata.method,
                    "collect_seconds": stats.metadata.extra.get("collect_seconds"),
                    "created": man.get("created")}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("\n".join(report_section(res)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("embed", "table"):
        p = sub.add_parser(name)
        p.add_argument("--calib", required=name == "table", help="a `trt-sora calibrate` folder")
        p.add_argument("--num", type=int, default=16, help="held-out prompts")
        p.add_argument("--out", required=True)
        p.add_argument("--recipe", default="rtx4090-fp8", help="recipe (table: its quantization section names our "
                       "sites; embed: its calibration preset when the model names none)")
    e = sub.choices["embed"]
    e.add_argument("--model", default=None, help="instead of --calib: the model a fresh calibration will run")
    e.add_argument("--preset", default=None, help="with --model: the calibration preset (default: the model's)")
    t = sub.choices["table"]
    t.add_argument("--prompts", default=None, help="embeddings from `embed` (default: the model's text encoder)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's deployment count)")
    args = ap.parse_args()
    if args.cmd == "embed" and not (args.calib or args.model):
        ap.error("embed needs --calib or --model")
    {"embed": embed, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
