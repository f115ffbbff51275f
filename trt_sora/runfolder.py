"""A run folder's layout: the one place that names its subfolders and files.

::

    build/<model>/<recipe>/
        recipe.yaml  pipeline.json
        export/  calib/  quant/  engine/  parity/       (each with a manifest.json)
        experts/ high/<stage> low/<stage>                a pair of experts: one parity/ for both

Every stage, ``check``, ``ls``, ``batch``, ``generate`` and the runtime ask :class:`RunFolder` for a
path instead of joining names by hand. The file names are module constants so a stage writing into
its temp folder uses the same names the readers look for.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from trt_sora.errors import ArtifactError
from trt_sora.manifest import MANIFEST, read_json, verify_folder
from trt_sora.manifest import read_manifest as _read_manifest

#: Pipeline stage -> its folder in a run folder.
STAGE_FOLDERS = {"export": "export", "calibrate": "calib", "quantize": "quant", "build": "engine", "check": "parity"}
#: Folder name -> the ``stage`` its manifest records.
MANIFEST_STAGES = {"export": "export", "calib": "calibrate", "quant": "quantize", "engine": "build",
                   "parity": "parity", "experts": "experts"}

RECIPE = "recipe.yaml"
STATE = "pipeline.json"
EXPERTS = "experts"              # the folder tying a pair of experts together
EXPERTS_JSON = "experts.json"
ONNX_MODEL = "model.onnx"        # export/
CALIB_STATS = "stats.safetensors"  # calib/
CALIB_WEIGHTS = "weights.safetensors"
CALIB_REPORT = "report.md"
QDQ_MODEL = "model.qdq.onnx"     # quant/
QDQ_MAP = "qdq_map.json"
BUILD_REPORT = "build_report.json"  # engine/
BUILD_REPORT_MD = "build_report.md"
PARITY_REPORT = "report.json"    # parity/
PARITY_REPORT_MD = "report.md"


def manifest_path(folder: str | os.PathLike) -> Path:
    """``folder/manifest.json``: where a stage folder lists its files."""
    return Path(folder) / MANIFEST


def has_manifest(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a ``manifest.json`` (a stage finished writing it)."""
    return manifest_path(folder).is_file()


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """``build/<model>/<recipe>/`` (or one expert's folder of a pair): its paths, manifests and reports.

    Paths are computed, never created; readers raise the typed errors of :mod:`trt_sora.manifest`.
    """

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    @staticmethod
    def under(root: str | os.PathLike) -> list[RunFolder]:
        """Every folder under ``root`` with an export manifest (a run folder, or an expert's of a pair)."""
        pattern = f"{STAGE_FOLDERS['export']}/{MANIFEST}"
        return [RunFolder(p.parent.parent) for p in Path(root).rglob(pattern)]

    # -- stage folders ---------------------------------------------------------------------------------
    def stage(self, name: str) -> Path:
        """A stage's folder by pipeline stage (``calibrate``) or folder name (``calib``, ``experts``)."""
        return self.path / STAGE_FOLDERS.get(name, name)

    @property
    def export(self) -> Path:
        return self.stage("export")

    @property
    def calib(self) -> Path:
        return self.stage("calib")

    @property
    def quant(self) -> Path:
        return self.stage("quant")

    @property
    def engine(self) -> Path:
        return self.stage("engine")

    @property
    def parity(self) -> Path:
        return self.stage("parity")

    # -- well-known files ------------------------------------------------------------------------------
    @property
    def recipe(self) -> Path:
        """The recipe the run was made with (``check``, ``ls`` and the runtime read it back)."""
        return self.path / RECIPE

    @property
    def state(self) -> Path:
        """``pipeline.json``: each stage's fingerprint."""
        return self.path / STATE

    def manifest(self, stage: str) -> Path:
        return manifest_path(self.stage(stage))

    def has_manifest(self, stage: str) -> bool:
        return has_manifest(self.stage(stage))

    @property
    def onnx_model(self) -> Path:
        return self.export / ONNX_MODEL

    @property
    def calib_stats(self) -> Path:
        return self.calib / CALIB_STATS

    @property
    def calib_weights(self) -> Path:
        return self.calib / CALIB_WEIGHTS

    @property
    def calib_report(self) -> Path:
        return self.calib / CALIB_REPORT

    @property
    def qdq_model(self) -> Path:
        return self.quant / QDQ_MODEL

    @property
    def qdq_map(self) -> Path:
        return self.quant / QDQ_MAP

    @property
    def build_report(self) -> Path:
        return self.engine / BUILD_REPORT

    @property
    def parity_report(self) -> Path:
        return self.parity / PARITY_REPORT

    @property
    def parity_report_md(self) -> Path:
        return self.parity / PARITY_REPORT_MD

    def engine_plan(self, *, check_stage: bool = True) -> Path | None:
        """The first engine the build manifest lists (not whatever ``*.plan`` lies there); None without one."""
        if not self.has_manifest("engine"):
            return None
        listed = self.read_manifest("engine", check_stage=check_stage).get("outputs", {}).get("engines") or []
        return self.engine / listed[0] if listed else None

    # -- a pair of experts -----------------------------------------------------------------------------
    @property
    def experts_dir(self) -> Path:
        return self.path / EXPERTS

    @property
    def experts_json(self) -> Path:
        return self.experts_dir / EXPERTS_JSON

    @property
    def is_pair(self) -> bool:
        """True for a pair of experts' run folder (its ``experts/`` manifest exists)."""
        return has_manifest(self.experts_dir)

    def expert(self, name: str) -> RunFolder:
        """One expert's folder of a pair (``high/``, ``low/``): the same layout, one level down."""
        return RunFolder(self.path / name)

    def read_pair(self) -> dict | None:
        """``experts/experts.json`` re-hashed against its manifest, or None when this is not a pair."""
        if not self.is_pair:
            return None
        verify_folder(self.experts_dir, stage="experts", fix=f"re-run `trt-sora engine` for {self}")
        pair = read_json(self.experts_json, what="experts file", fix="re-run `trt-sora engine`")
        if not isinstance(pair, dict) or not isinstance(pair.get("experts"), dict) or \
                pair.get("boundary_timestep") is None:
            raise ArtifactError(f"{self.experts_json} does not describe a pair of experts; re-run `trt-sora engine`")
        return pair

    def export_side(self, pair: dict | None = None) -> RunFolder:
        """The folder whose ``export/`` describes the model: this one, or a pair's first expert (every
        expert records the same model entry)."""
        return self if pair is None else self.expert(next(iter(pair["experts"])))

    # -- manifests and reports -------------------------------------------------------------------------
    def read_manifest(self, stage: str, *, check_stage: bool = True) -> dict:
        """A stage's manifest (:func:`trt_sora.manifest.read_manifest`; ArtifactError when missing).
        ``check_stage=False`` accepts a manifest of any stage (what older readers did)."""
        folder = STAGE_FOLDERS.get(stage, stage)
        return _read_manifest(self.stage(folder), stage=MANIFEST_STAGES.get(folder) if check_stage else None)

    def read_report(self) -> dict | None:
        """``parity/report.json`` after re-hashing the parity folder against its manifest (a report edited
        by hand is not a report); None when no check ever finished."""
        if not self.parity.exists():
            return None
        fix = f"re-run `trt-sora check --run {self}`"
        verify_folder(self.parity, stage="parity", fix=fix)
        rep = read_json(self.parity_report, what="parity report", fix=fix)
        if not isinstance(rep, dict) or not isinstance(rep.get("candidate"), dict):
            raise ArtifactError(f"{self.parity_report} is not a parity report of this trt_sora; {fix}")
        return rep

    def resolve(self, rel: str | os.PathLike) -> Path:
        """A path a report records relative to the run folder (absolute paths stay as they are)."""
        p = Path(rel)
        return p if p.is_absolute() else self.path / p
