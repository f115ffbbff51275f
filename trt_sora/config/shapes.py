"""Named latent-space shape ranges (TensorRT optimization profiles, export ranges).

All dims are in *latent* space: ``latent_frames`` counts latent frames (Wan:
``(num_frames - 1) // 4 + 1``), ``latent_height``/``latent_width`` count latent
pixels (pixels / 8 for Wan's VAE), ``text_len`` counts text tokens. A model family may add dims of its own
(HunyuanVideo 1.5:
``text_len_2``, its second text encoder's tokens): a bucket carries them in ``extra``
(see :meth:`ShapeProfile.with_extra`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from trt_sora.errors import ConfigError, ShapeError

DIM_NAMES: tuple[str, ...] = ("batch", "latent_frames", "latent_height", "latent_width", "text_len")


@dataclasses.dataclass(frozen=True)
class DimRange:
    """One dimension's ``min <= opt <= max`` (ints, >= 1)."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        for k in ("min", "opt", "max"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k}={v!r} must be an integer >= 1")
        if not self.min <= self.opt <= self.max:
            raise ConfigError(
                f"need min <= opt <= max, got min={self.min}, opt={self.opt}, max={self.max}; "
                "fix the order of the values"
            )

    @classmethod
    def from_yaml(cls, value, *, where: str = "") -> DimRange:
        """Accept ``7`` (fixed), ``[min, max]`` (opt=max), ``[min, opt, max]`` or a mapping."""
        try:
            if isinstance(value, bool):
                raise ConfigError(f"expected an int or [min, opt, max], got {value!r}")
            if isinstance(value, int):
                return cls(value, value, value)
            if isinstance(value, (list, tuple)) and len(value) == 2:
                return cls(value[0], value[1], value[1])
            if isinstance(value, (list, tuple)) and len(value) == 3:
                return cls(*value)
            if isinstance(value, Mapping):
                unknown = set(value) - {"min", "opt", "max"}
                if unknown:
                    raise ConfigError(f"unknown key(s) {sorted(unknown)}; use min/opt/max")
                return cls(value["min"], value.get("opt", value["max"]), value["max"])
            raise ConfigError(f"expected an int, [min, max], [min, opt, max] or a mapping, got {value!r}")
        except (ConfigError, KeyError, TypeError) as exc:
            raise ConfigError(f"{where or 'dim'}: {exc}") from None

    def to_yaml(self):
        return [self.min, self.opt, self.max]

    def contains(self, v: int) -> bool:
        return self.min <= v <= self.max


