"""Seconds per clip on one GPU, stage by stage: text encode, denoising steps, VAE decode, MP4 encode.

Wan 2.1 14B T2V with random weights (timing only) at 480p x 81, CFG on. Every stage of a clip runs
here for real on the GPU, once or a few times, with the sizes a 50-step clip has:

* text encode: a UMT5-XXL-sized encoder (random, bf16, 512 tokens), the prompt and the negative prompt;
* a denoising step, two ways: **eager BF16 as WanPipeline runs it** (the diffusers transformer, one
  call per CFG branch at batch 1) and **ours** (the sampler with the torch-fp8 runner: fused FP8
  quantization, 8-bit attention, both CFG branches in one batch-2 call replayed as a CUDA graph);
  ``--steps`` steps of the real loop are timed after two warm-up steps;
* VAE decode: Wan 2.1's ``AutoencoderKLWan`` at its real size, fp32 (as WanPipeline's examples load
  it) and bf16 (ours);
* MP4 encode of the 81 frames (``trt_sora.runtime.video.write_clip``).

Seconds per clip at ``--clip-steps`` (default 50) are composed from them: encode + steps x step +
decode + MP4; with ``--cache-saved F`` also a row whose transformer calls are cut by the fraction F
that the step cache saved on the checked model (the cache's own bookkeeping is not timed). The
composition is stated in the JSON; nothing is extrapolated that was not measured per unit.

``--measure clips`` composes nothing: it runs whole ``--clip-steps`` clips of ours end to end (text encode, every
step of the sampler, then the runtime's tail: the family's frame decoder in bf16, each group of frames streamed into
the MP4 writer as it is decoded, as ``trt-sora generate -o clip.mp4`` does; the JSON's ``tail`` says so), the cached
clip first, its step schedule from ``--cache-schedule`` (a
run folder or a JSON with a check's caching record, or a ``CacheSchedule`` JSON) or ``--cache-reuse`` (steps),
replayed through the sampler's ``cache=`` as ``runtime.generate`` replays a checked one. ``--clips eager,...``
also runs the baseline whole, first (before our runner rewrites the model): WanPipeline's eager BF16 steps with
split CFG, the fp32 VAE decoding the whole clip, then the MP4; the JSON's ``speedup_vs_eager`` divides by it.

    python benchmarks/e2e_bench.py --out benchmarks/results/h200_e2e_2026-12-05.json        # GPU
    python benchmarks/e2e_bench.py --model wan-tiny --size tiny --steps 2 --out /tmp/e2e.json  # CPU smoke
    python benchmarks/e2e_bench.py --measure clips --cache-schedule RESULTS.json --out clips.json      # GPU
    python benchmarks/e2e_bench.py --measure clips --model wan-tiny --size tiny --clip-steps 4 --cache-reuse 2 \
        --out /tmp/clips.json                                                                        # CPU smoke
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SIZES = {"480p": (81, 480, 832), "720p": (81, 720, 1280), "tiny": (9, 32, 48)}
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_encoder_decoder=False)


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, dev: str, reps: int = 1):
    """``(result, seconds per rep)`` after one untimed warm-up call."""
    out = fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(dev)
    return out, (time.perf_counter() - t0) / reps


def text_encoder(model_name: str, text_dim: int, dev: str):
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = dict(UMT5_XXL) if model_name.startswith("wan2") else dict(UMT5_XXL, vocab_size=1000, d_model=text_dim,
                                                                     d_ff=64, num_layers=2, num_heads=2, d_kv=8)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            enc = UMT5EncoderModel(UMT5Config(**cfg)).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return enc, cfg["vocab_size"]


def vae_for(model_name: str, dev: str, dtype):
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = AutoencoderKLWan() if model_name.startswith("wan2") else \
            AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return vae.to(dev, dtype).eval().requires_grad_(False)


def frame_decoder(adapter, vae, dev: str, dtype):
    """The family's ``decode_groups`` (``adapter.frame_decoder``: un-normalise, one latent frame at a time,
    as ``runtime.generate`` decodes) over ``vae``, this bench's full-size VAE, in place of the small random
    one a named config without weights would decode with (``adapter.use_vae``); the decoder's description
    proves it was used."""
    desc = f"{type(vae).__name__} (the bench's, {sum(p.numel() for p in vae.parameters())} parameters)"
    adapter.use_vae(vae, dev, dtype, desc)
    decode_groups, used = adapter.frame_decoder(dev, dtype)
    if used != desc:
        raise RuntimeError(f"{adapter.name}'s frame decoder did not take the bench's VAE ({used}); "
                           "make its frame_decoder decode with adapter.vae_on(device, dtype)")
    return decode_groups


def export_call(adapter, mdl):
    """``(call, f)``: the sampler's ``call(inputs)`` over ``mdl`` (the adapter's export signature ``f``), no
    autograd."""
    f = adapter.export_module(mdl)

    def call(inputs):
        with torch.inference_mode():
            return f(*[inputs[n] for n in adapter.input_names])
    return call, f


def fp8_bench_module():
    """benchmarks/fp8_bench.py, imported with this folder on the path (its runner helpers are shared)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fp8_bench

    return fp8_bench


