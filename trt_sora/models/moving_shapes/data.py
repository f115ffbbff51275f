"""Procedural "moving shapes" video dataset: clips, captions and splits.

A clip is one coloured shape moving in a straight line over a static
background. Everything is generated from a small caption grammar plus a seed,
so the data needs no download and is exactly reproducible:

    caption  "a red square slides left over a striped blue background"
    clip     float32 [3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1] (RGB, C-first
             like the Wan transformer's latents; pixel space, so the
             "latents" are the frames themselves)

Splits: the held-out split uses (colour, shape, motion) combinations that never
appear in training (:data:`HELDOUT_COMBOS`), seeds from a disjoint range, and
in addition :data:`HELDOUT_TEMPLATE`, a phrasing never seen in training.

Only numpy at import time; torch is imported inside the batched renderer.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

NUM_FRAMES = 9
HEIGHT = 32
WIDTH = 32

# Shape colours, RGB in [0, 1]. Chosen far apart from each other and from the
# background tones below so that a probe can tell them apart from pixels.
SHAPE_COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.92, 0.12, 0.10),
    "green": (0.15, 0.88, 0.15),
    "blue": (0.15, 0.40, 1.00),
    "yellow": (0.98, 0.90, 0.10),
    "white": (0.97, 0.97, 0.97),
    "purple": (0.70, 0.20, 0.90),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
# motion phrase -> unit direction (dx, dy) in image coordinates (y grows downwards)
MOTIONS: dict[str, tuple[int, int]] = {
    "slides left": (-1, 0),
    "slides right": (1, 0),
    "moves up": (0, -1),
    "moves down": (0, 1),
}
PATTERNS: tuple[str, ...] = ("plain", "striped", "checkered")
# background colour -> (main tone, second tone used by stripes / checks)
BACKGROUNDS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "black": ((0.04, 0.04, 0.04), (0.22, 0.22, 0.22)),
    "gray": ((0.50, 0.50, 0.50), (0.32, 0.32, 0.32)),
    "blue": ((0.12, 0.16, 0.50), (0.05, 0.07, 0.28)),
    "green": ((0.12, 0.40, 0.12), (0.05, 0.22, 0.05)),
}

# (colour, shape, motion) combinations never shown in training.
HELDOUT_COMBOS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("red", "circle", "moves up"),
        ("green", "triangle", "slides left"),
        ("blue", "square", "moves down"),
        ("yellow", "circle", "slides right"),
        ("white", "triangle", "moves up"),
        ("purple", "square", "slides left"),
        ("red", "triangle", "slides right"),
        ("white", "square", "moves down"),
    }
)
TRAIN_TEMPLATES: tuple[str, ...] = (
    "a {colour} {shape} {motion} over a {pattern} {background} background",
    "{pattern} {background} background, a {colour} {shape} {motion}",
)
HELDOUT_TEMPLATE = "on a {pattern} {background} background, a {colour} {shape} {motion}"

# Seeds: training uses [0, HELDOUT_SEED_START), evaluation [HELDOUT_SEED_START, ...).
HELDOUT_SEED_START = 1_000_000_000

SHAPE_SIZE_RANGE = (6.0, 8.0)  # pixels, side / diameter
# pixels per frame. With size <= 8 and speed >= 2 a pixel is covered by the
# shape in at most 4 of 9 frames, so the per-pixel temporal median of a clip is
# its background (the probe relies on this).
SPEED_RANGE = (2.0, 2.4)
STRIPE_PERIOD = 8  # pixels; stripes and checks are half a period wide


@dataclass(frozen=True)
class CaptionSpec:
    """What a caption says: the words that the probe checks."""

    colour: str
    shape: str
    motion: str
    pattern: str
    background: str

    def caption(self, template: str = TRAIN_TEMPLATES[0]) -> str:
        return template.format(**asdict(self))

    @property
    def combo(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.motion)

    @property
    def is_heldout(self) -> bool:
        return self.combo in HELDOUT_COMBOS


@dataclass(frozen=True)
class ClipSpec:
    """A caption plus the nuisance parameters drawn from a seed (pixel units)."""

    caption_spec: CaptionSpec
    seed: int
    size: float
    x0: float  # shape centre at frame 0
    y0: float
    speed: float  # pixels per frame along the motion direction
    stripe_vertical: bool
    pattern_phase: int


def all_caption_specs(split: str = "all") -> list[CaptionSpec]:
    """Every valid caption spec, in a fixed order.

    ``split``: ``"train"`` (combos not held out), ``"heldout"`` or ``"all"``.
    A shape never has the colour of its background (blue on blue, green on green).
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    out = []
    for colour, shape, motion, pattern, background in itertools.product(
        SHAPE_COLOURS, SHAPES, MOTIONS, PATTERNS, BACKGROUNDS
    ):
        if colour == background:
            continue
        spec = CaptionSpec(colour, shape, motion, pattern, background)
        if split == "train" and spec.is_heldout or split == "heldout" and not spec.is_heldout:
            continue
        out.append(spec)
    return out