@dataclasses.dataclass(frozen=True)
class ShapeProfile:
    """A named latent-space shape bucket: one ``DimRange`` per dim in ``DIM_NAMES``.

    ``validate(patch_size)`` checks that every latent frame/height/width value
    that the range can take at min/opt/max is divisible by the model's patch.
    """

    name: str
    batch: DimRange
    latent_frames: DimRange
    latent_height: DimRange
    latent_width: DimRange
    text_len: DimRange
    #: a model family's own dims, ``((name, range), ...)`` (see the module docstring)
    extra: tuple[tuple[str, DimRange], ...] = ()

    @classmethod
    def from_yaml(cls, value, *, where: str = "", extra_dims: tuple[str, ...] = ()) -> ShapeProfile:
        """A bucket from YAML. ``extra_dims``: the model family's own dims it may name; any other key
        is an error. A ``to_yaml`` of a bucket with extra dims reads back (its extras are accepted)."""
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where or 'bucket'}: expected a mapping with name + {DIM_NAMES}")
        from trt_sora.config.base import did_you_mean

        extra_dims = tuple(extra_dims) + tuple(k for k in (value.get("extra") or {}) if k not in extra_dims)
        known = ("name",) + DIM_NAMES + extra_dims
        for k in value:
            if k not in known and k != "extra":
                raise ConfigError(
                    f"unknown key {f'{where}.{k}' if where else k!r}{did_you_mean(k, known)}; "
                    f"a bucket has {', '.join(known)}"
                )
        missing = [k for k in ("name",) + DIM_NAMES if k not in value]
        if missing:
            raise ConfigError(f"{where or 'bucket'}: missing {missing}")
        name = value["name"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a non-empty string")
        dims = {k: DimRange.from_yaml(value[k], where=f"{where}.{k}" if where else k) for k in DIM_NAMES}
        given = {**dict(value.get("extra") or {}), **{k: value[k] for k in extra_dims if k in value}}
        extra = tuple((k, DimRange.from_yaml(v, where=f"{where}.{k}" if where else k)) for k, v in given.items())
        return cls(name=name, **dims, extra=extra)

    def to_yaml(self) -> dict:
        """``{name, <shared dims>}`` plus ``extra: {dim: [min, opt, max]}`` when the bucket has family dims."""
        out = {"name": self.name, **{k: getattr(self, k).to_yaml() for k in DIM_NAMES}}
        if self.extra:
            out["extra"] = {k: r.to_yaml() for k, r in self.extra}
        return out

    def dims(self) -> Iterator[tuple[str, DimRange]]:
        for k in DIM_NAMES:
            yield k, getattr(self, k)
        yield from self.extra

    def range(self, dim: str) -> DimRange:
        """The range of ``dim`` (a shared dim or one of ``extra``); ShapeError when the bucket has none."""
        for k, r in self.dims():
            if k == dim:
                return r
        raise ShapeError(f"bucket {self.name!r} has no dim {dim!r} (it has {[k for k, _ in self.dims()]})")

    def with_extra(self, defaults: Mapping[str, DimRange]) -> ShapeProfile:
        """This bucket with every dim of ``defaults`` it does not name yet (a family's own dims)."""
        have = {k for k, _ in self.extra}
        add = tuple((k, r) for k, r in defaults.items() if k not in have)
        return dataclasses.replace(self, extra=self.extra + add) if add else self

    def point(self, which: str = "opt") -> dict[str, int]:
        """The ``min`` / ``opt`` / ``max`` corner as ``{dim: value}``."""
        if which not in ("min", "opt", "max"):
            raise ConfigError(f"point must be min/opt/max, got {which!r}")
        return {k: getattr(r, which) for k, r in self.dims()}

    def contains(self, point: Mapping[str, int]) -> bool:
        """True when every dim of the bucket holds ``point``'s value (a family dim the point does not
        carry is not checked: a model without it never sees it)."""
        return all(r.contains(int(point[k])) for k, r in self.dims() if k in DIM_NAMES or k in point)

    def validate(self, patch_size: tuple[int, int, int]) -> ShapeProfile:
        """Check latent frames/height/width divisibility by the patch ``(t, h, w)``."""
        for dim, p in zip(("latent_frames", "latent_height", "latent_width"), patch_size):
            r = getattr(self, dim)
            for which in ("min", "opt", "max"):
                v = getattr(r, which)
                if v % p:
                    raise ConfigError(
                        f"bucket {self.name!r}: {dim}.{which}={v} is not divisible by the model's "
                        f"patch size {p} along that axis; use a multiple of {p} "
                        f"(e.g. {v - v % p or p} or {v - v % p + p})"
                    )
        return self


def check_point(point: Mapping[str, int], profiles, *, what: str = "input") -> ShapeProfile:
    """Return the first profile containing ``point``; else ShapeError listing all buckets."""
    for prof in profiles:
        if prof.contains(point):
            return prof
    listing = "; ".join(
        f"{p.name}: " + ", ".join(f"{k} {r.min}..{r.max}" for k, r in p.dims()) for p in profiles
    )
    shown = ", ".join(f"{k}={v}" for k, v in point.items())
    raise ShapeError(f"{what} shape ({shown}) is outside every bucket [{listing}]; "
                     "pick a shape inside one bucket or add a bucket to the recipe and rebuild")
