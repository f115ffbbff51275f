"""One-call H200 measurement for the Wan architectures (run through the device tool).

    python benchmarks/gpu_bench.py [--models wan2.1-t2v-1.3b,wan2.1-t2v-14b] [--skip-e2e]

1. GEMM study: every distinct linear of a Wan block at 480p x 81 frames (21x60x104 latent,
   32,760 tokens, text 512), BF16 vs FP8 E4M3 ``torch._scaled_mm`` with *static* per-tensor
   activation scales and per-channel weight scales; activation quantization timed separately
   (eager and torch.compile-fused), so the report shows what a TensorRT FP8 engine can gain.
2. End to end: the transformer call in eager BF16 (batch 1 and batch 2 = batched CFG), then the
   same model with every non-excluded linear swapped for a static-scale FP8 linear.
Prints JSON and writes it to $OUT/gpu_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

POINT_480P = {"batch": 1, "latent_frames": 21, "latent_height": 60, "latent_width": 104, "text_len": 512}


def bench(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters  # ms


def quant_eager(x, inv_scale):
    return (x * inv_scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


quant_compiled = torch.compile(quant_eager, dynamic=True)


def gemm_study(cfg: dict, tokens: int, text_len: int) -> dict:
    d, ffn = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"]
    shapes = {  # name: (M, K, N, count per block)
        "attn1.qkv_fused": (tokens, d, 3 * d, 1),
        "attn1.to_out": (tokens, d, d, 1),
        "attn2.to_q": (tokens, d, d, 1),
        "attn2.kv_fused": (text_len, d, 2 * d, 1),
        "attn2.to_out": (tokens, d, d, 1),
        "ffn.up": (tokens, d, ffn, 1),
        "ffn.down": (tokens, ffn, d, 1),
    }
    out, tot = {}, {"bf16_ms": 0.0, "fp8_gemm_ms": 0.0, "fp8_eager_quant_ms": 0.0, "fp8_fused_quant_ms": 0.0}
    for name, (m, k, n, cnt) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        t_bf16 = bench(lambda: x @ w.t())
        inv = torch.tensor(448.0 / x.abs().amax().float().item(), device="cuda")
        sa = (1.0 / inv).float().reshape(1, 1)
        wamax = w.abs().amax(dim=1, keepdim=True).float()
        wq = (w.float() * (448.0 / wamax)).to(torch.float8_e4m3fn)
        sb = (wamax / 448.0).reshape(1, n)
        xq = quant_eager(x, inv)
        sa_rows = sa.expand(m, 1).contiguous()
        t_fp8 = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa_rows, scale_b=sb, out_dtype=torch.bfloat16))
        sb_t = sb.max().reshape(1, 1)  # per-tensor weight scale variant (tensorwise kernel)
        wq_t = (w.float() / sb_t).clamp(-448, 448).to(torch.float8_e4m3fn)
        t_fp8_tensorwise = bench(lambda: torch._scaled_mm(xq, wq_t.t(), scale_a=sa, scale_b=sb_t,
                                                          out_dtype=torch.bfloat16))
        t_qe = bench(lambda: quant_eager(x, inv))
        t_qc = bench(lambda: quant_compiled(x, inv))
        ref = (x.float() @ w.float().t())
        got = torch._scaled_mm(xq, wq.t(), scale_a=sa_rows, scale_b=sb, out_dtype=torch.bfloat16).float()
        cos = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
        flops = 2 * m * k * n
        out[name] = {"M": m, "K": k, "N": n, "bf16_ms": round(t_bf16, 4), "fp8_ms": round(t_fp8, 4),
                     "fp8_tensorwise_ms": round(t_fp8_tensorwise, 4),
                     "quant_eager_ms": round(t_qe, 4), "quant_compiled_ms": round(t_qc, 4),
                     "bf16_tflops": round(flops / t_bf16 / 1e9, 1), "fp8_tflops": round(flops / t_fp8 / 1e9, 1),
                     "fp8_cosine_vs_fp32": round(cos, 6)}
        tot["bf16_ms"] += t_bf16 * cnt
        tot["fp8_gemm_ms"] += t_fp8 * cnt
        tot["fp8_eager_quant_ms"] += (t_fp8 + t_qe) * cnt
        tot["fp8_fused_quant_ms"] += (t_fp8 + t_qc) * cnt
        del x, w, xq, wq, wq_t
    tot = {k: round(v, 3) for k, v in tot.items()}
    tot["speedup_gemm_only"] = round(tot["bf16_ms"] / tot["fp8_gemm_ms"], 3)
    tot["speedup_with_eager_quant"] = round(tot["bf16_ms"] / tot["fp8_eager_quant_ms"], 3)
    tot["speedup_with_fused_quant"] = round(tot["bf16_ms"] / tot["fp8_fused_quant_ms"], 3)
    return {"per_linear": out, "per_block": tot}


class Fp8StaticLinear(torch.nn.Module):
    """Static per-tensor activation scale (from one calibration forward), per-channel FP8 weights."""

    def __init__(self, lin: torch.nn.Linear, amax: float):
        super().__init__()
        w = lin.weight.detach()
        wamax = w.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
        self.register_buffer("wq_t", (w.float() * (448.0 / wamax)).to(torch.float8_e4m3fn).t())
        self.register_buffer("sb", (wamax / 448.0).reshape(1, -1))
        self.register_buffer("inv", torch.tensor(448.0 / max(amax, 1e-12), device=w.device))
        self.register_buffer("sa", torch.tensor([[max(amax, 1e-12) / 448.0]], device=w.device))
        self.bias = lin.bias
        self.out_features = lin.out_features

    def forward(self, x):
        shp = x.shape
        xq = quant_compiled(x.reshape(-1, shp[-1]).to(torch.bfloat16), self.inv)
        y = torch._scaled_mm(xq, self.wq_t, scale_a=self.sa.expand(xq.shape[0], 1).contiguous(), scale_b=self.sb,
                             out_dtype=torch.bfloat16)
        if self.bias is not None:
            y = y + self.bias.to(torch.bfloat16)
        return y.reshape(*shp[:-1], self.out_features)


def timed_calls(fn, iters: int):
    """``(output of a warm-up call, best wall time in s of ``iters`` synchronized calls)``."""
    with torch.no_grad():
        out = fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
    return out, round(min(ts), 3)


def e2e_model(name: str, iters: int) -> dict:
    from trt_sora.models import get_adapter

    a = get_adapter(name)
    t0 = time.perf_counter()
    model = a.load("bf16", "cuda")
    torch.cuda.synchronize()
    res = {"load_s": round(time.perf_counter() - t0, 2), "params": sum(p.numel() for p in model.parameters())}
    out = {}
    for b in (1, 2):
        x = a.example_inputs({**POINT_480P, "batch": b}, dtype="bf16", device="cuda")
        ref, best = timed_calls(lambda: a.forward(model, x), iters)
        out[f"bf16_eager_batch{b}_s"] = best
        if b == 1:
            ref1, x1 = ref.float(), x
    # FP8 static-scale linears on the block linears (embedders / proj_out stay BF16, as in the recipes)
    amax: dict[str, float] = {}
    hooks = []
    for mname, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and mname.startswith("blocks."):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, n=mname: amax.__setitem__(n, max(amax.get(n, 0.0), args[0].abs().amax().item()))))
    with torch.no_grad():
        a.forward(model, x1)
    for h in hooks:
        h.remove()
    for mname, amx in amax.items():
        parent, _, child = mname.rpartition(".")
        owner = model.get_submodule(parent)
        lin = owner.get_submodule(child)
        setattr(owner, child, Fp8StaticLinear(lin, amx))
    torch.cuda.empty_cache()
    got, out["fp8_static_batch1_s"] = timed_calls(lambda: a.forward(model, x1), iters)  # warm-up compiles
    got = got.float()
    out["fp8_linears"] = len(amax)
    out["fp8_vs_bf16_cosine"] = round(torch.nn.functional.cosine_similarity(ref1.flatten(), got.flatten(), 0).item(), 5)
    out["speedup_fp8_static"] = round(out["bf16_eager_batch1_s"] / out["fp8_static_batch1_s"], 3)
    res.update(out)
    del model
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="wan2.1-t2v-1.3b,wan2.1-t2v-14b")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    from trt_sora.models.wan import CONFIGS

    tokens = POINT_480P["latent_frames"] * (POINT_480P["latent_height"] // 2) * (POINT_480P["latent_width"] // 2)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "point": POINT_480P,
              "tokens": tokens, "gemm": {}, "e2e": {}}
    for name in args.models.split(","):
        report["gemm"][name] = gemm_study(CONFIGS[name], tokens, POINT_480P["text_len"])
        print(json.dumps({name: report["gemm"][name]["per_block"]}), flush=True)
    if not args.skip_e2e:
        for name in args.models.split(","):
            report["e2e"][name] = e2e_model(name, args.iters)
            print(json.dumps({name: report["e2e"][name]}), flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_bench.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
