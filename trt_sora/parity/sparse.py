"""Sparse attention in the parity check: the recipe's pattern resolved at the loop's settings (each layer's
window from the recipe, or picked from the calibrated attention mass), opened on the candidate, so every
level - the single calls, the trajectory, the loop and its decoded clip - judges the sparse candidate
against the dense fp32 reference with the recipe's gates. What passes is what the runtime serves
(``report["candidate"]["open"]["sparse"]``)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trt_sora.errors import ConfigError
from trt_sora.runners.registry import SPARSE_BACKENDS
from trt_sora.sparse import MASS_FILE, AttentionMass, SparsePlan, plan_sparse

__all__ = ["SparseCheck", "plan_sparse_check", "render"]


@dataclasses.dataclass(frozen=True)
class SparseCheck:
    """The plan the candidate opens with, what chose it, and the calibration file it read (``{name: path}``)."""

    plan: SparsePlan
    chosen: dict
    files: dict[str, Path]

    def record(self, layers: Sequence[str], grid) -> dict[str, Any]:
        """``report["sparse_attention"]``: the choice and each layer's block density at the loop's grid."""
        return {**self.chosen, "grid": list(grid), "density": self.plan.density(layers, grid)}


def plan_sparse_check(config, backend: str, timesteps: Sequence[float], calib_dirs: dict[str, Path]) -> SparseCheck:
    """The recipe's sparse plan for ``backend`` over a trajectory of ``timesteps`` (``calib_dirs``: ``{name:
    calib folder}``, one transformer). ConfigError for a backend or a pair it cannot run on."""
    if backend not in SPARSE_BACKENDS:
        raise ConfigError(f"sparse_attention is on but backend {backend!r} runs the dense attention of its graph; "
                          f"check with --backend {' or '.join(SPARSE_BACKENDS)}, or set sparse_attention.enabled: "
                          "false")
    if len(calib_dirs) != 1:
        raise ConfigError("sparse_attention checks one transformer; a pair of experts is not supported yet - set "
                          "sparse_attention.enabled: false")
    files = {} if config.window is not None else {name: Path(d) / MASS_FILE for name, d in calib_dirs.items()}
    mass = AttentionMass.load(next(iter(files.values()))) if files else None
    plan, chosen = plan_sparse(config, timesteps, mass)
    return SparseCheck(plan, chosen, files)


def render(record: dict) -> list[str]:
    """The report.md section: the setting, each layer's window and density."""
    s = record["setting"]
    windows = record["plan"]["windows"]
    lines = ["", "## Sparse attention", "",
             f"tile {s['tile']} tokens, global frames {s['global_frames']}, first {s['dense_steps']} steps dense, "
             f"dense layers {s['dense_layers']}; windows from {record['source']}"
             + (f" (mass budget {record['mass_budget']:g})" if "mass_budget" in record else "")
             + f". Every level above ran the candidate with this pattern; block density at grid {record['grid']}:", "",
             "| layer | window | density |" + (" worst outside mass per candidate |" if "mass" in record else ""),
             "|---|---|---|" + ("---|" if "mass" in record else "")]
    worst = (record.get("mass") or {}).get("worst", {})
    cands = (record.get("mass") or {}).get("candidates", [])
    plan = SparsePlan.from_dict(record["plan"])
    for layer, d in record["density"].items():
        w = plan.window(layer, float("-inf")) if windows else None
        row = f"| {layer} | {list(w) if w else 'dense'} | {d:.3f} |"
        if "mass" in record:
            row += " " + ", ".join(f"{c}: {m:.4f}" if m is not None else f"{c}: -"
                                   for c, m in zip(cands, worst.get(layer, []))) + " |"
        lines.append(row)
    return lines
