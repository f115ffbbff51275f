"""The backend registry: the runner a check verified and the runner the runtime serves come from one call."""
import ast
import dataclasses
import json
from pathlib import Path

import pytest
from run_folders import RECIPE

import trt_sora
from trt_sora.errors import ConfigError
from trt_sora.runners import registry

ROOT = Path(trt_sora.__file__).resolve().parent
#: the runner classes of the registered backends
BACKEND_RUNNERS = {"TrtRunner", "OrtRunner", "TorchFp8Runner", "TorchRunner"}


def _constructions(path: Path) -> set[str]:
    """Names of the backend runner classes called in ``path``."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in BACKEND_RUNNERS:
                calls.add(name)
    return calls


def test_the_registry_is_the_only_place_backend_runners_are_constructed():
    found = {str(p.relative_to(ROOT)): c for p in sorted(ROOT.rglob("*.py")) if (c := _constructions(p))}
    assert found == {"runners/registry.py": BACKEND_RUNNERS}


def _recording(monkeypatch, name: str) -> list:
    """Record every ``open`` of backend ``name`` (root, the artifacts it loads, options), then open it."""
    calls = []
    b = registry.BACKENDS[name]

    def opener(root, arts, family, options, **kw):
        calls.append((Path(root), {k: Path(arts[k]).resolve() for k in b.loads(arts)}, options))
        return b._open(root, arts, family, options, **kw)

    monkeypatch.setitem(registry.BACKENDS, name, dataclasses.replace(b, _open=opener))
    return calls


def test_check_and_load_open_the_candidate_with_one_call_and_the_same_options(checked_run, monkeypatch):
    import trt_sora.runtime as rt
    from trt_sora.parity import check_artifacts

    calls = _recording(monkeypatch, "ort")
    rep = check_artifacts(checked_run, RECIPE, write=False)
    cand = [c for c in calls if "qdq" in c[1]]  # the check's candidate (its export level opens the plain ONNX)
    assert len(cand) == 1
    _, check_arts, check_opts = cand[0]
    assert rep["candidate"]["open"] == check_opts.checked()
    assert json.loads((checked_run / "parity" / "report.json").read_text())["candidate"]["open"] == rep[
        "candidate"]["open"]
    calls.clear()
    r = rt.load(checked_run, backend="ort", warmup=False, threads=1, device="cpu")
    r.close()
    (root, served_arts, served_opts), = calls
    assert root == checked_run and served_arts == check_arts
    assert served_opts.checked() == check_opts.checked()
    assert (served_opts.threads, served_opts.device) == (1, "cpu")  # resources: the caller's


@pytest.mark.parametrize("backend", sorted(registry.BACKENDS), ids=lambda b: f"backend-{b}")  # not a marker name
def test_the_options_a_report_records_are_the_options_served(backend):
    """Every backend, a recipe off every default: the checked options go through the report (JSON) into
    the served runner's options; the resources are the caller's."""
    from trt_sora.config import TorchFp8Config, load_recipe

    recipe = dataclasses.replace(load_recipe(RECIPE), torch_fp8=TorchFp8Config(
        fp8_attention=False, attention_exclude=("blocks.0",), attention_timesteps=(100.0, 900.0),
        attention_kernel="cudnn-fp8", cuda_graphs=False, gemm_fast_accum=False))
    checked = registry.check_options(backend, recipe, device="cuda:1")
    rep = json.loads(json.dumps({"candidate": {"backend": backend, "open": checked.checked()}}))
    served = registry.served_options(rep, device="cuda:0", dtype="bf16", compile=True, threads=2, contexts=3)
    assert served.checked() == checked.checked()
    assert (served.device, served.dtype, served.compile, served.threads, served.contexts) == (
        "cuda:0", "bf16", True, 2, 3)
    if backend == "torch-fp8":
        assert checked.checked() == {"cuda_graphs": False, "fast_accum": False, "attention": {
            "enabled": False, "exclude": ["blocks.0"], "timesteps": [100.0, 900.0], "kernel": "cudnn-fp8"}}
    else:
        assert checked.checked() == registry.OpenOptions().checked()


def test_a_sparse_plan_is_checked_and_served_as_recorded_and_dense_graphs_refuse_it(tmp_path):
    sparse = {"tile": [1, 8, 16], "global_frames": 1, "dense_above": 800.0,
              "windows": {"blocks.0": None, "*": [1, 1, 1]}}
    checked = dataclasses.replace(registry.OpenOptions(), sparse=sparse)
    rep = json.loads(json.dumps({"candidate": {"backend": "torch-fp8", "open": checked.checked()}}))
    assert registry.served_options(rep).sparse == sparse
    for backend in ("ort", "trt"):
        with pytest.raises(ConfigError, match="sparse attention runs on torch and torch-fp8"):
            registry.get_backend(backend).open(tmp_path, {}, None, checked)


def test_a_report_without_recorded_options_serves_the_policy_it_executed():
    ran = {"attention_policy": {"enabled": False, "exclude": [], "timesteps": [0.0, 1000.0]}, "gemm_fast_accum": True}
    served = registry.served_options({"candidate": {"backend": "torch-fp8", "device": ran}})
    assert (served.attention, served.fast_accum, served.cuda_graphs) == (ran["attention_policy"], True, True)


def test_the_verified_files_map_back_to_the_artifacts_a_backend_loads(tmp_path):
    files = {"quant/model.qdq.onnx": tmp_path / "q", "quant/model.qdq.onnx.data": tmp_path / "qd",
             "high/engine/wan-sm90.plan": tmp_path / "p", "calib/stats.safetensors": tmp_path / "s"}
    arts = registry.artifacts_from_files(files)
    assert arts == {"qdq": tmp_path / "q", "engine": tmp_path / "p", "stats": tmp_path / "s"}
    assert registry.BACKENDS["ort"].loads({**arts, "export": tmp_path / "e"}) == ("qdq",)
    assert registry.BACKENDS["ort"].loads({"export": tmp_path / "e", "qdq": None}) == ("export",)
    assert registry.BACKENDS["torch"].loads(arts) == ()


def test_an_unknown_backend_names_the_registered_ones():
    from trt_sora.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'torch-fp8'"):
        registry.get_backend("torch_fp8")