def train_captions() -> list[str]:
    """Every caption the model is trained on (all train specs x TRAIN_TEMPLATES)."""
    return [s.caption(t) for t in TRAIN_TEMPLATES for s in all_caption_specs("train")]


def parse_caption(caption: str) -> CaptionSpec:
    """Inverse of :meth:`CaptionSpec.caption` for any template in this module."""
    for template in (*TRAIN_TEMPLATES, HELDOUT_TEMPLATE):
        for spec in _spec_index():
            if spec.caption(template) == caption:
                return spec
    raise ValueError(f"not a moving-shapes caption: {caption!r}")


_SPEC_CACHE: list[CaptionSpec] = []


def _spec_index() -> list[CaptionSpec]:
    if not _SPEC_CACHE:
        _SPEC_CACHE.extend(all_caption_specs("all"))
    return _SPEC_CACHE


def sample_clip_spec(caption_spec: CaptionSpec, seed: int) -> ClipSpec:
    """Draw size, start position, speed and background layout from ``seed``.

    Deterministic: the same (caption_spec, seed) always gives the same clip.
    The shape stays fully inside the frame for all frames.
    """
    rng = np.random.default_rng(seed)
    size = float(rng.uniform(*SHAPE_SIZE_RANGE))
    speed = float(rng.uniform(*SPEED_RANGE))
    dx, dy = MOTIONS[caption_spec.motion]
    travel = speed * (NUM_FRAMES - 1)
    margin = size / 2 + 1.0

    def start(d: int, extent: int) -> float:
        if d == 0:
            return float(rng.uniform(margin, extent - margin))
        lo, hi = margin, extent - margin - travel
        pos = float(rng.uniform(lo, hi))
        return pos if d > 0 else extent - pos

    x0 = start(dx, WIDTH)
    y0 = start(dy, HEIGHT)
    return ClipSpec(
        caption_spec=caption_spec,
        seed=int(seed),
        size=size,
        x0=x0,
        y0=y0,
        speed=speed,
        stripe_vertical=bool(rng.integers(0, 2)),
        pattern_phase=int(rng.integers(0, STRIPE_PERIOD)),
    )


def sample_batch_specs(
    batch: int, seed: int, split: str = "train", specs: Sequence[CaptionSpec] | None = None
) -> list[ClipSpec]:
    """``batch`` random clip specs of ``split``, deterministic in ``seed``.

    Clip seeds are drawn from the split's seed range (train: below
    HELDOUT_SEED_START; heldout: at or above it).
    """
    specs = list(specs) if specs is not None else all_caption_specs(split)
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    idx = rng.integers(0, len(specs), size=batch)
    base = 0 if split == "train" else HELDOUT_SEED_START
    clip_seeds = base + rng.integers(0, HELDOUT_SEED_START, size=batch)
    return [sample_clip_spec(specs[i], int(s)) for i, s in zip(idx, clip_seeds)]