def fp8_runner(adapter, model, fwd, noise, text, dev: str, kernel: str = "int8"):
    """Our torch-fp8 runner (fused FP8 quantization, 8-bit attention on ``kernel``, CUDA graphs on a GPU),
    activated; its input amax calibrated on one call of ``fwd`` at timestep 700 with ``noise`` [1, C, F, H, W]
    and ``text`` [1, L, D]. ``model`` is rewritten in place (the runner's from then on)."""
    from trt_sora.runners.fp8_runner import AttentionPolicy, TorchFp8Runner

    feeds = {"hidden_states": noise.bfloat16(), "timestep": torch.full((1,), 700.0, device=dev),
             "encoder_hidden_states": text.bfloat16()}
    plan = fp8_bench_module().calibrate_plan(model, lambda *a: fwd(*a), [feeds[n] for n in adapter.input_names],
                                              adapter.quant_excludes)
    return TorchFp8Runner(adapter, None, plan=plan, device=dev, model=model, mode="fused",
                          attention=AttentionPolicy(enabled=True, kernel=kernel), cuda_graphs=True).activate()


def measure(args) -> dict:
    from trt_sora.models import get_adapter
    from trt_sora.sampling import SamplingSettings, gaussian_noise, runner_call, sample

    dev = args.device
    adapter = get_adapter(args.model)
    frames, height, width = SIZES[args.size]
    lat = adapter.latent_size(frames, height, width)
    text_len = 512 if args.model.startswith("wan2") else 16
    res: dict = {"model": args.model, "size": args.size, "frames": frames, "height": height, "width": width,
                 "latent": lat, "text_len": text_len, "device": torch.cuda.get_device_name() if dev != "cpu" else "cpu",
                 "torch": torch.__version__, "measured": {}}
    m = res["measured"]

    def save() -> None:  # what finished so far, in case a later stage runs past the call's time limit
        Path(args.out).write_text(json.dumps({**res, "partial": True}, indent=2, default=str) + "\n")

    # text encode: prompt + negative prompt, 512 tokens each
    enc, vocab = text_encoder(args.model, adapter.text_dim, dev)
    ids = torch.randint(0, vocab, (2, text_len), device=dev, generator=torch.Generator(dev).manual_seed(0))
    with torch.inference_mode():
        emb, m["text_encode_s"] = timed(lambda: enc(input_ids=ids).last_hidden_state, dev, reps=3)
    emb = emb.float()
    save()
    del enc
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()

    # the transformer
    t0 = time.perf_counter()
    model = adapter.load("bf16", dev)
    m["model_build_s"] = time.perf_counter() - t0
    cond, uncond = {"encoder_hidden_states": emb[:1]}, {"encoder_hidden_states": emb[1:]}
    noise = gaussian_noise((1, adapter.latent_channels, lat["latent_frames"], lat["latent_height"],
                            lat["latent_width"]), 0).to(dev)
    steps = args.steps + 2  # two warm-up steps (CUDA graph capture, autotuning) then the timed ones

    def loop(call, cfg: str) -> float:
        """Seconds per step over ``args.steps`` steps of the real sampler, after two warm-up steps."""
        marks: list[float] = []

        def hook(info):
            if info.branches[0] == "cond":  # the step's first call (split) or its only one (batched)
                sync(dev)
                marks.append(time.perf_counter())
            return None

        settings = SamplingSettings(num_steps=steps, guidance_scale=5.0, shift=adapter.sampling.shift)
        sample(call, noise, cond, uncond, scheduler=adapter.scheduler(settings.shift), settings=settings, cfg=cfg,
               dtype=torch.bfloat16, hook=hook)
        sync(dev)
        marks.append(time.perf_counter())
        return (marks[-1] - marks[2]) / args.steps

    eager, fwd = export_call(adapter, model)

    def attempt(name: str, fn) -> None:  # one path's failure is recorded, and the next path still runs
        if name not in args.paths:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a benchmark row, not a library call
            m[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
        save()

    def run_eager() -> None:
        m["eager_bf16_split_step_s"] = loop(eager, "split")

    def run_ours() -> None:
        runner = fp8_runner(adapter, model, fwd, noise, emb[:1], dev, args.attention_kernel)
        try:
            m["ours_fp8_batched_graph_step_s"] = loop(runner_call(runner), "batched")
            m["ours_report"] = {k: v for k, v in runner.report().items() if isinstance(v, (int, float, str, bool))}
        finally:
            runner.deactivate()

    def compiled_loop(key: str, mdl) -> None:
        """WanPipeline's documented compile (regional: each transformer block), split CFG; then undone."""
        t0 = time.perf_counter()
        mdl.compile_repeated_blocks(fullgraph=True)
        try:
            m[key] = loop(export_call(adapter, mdl)[0], "split")
            m[key.replace("_step_s", "_wall_with_compile_s")] = time.perf_counter() - t0
        finally:
            for sub in mdl.modules():
                if getattr(sub, "_compiled_call_impl", None) is not None:
                    sub._compiled_call_impl = None
            torch._dynamo.reset()

    def run_torchao() -> None:  # in a copy: quantize_ swaps the weights in place
        import copy

        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        t0 = time.perf_counter()
        qmodel = copy.deepcopy(model)
        bf16_linear = lambda mod, fqn: isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.bfloat16  # noqa: E731
        quantize_(qmodel, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=bf16_linear)
        m["torchao_quantize_s"] = time.perf_counter() - t0
        try:
            compiled_loop("torchao_fp8_rowwise_compile_split_step_s", qmodel)
        finally:
            del qmodel
            torch.cuda.empty_cache()

    # ours last: its runner rewrites the model's blocks
    attempt("eager", run_eager)
    if dev.startswith("cuda"):
        attempt("compile", lambda: compiled_loop("compile_bf16_split_step_s", model))
        attempt("torchao", run_torchao)
        attempt("ours", run_ours)
    del model, fwd, eager
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()

    # VAE decode of one clip's latents, fp32 and bf16
    z = torch.randn(1, 16, lat["latent_frames"], lat["latent_height"], lat["latent_width"], device=dev)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)) if "vae" in args.paths else ():
        vae = vae_for(args.model, dev, dtype)
        with torch.inference_mode():
            x, m[f"vae_decode_{name}_s"] = timed(lambda v=vae, d=dtype: v.decode(z.to(d), return_dict=False)[0], dev)
        if dev.startswith("cuda"):
            m[f"vae_decode_{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        save()
        del vae
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    if "mp4" in args.paths:  # MP4 encode (CPU: ffmpeg) of the decoded frames (noise frames without a decode)
        from trt_sora.runtime.generate import to_uint8
        from trt_sora.runtime.video import DEFAULT_PRESET, write_clip

        pixels = to_uint8(x[0]) if "vae" in args.paths else \
            torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8).numpy()
        out = Path(args.tmp) / "e2e_clip.mp4"
        _, m["mp4_encode_s"] = timed(lambda: write_clip(pixels, out, 16.0), "cpu")
        m["mp4_bytes"] = out.stat().st_size
        m["mp4_preset"] = DEFAULT_PRESET  # medium in results before 2026-12-06's tail change
    return res


