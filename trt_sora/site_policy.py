"""Which linear layers get Q/DQ: recipe include/exclude patterns plus default exclusions.

Below every stage: the quantize stage inserts Q/DQ where this says, and calibration's
report and the PyTorch fake-quant runners simulate exactly the same sites.

Order of precedence for a site (module path such as ``blocks.0.attn1.to_q``):

1. an explicit ``quantization.exclude`` pattern -> excluded ("recipe exclude ...");
2. an explicit ``quantization.include`` pattern *other than* ``"*"`` -> included, even when a
   default exclusion matches (this is how one default is overridden, e.g. ``include: ["*",
   "proj_out"]`` quantizes the final projection);
3. a default exclusion (when ``default_excludes: true``): the shared ones below, then the model
   family's own (``ModelAdapter.quant_excludes``, passed as ``family_excludes``) -> excluded with its reason;
4. the ``"*"`` include (the default) -> included; no include match -> excluded.

Patterns are :func:`fnmatch.fnmatchcase` patterns over module paths without the
export wrapper's ``inner.`` prefix.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from trt_sora.config.recipe import QuantConfig

#: ``pattern -> reason``: layers known to be fragile in DiTs (small, precision-critical, cheap).
DEFAULT_EXCLUDES: dict[str, str] = {
    "patch_embedding": "patch embedding (first layer, sees raw latents)",
    "patch_embedding.*": "patch embedding (first layer, sees raw latents)",
    "x_embedder*": "patch embedding (first layer, sees raw latents)",
    "condition_embedder.time_embedder.*": "timestep embedder (runs on fp32 sinusoids)",
    "condition_embedder.time_proj": "AdaLN modulation projection (scales every block)",
    "condition_embedder.text_embedder.*": "text embedder (conditions every cross-attention)",
    "condition_embedder.image_embedder.*": "image embedder (conditions every cross-attention)",
    "time_embed*": "timestep embedder",
    "*.norm1.linear": "AdaLN modulation",
    "*.norm1_context.linear": "AdaLN modulation",
    "*adaLN_modulation*": "AdaLN modulation",
    "norm_out.*": "final AdaLN modulation",
    "proj_out": "final projection (writes the predicted velocity/noise)",
}


def site_policy(site: str, config: QuantConfig, family_excludes: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """``(quantize?, reason)`` for one site under ``config`` (see the module docstring);
    ``family_excludes``: the model family's own default exclusions, ``{pattern: reason}``."""
    for pat in config.exclude:
        if fnmatch.fnmatchcase(site, pat):
            return False, f"recipe exclude {pat!r}"
    for pat in config.include:
        if pat != "*" and fnmatch.fnmatchcase(site, pat):
            return True, f"recipe include {pat!r}"
    if config.default_excludes:
        for pat, why in {**DEFAULT_EXCLUDES, **dict(family_excludes or {})}.items():
            if fnmatch.fnmatchcase(site, pat):
                return False, f"default exclusion: {why} (override with quantization.include: ['*', {site!r}])"
    if "*" in config.include:
        return True, "recipe include '*'"
    return False, "matches no quantization.include pattern"
