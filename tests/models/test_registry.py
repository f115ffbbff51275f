"""The embedded default model: wan-shapes is registered with its own buckets, preset and prompts."""
import pytest

from trt_sora.config import load_recipe
from trt_sora.models import DEFAULT_MODEL, get_adapter, list_models
from trt_sora.models.moving_shapes import data


def test_default_model_is_the_trained_one():
    assert DEFAULT_MODEL == "wan-shapes" in list_models()
    assert load_recipe("rtx4090-fp8").model.default == DEFAULT_MODEL


def test_wan_shapes_facts():
    a = get_adapter("wan-shapes")
    assert a.spec.source == "checkpoint" and a.latent_channels == 3 and a.text_dim == 384
    buckets, source = a.buckets_for(load_recipe("rtx4090-fp8"))
    assert [b.name for b in buckets] == ["shapes-1clip", "shapes-2clips"] and "wan-shapes" in source
    assert all(b.latent_height.opt == 32 and b.latent_frames.opt == 9 for b in buckets)
    held = a.heldout_prompts()
    assert sorted(held) == sorted(s.caption() for s in data.all_caption_specs("heldout"))
    assert not set(held) & {s.caption() for s in data.all_caption_specs("train")}
    assert a.spec.model_hash() == get_adapter("wan-shapes").spec.model_hash()


def test_wan_tiny_keeps_recipe_buckets_only_when_it_has_none():
    r = load_recipe("h100-fp8")
    big = get_adapter("wan2.1-t2v-1.3b").buckets_for(r)
    assert big[0] == r.buckets and big[1] == "recipe h100-fp8"


def test_manifest_entry_of_a_named_checkpoint_keeps_its_buckets():
    # `trt-sora check` / runtime.load resolve the model from the export manifest; wan-shapes is a
    # checkpoint folder too, but must come back as wan-shapes (its own 9x32x32 buckets), not as a
    # bare folder that takes the recipe's 480p buckets
    from trt_sora.models import adapter_for_manifest

    entry = get_adapter("wan-shapes").describe()
    assert entry["source"] == "checkpoint" and entry.get("path")
    a = adapter_for_manifest(entry)
    assert a.name == "wan-shapes"
    assert [b.name for b in a.buckets_for(load_recipe("rtx4090-fp8"))[0]] == ["shapes-1clip", "shapes-2clips"]
    folder_only = adapter_for_manifest({**entry, "ref": "/some/renamed/copy", "path": entry["path"]})
    assert folder_only.spec.path == entry["path"]


@pytest.mark.parametrize("ref", ["", "   "])
def test_empty_model_name_is_an_error(ref):
    from trt_sora.errors import ModelError
    from trt_sora.models import resolve

    with pytest.raises(ModelError, match="empty"):
        resolve(ref)
