"""The absolute frame-index embedding (trt_sora/models/frame_embed.py) on wan-tiny:
stock-equivalent at zero, saved and restored through a checkpoint folder, exported with a
dynamic frame axis (ONNX Runtime vs PyTorch) and built by TensorRT-RTX."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from trt_sora.models import frame_embed  # noqa: E402


@pytest.fixture(scope="module")
def inputs(tiny_adapter):
    return tiny_adapter.example_inputs({"batch": 2, "latent_frames": 3, "latent_height": 4, "latent_width": 6,
                                        "text_len": 5}, seed=3)


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_zero_embedding_is_the_stock_model(tiny_model, inputs):
    m = copy.deepcopy(tiny_model)
    frame_embed.attach(m)
    assert isinstance(m.patch_embedding, frame_embed.FrameEmbeddedConv3d)
    assert torch.equal(_run(m, inputs), _run(tiny_model, inputs))


def test_embedding_is_a_per_frame_offset_of_the_patch_tokens(tiny_model, inputs):
    m = copy.deepcopy(tiny_model)
    frame_embed.attach(m, torch.randn(m.patch_embedding.out_channels, 2 * frame_embed.NUM_FREQS))
    x = inputs["hidden_states"]
    with torch.no_grad():
        diff = m.patch_embedding(x) - tiny_model.patch_embedding(x)  # [B, C, F, H', W']
    # the same offset for every batch item and spatial position, different per frame
    assert torch.allclose(diff, diff[:1, :, :, :1, :1].expand_as(diff), atol=1e-6)
    per_frame = diff[0, :, :, 0, 0]
    assert (per_frame[:, 1:] - per_frame[:, :-1]).abs().amax() > 1e-2
    assert not torch.allclose(_run(m, inputs), _run(tiny_model, inputs), atol=1e-4)


@pytest.fixture(scope="module")
def embedded_checkpoint(tmp_path_factory, tiny_model):
    """wan-tiny with a random frame embedding, saved as a diffusers checkpoint folder."""
    m = copy.deepcopy(tiny_model)
    g = torch.Generator().manual_seed(0)
    frame_embed.attach(m, 0.5 * torch.randn(m.patch_embedding.out_channels, 2 * frame_embed.NUM_FREQS, generator=g))
    folder = tmp_path_factory.mktemp("frame_ckpt") / "transformer"
    m.save_pretrained(str(folder), safe_serialization=True)
    return folder, m


def test_checkpoint_round_trip_through_the_adapter(embedded_checkpoint, inputs):
    from trt_sora.models import get_adapter

    folder, original = embedded_checkpoint
    assert frame_embed.stored_weight(folder) is not None
    loaded = get_adapter(str(folder)).load("fp32", "cpu")
    assert isinstance(loaded.patch_embedding, frame_embed.FrameEmbeddedConv3d)
    torch.testing.assert_close(_run(loaded, inputs), _run(original, inputs), rtol=1e-5, atol=1e-5)


def test_stock_checkpoint_loads_without_the_embedding(tmp_path, tiny_model):
    tiny_model.save_pretrained(str(tmp_path), safe_serialization=True)
    assert frame_embed.stored_weight(tmp_path) is None
    assert type(frame_embed.load(tmp_path).patch_embedding) is torch.nn.Conv3d


@pytest.fixture(scope="module")
def embedded_export(tmp_path_factory, embedded_checkpoint, tiny_points):
    from trt_sora.config import ExportConfig
    from trt_sora.export import export_onnx
    from trt_sora.models import get_adapter

    folder, _ = embedded_checkpoint
    adapter = get_adapter(str(folder))
    out = tmp_path_factory.mktemp("frame_export") / "export"
    return export_onnx(adapter, ExportConfig(verify_points=tiny_points), out)


def test_export_with_dynamic_frames_matches_pytorch(embedded_export, tiny_points):
    # the embedding is recomputed from the frame count: 3, 2 and 5 frames all match
    rows = embedded_export.parity
    assert len(rows) == len(tiny_points)
    for row in rows:
        assert row["cosine"] > 1 - 1e-6, row
    import onnx

    ops = {n.op_type for n in onnx.load(str(embedded_export.onnx_path), load_external_data=False).graph.node}
    assert {"Sin", "Cos"} <= ops


@pytest.mark.trt_rtx
def test_tensorrt_rtx_builds_the_embedded_export(embedded_export, tmp_path):
    import dataclasses

    from trt_sora.build import BuildTarget, build_engine
    from trt_sora.config import Backend, BuildConfig, DimRange, QuantFormat, ShapeProfile

    buckets = [ShapeProfile("f2-5", DimRange(1, 2, 2), DimRange(2, 3, 5), DimRange(2, 4, 8), DimRange(2, 4, 8),
                            DimRange(1, 8, 16))]
    cfg = dataclasses.replace(BuildConfig(), optimization_level=0, workspace_gb=1)
    result = build_engine(embedded_export.onnx_path, cfg, tmp_path / "engine", buckets=buckets,
                          target=BuildTarget(Backend.TENSORRT_RTX, "8.9", QuantFormat.NONE), model_name="tiny-fe")
    assert result.engine_path.stat().st_size > 0
