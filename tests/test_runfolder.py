"""RunFolder: the one layout of a run folder, its readers' typed errors, and no hand joins elsewhere."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import trt_sora
from trt_sora.errors import ArtifactError
from trt_sora.manifest import write_json, write_manifest
from trt_sora.runfolder import RunFolder

PKG = Path(trt_sora.__file__).resolve().parent


def test_layout_is_the_documented_one(tmp_path):
    rf = RunFolder(tmp_path)
    want = {  # ARCHITECTURE.md's tree, spelled out independently of runfolder.py's constants
        rf.recipe: "recipe.yaml", rf.state: "pipeline.json",
        rf.onnx_model: "export/model.onnx", rf.manifest("export"): "export/manifest.json",
        rf.calib_stats: "calib/stats.safetensors", rf.calib_weights: "calib/weights.safetensors",
        rf.calib_report: "calib/report.md", rf.manifest("calibrate"): "calib/manifest.json",
        rf.qdq_model: "quant/model.qdq.onnx", rf.qdq_map: "quant/qdq_map.json",
        rf.build_report: "engine/build_report.json", rf.manifest("build"): "engine/manifest.json",
        rf.parity_report: "parity/report.json", rf.parity_report_md: "parity/report.md",
        rf.manifest("check"): "parity/manifest.json", rf.experts_json: "experts/experts.json",
    }
    assert {str(p.relative_to(tmp_path)): rel for p, rel in want.items()} == {rel: rel for rel in want.values()}
    assert RunFolder(str(tmp_path)).path == tmp_path  # a str is taken as a path
    with pytest.raises(AttributeError):
        rf.path = tmp_path / "x"  # frozen


def _stage(folder: Path, stage: str, files: dict[str, str], **kw) -> None:
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    write_manifest(folder, stage=stage, inputs={}, config={}, **kw)


def _pair(tmp_path) -> RunFolder:
    rf = RunFolder(tmp_path)
    pair = {"boundary_timestep": 875.0, "experts": {"high": {"folder": "high"}, "low": {"folder": "low"}}}
    rf.experts_dir.mkdir()
    write_json(rf.experts_json, pair)
    write_manifest(rf.experts_dir, stage="experts", inputs={}, config={}, results=pair)
    for e in ("high", "low"):
        _stage(tmp_path / e / "export", "export", {"model.onnx": e}, results={"model": {"ref": e}})
    return rf


def test_pair_layout(tmp_path):
    assert not RunFolder(tmp_path).is_pair and RunFolder(tmp_path).read_pair() is None
    rf = _pair(tmp_path)
    assert rf.is_pair
    assert rf.expert("low").onnx_model == tmp_path / "low" / "export" / "model.onnx"
    assert rf.expert("high").read_manifest("export")["results"]["model"] == {"ref": "high"}
    pair = rf.read_pair()
    assert list(pair["experts"]) == ["high", "low"]
    assert rf.export_side(pair) == rf.expert("high") and rf.export_side(None) == rf


def test_pair_edited_after_writing_is_refused(tmp_path):
    rf = _pair(tmp_path)
    rf.experts_json.write_text(json.dumps({"boundary_timestep": 1.0, "experts": {}}))
    with pytest.raises(ArtifactError, match="experts.json"):
        rf.read_pair()


def test_missing_or_foreign_stage_is_the_manifest_readers_error(tmp_path):
    rf = RunFolder(tmp_path)
    with pytest.raises(ArtifactError, match=r"engine has no manifest\.json"):
        rf.read_manifest("build")
    assert rf.engine_plan() is None and rf.read_report() is None and not rf.has_manifest("export")
    _stage(rf.quant, "export", {"model.qdq.onnx": "q"})  # an export's manifest in quant/
    with pytest.raises(ArtifactError, match="holds a 'export' artifact, expected 'quantize'"):
        rf.read_manifest("quantize")
    assert rf.read_manifest("quant", check_stage=False)["stage"] == "export"


def test_engine_plan_is_the_listed_one(tmp_path):
    rf = RunFolder(tmp_path)
    _stage(rf.engine, "build", {"a.plan": "a", "b.plan": "b"}, outputs={"engines": ["b.plan"]})
    assert rf.engine_plan() == tmp_path / "engine" / "b.plan"


def test_report_is_rehashed_before_it_is_read(tmp_path):
    rf = RunFolder(tmp_path)
    _stage(rf.parity, "parity", {"report.json": json.dumps({"passed": True, "candidate": {}})})
    assert rf.read_report() == {"passed": True, "candidate": {}}
    rf.parity_report.write_text(json.dumps({"passed": True, "candidate": {"x": 1}}))  # edited by hand
    with pytest.raises(ArtifactError, match=r"parity/report\.json .*parity/manifest\.json"):
        rf.read_report()


# -- no other code joins run-folder subpaths ------------------------------------------------------------------
_NAMES = (r"export|calib|quant|engine|parity|experts|high|low|manifest\.json|recipe\.yaml|pipeline\.json"
          r"|experts\.json|report\.json|report\.md|build_report\.json|build_report\.md|stats\.safetensors"
          r"|weights\.safetensors|model\.onnx|model\.qdq\.onnx|qdq_map\.json")
#: ``x / "export"``, ``x / "model.onnx"``, ``x / MANIFEST``, ``rglob("export/...")``.
HAND_JOIN = re.compile(rf'/\s*"({_NAMES})"|/\s*MANIFEST\b|glob\("({_NAMES})/')
#: Lines that join one of these names but are not a run folder, each with why.
ALLOWED: dict[str, str] = {
    "manifest.py": "the manifest module itself: any stage folder's manifest.json, run folder or not",
    "runfolder.py": "the layout",
}


def hand_joins(root: Path = PKG) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ALLOWED:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HAND_JOIN.search(line.split("#")[0]):
                out.append(f"{rel}:{i}: {line.strip()}")
    return out


def test_no_hand_joins_of_run_folder_paths():
    assert hand_joins() == []


def test_the_grep_finds_a_hand_join(tmp_path):
    (tmp_path / "m.py").write_text('a = run / "parity" / "report.json"\nb = f / MANIFEST\n'
                                   'c = Path(r).rglob("export/x")\nd = run / "config.json"\n')
    assert [h.split(":")[1] for h in hand_joins(tmp_path)] == ["1", "2", "3"]
