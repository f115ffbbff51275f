"""Shape buckets small enough for ~5 s builds (a module of its own: ``from conftest import`` is ambiguous
once pytest is given several test folders, each with its own conftest)."""
from __future__ import annotations

from trt_sora.config import DimRange, ShapeProfile


def bucket(name: str, f: int, *, batch=(1, 2, 2), text=(1, 8, 8)) -> ShapeProfile:
    """A latent bucket ``f`` frames, ``2f x 2f`` latent pixels."""
    return ShapeProfile(name, DimRange(*batch), DimRange(1, f, f), DimRange(2, 2 * f, 2 * f),
                        DimRange(2, 2 * f, 2 * f), DimRange(*text))