#: What ``--measure clips`` runs after the sampler (the JSON's ``tail``), and what older results' stages meant.
TAIL = {"ran": "the runtime's tail: the family's frame_decoder (bf16, one latent frame a group; Wan: 1 then 4 "
               "frames), each group to uint8 on the device and into runtime.video.Mp4Writer as it is decoded "
               "(ffmpeg libx264 crf 18 at the preset named here, encoding while the GPU decodes the next group)",
        "stages": "decode_and_encode_s: from the sampler's end to the last group handed to the writer (the decode, "
                  "with the encode beside it); encode_finish_s: the wait for ffmpeg after it",
        "before": "results up to 2026-12-06's h100_e2eclip_cache56 ran the tail serially: vae_decode_s (diffusers' "
                  "vae.decode of the whole clip, bf16) then mp4_s (frames to uint8 on the device, to the host, "
                  "runtime.video.write_clip at x264's preset medium)"}


def cache_schedule(source: str | None, reuse: str | None, order: int, steps: int):
    """``(CacheSchedule, record)``: the step schedule a cached clip replays, and what the JSON says of it.

    ``reuse``: an explicit comma list of steps both CFG branches reuse (extrapolated at ``order``). Else
    ``source``: a run folder (its verified ``parity/report.json`` caching record), a check report's JSON
    (``caching``), a results JSON holding one (``check_report.caching``) or a ``CacheSchedule`` JSON
    (``num_steps``, ``reused``). ConfigError when it covers another step count or its check failed."""
    from trt_sora.caching import CacheSchedule
    from trt_sora.errors import ConfigError
    from trt_sora.runfolder import RunFolder

    if reuse is not None:
        at = [int(x) for x in reuse.split(",") if x.strip()]
        sched = CacheSchedule.from_dict({"num_steps": steps, "reused": {"cond": at, "uncond": at}, "order": order},
                                        where=f"--cache-reuse {reuse}")
        return sched, {"source": "explicit list of reused steps (--cache-reuse; not read from a check)",
                       "checked": None, "schedule": sched.to_dict()}
    if source is None:
        raise ConfigError("a cached clip needs a schedule: pass --cache-schedule (a run folder or a JSON written by "
                          "`trt-sora check`) or --cache-reuse (steps), or --clips uncached")
    path = Path(source)
    doc = RunFolder(path).read_report() if path.is_dir() else json.loads(path.read_text())
    record = (doc or {}).get("check_report", doc) or {}
    model = record.get("model")
    record = record.get("caching", record)
    if "reused" not in record and "schedule" not in record:
        raise ConfigError(f"{source} holds no step schedule (no caching record of a check, no CacheSchedule); run "
                          "`trt-sora check` with a caching: section, or pass --cache-reuse")
    if record.get("passed") is False:
        raise ConfigError(f"{source}: its check failed this step schedule; pick a setting the check passed")
    sched = CacheSchedule.from_dict(record.get("schedule", record), where=str(source))
    if sched.num_steps != steps:
        raise ConfigError(f"{source} schedules {sched.num_steps} steps but the clip runs --clip-steps {steps}; "
                          f"pass --clip-steps {sched.num_steps} or a schedule of {steps} steps")
    checked = None if "schedule" not in record else {
        "model": model, "setting": record.get("setting"), "sampling": record.get("sampling"),
        "passed": record.get("passed"), "calls": record.get("calls"), "calls_uncached": record.get("calls_uncached")}
    kind = "a check's caching record" if checked else "a CacheSchedule JSON"
    return sched, {"source": f"{kind}: {source}", "checked": checked, "schedule": sched.to_dict()}


