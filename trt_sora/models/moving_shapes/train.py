"""Train the moving-shapes Wan model (flow matching, pixel space).

    python -m trt_sora.models.moving_shapes.train --out DIR [--minutes 7] [--batch 128]

The shipped weights came from four such runs (MODEL_CARD.md). The last one
added ``--frame-embed --hi-sigma 0.5``: without an absolute frame embedding
and training at high noise the model never learns the *sign* of the motion
(the caption's "up" vs "down"); pass both for any new run.

Runs on CUDA (bf16 autocast) or CPU (fp32, for smoke tests). Batches are
rendered on the fly on the training device from fresh seeds, so the model
never sees the same clip twice. Writes to ``--out``:

    config.json, diffusion_pytorch_model.safetensors   (EMA weights, fp16;
        ``trt_sora.models.frame_embed.load(out)`` loads them, frame embedding included)
    train_log.json    run facts, loss curve, held-out probe evaluation
    samples.png       held-out captions, every frame

Text embeddings: ``--embeddings FILE`` (a safetensors file made by
``--make-embeddings FILE`` on a machine with the MiniLM package) or, without
it, encoded here with :mod:`.text`.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from trt_sora.models import frame_embed

from . import data
from .probe import probe_clip
from .sample import SampleConfig, sample

log = logging.getLogger("trt_sora")


def model_config(layers: int = 6, heads: int = 4, head_dim: int = 64, ffn_mult: int = 4) -> dict:
    """``WanTransformer3DModel`` constructor arguments of this model family."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=3,
        out_channels=3,
        text_dim=384,  # all-MiniLM-L6-v2 hidden size (text.TEXT_DIM)
        freq_dim=256,
        ffn_dim=ffn_mult * heads * head_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
        pos_embed_seq_len=None,
    )


def needed_captions() -> list[str]:
    """Every caption training and its evaluation look up: train, held-out, and ""."""
    heldout = data.all_caption_specs("heldout")
    return (
        [""]
        + data.train_captions()
        + [s.caption() for s in heldout]
        + [s.caption(data.HELDOUT_TEMPLATE) for s in heldout]
    )


def make_embeddings(path: Path, text_len: int) -> None:
    """Encode :func:`needed_captions` with MiniLM into a fp16 safetensors file."""
    from safetensors.torch import save_file

    from . import text

    caps = needed_captions()
    chunks = [text.encode(caps[i : i + 256], text_len) for i in range(0, len(caps), 256)]
    emb = torch.cat(chunks).to(torch.float16).contiguous()
    save_file({"embeddings": emb}, str(path), metadata={"captions": json.dumps(caps), "text_len": str(text_len)})


def load_embeddings(path: Path | None, text_len: int):
    """(captions -> row index, float16 tensor [N, text_len, 384])."""
    if path is None:
        from . import text

        caps = needed_captions()
        emb = torch.cat([text.encode(caps[i : i + 256], text_len) for i in range(0, len(caps), 256)])
        return {c: i for i, c in enumerate(caps)}, emb.to(torch.float16)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        caps = json.loads(f.metadata()["captions"])
        emb = f.get_tensor("embeddings")
    if emb.shape[1] != text_len:
        raise ValueError(f"{path} holds text_len {emb.shape[1]}, asked for {text_len}")
    return {c: i for i, c in enumerate(caps)}, emb


#: the noise band where the caption alone must decide the motion's sign (see ``--hi-sigma``)
HI_SIGMA_BAND = (0.75, 1.0)


def sample_sigmas(n: int, generator, device, hi_fraction: float = 0.0):
    """Flow-matching noise levels: logit-normal(0, 1) mixed with 10% uniform (tails).

    ``hi_fraction`` of the batch is drawn uniformly from :data:`HI_SIGMA_BAND`
    instead. Logit-normal(0, 1) puts only ~2 % of samples above sigma 0.9, yet
    that is where the direction of motion gets decided: below ~0.85 the shape's
    trajectory is already visible in the noisy clip and the model only has to
    follow it, so a model trained on logit-normal alone learns the axis of
    motion from the verb and never the sign.
    """
    s = torch.sigmoid(torch.randn(n, generator=generator))
    u = torch.rand(n, generator=generator)
    s = torch.where(torch.rand(n, generator=generator) < 0.1, u, s)
    lo, hi = HI_SIGMA_BAND
    band = lo + (hi - lo) * torch.rand(n, generator=generator)
    s = torch.where(torch.rand(n, generator=generator) < hi_fraction, band, s)
    return s.clamp(1e-4, 1.0).to(device)


