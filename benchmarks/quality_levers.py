"""Issue 13's lever table: wan-shapes held-out clips at the model's sampling settings, one quantization
variant at a time, against the unquantized (fp32) model.

Clip set: every 11th held-out caption from 0 and from 5 (17 clips; the model card's selection first,
so the issue's "a blue square moves down over a plain black background" is clip 3, noise seed
1e9 + 3), noise seed 1e9 + i, the model's sampling settings (20 steps, CFG 4, shift 2, zero
unconditional embedding), CFG batched. Per variant: clip PSNR (peak 2.0, pixels clamped to
[-1, 1]) per clip, mean and worst; the probe's verdicts (colour, motion, background, shape) vs
fp32's; the fraction of linear-layer FLOPs that run quantized.

Variants are ``<fmt>_<method>_<weights>[_<option>...]``: fmt ``fp8`` | ``int8``; method an observer
of the stats (``minmax``, ``mse``, ``percentile``, ``ema``); weights ``wch`` (per output channel, what
the Q/DQ graph builds) | ``wtensor`` (one scale per tensor, ModelOpt's FP8 default); options
``lastK`` / ``firstK`` (those steps on the unquantized model), ``excl=<kind>+<kind>`` (layer kinds
left unquantized, see ``adapter.layer_kinds``), ``sq<alpha>`` (SmoothQuant: per-input-channel
``s = max|x|^a / max|W|^(1-a)``, ``x / s`` and ``W * s`` before quantizing), ``gptq`` (the calibration
folder's ``weights.safetensors``: weights rounded column by column with the rounding error pushed onto
the columns not yet rounded through the inverse Hessian of the calibration inputs - the scales stay the
same; ``calibration.weight_rounding: gptq``). Special variants:
``bf16`` (the model in bf16), ``modelopt`` / ``modelopt_wch`` (NVIDIA ModelOpt's FP8, max
calibration on the stats' own calibration trajectories, restricted to the same linears), ``noise<r>``
(no quantization: the fp32 model with Gaussian noise of relative RMS ``r`` added to every call's
output, seeded: how far a clip moves under a per-call error of that size - FP8's per-call cosine of
~0.998 is a relative error of ~0.06).

The calibration folders are ``trt-sora calibrate`` outputs at the model's sampling settings (one per
format: the MSE observer targets its format), with ``calibration.weight_rounding: gptq`` for the
``gptq`` variants:

    python benchmarks/quality_levers.py --encode --out build/lev/prompts.safetensors              # CPU
    python benchmarks/quality_levers.py --calibrate build/lev --prompts build/lev/prompts.safetensors --device cuda
    python benchmarks/quality_levers.py --calib fp8_e4m3=build/lev/calib_fp8 --calib int8=build/lev/calib_int8 \\
        --prompts build/levers_prompts.safetensors --variants fp8_mse_wch,fp8_mse_wch_gptq,modelopt \\
        --device cuda --out benchmarks/results/levers.json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED0 = 1_000_000_000


def clip_captions(n: int) -> list[str]:
    from trt_sora.models.moving_shapes import data

    held = [s.caption() for s in data.all_caption_specs("heldout")]
    return (held[::11] + held[5::11])[:n]


def encode(out: str, n: int) -> None:
    from safetensors.torch import save_file

    from trt_sora.models import get_adapter
    from trt_sora.models import moving_shapes as ms

    caps = clip_captions(n)
    emb = get_adapter("wan-shapes").text_encoder()(caps, ms.TEXT_LEN).float().contiguous()
    calib = calibration_prompts()
    cal = get_adapter("wan-shapes").text_encoder()(calib, ms.TEXT_LEN).float().contiguous()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file({"cond": emb, "calib_cond": cal}, out, metadata={"prompts": json.dumps(caps),
                                                             "calib_prompts": json.dumps(calib)})
    from trt_sora.models.text import save_embeddings  # the same, for `--calibrate --text-embeddings` (no MiniLM)

    save_embeddings(caps + calib, torch.cat([emb, cal]), text_file(out))


def text_file(out: str) -> str:
    return str(Path(out).with_suffix(".text.safetensors"))


def calibration_prompts() -> list[str]:
    from trt_sora.calibrate.data import load_preset, prompts_for_preset

    return [p.prompt for p in prompts_for_preset(load_preset("moving-shapes"))]


def sample_clip(adapter, call, cond, index: int, device, hook=None):
    """Clip ``index`` of the set (``cond`` its [1, L, D] caption embedding): the model's sampling settings,
    CFG batched with the zero unconditional embedding, noise seed ``SEED0 + index``; fp32 latents
    [1, 3, 9, 32, 32] (wan-shapes' pixels) on ``device``."""
    from trt_sora.sampling import gaussian_noise, sample

    st = adapter.sampling
    return sample(call, gaussian_noise((1, 3, 9, 32, 32), SEED0 + index, device), cond, torch.zeros_like(cond),
                  scheduler=adapter.scheduler(st.shift), settings=st, cfg="batched", hook=hook).latents.float()


def psnr(a, b) -> float:
    mse = float((a.double().clamp(-1, 1) - b.double().clamp(-1, 1)).square().mean())
    return 10 * math.log10(4.0 / max(mse, 1e-30))


def linear_flops(adapter, model, device) -> dict[str, int]:
    """FLOPs of every nn.Linear in one CFG-batched call at the clip shape."""
    fl: dict[str, int] = {}
    hs = [m.register_forward_hook(lambda m, a, o, n=n: fl.__setitem__(n, 2 * a[0].numel() * m.out_features))
          for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    x = {"hidden_states": torch.randn(2, 3, 9, 32, 32, device=device),
         "timestep": torch.full((2,), 500.0, device=device),
         "encoder_hidden_states": torch.randn(2, 16, 384, device=device)}
    with torch.no_grad():
        adapter.forward(model, x)
    for h in hs:
        h.remove()
    return fl


def parse(variant: str, num_steps: int) -> dict:
    parts = variant.split("_")
    cfg = {"fmt": {"fp8": "fp8_e4m3", "int8": "int8"}[parts[0]], "method": parts[1], "weights": parts[2][1:],
           "fp32_steps": set(), "exclude": [], "smooth": None, "gptq": False}
    for p in parts[3:]:
        if p.startswith("last"):
            cfg["fp32_steps"] |= set(range(num_steps - int(p[4:]), num_steps))
        elif p.startswith("first"):
            cfg["fp32_steps"] |= set(range(int(p[5:])))
        elif p.startswith("excl="):
            cfg["exclude"] = p[5:].split("+")
        elif p == "gptq":
            cfg["gptq"] = True
        elif p.startswith("sq"):
            cfg["smooth"] = float(p[2:])
        else:
            raise SystemExit(f"unknown option {p!r} in {variant!r}")
    return cfg


def smooth_factors(model, sites, chmax, alpha) -> dict:
    """SmoothQuant's per-input-channel ``s = max|x|^a / max|W|^(1-a)`` of each site (original weights)."""
    mods = dict(model.named_modules())
    out = {}
    for s in sites:
        w_in = mods[s].weight.detach().abs().amax(0).clamp_min(1e-8)
        out[s] = (chmax[s].to(w_in.device).clamp_min(1e-8) ** alpha / w_in ** (1 - alpha)).clamp_min(1e-4)
    return out


@contextlib.contextmanager
def smoothed(model, factors):
    """``W * s`` folded into each site's weight, its input divided by ``s`` in a pre-hook."""
    mods = dict(model.named_modules())
    saved, hooks = {}, []
    for s, sc in factors.items():
        m = mods[s]
        saved[s] = m.weight.data
        m.weight.data = m.weight.data * sc
        hooks.append(m.register_forward_pre_hook(lambda mod, a, sc=sc: (a[0] / sc.to(a[0].dtype),)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for s in factors:
            mods[s].weight.data = saved[s]


def channel_max(adapter, model, sites, calib_cond, settings, device) -> dict:
    """Per-input-channel max |x| of each site over the calibration trajectories (for SmoothQuant)."""
    from trt_sora.calibrate.data import load_preset
    from trt_sora.sampling import adapter_call, gaussian_noise, sample

    mods = dict(model.named_modules())
    chmax = {s: torch.zeros(mods[s].in_features, device=device) for s in sites}

    def hook(name):
        def f(m, a):
            chmax[name] = torch.maximum(chmax[name], a[0].detach().abs().reshape(-1, a[0].shape[-1]).amax(0).float())
        return f

    hs = [mods[s].register_forward_pre_hook(hook(s)) for s in sites]
    preset = load_preset("moving-shapes")
    for k in range(calib_cond.shape[0]):
        c = calib_cond[k:k + 1]
        sample(adapter_call(adapter, model), gaussian_noise((1, 3, 9, 32, 32), preset.seed * 1_000_003 + k, device), c,
               torch.zeros_like(c), scheduler=adapter.scheduler(settings.shift), settings=settings, cfg="split")
    for h in hs:
        h.remove()
    return chmax


def modelopt_model(adapter, base, sites, calib_cond, cal_settings, weight_axis, device):
    """ModelOpt FP8 (FP8_DEFAULT_CFG: max calibration, E4M3 inputs and weights) over the calibration
    trajectories; quantizers outside ``sites`` disabled afterwards (ModelOpt collects with quantization off)."""
    import modelopt.torch.quantization as mtq

    from trt_sora.calibrate.data import load_preset
    from trt_sora.sampling import adapter_call, gaussian_noise, sample

    preset = load_preset("moving-shapes")
    m = copy.deepcopy(base)
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    for e in cfg["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer":
            e["cfg"]["axis"] = weight_axis

    def loop(mm):
        for k in range(calib_cond.shape[0]):
            c = calib_cond[k:k + 1]
            sample(adapter_call(adapter, mm), gaussian_noise((1, 3, 9, 32, 32), preset.seed * 1_000_003 + k, device),
                   c, torch.zeros_like(c), scheduler=adapter.scheduler(cal_settings.shift), settings=cal_settings,
                   cfg="split")

    m = mtq.quantize(m, cfg, forward_loop=loop)
    for name, mod in m.named_modules():
        if hasattr(mod, "input_quantizer") and name not in sites:
            mod.input_quantizer.disable()
            mod.weight_quantizer.disable()
    return m


def calibrate_both(folder: str, device: str, text: str | None = None) -> None:
    """``<folder>/calib_fp8_e4m3`` and ``<folder>/calib_int8``: the default recipe's calibration (its
    preset for wan-shapes, the model's sampling settings) with ``weight_rounding: gptq``, per format."""
    import dataclasses

    from trt_sora.calibrate.run import calibrate
    from trt_sora.config import load_recipe
    from trt_sora.config.recipe import QuantFormat
    from trt_sora.models import get_adapter

    r = load_recipe("rtx4090-fp8")
    adapter = get_adapter("wan-shapes")
    model = adapter.load("fp32", device)
    for fmt in ("fp8_e4m3", "int8"):
        q = dataclasses.replace(r.quantization, format=QuantFormat(fmt))
        t0 = time.perf_counter()
        res = calibrate(adapter, dataclasses.replace(r.calibration, weight_rounding="gptq"),
                        Path(folder) / f"calib_{fmt}", model=model, preset="moving-shapes", quant_format=q.format,
                        quant_config=q, report=False, text_encoder=text, device=device)
        print(fmt, f"{time.perf_counter() - t0:.0f} s", res.manifest["results"]["weight_rounding"], flush=True)


def load_calib(specs: list[str]) -> dict:
    """``{format: (CalibStats, {site: W'} | None)}`` from ``FMT=DIR`` calibration folders."""
    from trt_sora.calibrate.gptq import WEIGHTS_FILE, load_rounded_weights
    from trt_sora.calibrate.stats import CalibStats

    out = {}
    for spec in specs:
        fmt, _, folder = spec.partition("=")
        w = Path(folder) / WEIGHTS_FILE
        meta = json.loads((Path(folder) / "manifest.json").read_text())
        rounded_fmt = meta["results"].get("weight_rounding", {}).get("format")
        out[fmt] = (CalibStats.load(Path(folder) / "stats.safetensors"),
                    load_rounded_weights(w) if w.is_file() and rounded_fmt == fmt else None, folder)
    return out


def build_variant(variant, adapter, base, sites, calib, calib_cond, st, dev, stack, cache):
    """``(call, quantized sites, steps on fp32)`` of one variant (contexts entered on ``stack``)."""
    from trt_sora.calibrate.evaluate import site_kind
    from trt_sora.calibrate.fakequant_model import fake_quantized
    from trt_sora.sampling import SamplingSettings, adapter_call

    if variant.startswith("noise"):
        rel, call0, g = float(variant[5:]), adapter_call(adapter, base), torch.Generator().manual_seed(0)

        def noisy(f):
            y = call0(f)
            n = torch.randn(y.shape, generator=g).to(y.device)
            return y + rel * y.norm() / n.norm() * n

        return noisy, [], set()
    if variant == "bf16":
        m16 = adapter.load("bf16", dev)
        return (lambda f: adapter.forward(m16, {k: v.to(torch.bfloat16) if k != "timestep" else v
                                                for k, v in f.items()}).float()), [], set()
    stats = calib["fp8_e4m3"][0]
    cal_settings = SamplingSettings(num_steps=stats.metadata.num_steps, guidance_scale=stats.metadata.guidance_scale,
                                    shift=stats.metadata.shift)
    if variant.startswith("modelopt"):
        mq = modelopt_model(adapter, base, sites, calib_cond, cal_settings, 0 if variant.endswith("wch") else None, dev)
        return adapter_call(adapter, mq), sites, set()
    cfg = parse(variant, st.num_steps)
    stats, rounded, folder = calib[cfg["fmt"]]
    qsites = [s for s in sites if site_kind(s, adapter.layer_kinds)[2] not in cfg["exclude"]]
    mq = copy.deepcopy(base)
    act = {s: stats.amax[s] if cfg["method"] == stats.metadata.method else stats.method_amax[s][cfg["method"]]
           for s in qsites}
    if cfg["smooth"] is not None:  # min-max of the smoothed inputs: max_j max|x_j| / s_j
        if "chmax" not in cache:
            cache["chmax"] = channel_max(adapter, base, sites, calib_cond, cal_settings, dev)
        fac = smooth_factors(mq, qsites, cache["chmax"], cfg["smooth"])
        stack.enter_context(smoothed(mq, fac))
        act = {s: (cache["chmax"][s] / fac[s]).max() for s in qsites}
    mods = dict(mq.named_modules())
    w = {s: mods[s].weight.detach().abs().amax(1) for s in qsites}  # after any smoothing fold
    if cfg["weights"] == "tensor":
        w = {s: v.max().expand_as(v) for s, v in w.items()}
    weights = None
    if cfg["gptq"]:  # the calibration's rounded weights (on the stats' per-channel grid)
        if rounded is None or cfg["smooth"] is not None or cfg["weights"] != "ch":
            raise SystemExit(f"{variant}: gptq needs per-channel weights, no sq, and {folder} calibrated with "
                             f"calibration.weight_rounding: gptq in {cfg['fmt']}")
        w = {s: stats.amax[f"{s}.weight"] for s in qsites}
        weights = rounded
    stack.enter_context(fake_quantized(mq, act, cfg["fmt"], sites=qsites, weight_amax=w, weights=weights))
    return adapter_call(adapter, mq), qsites, cfg["fp32_steps"]


def table(path: str) -> str:
    """The results JSON as the markdown table of benchmarks/README.md."""
    res = json.loads(Path(path).read_text())
    lines = ["| variant | mean PSNR (dB) | worst clip (dB) | probe passes (fp32) | quantized linear FLOPs |",
             "|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| `{name}` | {r['mean_psnr_db']:.2f} | {r['worst_psnr_db']:.2f} | "
                     f"{r['probe_pass']}/{r['clips']} ({r['probe_pass_fp32']}) | "
                     f"{100 * r['quantized_linear_flop_fraction']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encode", action="store_true", help="CPU: write the clips' and calibration captions' embeddings")
    ap.add_argument("--calib", action="append", default=[], help="FMT=DIR: a calibration folder (fp8_e4m3, int8)")
    ap.add_argument("--prompts", default=None, help="embeddings from --encode (else encoded here)")
    ap.add_argument("--variants", default="fp8_mse_wch")
    ap.add_argument("--clips", type=int, default=17)
    ap.add_argument("--select", default=None, help="comma-separated clip indices (a subset; seeds stay 1e9 + index)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ref", default=None, help="cache of the fp32 reference clips (default: <out>.fp32.pt)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--calibrate", default=None, metavar="DIR", help="write DIR/calib_fp8_e4m3 and DIR/calib_int8")
    ap.add_argument("--table", default=None, metavar="JSON", help="print a results file as a markdown table")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return
    if a.calibrate:
        calibrate_both(a.calibrate, a.device, text_file(a.prompts) if a.prompts else None)
        return
    if a.out is None:
        raise SystemExit("--out is required (the results JSON, or the embeddings file with --encode)")
    if a.encode:
        encode(a.out, a.clips)
        return
    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.config import load_recipe
    from trt_sora.models import get_adapter
    from trt_sora.models.moving_shapes import data
    from trt_sora.models.moving_shapes.probe import probe_batch
    from trt_sora.sampling import adapter_call

    dev = a.device
    adapter = get_adapter("wan-shapes")
    st = adapter.sampling
    if a.prompts:
        from safetensors import safe_open

        with safe_open(a.prompts, "pt") as f:
            caps = json.loads(f.metadata()["prompts"])[:a.clips]
            cond, calib_cond = f.get_tensor("cond")[:a.clips].to(dev), f.get_tensor("calib_cond").to(dev)
    else:
        from trt_sora.models import moving_shapes as ms

        caps = clip_captions(a.clips)
        enc = adapter.text_encoder()
        cond = enc(caps, ms.TEXT_LEN).float().to(dev)
        calib_cond = enc(calibration_prompts(), ms.TEXT_LEN).float().to(dev)
    index = list(range(len(caps)))
    if a.select:
        index = [int(i) for i in a.select.split(",")]
        caps, cond = [caps[i] for i in index], cond[index]
    base = adapter.load("fp32", dev)
    fl = linear_flops(adapter, base, dev)
    specs = [data.parse_caption(c) for c in caps]
    out_path = Path(a.out)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {}

    def clips(call, fp32_steps=frozenset()):
        state, out = {}, []
        ref_call = adapter_call(adapter, base)
        for i in range(len(caps)):
            r = sample_clip(adapter, lambda f: (ref_call if state["step"] in fp32_steps else call)(f),
                            cond[i:i + 1], index[i], dev, hook=lambda ci: state.__setitem__("step", ci.step))
            out.append(r.cpu())
        return torch.cat(out)

    t0 = time.perf_counter()
    ref_file = Path(a.ref) if a.ref else out_path.with_suffix(".fp32.pt")  # reused by later invocations
    saved = torch.load(ref_file) if ref_file.is_file() else None
    if saved is not None and set(index) <= set(saved.get("index", ())):  # a superset: its clips are ours
        ref = saved["clips"][[saved["index"].index(i) for i in index]]
    else:
        ref = clips(adapter_call(adapter, base))
        ref_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"index": index, "clips": ref}, ref_file)
    probe_ref = [p.passes(s) for p, s in zip(probe_batch(ref.clamp(-1, 1)), specs)]
    print(f"fp32 reference: {len(caps)} clips in {time.perf_counter() - t0:.0f} s", flush=True)
    if not a.calib:
        return
    calib = load_calib(a.calib)
    stats = calib["fp8_e4m3"][0]
    policy = load_recipe("rtx4090-fp8").quantization
    sites = [s for s in quantized_sites(base, policy, adapter.quant_excludes) if s in stats.amax]
    cache: dict = {}
    for variant in a.variants.split(","):
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            call, qsites, fp32_steps = build_variant(variant, adapter, base, sites, calib, calib_cond, st, dev,
                                                     stack, cache)
            got = clips(call, fp32_steps)
        ps = [psnr(r, g) for r, g in zip(ref, got)]
        probe = [p.passes(s) for p, s in zip(probe_batch(got.clamp(-1, 1)), specs)]
        frac = sum(fl[s] for s in qsites) / sum(fl.values()) * (1 - len(fp32_steps) / st.num_steps)
        results[variant] = {"clips": len(caps), "clip_index": index, "mean_psnr_db": sum(ps) / len(ps),
                            "worst_psnr_db": min(ps),
                            "worst_clip": caps[ps.index(min(ps))], "per_clip_psnr_db": ps,
                            "probe_pass": sum(probe), "probe_pass_fp32": sum(probe_ref),
                            "quantized_linear_flop_fraction": frac, "calib": {k: v[2] for k, v in calib.items()},
                            "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{variant:32s} mean {results[variant]['mean_psnr_db']:.2f} dB  worst {min(ps):.2f} dB  probe "
              f"{sum(probe)}/{len(caps)} (fp32 {sum(probe_ref)})  FLOPs quantized {frac:.3f}", flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