def measure_clips(args) -> dict:
    """Whole clips, every stage and every step measured (nothing composed): per clip, the text encode (prompt
    + negative), ``args.clip_steps`` steps of the sampler with our torch-fp8 runner (batched CFG, CUDA graph)
    and, for the cached clip, the step schedule replayed through the sampler's ``cache=`` (as
    ``runtime.generate`` serves a checked one), then the runtime's tail (:data:`TAIL`). One warm-up first
    (a 2-step trajectory: graph capture, autotuning; an encode; a decode), timed apart. The JSON is written
    after each clip."""
    from trt_sora.caching import CacheSchedule
    from trt_sora.models import get_adapter
    from trt_sora.runtime.generate import to_uint8
    from trt_sora.runtime.video import DEFAULT_PRESET, Mp4Writer
    from trt_sora.sampling import SamplingSettings, gaussian_noise, runner_call

    dev, cuda = args.device, args.device.startswith("cuda")
    adapter = get_adapter(args.model)
    schedule, source = cache_schedule(args.cache_schedule, args.cache_reuse, args.cache_order, args.clip_steps) \
        if "cached" in args.clips else (None, None)
    frames, height, width = SIZES[args.size]
    lat = adapter.latent_size(frames, height, width)
    text_len = 512 if args.model.startswith("wan2") else 16
    settings = SamplingSettings(num_steps=args.clip_steps, guidance_scale=5.0, shift=adapter.sampling.shift)
    res: dict = {"mode": "measured clips: every stage and step run, nothing composed", "model": args.model,
                 "size": args.size, "frames": frames, "height": height, "width": width, "latent": lat,
                 "text_len": text_len, "sampling": settings.to_dict(), "cfg": "batched", "backend": "torch-fp8",
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "weights": "random (timing only)", "schedule": source,
                 "tail": {**TAIL, "preset": DEFAULT_PRESET}, "setup": {}, "clips": {}}
    if source is not None:
        source["branch_calls"], source["branch_calls_uncached"] = schedule.calls([("cond", "uncond")] * args.clip_steps)
        source["note"] = ("the step schedule is replayed by step index through trt_sora.caching.CacheSchedule (the "
                          "sampler's cache=, as runtime.generate applies a checked one); this model's random weights "
                          "cannot be calibrated or checked, so the schedule is the one named above")
    setup = res["setup"]

    def save() -> None:  # what finished so far, in case a later clip runs past the call's time limit
        Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")

    t0 = time.perf_counter()
    enc, vocab = text_encoder(args.model, adapter.text_dim, dev)
    vae = vae_for(args.model, dev, torch.bfloat16)
    decode_groups = frame_decoder(adapter, vae, dev, torch.bfloat16)
    model = adapter.load("bf16", dev)
    setup["build_s"] = time.perf_counter() - t0  # text encoder, VAE, transformer (random weights)
    ids = torch.randint(0, vocab, (2, text_len), device=dev, generator=torch.Generator(dev).manual_seed(0))
    noise = gaussian_noise((1, adapter.latent_channels, lat["latent_frames"], lat["latent_height"],
                            lat["latent_width"]), 0).to(dev)
    with torch.inference_mode():
        emb = enc(input_ids=ids).last_hidden_state.float()
    save()
    if "eager" in args.clips:  # before the runner: it rewrites the model's blocks
        eager_clips(args, res, adapter, model, enc, ids, noise, settings, save)
        if args.clips == ["eager"]:
            return res
    t0 = time.perf_counter()
    runner = fp8_runner(adapter, model, export_call(adapter, model)[1], noise, emb[:1], dev, args.attention_kernel)
    call = runner_call(runner)
    setup["runner_s"] = time.perf_counter() - t0  # FP8 plan calibration (one call) + block rewrite
    save()

    def clip(name: str, steps: SamplingSettings, cache) -> dict:
        """One clip's stages, each timed after a device sync; ``calls``: the sampler's transformer calls."""
        marks = [time.perf_counter()]
        out, calls = encode_and_sample(call, "batched", steps, adapter=adapter, enc=enc, ids=ids, noise=noise,
                                       dev=dev, marks=marks, cache=cache)
        path = Path(args.tmp) / f"e2e_{name}.mp4"
        with Mp4Writer(path, 16.0, height=height, width=width) as mp4:  # the runtime's tail (run_to_files)
            for x in decode_groups(out.latents):
                mp4.write(to_uint8(x[0]))
            marks.append(time.perf_counter())
        marks.append(time.perf_counter())
        stages = dict(zip(("text_encode_s", "denoise_s", "decode_and_encode_s", "encode_finish_s"),
                          (b - a for a, b in zip(marks, marks[1:]))))
        branch_calls = sum(len(c) for c in calls)
        return {**stages, "clip_s": marks[-1] - marks[0], "steps": steps.num_steps,
                "s_per_step": stages["denoise_s"] / steps.num_steps, "transformer_calls": len(calls),
                "branch_calls": branch_calls, "branch_calls_uncached": 2 * steps.num_steps,
                "reused": {b: [r.step for r in out.steps if b in r.reused] for b in ("cond", "uncond")},
                "frames": mp4.frames, "mp4_bytes": path.stat().st_size}

    t0 = time.perf_counter()
    clip("warmup", settings.override(num_steps=2), None)
    if schedule is not None and any(schedule.reuse(i, "cond") != schedule.reuse(i, "uncond")
                                    for i in range(args.clip_steps)):
        clip("warmup", settings.override(num_steps=2), CacheSchedule(2, {"uncond": (1,)}))  # a lone branch's graph
    setup["warmup_s"] = time.perf_counter() - t0
    setup["ours_report"] = {k: v for k, v in runner.report().items() if isinstance(v, (int, float, str, bool))}
    save()
    for name in (c for c in args.clips if c != "eager"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        res["clips"][name] = clip(name, settings, schedule if name == "cached" else None)
        if cuda:
            res["clips"][name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        save()
    runner.deactivate()
    if {"cached", "uncached"} <= set(res["clips"]):
        res["cached_speedup"] = res["clips"]["uncached"]["clip_s"] / res["clips"]["cached"]["clip_s"]
    if "eager" in res["clips"]:
        res["speedup_vs_eager"] = {n: res["clips"]["eager"]["clip_s"] / c["clip_s"]
                                   for n, c in res["clips"].items() if n != "eager"}
    return res


def encode_and_sample(call, cfg: str, steps, *, adapter, enc, ids, noise, dev: str, marks: list, cache=None):
    """The head every measured clip shares: the text encode (prompt and negative) and ``steps`` of the sampler
    over ``call`` with ``cfg``, each stage's end appended to ``marks`` after a device sync. Returns the sampler's
    output and its transformer calls (the branches of each)."""
    from trt_sora.sampling import sample

    calls: list[tuple[str, ...]] = []
    with torch.inference_mode():
        text = enc(input_ids=ids).last_hidden_state
        sync(dev)
        marks.append(time.perf_counter())
        out = sample(call, noise, text[:1], text[1:], scheduler=adapter.scheduler(steps.shift), settings=steps,
                     cfg=cfg, dtype=torch.bfloat16, cache=cache, hook=lambda info: calls.append(info.branches))
        sync(dev)
        marks.append(time.perf_counter())
    return out, calls


def eager_clips(args, res: dict, adapter, model, enc, ids, noise, settings, save) -> None:
    """The issue's baseline clip measured whole, as diffusers' ``WanPipeline`` runs it in BF16 eager: the
    text encode, ``settings.num_steps`` steps with split CFG (two transformer calls a step) through the same
    sampler, the fp32 VAE decoding the whole clip at once, then the MP4 (``runtime.video.write_clip`` of the
    frames brought to the host). A 2-step clip first (cuDNN / allocator warm-up), timed apart."""
    from trt_sora.runtime.generate import to_uint8
    from trt_sora.runtime.video import write_clip

    dev = args.device
    eager = export_call(adapter, model)[0]
    t0 = time.perf_counter()
    vae = vae_for(args.model, dev, torch.float32)
    res["setup"]["eager_vae_fp32_s"] = time.perf_counter() - t0

    def clip(name: str, steps) -> dict:
        marks = [time.perf_counter()]
        out, calls = encode_and_sample(eager, "split", steps, adapter=adapter, enc=enc, ids=ids, noise=noise,
                                       dev=dev, marks=marks)
        with torch.inference_mode():
            x = vae.decode(out.latents.float(), return_dict=False)[0]
            sync(dev)
            marks.append(time.perf_counter())
        pixels = to_uint8(x[0])
        path = Path(args.tmp) / f"e2e_{name}.mp4"
        write_clip(pixels, path, 16.0)
        marks.append(time.perf_counter())
        stages = dict(zip(("text_encode_s", "denoise_s", "vae_decode_fp32_s", "mp4_s"),
                          (b - a for a, b in zip(marks, marks[1:]))))
        return {**stages, "clip_s": marks[-1] - marks[0], "steps": steps.num_steps, "cfg": "split",
                "s_per_step": stages["denoise_s"] / steps.num_steps, "transformer_calls": len(calls),
                "branch_calls": sum(len(c) for c in calls), "frames": int(pixels.shape[0]),
                "mp4_bytes": path.stat().st_size}

    t0 = time.perf_counter()
    clip("eager_warmup", settings.override(num_steps=2))
    res["setup"]["eager_warmup_s"] = time.perf_counter() - t0
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    res["clips"]["eager"] = {"path": "eager BF16 (diffusers' transformer, split CFG, fp32 VAE, serial MP4)",
                             **clip("eager", settings)}
    if args.device.startswith("cuda"):
        res["clips"]["eager"]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del vae
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    save()


def compose(res: dict, clip_steps: int, cache_saved: float | None) -> dict:
    """Seconds per clip from the measured units (stated, so a reader can redo the sum). A row whose step
    was not measured is left out; a stage not measured in this run is left out of every row (named)."""
    m = res["measured"]
    fp32_vae, bf16_vae = m.get("vae_decode_fp32_s"), m.get("vae_decode_bf16_s")
    rows = {"eager_bf16 (WanPipeline: split CFG, fp32 VAE)": ("eager_bf16_split_step_s", fp32_vae, 0.0),
            "compile_bf16 (WanPipeline + regional torch.compile, fp32 VAE)": ("compile_bf16_split_step_s",
                                                                               fp32_vae, 0.0),
            "torchao FP8 rowwise + compile (diffusers' FP8 recipe, fp32 VAE)": (
                "torchao_fp8_rowwise_compile_split_step_s", fp32_vae, 0.0),
            "ours torch-fp8 (batched CFG, CUDA graph, bf16 VAE)": ("ours_fp8_batched_graph_step_s", bf16_vae, 0.0)}
    if cache_saved:
        rows[f"ours torch-fp8 + step cache ({cache_saved:.0%} of calls saved)"] = (
            "ours_fp8_batched_graph_step_s", bf16_vae, cache_saved)
    missing = [k for k in ("text_encode_s", "mp4_encode_s") if k not in m] + \
        [k for k in ("vae_decode_fp32_s", "vae_decode_bf16_s") if k not in m]
    table = {}
    for name, (key, decode, saved) in rows.items():
        if key not in m:
            continue
        step = m[key] * (1 - saved)
        total = m.get("text_encode_s", 0.0) + clip_steps * step + (decode or 0.0) + m.get("mp4_encode_s", 0.0)
        table[name] = {"text_encode_s": m.get("text_encode_s"), "steps": clip_steps, "step_s": step,
                       "denoise_s": clip_steps * step, "decode_s": decode, "mp4_s": m.get("mp4_encode_s"),
                       "clip_s": total}
    base = table.get("eager_bf16 (WanPipeline: split CFG, fp32 VAE)", {}).get("clip_s")
    for row in table.values():
        row["speedup_vs_eager"] = base / row["clip_s"] if base else None
    return {"clip_steps": clip_steps, "composition": "text_encode + steps * step + decode + mp4",
            "stages_not_measured": missing, "rows": table}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan2.1-t2v-14b")
    ap.add_argument("--size", default="480p", choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=4, help="timed denoising steps per path (after 2 warm-up steps)")
    ap.add_argument("--clip-steps", type=int, default=50)
    ap.add_argument("--paths", default="eager,ours,compile,torchao,vae,mp4",
                    help="what to measure (comma list): eager, ours, compile, torchao (diffusers' documented FP8: "
                    "torchao rowwise + regional compile), vae, mp4")
    ap.add_argument("--cache-saved", type=float, default=None, help="fraction of transformer calls the checked "
                    "step cache saved (a row of its own)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention-kernel", default="int8", help="our runner's 8-bit attention kernel (int8; "
                    "int8-cute: the h100-fp8 / h200-fp8 recipes' kernel, needs nvidia-cutlass-dsl and SM 9.0)")
    ap.add_argument("--cute-schedule", default=None, help="with --attention-kernel int8-cute: the kernel's schedule "
                    "over trt_sora.kernels.cute_attention.SCHEDULE, e.g. early_pack=0,stages=3 (fp8_bench's flag)")
    ap.add_argument("--tmp", default="/tmp")
    ap.add_argument("--out", required=True)
    ap.add_argument("--measure", default="units", choices=("units", "clips"), help="units: time each stage and a "
                    "few steps per path, compose a clip; clips: run whole --clip-steps clips of ours end to end")
    ap.add_argument("--clips", default="cached,uncached", help="--measure clips: which clips (comma list of eager, "
                    "cached, uncached; eager runs first, before the runner rewrites the model)")
    ap.add_argument("--cache-schedule", default=None, help="the cached clip's schedule: a run folder (its checked "
                    "parity report), a check report / results JSON with its caching record, or a CacheSchedule JSON")
    ap.add_argument("--cache-reuse", default=None, help="instead: the steps both CFG branches reuse (comma list)")
    ap.add_argument("--cache-order", type=int, default=1, help="--cache-reuse's extrapolation order (0: reuse)")
    ap.add_argument("--compose-from", default=None, help="recompose a measured JSON (e.g. with --cache-saved) "
                    "instead of measuring")
    args = ap.parse_args(argv)
    schedule = None
    if args.cute_schedule:
        schedule = fp8_bench_module().set_cute_schedule(args.cute_schedule)
    args.paths = set(args.paths.split(","))
    args.clips = [c for c in args.clips.split(",") if c]
    if not args.clips or set(args.clips) - {"eager", "cached", "uncached"} or len(set(args.clips)) < len(args.clips):
        ap.error(f"--clips {','.join(args.clips)}: name eager, cached and/or uncached, each once")
    if args.measure == "clips":
        res = measure_clips(args)
    else:
        res = json.loads(Path(args.compose_from).read_text()) if args.compose_from else measure(args)
        res["per_clip"] = compose(res, args.clip_steps, args.cache_saved)
    if schedule:
        res["cute_schedule"] = schedule
    text = json.dumps(res, indent=2, default=str)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