def foreground_weights(x0, weight: float):
    """Per-pixel loss weights: ``weight`` on the moving shape, 1 elsewhere, mean 1 per clip.

    The background is static, so the shape is where a frame differs from the
    clip's temporal median.
    """

    bg = x0.median(dim=2, keepdim=True).values
    fg = ((x0 - bg).abs().amax(dim=1, keepdim=True) > 0.2).float()  # [B, 1, F, H, W]
    w = 1.0 + (weight - 1.0) * fg
    return w / w.mean(dim=(1, 2, 3, 4), keepdim=True)


def evaluate(model, cap_index, emb, device, dtype, settings, n_seeds: int = 1, template=None, limit=None,
             split: str = "heldout"):
    """Probe accuracy on ``split`` captions for each (steps, guidance, shift) setting.

    Besides per-attribute accuracy, reports the motion confusion (caption
    direction -> probed direction) and how often the *axis* of the motion is
    right: a model that knows the axis but not the sign sits at ~50 % motion.
    """
    specs = data.all_caption_specs(split)
    if split != "heldout":  # an even spread over the (larger) training set
        specs = specs[:: max(1, len(specs) // (limit or len(specs)))]
    specs = specs[:limit]
    caps = [s.caption(template) if template else s.caption() for s in specs]
    cond = emb[[cap_index[c] for c in caps]].to(device).float()
    axis = {m: ("x" if v[0] else "y") for m, v in data.MOTIONS.items()}
    out = []
    for steps, guidance, shift in settings:
        hits = {"colour": 0, "motion": 0, "background": 0, "shape": 0, "pass": 0, "motion_axis": 0}
        confusion: dict[str, dict[str, int]] = {}
        total = 0
        for seed in range(n_seeds):
            cfg = SampleConfig(steps=steps, guidance_scale=guidance, shift=shift, seed=data.HELDOUT_SEED_START + seed)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                clips = sample(model, cond, cfg, dtype=torch.float32)
            for spec, clip in zip(specs, clips):
                r = probe_clip(clip)
                for k, v in r.matches(spec).items():
                    hits[k] += int(v)
                hits["pass"] += int(r.passes(spec))
                hits["motion_axis"] += int(axis.get(r.motion) == axis[spec.motion])
                row = confusion.setdefault(spec.motion, {})
                row[str(r.motion)] = row.get(str(r.motion), 0) + 1
                total += 1
        out.append({"split": split, "steps": steps, "guidance": guidance, "shift": shift, "n": total,
                    **{k: v / total for k, v in hits.items()}, "motion_confusion": confusion})
        log.info("eval %s", out[-1])
    return out


def save_frames_png(clips, captions, path: Path) -> None:
    """Grid: one row per clip, one column per frame (4x nearest upscaling)."""
    from PIL import Image, ImageDraw

    x = ((clips.float().cpu().clamp(-1, 1) + 1) * 127.5).round().byte().numpy()  # [B, 3, F, H, W]
    b, _, f, h, w = x.shape
    s, label_h = 4, 12
    img = Image.new("RGB", (f * w * s + (f - 1) * 2, b * (h * s + label_h + 4)), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for i in range(b):
        y = i * (h * s + label_h + 4)
        draw.text((2, y), captions[i], fill=(0, 0, 0))
        for j in range(f):
            frame = Image.fromarray(np.transpose(x[i, :, j], (1, 2, 0))).resize((w * s, h * s), Image.NEAREST)
            img.paste(frame, (j * (w * s + 2), y + label_h))
    img.save(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--embeddings", type=Path, default=None)
    p.add_argument("--init", type=Path, default=None, help="start from these weights (a from_pretrained folder)")
    p.add_argument("--make-embeddings", type=Path, default=None, help="write the embeddings file and exit")
    p.add_argument("--text-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=100_000, help="upper bound; --minutes usually ends the run")
    p.add_argument("--minutes", type=float, default=7.0, help="training-loop wall-time budget")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--drop-text", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--eval-steps", type=int, default=30)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out captions to evaluate (default all)")
    p.add_argument("--save-every", type=float, default=120.0, help="seconds between checkpoints")
    p.add_argument("--frame-embed", action="store_true",
                   help="add the absolute frame-index embedding (frame_embed.py); zero-initialised when "
                        "--init lacks one")
    p.add_argument("--hi-sigma", type=float, default=0.0,
                   help=f"fraction of each batch drawn from sigma in {HI_SIGMA_BAND} (see sample_sigmas)")
    p.add_argument("--fg-weight", type=float, default=1.0, help="loss weight of the moving shape's pixels")
    p.add_argument("--frame-init-std", type=float, default=0.1, help="initial std of a new frame embedding's weight")
    p.add_argument("--frame-lr-mult", type=float, default=10.0, help="learning-rate multiplier of the frame embedding")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (falls back to eager)")
    p.add_argument("--eval-only", action="store_true", help="evaluate --init and exit (no training)")
    p.add_argument("--quick-eval", action="store_true", help="one sampler setting, held-out and train captions")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    if args.make_embeddings:
        make_embeddings(args.make_embeddings, args.text_len)
        return 0


    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    train_data = _TrainData.load(args, device)
    model, cfg, prior = _load_model(args)
    model = model.to(device).train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    log.info("params %.2fM, device %s, train captions %d", sum(p.numel() for p in model.parameters()) / 1e6,
             device, train_data.cap_ids.numel())
    if args.eval_only:
        args.steps = 0
    step, curve, train_s = _train(args, model, ema, train_data, device, amp)
    if not args.eval_only:
        _save(ema, args.out, f"final step {step}")

    run = _run_record(args, model, cfg, prior, step, curve, train_s, device)
    if not args.no_eval:
        model_eval = (model if args.eval_only else ema).eval().to(torch.float32)
        run.update(_probe_evaluations(args, model_eval, train_data, device, amp))
        _save_samples(args, model_eval, train_data, device, amp)
    run["total_seconds"] = round(time.time() - t_start, 1)
    (args.out / "train_log.json").write_text(json.dumps(run, indent=1))
    log.info("done: %d steps in %.0fs, final loss %s", step, train_s, run["final_loss"])
    return 0


@dataclasses.dataclass
class _TrainData:
    """The caption embeddings on the training device and the training captions (spec x template)."""

    cap_index: dict  # caption -> row of ``emb_table``
    emb_table: object  # [N, text_len, 384]
    specs: list
    cap_ids: object  # [len(specs), len(TRAIN_TEMPLATES)] rows of ``emb_table``
    empty_id: int  # the row of ""

    @classmethod
    def load(cls, args, device) -> _TrainData:
        cap_index, emb_table = load_embeddings(args.embeddings, args.text_len)
        specs = data.all_caption_specs("train")
        cap_ids = torch.tensor(
            [[cap_index[s.caption(t)] for t in data.TRAIN_TEMPLATES] for s in specs], device=device
        )
        return cls(cap_index, emb_table.to(device), specs, cap_ids, cap_index[""])

    def batch(self, args, step: int, device):
        """Step ``step``'s clips, rendered from fresh seeds, and their captions' embeddings ``(x0, cond)``."""
        rng = np.random.default_rng([args.seed, step])
        idx = rng.integers(0, len(self.specs), size=args.batch)
        tmpl = rng.integers(0, len(data.TRAIN_TEMPLATES), size=args.batch)
        seeds = rng.integers(0, data.HELDOUT_SEED_START, size=args.batch)
        clips = [data.sample_clip_spec(self.specs[i], int(s)) for i, s in zip(idx, seeds)]
        x0 = data.render_batch(clips, device)
        ids = self.cap_ids[torch.from_numpy(idx).to(device), torch.from_numpy(tmpl).to(device)]
        # classifier-free guidance: drop the text, half to zeros, half to the encoding of ""
        drop = torch.from_numpy(rng.random(args.batch) < args.drop_text).to(device)
        to_empty = torch.from_numpy(rng.random(args.batch) < 0.5).to(device)
        ids = torch.where(drop & to_empty, torch.full_like(ids, self.empty_id), ids)
        cond = self.emb_table[ids].float() * (~(drop & ~to_empty)).float().view(-1, 1, 1)
        return x0, cond


def _load_model(args):
    """``(model, config, prior train log)``: ``--init``'s weights or a fresh model, with the frame
    embedding attached when ``--frame-embed`` asks for it."""
    from diffusers import WanTransformer3DModel

    cfg = model_config(layers=args.layers, heads=args.heads)
    if args.init:
        model = frame_embed.load(args.init, torch.float32)
        cfg = {k: model.config[k] for k in cfg}
        log_path = args.init / "train_log.json"
        prior = json.loads(log_path.read_text()) if log_path.exists() else {}
    else:
        model = WanTransformer3DModel(**cfg)
        prior = {}
    if args.frame_embed and not isinstance(model.patch_embedding, frame_embed.FrameEmbeddedConv3d):
        frame_embed.attach(model)
        if args.frame_init_std > 0:
            # a non-zero start: with W = 0 the data's time symmetry keeps W's gradient near zero
            torch.nn.init.normal_(model.patch_embedding.frame_weight, std=args.frame_init_std)
    return model, cfg, prior


def _optimizer(model, args, device):
    """AdamW; the frame embedding's weight learns ``--frame-lr-mult`` times faster (the group's ``mult``)."""
    frame_params = [p for n, p in model.named_parameters() if n == frame_embed.PARAM_NAME]
    other_params = [p for n, p in model.named_parameters() if n != frame_embed.PARAM_NAME]
    groups = [{"params": other_params, "mult": 1.0}]
    groups += [{"params": frame_params, "mult": args.frame_lr_mult}] if frame_params else []
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01, fused=device.type == "cuda")


def _save(ema, out: Path, tag: str) -> None:
    """The EMA weights as fp16 safetensors in ``out`` (the EMA model stays fp32)."""
    ema.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    ema.to(torch.float32)
    log.info("saved %s", tag)


def _train(args, model, ema, train_data: _TrainData, device, amp):
    """The training loop until ``--steps`` or ``--minutes``: cosine learning rate after a warm-up,
    EMA, a checkpoint every ``--save-every`` seconds. Returns ``(steps, loss curve, seconds)``."""
    opt = _optimizer(model, args, device)
    step_fn = _TrainStep(model, opt, args, device, amp)
    budget = args.minutes * 60
    curve, window, last_save = [], [], time.time()
    t_loop = time.time()
    step = 0
    while step < args.steps:
        elapsed = time.time() - t_loop
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr * g["mult"]
        loss, gnorm = step_fn(*train_data.batch(args, step, device))
        _ema_update(ema, model, min(args.ema, (1 + step) / (10 + step)))
        window.append(loss.detach())
        step += 1
        if step % 25 == 0:
            curve.append(_curve_point(window, step, lr, gnorm, t_loop))
        if time.time() - last_save > args.save_every:
            _save(ema, args.out, f"step {step}")
            last_save = time.time()
    return step, curve, time.time() - t_loop


class _TrainStep:
    """One optimiser step of flow matching on a batch; the forward is compiled with ``--compile``
    and falls back to eager for good when compiling fails."""

    def __init__(self, model, opt, args, device, amp):
        self.model, self.opt, self.args, self.device, self.amp = model, opt, args, device, amp
        self.gen = torch.Generator().manual_seed(args.seed)
        self.fwd = model
        if args.compile:
            try:
                self.fwd = torch.compile(model)
            except Exception as exc:  # noqa: BLE001 - an optimisation only
                log.warning("torch.compile unavailable (%s); eager", exc)

    def __call__(self, x0, cond):
        args, device = self.args, self.device
        sigma = sample_sigmas(args.batch, self.gen, device, args.hi_sigma)
        noise = torch.randn(x0.shape, generator=self.gen).to(device)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        target = noise - x0
        with torch.autocast(device.type, dtype=self.amp, enabled=self.amp != torch.float32):
            pred = self.forward(hidden_states=xt, timestep=sigma * 1000, encoder_hidden_states=cond)
        if args.fg_weight != 1.0:
            loss = (foreground_weights(x0, args.fg_weight) * (pred.float() - target) ** 2).mean()
        else:
            loss = torch.nn.functional.mse_loss(pred.float(), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss, gnorm

    def forward(self, **inputs):
        try:
            return self.fwd(**inputs, return_dict=False)[0]
        except Exception as exc:  # noqa: BLE001 - a failed compile falls back to eager
            if self.fwd is self.model:
                raise
            log.warning("compiled forward failed (%s); eager from here", str(exc).splitlines()[0][:200])
            self.fwd = self.model
            return self.fwd(**inputs, return_dict=False)[0]


def _ema_update(ema, model, decay: float) -> None:
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)


def _curve_point(window: list, step: int, lr: float, gnorm, t_loop: float) -> dict:
    """The mean loss of the steps in ``window`` (emptied) as a loss-curve point; logged every 200 steps."""
    mean = torch.stack(window).mean().item()
    window.clear()
    if step % 200 == 0:
        log.info("step %d loss %.4f lr %.2e gnorm %.2f %.1fs", step, mean, lr, float(gnorm), time.time() - t_loop)
    return {"step": step, "loss": mean, "lr": lr, "grad_norm": float(gnorm), "t": round(time.time() - t_loop, 1)}


def _run_record(args, model, cfg, prior, step, curve, train_s, device) -> dict:
    """``train_log.json``'s run facts and loss curve (a continued run keeps the earlier runs' records)."""
    has_frame_embed = isinstance(model.patch_embedding, frame_embed.FrameEmbeddedConv3d)
    run = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "steps": step,
        "batch": args.batch,
        "clips_seen": step * args.batch,
        "train_seconds": round(train_s, 1),
        "final_loss": float(np.mean([c["loss"] for c in curve[-4:]])) if curve else None,
        "params": sum(p.numel() for p in model.parameters()),
        "frame_embedding": has_frame_embed,
        "frame_weight_norm": float(model.patch_embedding.frame_weight.detach().norm()) if has_frame_embed else None,
        "args": {k: str(v) for k, v in vars(args).items()},
        "config": cfg,
        "loss_curve": curve,
    }
    if prior and not args.eval_only:  # a continued run: keep the earlier run's record
        earlier = {k: v for k, v in prior.items() if k != "previous_runs"}
        run["previous_runs"] = prior.get("previous_runs", []) + [earlier]
        run["steps_total"] = prior.get("steps_total", prior.get("steps", 0)) + step
    return run


def _probe_evaluations(args, model, train_data: _TrainData, device, amp) -> dict:
    """:func:`evaluate` at the sampler settings ``--quick-eval`` (one, held-out and train captions) or
    the full sweep (held-out captions, and the held-out template) asks for."""
    cap_index, emb = train_data.cap_index, train_data.emb_table
    if args.quick_eval:
        quick = [(args.eval_steps, 4.0, 2.0)]
        return {"eval_heldout": evaluate(model, cap_index, emb, device, amp, quick, n_seeds=2, limit=args.eval_limit),
                "eval_train": evaluate(model, cap_index, emb, device, amp, quick, n_seeds=2, limit=args.eval_limit,
                                       split="train")}
    settings = [(args.eval_steps, g, sh) for sh in (1.0, 2.0, 3.0) for g in (3.0, 5.0)]
    settings += [(max(2, args.eval_steps // 2), 4.0, 2.0)]
    return {"eval_heldout": evaluate(model, cap_index, emb, device, amp, settings, n_seeds=2, limit=args.eval_limit),
            "eval_heldout_template": evaluate(model, cap_index, emb, device, amp, [(args.eval_steps, 4.0, 2.0)],
                                              n_seeds=2, template=data.HELDOUT_TEMPLATE, limit=args.eval_limit)}


def _save_samples(args, model, train_data: _TrainData, device, amp) -> None:
    """``samples.png``: up to 8 held-out captions sampled at ``--eval-steps``, every frame."""
    specs = data.all_caption_specs("heldout")[::11][: min(8, args.eval_limit or 8)]
    caps = [s.caption() for s in specs]
    with torch.autocast(device.type, dtype=amp, enabled=amp != torch.float32):
        clips = sample(model, train_data.emb_table[[train_data.cap_index[c] for c in caps]].float(),
                       SampleConfig(steps=args.eval_steps, seed=7), dtype=torch.float32)
    save_frames_png(clips, caps, args.out / "samples.png")


if __name__ == "__main__":
    raise SystemExit(main())