def render_batch(clips: Sequence[ClipSpec], device: torch.device | str = "cpu") -> torch.Tensor:
    """Render clips: float32 [B, 3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1].

    Vectorised in torch so that training renders its batches on the GPU.
    """
    import torch

    b = len(clips)
    # Gather per-clip parameters on the host first: one transfer per array, not per clip.
    dirs = np.array([MOTIONS[c.caption_spec.motion] for c in clips], dtype=np.float32)
    params = np.array(
        [
            [c.size, c.speed, c.x0, c.y0, SHAPES.index(c.caption_spec.shape), c.pattern_phase,
             float(c.stripe_vertical), PATTERNS.index(c.caption_spec.pattern)]
            for c in clips
        ],
        dtype=np.float32,
    ).reshape(b, 8)
    tones = np.array(
        [BACKGROUNDS[c.caption_spec.background] for c in clips], dtype=np.float32
    ).reshape(b, 2, 3)
    colours = np.array([SHAPE_COLOURS[c.caption_spec.colour] for c in clips], dtype=np.float32).reshape(b, 3)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    p, dirs_t, tones_t, fg = dev(params), dev(dirs.reshape(b, 2)), dev(tones), dev(colours)

    def per_clip(i: int) -> torch.Tensor:
        return p[:, i].view(b, 1, 1, 1)

    f = torch.arange(NUM_FRAMES, device=device, dtype=torch.float32).view(1, -1, 1, 1)
    ys = torch.arange(HEIGHT, device=device, dtype=torch.float32).view(1, 1, -1, 1) + 0.5
    xs = torch.arange(WIDTH, device=device, dtype=torch.float32).view(1, 1, 1, -1) + 0.5
    size, speed = per_clip(0), per_clip(1)
    cx = per_clip(2) + dirs_t[:, 0].view(b, 1, 1, 1) * speed * f
    cy = per_clip(3) + dirs_t[:, 1].view(b, 1, 1, 1) * speed * f
    dx, dy = xs - cx, ys - cy  # [B, F, H, W]
    half = size / 2
    square = (dx.abs() <= half) & (dy.abs() <= half)
    circle = dx * dx + dy * dy <= half * half
    # apex up, base down: the half-width grows linearly from 0 at the top to `half`
    triangle = (dy.abs() <= half) & (dx.abs() <= (dy + half) / 2)
    kind = per_clip(4)
    mask = torch.where(kind == 0, square, torch.where(kind == 1, circle, triangle))

    # background: [B, H, W] choice between tone 0 and tone 1
    phase = p[:, 5].view(b, 1, 1).long()
    yi = torch.arange(HEIGHT, device=device).view(1, -1, 1)
    xi = torch.arange(WIDTH, device=device).view(1, 1, -1)
    half_p = STRIPE_PERIOD // 2
    vert = p[:, 6].view(b, 1, 1) > 0
    stripe = torch.where(vert, ((xi + phase) // half_p) % 2, ((yi + phase) // half_p) % 2)
    checks = (((xi + phase) // half_p) + ((yi + phase) // half_p)) % 2
    pat = p[:, 7].view(b, 1, 1)
    second = torch.where(pat == 0, torch.zeros_like(stripe), torch.where(pat == 1, stripe, checks)) > 0
    bg = torch.where(second.unsqueeze(1), tones_t[:, 1].view(b, 3, 1, 1), tones_t[:, 0].view(b, 3, 1, 1))
    fg = fg.view(b, 3, 1, 1, 1)
    video = torch.where(mask.unsqueeze(1), fg, bg.unsqueeze(2))  # [B, 3, F, H, W]
    return video * 2 - 1


def render_clip(clip: ClipSpec) -> torch.Tensor:
    """One clip: float32 [3, NUM_FRAMES, HEIGHT, WIDTH] in [-1, 1]."""
    return render_batch([clip])[0]
