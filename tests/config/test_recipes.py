import dataclasses

import pytest
import yaml

from trt_sora.config import (
    DimRange,
    QuantFormat,
    ShapeProfile,
    check_point,
    dump_recipe,
    list_recipes,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
)
from trt_sora.errors import ConfigError, ShapeError

RECIPES = sorted(list_recipes())


def test_expected_recipes_exist():
    for name in ("h100-fp8", "h200-fp8", "h100-bf16", "a100-int8", "l40s-fp8", "rtx4090-fp8", "rtx5090-fp8"):
        assert name in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_round_trips(name, tmp_path):
    recipe = load_recipe(name)
    text = dump_recipe(recipe)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    again = load_recipe(path)
    assert again == recipe
    assert recipe_to_dict(again) == yaml.safe_load(text)


def _raw(name="rtx4090-fp8"):
    return yaml.safe_load(load_recipe.__globals__["list_recipes"]()[name].read_text())


@pytest.mark.parametrize("path,typo,hint", [
    ((), "quantisation", "quantization"),
    (("build",), "optimisation_level", "optimization_level"),
    (("quantization",), "fromat", "format"),
    (("build", "requirements"), "min_fp8_gemm_fractoin", "min_fp8_gemm_fraction"),
])
def test_unknown_key_has_hint(path, typo, hint):
    raw = _raw()
    node = raw
    for p in path:
        node = node[p]
    node[typo] = node.pop(hint, 1)
    with pytest.raises(ConfigError, match=f"did you mean '{hint}'"):
        recipe_from_dict(raw)


def test_bucket_typo_and_bad_enum():
    raw = _raw()
    raw["buckets"][0]["latent_hieght"] = raw["buckets"][0].pop("latent_height")
    with pytest.raises(ConfigError, match="latent_height"):
        recipe_from_dict(raw)
    raw = _raw()
    raw["quantization"]["format"] = "fp8_e5m2x"
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        recipe_from_dict(raw)
    raw = _raw()
    raw.setdefault("torch_fp8", {})["attention_kernel"] = "cudnn"
    with pytest.raises(ConfigError, match="cudnn-fp8"):
        recipe_from_dict(raw)
    raw["torch_fp8"]["attention_kernel"] = "cudnn-fp8"
    assert recipe_from_dict(raw).torch_fp8.attention_policy()["kernel"] == "cudnn-fp8"
    raw["torch_fp8"]["attention_kernel"] = "int8-cute"
    assert recipe_from_dict(raw).torch_fp8.attention_policy()["kernel"] == "int8-cute"


def test_min_greater_than_max_and_odd_height():
    with pytest.raises(ConfigError, match="min <= opt <= max"):
        DimRange(4, 2, 8)
    prof = ShapeProfile.from_yaml({"name": "b", "batch": 1, "latent_frames": 3, "latent_height": [5, 6, 8],
                                   "latent_width": 8, "text_len": 16})
    with pytest.raises(ConfigError, match="latent_height.min=5 is not divisible by .* patch size 2"):
        prof.validate((1, 2, 2))
    assert prof.validate((1, 1, 1)) is prof


def test_bucket_outside_export_range():
    raw = _raw()
    raw["buckets"][0]["batch"] = [1, 2, 16]
    with pytest.raises(ConfigError, match="outside the exported range 1..8"):
        recipe_from_dict(raw)


def test_unknown_recipe_name():
    with pytest.raises(ConfigError, match="did you mean 'h100-fp8'"):
        load_recipe("h100-fp9")


def test_recipe_is_frozen():
    r = load_recipe("h100-fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"  # type: ignore[misc]
    assert r.quantization.format is QuantFormat.FP8_E4M3 and r.sm == 90


def test_check_point_lists_buckets():
    r = load_recipe("h100-fp8")
    ok = {"batch": 2, "latent_frames": 21, "latent_height": 60, "latent_width": 104, "text_len": 512}
    assert check_point(ok, r.buckets).name == "480p-81f"
    with pytest.raises(ShapeError, match=r"outside every bucket .*480p-81f.*720p-81f"):
        check_point({**ok, "latent_height": 62}, r.buckets)


@pytest.mark.parametrize("path,value", [
    (("parity", "quality", "min_cosine"), 7), (("parity", "quality", "min_cosine"), 0.0),
    (("parity", "qdq", "min_psnr_db"), float("nan")), (("parity", "loop", "min_psnr_db"), -5.0),
    (("parity", "export", "max_abs"), -1.0), (("parity", "frames", "min_ssim"), 2.0),
    (("parity", "qdq", "max_floor_ratio"), 0.0), (("parity", "num_samples"), 0), (("parity", "jump_factor"), 1.0),
    (("build", "requirements", "min_fp8_gemm_fraction"), 1.5), (("build", "workspace_gb"), -3),
    (("build", "workspace_gb"), float("inf")), (("export", "min_cosine"), 2.0), (("calibration", "num_bins"), 0),
    (("calibration", "num_bins"), 1000),
])
def test_gates_and_limits_are_range_checked(path, value):
    """A threshold that can never pass (or passes anything) is a typo: a ConfigError naming the key."""
    raw = _raw()
    node = raw
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=path[-1]) as e:
        recipe_from_dict(raw)
    assert "\n" not in str(e.value)


def test_recipe_not_utf8_or_unreadable(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\xe9-fp8\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_recipe(p)
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n  x: 1\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        load_recipe(tmp_path / "bad.yaml")
    assert "\n" not in str(e.value)
