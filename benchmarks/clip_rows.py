"""Where a quantized clip's error sits (issue 13's worst clip): per-frame PSNR, the per-call relative
error along the fp32 trajectory (teacher-forced), and the share of the squared error in the worst rows.

    python benchmarks/clip_rows.py --calib build/lev/calib_fp8_e4m3 --prompts build/lev/prompts.safetensors \\
        --clips 16,3 --variant fp8_mse_wch_gptq

Same clip set, seeds and sampling as ``quality_levers.py`` (whose variants it builds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import quality_levers as ql
    from safetensors import safe_open

    from trt_sora.calibrate.fakequant_model import quantized_sites
    from trt_sora.config import load_recipe
    from trt_sora.models import get_adapter
    from trt_sora.sampling import adapter_call

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--clips", default="16,3")
    ap.add_argument("--variant", default="fp8_mse_wch_gptq")
    ap.add_argument("--rows", type=int, default=4)
    a = ap.parse_args()
    ad = get_adapter("wan-shapes")
    st = ad.sampling
    with safe_open(a.prompts, "pt") as f:
        caps, cond, calib_cond = json.loads(f.metadata()["prompts"]), f.get_tensor("cond"), f.get_tensor("calib_cond")
    base = ad.load("fp32", "cpu")
    fmt = "int8" if a.variant.startswith("int8") else "fp8_e4m3"
    calib = ql.load_calib([f"{fmt}={a.calib}"] + ([] if fmt == "fp8_e4m3" else [f"fp8_e4m3={a.calib}"]))
    policy = load_recipe("rtx4090-fp8").quantization
    sites = [s for s in quantized_sites(base, policy, ad.quant_excludes) if s in calib[fmt][0].amax]

    def run(call, i):
        return ql.sample_clip(ad, call, cond[i:i + 1], i, "cpu").clamp(-1, 1)

    out = {}
    with contextlib.ExitStack() as stack, torch.no_grad():
        q, _, _ = ql.build_variant(a.variant, ad, base, sites, calib, calib_cond, st, "cpu", stack, {})
        ref_call = adapter_call(ad, base)
        for i in (int(x) for x in a.clips.split(",")):
            r, g = run(ref_call, i), run(q, i)
            errs = []

            def forced(f):  # the quantized call's relative error on the fp32 trajectory's inputs
                y0 = ref_call(f)
                errs.append(float((q(f) - y0).norm() / y0.norm()))
                return y0

            run(forced, i)
            e = (r - g).square()
            rows = e.mean(dim=(0, 1, 2, 4))
            worst = rows.sort(descending=True).indices[:a.rows]
            keep = torch.ones(rows.numel(), dtype=torch.bool)
            keep[worst] = False
            out[i] = {"caption": caps[i], "psnr_db": ql.psnr(r, g),
                      "per_frame_psnr_db": [ql.psnr(r[:, :, t], g[:, :, t]) for t in range(r.shape[2])],
                      "per_call_relative_error": errs, "worst_rows": worst.tolist(),
                      "worst_rows_share_of_squared_error": float(rows[worst].sum() / rows.sum()),
                      "psnr_without_worst_rows_db": 10 * math.log10(4 / float(e[..., keep, :].mean())),
                      "worst_rows_frame0_mean_fp32_vs_quantized": [
                          [float(r[0, :, 0, k].mean()), float(g[0, :, 0, k].mean())]
                                                                   for k in worst]}
            print(json.dumps({i: out[i]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
