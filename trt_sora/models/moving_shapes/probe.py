"""Automatic caption check of a clip, from its pixels alone.

Method (works on generated clips as on ground truth):

1. background = per-pixel temporal median (the shape covers any pixel in at
   most 4 of 9 frames, see ``data.SPEED_RANGE``);
2. foreground = pixels farther than ``FG_THRESHOLD`` (RGB, [0, 1] units) from it;
3. colour = nearest palette colour to the median foreground pixel;
4. motion = sign of the larger component of the median frame-to-frame step of
   the foreground centroid (pixels per frame), "static" below ``MIN_SPEED``;
5. background colour = majority vote of the nearest background tone per pixel;
   shape = foreground fill ratio of its bounding box (square ~1, circle ~0.75,
   triangle ~0.55), informative only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import BACKGROUNDS, MOTIONS, SHAPE_COLOURS, CaptionSpec

FG_THRESHOLD = 0.3
MIN_SPEED = 0.5  # pixels per frame
MIN_FG_PIXELS = 4  # per frame, for the frame's centroid to count


@dataclass(frozen=True)
class ProbeResult:
    colour: str | None
    motion: str | None  # one of data.MOTIONS, "static", or None (no shape found)
    background: str
    shape: str | None
    velocity: tuple[float, float]  # (dx, dy) pixels per frame, image coordinates
    fg_fraction: float  # foreground pixels / all pixels

    def matches(self, spec: CaptionSpec) -> dict[str, bool]:
        """Per-attribute agreement with a caption spec."""
        return {
            "colour": self.colour == spec.colour,
            "motion": self.motion == spec.motion,
            "background": self.background == spec.background,
            "shape": self.shape == spec.shape,
        }

    def passes(self, spec: CaptionSpec) -> bool:
        """The check the tests use: colour and motion direction both right."""
        m = self.matches(spec)
        return m["colour"] and m["motion"]


def _nearest(value: np.ndarray, palette: dict[str, tuple]) -> str:
    names = list(palette)
    ref = np.array([palette[n] for n in names], dtype=np.float32)
    return names[int(np.argmin(((ref - value) ** 2).sum(-1)))]


def probe_clip(clip) -> ProbeResult:
    """Probe one clip: [3, F, H, W] in [-1, 1] (torch tensor or numpy array)."""
    x = clip.detach().cpu().float().numpy() if hasattr(clip, "detach") else np.asarray(clip, dtype=np.float32)
    if x.ndim != 4 or x.shape[0] != 3:
        raise ValueError(f"expected a clip [3, F, H, W], got shape {x.shape}")
    x = np.clip((np.transpose(x, (1, 2, 3, 0)) + 1) / 2, 0, 1)  # [F, H, W, 3] in [0, 1]
    bg = np.median(x, axis=0)  # [H, W, 3]
    fg = np.sqrt(((x - bg) ** 2).sum(-1)) > FG_THRESHOLD  # [F, H, W]

    tones = {f"{name}/{i}": tone for name, pair in BACKGROUNDS.items() for i, tone in enumerate(pair)}
    names = list(tones)
    ref = np.array([tones[n] for n in names], dtype=np.float32)
    nearest = np.argmin(((bg.reshape(-1, 1, 3) - ref) ** 2).sum(-1), axis=1)  # vote per pixel
    votes: dict[str, int] = {}
    for i, count in zip(*np.unique(nearest, return_counts=True)):
        name = names[int(i)].split("/")[0]
        votes[name] = votes.get(name, 0) + int(count)
    background = max(votes, key=votes.get)
    if fg.sum() < MIN_FG_PIXELS:
        return ProbeResult(None, None, background, None, (0.0, 0.0), 0.0)

    colour = _nearest(np.median(x[fg], axis=0), SHAPE_COLOURS)

    frames, cxs, cys, fills = [], [], [], []
    for i, m in enumerate(fg):
        ys, xs = np.nonzero(m)
        if len(xs) < MIN_FG_PIXELS:
            continue
        frames.append(i)
        cxs.append(xs.mean())
        cys.append(ys.mean())
        fills.append(len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1)))
    if len(frames) < 2:
        return ProbeResult(colour, None, background, None, (0.0, 0.0), float(fg.mean()))
    # median frame-to-frame centroid step: the direction the shape moves most of
    # the time, so one jump (a shape leaving one edge and re-entering at the
    # opposite one) does not flip the answer; equals the speed on ground truth
    t = np.array(frames, dtype=np.float64)
    dt = np.diff(t)
    vx = float(np.median(np.diff(cxs) / dt))
    vy = float(np.median(np.diff(cys) / dt))
    if max(abs(vx), abs(vy)) < MIN_SPEED:
        motion = "static"
    else:
        d = (int(np.sign(vx)), 0) if abs(vx) >= abs(vy) else (0, int(np.sign(vy)))
        motion = next(name for name, v in MOTIONS.items() if v == d)
    fill = float(np.median(fills))
    shape = "square" if fill > 0.88 else "circle" if fill > 0.66 else "triangle"
    return ProbeResult(colour, motion, background, shape, (vx, vy), float(fg.mean()))


def probe_batch(clips) -> list[ProbeResult]:
    """Probe each clip of [B, 3, F, H, W]."""
    return [probe_clip(c) for c in clips]


def verdict(caption: str, frames) -> dict:
    """The probe's reading of a generated clip against its caption: ``frames`` uint8
    ``[F, H, W, 3]`` (``trt_sora.runtime.Clip.frames``). ``passes`` (colour and motion right) is
    None when the caption is not one of the dataset's."""
    from .data import parse_caption

    x = np.asarray(frames, dtype=np.float32)
    r = probe_clip(np.transpose(x / 127.5 - 1.0, (3, 0, 1, 2)))
    out = {"colour": r.colour, "motion": r.motion, "background": r.background, "shape": r.shape,
           "matches": None, "passes": None}
    try:
        spec = parse_caption(caption)
    except ValueError:
        return out
    out["matches"] = r.matches(spec)
    out["passes"] = bool(r.passes(spec))
    return out
