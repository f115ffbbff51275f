"""GPTQ in groups on a real-size Wan (random init) on the CPU: passes, time per pass, peak RSS, and
the error GPTQ vs nearest rounding on held-out inputs.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/cpu_gptq_groups.py --out benchmarks/results/x.json

What it does (``--model wan2.1-t2v-1.3b``, bf16 weights so the model fits in ~3 GB):

1. the whole model's plan: which linears share an input (probe forward), the fp64 Hessian bytes with
   and without sharing, and the passes :func:`plan_hessians` needs at several budgets - no solving;
2. a real calibration (``--prompts`` prompts, ``--steps`` steps, CFG, latent ``--latent``, 16 text tokens) with
   GPTQ on the
   linears matching ``--include`` under ``--budget-gb``, forcing several passes over the trajectories
   (each pass runs the full model; only the solve is restricted, because this repo's column-by-column
   solver takes ~10 s per 1536-wide linear and 5-7 min per 8960-wide FFN down on a shared 2-core CPU);
3. one held-out trajectory (another caption and seed): every GPTQ linear's inputs are captured and
   the output error ``||(W' - W) x||`` of GPTQ vs nearest rounding (same per-row grid) is reported as
   SQNR of ``W x`` in dB, with the weight-space SQNR beside it.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import tempfile
import textwrap
import time
from pathlib import Path


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # kB -> GiB


def _preset(folder: Path, steps: int, prompts: int, latent: str) -> Path:
    f, h, w = (int(v) for v in latent.split("x"))
    p = folder / "gptq_groups.yaml"
    p.write_text(textwrap.dedent(f"""\
        prompt_set: video_prompts_v1
        num_prompts: {prompts}
        num_steps: {steps}
        seed: 0
        shapes:
          - {{batch: 1, latent_frames: {f}, latent_height: {h}, latent_width: {w}, text_len: 16}}
        """))
    return p


def _full_plan(adapter, model, budgets):
    import torch

    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.calibrate.gptq import plan_hessians, shared_inputs, smallest_budget_gb
    from trt_sora.config.recipe import QuantConfig, QuantFormat

    sites = quantized_sites(model, QuantConfig(format=QuantFormat.FP8_E4M3), adapter.quant_excludes)
    point = {"batch": 1, "latent_frames": 1, "latent_height": 2, "latent_width": 2, "text_len": 16}
    t0 = time.perf_counter()
    leader = shared_inputs(model, sites, lambda: adapter.forward(model, adapter.example_inputs(point, dtype="bf16")))
    probe_s = time.perf_counter() - t0
    mods = dict(model.named_modules())
    unshared = sum(mods[s].in_features ** 2 * 8 for s in sites)
    largest = max(mods[s].in_features for s in sites) ** 2 * 8
    out = {"linears": len(sites), "probe_seconds": round(probe_s, 2),
           "shared_inputs": sum(1 for s, ld in leader.items() if s != ld),
           "shared_examples": sorted({f"{s} -> {ld}" for s, ld in leader.items() if s != ld})[:4],
           "unshared_hessian_gib": round(unshared / 2 ** 30, 3),
           "smallest_workable_gb": smallest_budget_gb(largest), "passes_at_budget_gb": {}}
    for b in budgets:
        plan = plan_hessians(model, leader, b)
        out["hessian_gib"] = round(sum(plan.nbytes.values()) / 2 ** 30, 3)
        out["hessians"] = len(plan.nbytes)
        out["passes_at_budget_gb"][f"{b:g}"] = plan.passes
    del torch
    return out


def _heldout_inputs(adapter, model, preset, sites, seed: int):
    """``{site: [tokens, in] fp64}``: every input of ``sites`` over one held-out trajectory."""
    import torch

    from trt_sora.calibrate.data import CalibShape
    from trt_sora.calibrate.trajectories import branch_inputs, calibration_sampling
    from trt_sora.sampling import adapter_call, gaussian_noise, sample

    settings, _ = calibration_sampling(adapter, preset)
    shape = CalibShape(**preset.shapes[0].as_dict())
    encode = adapter.text_encoder(None)
    cond, uncond = branch_inputs(adapter, encode, preset, ["a red kite rises over a windy beach at dusk"], shape,
                                 uses_cfg=settings.uses_cfg, seed=seed, device="cpu")
    noise = gaussian_noise((1, adapter.latent_channels, shape.latent_frames, shape.latent_height,
                            shape.latent_width), seed, "cpu")
    mods = dict(model.named_modules())
    seen: dict[str, list] = {s: [] for s in sites}
    handles = [mods[s].register_forward_pre_hook(
        lambda _m, a, s=s: seen[s].append(a[0].detach().reshape(-1, a[0].shape[-1]).double())) for s in sites]
    try:
        with torch.no_grad():
            sample(adapter_call(adapter, model), noise, cond, uncond, scheduler=adapter.scheduler(settings.shift),
                   settings=settings, cfg="split", dtype=torch.bfloat16, label="held-out", conditioner=adapter)
    finally:
        for h in handles:
            h.remove()
    return {s: torch.cat(v) for s, v in seen.items()}


def _errors(model, rounded, stats, inputs, fmt: str) -> dict:
    import torch

    from trt_sora.calibrate.fake_quant import fake_quant

    mods = dict(model.named_modules())
    db = lambda sig, err: round(10 * math.log10(sig / err), 2) if err > 0 else math.inf  # noqa: E731
    out = {}
    for s, wq in rounded.items():
        w = mods[s].weight.detach().double()
        near = fake_quant(w.float(), stats.amax[f"{s}.weight"], fmt, axis=0).double()
        x = inputs[s]
        y = x @ w.T
        sig = float(y.square().sum())
        out[s] = {"tokens": int(x.shape[0]),
                  "output_sqnr_db": {"gptq": db(sig, float((x @ (wq.double() - w).T).square().sum())),
                                     "nearest": db(sig, float((x @ (near - w).T).square().sum()))},
                  "weight_sqnr_db": {"gptq": db(float(w.square().sum()), float((wq.double() - w).square().sum())),
                                     "nearest": db(float(w.square().sum()), float((near - w).square().sum()))}}
        out[s]["gain_db"] = round(out[s]["output_sqnr_db"]["gptq"] - out[s]["output_sqnr_db"]["nearest"], 2)
    del torch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--latent", default="1x16x32", help="latent frames x height x width of the calibration")
    ap.add_argument("--budget-gb", type=float, default=0.6)
    ap.add_argument("--include", nargs="+", default=["blocks.0.*", "blocks.1.*"])
    ap.add_argument("--format", default="fp8_e4m3")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import torch

    from trt_sora.calibrate.data import load_preset
    from trt_sora.calibrate.gptq import load_rounded_weights
    from trt_sora.calibrate.run import calibrate
    from trt_sora.config.recipe import CalibConfig, QuantConfig, QuantFormat
    from trt_sora.models import get_adapter

    torch.manual_seed(0)
    adapter = get_adapter(args.model)
    t0 = time.perf_counter()
    model = adapter.load("bf16", "cpu")
    result = {"model": args.model, "dtype": "bf16 weights, fp64 Hessians", "threads": torch.get_num_threads(),
              "load_seconds": round(time.perf_counter() - t0, 1), "rss_after_load_gib": round(_rss_gb(), 2)}
    result["full_model_plan"] = _full_plan(adapter, model, [1, 2, 4, 8, 16, 32])
    with tempfile.TemporaryDirectory() as tmp:
        preset = load_preset(str(_preset(Path(tmp), args.steps, args.prompts, args.latent)))
        qcfg = QuantConfig(format=QuantFormat(args.format), include=tuple(args.include))
        cfg = CalibConfig(method="minmax", weight_rounding="gptq", gptq_max_hessian_gb=args.budget_gb)
        t0 = time.perf_counter()
        cal = calibrate(adapter, cfg, Path(tmp) / "calib", model=model, preset=preset, report=False,
                        quant_config=qcfg, quant_format=QuantFormat(args.format))
        wr = cal.manifest["results"]["weight_rounding"]
        result["calibration"] = {"preset": (f"{args.prompts} prompts, {args.steps} steps, CFG "
                                               f"{cal.stats.metadata.guidance_scale:g}, latent {args.latent}, "
                                               "text_len 16"),
                                 "include": args.include, "budget_gb": args.budget_gb,
                                 "seconds": round(time.perf_counter() - t0, 1),
                                 "forwards_per_pass": cal.manifest["results"]["num_forwards"],
                                 "weight_rounding": wr, "peak_rss_gib": round(_rss_gb(), 2)}
        rounded = load_rounded_weights(Path(tmp) / "calib" / "weights.safetensors")
        inputs = _heldout_inputs(adapter, model, preset, list(rounded), seed=1_000_000_003)
        errs = _errors(model, rounded, cal.stats, inputs, args.format)
    result["heldout_error"] = errs
    gains = [e["gain_db"] for e in errs.values()]
    result["summary"] = {"passes": wr["passes"], "sites": wr["sites"],
                         "pass_seconds": wr["pass_seconds"],
                         "peak_hessian_gib": round(wr["peak_hessian_bytes"] / 2 ** 30, 4),
                         "gptq_gain_db_mean": round(sum(gains) / len(gains), 2), "gptq_gain_db_min": min(gains),
                         "peak_rss_gib": round(_rss_gb(), 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    logging.info("summary: %s", json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
