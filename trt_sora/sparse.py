"""Sparse self-attention: the 3-D tile pattern, its mask, the attention mass it leaves out, and the plan
``check`` verifies and the runtime replays.

The pattern over a token grid ``(F, H, W)`` (latent frames x height x width after patching; tokens in
raster order, as the transformer flattens them):

* tokens are grouped into tiles of ``tile = (tf, th, tw)`` tokens (the grid's edge tiles may be smaller)
  and put in *tile order* (tile by tile, raster inside each; :func:`tile_order`);
* the tile order is cut into blocks of ``tf * th * tw`` tokens (a block is a tile when the grid divides);
* query block ``i`` attends key block ``j`` when a tile of ``i`` and a tile of ``j`` lie within ``window``
  tile distances on every axis, or ``j`` holds a token of the first ``global_frames`` frames
  (:func:`block_mask`); a token attends exactly the keys of the blocks its block attends (:func:`token_mask`).

A block is the unit the 8-bit kernel skips (128-key tiles inside it, :func:`kernel_blocks`), so the
masked reference (:func:`masked_attention`) and the kernel compute the same sparse attention.

The calibrate stage's :class:`MassRecorder` measures, per layer and step, the softmax mass outside each
candidate window (mean over queries, heads and rows; :class:`AttentionMass` in
``calib/attention_mass.safetensors``); :func:`plan_sparse` picks each layer's narrowest window within the
recipe's budget, and :class:`SparsePlan` is what a runner applies (dense for the first steps, by timestep).

No heavy imports at module load: numpy here, torch and safetensors inside the functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trt_sora.errors import ArtifactError, ConfigError
from trt_sora.manifest import read_safetensors

__all__ = ["KERNEL_BLOCK", "MASS_FILE", "AttentionMass", "MassRecorder", "SparsePlan", "TileSparse", "block_mask",
           "kernel_blocks", "masked_attention", "outside_mass", "pick_window", "plan_sparse", "render_mass",
           "tile_order", "tile_sparse", "token_mask"]

#: The calibrate stage's file of per-layer attention mass outside the candidate windows.
MASS_FILE = "attention_mass.safetensors"
_FORMAT = "trt_sora.attention_mass/1"
#: Keys per tile of the 8-bit attention kernel (its scale block): a block must be a multiple of it there.
KERNEL_BLOCK = 128
MASS = "mean over queries, heads and rows of the softmax mass on keys outside the window's mask"
Grid = tuple[int, int, int]


# -- the pattern --------------------------------------------------------------------------------------------
def _coords(grid: Grid) -> np.ndarray:
    """``[S, 3]`` (frame, row, column) of each token in raster order."""
    f, h, w = grid
    return np.stack(np.unravel_index(np.arange(f * h * w), (f, h, w)), axis=1)


@functools.lru_cache(maxsize=64)
def tile_order(grid: Grid, tile: Grid) -> np.ndarray:
    """``perm [S]``: the raster index of the ``i``-th token in tile order (tiles in raster order of their
    tile coordinates, tokens in raster order inside a tile)."""
    c = _coords(grid)
    t = c // np.asarray(tile)
    return np.lexsort((c[:, 2], c[:, 1], c[:, 0], t[:, 2], t[:, 1], t[:, 0]))


@functools.lru_cache(maxsize=64)
def block_mask(grid: Grid, tile: Grid, window: Grid, global_frames: int = 0) -> np.ndarray:
    """``[nb, nb]`` bool: query block ``i`` attends key block ``j`` (see the module docstring)."""
    if len(grid) != 3 or min(grid) < 1:
        raise ConfigError(f"sparse attention: token grid {list(grid)} must be 3 positive sizes")
    c = _coords(grid)[tile_order(grid, tile)]
    tc = c // np.asarray(tile)
    block = int(np.prod(tile))
    nb = -(-len(c) // block)
    tiles, tile_id = np.unique(tc, axis=0, return_inverse=True)
    inc = np.zeros((nb, len(tiles)), bool)
    inc[np.arange(len(c)) // block, tile_id.reshape(-1)] = True
    near = (np.abs(tiles[:, None, :] - tiles[None, :, :]) <= np.asarray(window)).all(-1)
    allowed = (inc.astype(np.int64) @ near.astype(np.int64) @ inc.T.astype(np.int64)) > 0
    glob = np.zeros(nb, bool)
    np.logical_or.at(glob, np.arange(len(c)) // block, c[:, 0] < global_frames)
    return allowed | glob[None, :]


def token_mask(grid: Grid, tile: Grid, window: Grid, global_frames: int = 0, *, order: str = "raster") -> np.ndarray:
    """``[S, S]`` bool, True where query token ``i`` attends key token ``j``; ``order``: ``"raster"`` (the
    transformer's token order) or ``"tile"`` (:func:`tile_order`'s)."""
    bm = block_mask(grid, tile, window, global_frames)
    s = int(np.prod(grid))
    b = np.arange(s) // int(np.prod(tile))
    m = bm[b][:, b]
    if order == "tile":
        return m
    perm = tile_order(grid, tile)
    out = np.empty_like(m)
    out[np.ix_(perm, perm)] = m
    return out


def kernel_blocks(grid: Grid, tile: Grid, window: Grid, global_frames: int = 0):
    """The key tiles each 128-query tile of the tile order attends, for the 8-bit kernel:
    ``(kidx [nq, nfull] int32, kcnt [nq] int32, ragged [nq] int32)`` with ``nq = ceil(S / 128)``,
    ``nfull = S // 128``: ``kidx[i, :kcnt[i]]`` the full key tiles, ascending; ``ragged[i]`` 1 when the
    last, partial key tile is attended. ConfigError unless the block is a multiple of 128 tokens."""
    block = int(np.prod(tile))
    if block % KERNEL_BLOCK:
        raise ConfigError(f"sparse_attention.tile={list(tile)} holds {block} tokens; the 8-bit attention kernel "
                          f"skips {KERNEL_BLOCK}-key tiles, so use a tile of a multiple of {KERNEL_BLOCK} tokens "
                          "(e.g. [1, 8, 16]) for torch-fp8 on CUDA")
    s = int(np.prod(grid))
    r, nq, nfull = block // KERNEL_BLOCK, -(-s // KERNEL_BLOCK), s // KERNEL_BLOCK
    sub = np.kron(block_mask(grid, tile, window, global_frames), np.ones((r, r), bool))[:nq, :nq]
    kidx = np.zeros((nq, max(nfull, 1)), np.int32)
    kcnt = np.zeros(nq, np.int32)
    for i in range(nq):
        js = np.flatnonzero(sub[i, :nfull])
        kidx[i, :len(js)], kcnt[i] = js, len(js)
    ragged = (sub[:, nfull] if nfull < nq else np.zeros(nq, bool)).astype(np.int32)
    return kidx, kcnt, ragged


def masked_attention(q, k, v, mask):
    """Softmax attention over the keys ``mask`` allows: ``q``/``k``/``v`` [B, H, S, D], ``mask`` [S, S]
    bool (True: attend; every row attends at least one key) or None (dense) -> [B, H, S, D]."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def outside_mass(q, k, masks: Sequence[Any], *, chunk: int = 1024) -> list[float]:
    """The mean over queries, heads and rows of the softmax mass on the keys each of ``masks`` ([S, S]
    bool torch tensors, True: attend) leaves out; ``q``/``k`` [B, H, S, D]; fp32 softmax, query chunks
    of ``chunk`` rows."""
    import torch

    scale = 1.0 / math.sqrt(q.shape[-1])
    tot = [0.0] * len(masks)
    for s0 in range(0, q.shape[2], chunk):
        p = torch.softmax((q[:, :, s0:s0 + chunk].float() @ k.float().transpose(-1, -2)) * scale, dim=-1)
        for i, m in enumerate(masks):
            tot[i] += float((p * ~m[s0:s0 + chunk]).sum(-1).double().sum())
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    return [t / rows for t in tot]


