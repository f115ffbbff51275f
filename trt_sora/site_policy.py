"""Which linear layers get Q/DQ: recipe include/exclude patterns plus default exclusions.

Below every stage: the quantize stage inserts Q/DQ where this says, and calibration's
report and the PyTorch fake-quant runners simulate exactly the same sites.

Order of precedence for a site (module path such as ``blocks.0.attn1.to_q``):

1. an explicit ``quantization.exclude`` pattern -> excluded ("recipe exclude ...");
2. an explicit ``quantization.include`` pattern *other than* ``"*"`` -> included, even when a
   default exclusion matches (this is how one default is overridden, e.g. ``include: ["*",
   "proj_out"]`` quantizes the final projection);
3. a default exclusion (when ``default_excludes: true``): the model family's own, in its order
   (``ModelAdapter.quant_excludes``, passed as ``family_excludes``) -> excluded with its reason;
4. the ``"*"`` include (the default) -> included; no include match -> excluded.

Patterns are :func:`fnmatch.fnmatchcase` patterns over module paths without the
export wrapper's ``inner.`` prefix.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from trt_sora.config.recipe import QuantConfig


def site_policy(site: str, config: QuantConfig, family_excludes: Mapping[str, str]) -> tuple[bool, str]:
    """``(quantize?, reason)`` for one site under ``config`` (see the module docstring);
    ``family_excludes``: the model family's default exclusions, ``{pattern: reason}`` (layers known
    to be fragile in a DiT: small, precision-critical, cheap)."""
    for pat in config.exclude:
        if fnmatch.fnmatchcase(site, pat):
            return False, f"recipe exclude {pat!r}"
    for pat in config.include:
        if pat != "*" and fnmatch.fnmatchcase(site, pat):
            return True, f"recipe include {pat!r}"
    if config.default_excludes:
        for pat, why in family_excludes.items():
            if fnmatch.fnmatchcase(site, pat):
                return False, f"default exclusion: {why} (override with quantization.include: ['*', {site!r}])"
    if "*" in config.include:
        return True, "recipe include '*'"
    return False, "matches no quantization.include pattern"