# -- what the calibrate stage measures ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AttentionMass:
    """Attention mass outside each candidate window, per self-attention layer and step.

    Attributes:
        layers: block paths (``blocks.0``), in model order.
        steps: the schedule indices covered.
        candidates: the windows measured (tile distances), as the recipe lists them.
        tile / global_frames: the pattern the windows belong to.
        mass: ``[len(layers), len(steps), len(candidates)]`` float64, mean over every call of the step
            (rows, CFG branches, prompts); NaN where no call ran.
    """

    layers: tuple[str, ...]
    steps: tuple[int, ...]
    candidates: tuple[Grid, ...]
    tile: Grid
    global_frames: int
    mass: np.ndarray

    def worst(self, from_step: int) -> np.ndarray:
        """``[layers, candidates]`` the largest per-step mass over the steps ``>= from_step`` (NaN: none ran)."""
        sel = np.asarray(self.steps) >= from_step
        if not sel.any() or np.isnan(self.mass[:, sel]).all():
            return np.full((len(self.layers), len(self.candidates)), np.nan)
        return np.nanmax(self.mass[:, sel], axis=1)

    def summary(self, from_step: int = 0) -> dict[str, Any]:
        worst = self.worst(from_step)
        return {"measure": MASS, "tile": list(self.tile), "global_frames": self.global_frames,
                "candidates": [list(c) for c in self.candidates], "steps": list(self.steps),
                "from_step": from_step,
                "worst": {name: [None if math.isnan(x) else round(float(x), 6) for x in row]
                          for name, row in zip(self.layers, worst)}}

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        meta = {"format": _FORMAT, "measure": MASS, "layers": json.dumps(list(self.layers)),
                "candidates": json.dumps([list(c) for c in self.candidates]), "tile": json.dumps(list(self.tile)),
                "global_frames": str(self.global_frames)}
        save_file({"mass": np.ascontiguousarray(self.mass, np.float64), "steps": np.asarray(self.steps, np.int64)},
                  str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> AttentionMass:
        meta, t = read_safetensors(path, fmt=_FORMAT, what="an attention-mass file",
                                   missing="the calibration measured no attention mass",
                                   fix="re-run `trt-sora calibrate` with the recipe's sparse_attention section enabled")
        return cls(layers=tuple(json.loads(meta["layers"])), steps=tuple(int(s) for s in t["steps"]),
                   candidates=tuple(tuple(c) for c in json.loads(meta["candidates"])),
                   tile=tuple(json.loads(meta["tile"])), global_frames=int(meta["global_frames"]), mass=t["mass"])


class MassRecorder:
    """Measures :class:`AttentionMass` over the calibration's trajectories: while :meth:`at` holds, each
    self-attention site (``{layer: processor}`` with a ``sparse`` seam) records the mass outside every
    candidate window of ``config`` and returns the dense attention (the trajectories are unchanged)."""

    def __init__(self, config, num_steps: int):
        self.config, self.num_steps = config, int(num_steps)
        self._sum: dict[str, np.ndarray] = {}
        self._count: dict[str, np.ndarray] = {}

    @contextlib.contextmanager
    def at(self, sites: Mapping[str, Any], grid: Grid, step: int) -> Iterator[None]:
        for layer, proc in sites.items():
            proc.sparse = functools.partial(self._attend, layer, tuple(grid), int(step))
        try:
            yield
        finally:
            for proc in sites.values():
                proc.sparse = None

    def _attend(self, layer: str, grid: Grid, step: int, q, k, v):
        import torch

        c = self.config
        masks = [torch.from_numpy(token_mask(grid, c.tile, w, c.global_frames)).to(q.device) for w in c.candidates]
        mass = outside_mass(q, k, masks)
        n = q.shape[0] * q.shape[1]
        s = self._sum.setdefault(layer, np.zeros((self.num_steps, len(masks))))
        cnt = self._count.setdefault(layer, np.zeros(self.num_steps))
        s[step] += np.asarray(mass) * n
        cnt[step] += n
        return masked_attention(q, k, v, None)

    def result(self, steps: Sequence[int] | None = None) -> AttentionMass:
        steps = tuple(range(self.num_steps)) if steps is None else tuple(int(s) for s in steps)
        layers = tuple(self._sum)
        with np.errstate(invalid="ignore", divide="ignore"):
            mass = np.stack([self._sum[n][list(steps)] / self._count[n][list(steps), None] for n in layers]) \
                if layers else np.zeros((0, len(steps), len(self.config.candidates)))
        return AttentionMass(layers, steps, self.config.candidates, tuple(self.config.tile),
                             self.config.global_frames, mass)


def pick_window(candidates: Sequence[Grid], worst: Sequence[float], budget: float) -> Grid | None:
    """The first (narrowest) candidate whose worst mass is <= ``budget``; None (dense) when none is."""
    return next((tuple(c) for c, m in zip(candidates, worst) if m <= budget), None)


def render_mass(mass: AttentionMass, config) -> list[str]:
    """The calibration report's section: per layer, the worst mass outside each candidate over the sparse
    steps and the window :func:`plan_sparse` picks at ``config.mass_budget``."""
    worst = mass.worst(config.dense_steps)
    cands = [str(list(c)) for c in mass.candidates]
    lines = ["", "## Sparse attention: attention mass outside each candidate window", "",
             f"{MASS}; the worst step from step {config.dense_steps} on (the first steps run dense), tile "
             f"{list(mass.tile)} tokens, global frames {mass.global_frames}. A layer takes the narrowest window "
             f"whose mass is <= {config.mass_budget:g} (none: dense).", "",
             "| layer | " + " | ".join(cands) + " | window |", "|---" * (len(cands) + 2) + "|"]
    for layer, row in zip(mass.layers, worst):
        w = pick_window(mass.candidates, row, config.mass_budget)
        lines.append(f"| {layer} | " + " | ".join("-" if math.isnan(m) else f"{m:.4f}" for m in row)
                     + f" | {list(w) if w else 'dense'} |")
    return lines


# -- the plan a runner applies --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SparsePlan:
    """The sparse attention a runner applies: ``windows`` maps layer patterns (fnmatch over block paths; the
    first match decides, none: dense) to a window or None (dense); the tile and global frames; and
    ``dense_above``: calls whose timestep is above it run dense (the first steps)."""

    tile: Grid
    windows: Mapping[str, Grid | None]
    global_frames: int = 0
    dense_above: float = math.inf

    def window(self, layer: str, timestep: float) -> Grid | None:
        if timestep > self.dense_above:
            return None
        return next((w for p, w in self.windows.items() if fnmatch.fnmatchcase(layer, p)), None)

    def set(self, sites: Mapping[str, Any], grid: Grid | None, timestep: float, device) -> tuple:
        """Set each site's ``sparse`` seam (:class:`TileSparse`, None: dense) for one call (``grid`` None:
        every site dense); returns the seams set, a key of the call's pattern."""
        seams = []
        for layer, site in sites.items():
            w = None if grid is None else self.window(layer, timestep)
            site.sparse = None if w is None else tile_sparse(tuple(grid), self.tile, w, self.global_frames,
                                                             str(device))
            seams.append(site.sparse)
        return tuple(seams)

    @contextlib.contextmanager
    def applied(self, sites: Mapping[str, Any], grid: Grid, timestep: float, device) -> Iterator[None]:
        """The seams of one call set for the duration of the block (then every site dense again)."""
        self.set(sites, grid, timestep, device)
        try:
            yield
        finally:
            self.set(sites, None, timestep, device)

    def density(self, layers: Sequence[str], grid: Grid) -> dict[str, float]:
        """Fraction of query-key blocks each of ``layers`` computes at ``grid`` in the sparse steps."""
        return {layer: 1.0 if (w := self.window(layer, -math.inf)) is None else
                round(float(block_mask(tuple(grid), self.tile, w, self.global_frames).mean()), 6) for layer in layers}

    def to_dict(self) -> dict[str, Any]:
        return {"tile": list(self.tile), "global_frames": self.global_frames,
                "dense_above": None if math.isinf(self.dense_above) else self.dense_above,
                "windows": {k: None if w is None else list(w) for k, w in self.windows.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SparsePlan | None:
        if not d:
            return None
        try:
            above = d.get("dense_above")
            return cls(tile=tuple(int(x) for x in d["tile"]), global_frames=int(d.get("global_frames", 0)),
                       dense_above=math.inf if above is None else float(above),
                       windows={str(k): None if w is None else tuple(int(x) for x in w)
                                for k, w in d["windows"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ArtifactError("the sparse attention plan is not one of this trt_sora; re-run `trt-sora check`") \
                from None


@dataclasses.dataclass(frozen=True, eq=False)
class TileSparse:
    """One layer's pattern at one token grid on one device: the ``sparse`` seam a self-attention calls.
    Called as ``seam(q, k, v)`` ([B, H, S, D], raster order) it is :func:`masked_attention`; a fused block
    instead permutes its tokens by ``perm`` (raster index of each tile-order token; ``inv`` undoes it) and
    runs the 8-bit kernel over ``kernel_blocks`` or the reference over ``mask_tile``. The masks ([S, S])
    are built on first use only: the GPU kernel needs none."""

    grid: Grid
    tile: Grid
    window: Grid
    global_frames: int
    device: str

    def _t(self, a):
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    @functools.cached_property
    def perm(self):
        return self._t(tile_order(self.grid, self.tile).astype(np.int64))

    @functools.cached_property
    def inv(self):
        return self._t(np.argsort(tile_order(self.grid, self.tile)).astype(np.int64))

    @functools.cached_property
    def mask(self):
        return self._t(token_mask(self.grid, self.tile, self.window, self.global_frames))

    @functools.cached_property
    def mask_tile(self):
        return self._t(token_mask(self.grid, self.tile, self.window, self.global_frames, order="tile"))

    @functools.cached_property
    def kernel_blocks(self):
        return tuple(self._t(a) for a in kernel_blocks(self.grid, self.tile, self.window, self.global_frames))

    def __call__(self, q, k, v):
        return masked_attention(q, k, v, self.mask)

    def attend_tile(self, q, k, v):
        """:func:`masked_attention` of tile-ordered ``q``/``k``/``v``."""
        return masked_attention(q, k, v, self.mask_tile)


@functools.lru_cache(maxsize=32)
def tile_sparse(grid: Grid, tile: Grid, window: Grid, global_frames: int, device: str) -> TileSparse:
    """The (cached) seam of one pattern at ``grid`` on ``device``."""
    return TileSparse(tuple(grid), tuple(tile), tuple(window), int(global_frames), str(device))


def plan_sparse(config, timesteps: Sequence[float], mass: AttentionMass | None = None) -> tuple[SparsePlan, dict]:
    """The plan of ``config`` (the recipe's ``sparse_attention``) at a trajectory of ``timesteps`` (the
    scheduler's), and a record of what it chose: ``config.window`` for every layer not matching
    ``dense_layers``, else each calibrated layer's narrowest candidate whose worst mass over the sparse steps
    is <= ``mass_budget`` (none: dense). ArtifactError / ConfigError naming the fix when ``mass`` is missing
    or measured another pattern."""
    n, k = len(timesteps), config.dense_steps
    dense_above = (float(timesteps[k - 1]) + float(timesteps[k])) / 2 if 0 < k < n else math.inf
    dense: dict[str, Grid | None] = {p: None for p in config.dense_layers}
    chosen: dict[str, Any] = {"setting": {"tile": list(config.tile), "global_frames": config.global_frames,
                                          "dense_steps": config.dense_steps, "dense_layers": list(config.dense_layers)}}
    if config.window is not None:
        windows = {**dense, "*": tuple(config.window)}
        chosen["source"] = "the recipe's window"
    else:
        if mass is None:
            raise ArtifactError("sparse_attention has no window; the calibrate stage picks one per layer from its "
                                f"measured attention mass ({MASS_FILE}): re-run `trt-sora calibrate`")
        if tuple(mass.tile) != tuple(config.tile) or tuple(mass.candidates) != tuple(config.candidates) \
                or mass.global_frames != config.global_frames:
            raise ConfigError(f"sparse_attention: the calibration measured tile {list(mass.tile)}, candidates "
                              f"{[list(c) for c in mass.candidates]}, global_frames {mass.global_frames}; the recipe "
                              "asks for others - re-run `trt-sora calibrate` with this recipe")
        windows = dict(dense)
        for layer, row in zip(mass.layers, mass.worst(config.dense_steps)):
            windows.setdefault(layer, pick_window(mass.candidates, row, config.mass_budget))
        chosen.update(source="calibrated", mass_budget=config.mass_budget, mass=mass.summary(config.dense_steps))
    if k >= n:  # every step dense
        windows = {}
    plan = SparsePlan(tuple(config.tile), windows, config.global_frames, dense_above)
    chosen["plan"] = plan.to_dict()
    return plan, chosen
