"""Weights one tensor at a time: safetensors I/O against the safetensors library, per-parameter random init,
the random-checkpoint writer against diffusers' loader, streamed forwards against loaded ones."""
import math

import pytest
import torch

from trt_sora.errors import ModelError
from trt_sora.weights.safetensors_io import SafetensorsFile, write_safetensors
from trt_sora.weights.sources import CheckpointSource, RandomInitSource, StateDictSource, check_covers, streamed


def test_reader_matches_safetensors_library():
    from safetensors.torch import load_file

    from trt_sora.models import moving_shapes

    path = moving_shapes.WEIGHTS_DIR / "diffusion_pytorch_model.safetensors"
    ref = load_file(str(path))
    f = SafetensorsFile(path)
    assert set(f.entries) == set(ref)
    for name, t in ref.items():
        got = f.read(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name


def test_writer_roundtrip_through_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
               "c": torch.randn(2, 2, generator=g).to(torch.float8_e4m3fn), "d": torch.arange(4),
               "scalar": torch.tensor(2.5)}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", specs, lambda n: tensors[n], metadata={"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(back[k].dtype == v.dtype
               and torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
               for k, v in tensors.items())
    with pytest.raises(ModelError, match="produced shape"):
        write_safetensors(tmp_path / "y.safetensors", [("a.weight", (5, 3), torch.float32)], lambda n: tensors[n])
    assert not list(tmp_path.glob("y.*")), "partial file left behind"


def test_random_init_per_parameter(tiny_adapter):
    m = tiny_adapter.load_empty()
    src = RandomInitSource(m, seed=0)
    with pytest.raises(ModelError, match="no random-init rule"):
        src.get("scale_shift_table")  # a Wan fact: only the family rule knows it
    src = tiny_adapter.weight_source()
    w = src.get("blocks.0.ffn.net.0.proj.weight")  # nn.Linear [128, 64]: U(-1/8, 1/8)
    bound = 1 / math.sqrt(64)
    assert w.shape == (128, 64) and w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert abs(float(w.std()) - bound / math.sqrt(3)) < 0.1 * bound  # uniform's std
    assert torch.equal(src.get("blocks.0.norm2.weight"), torch.ones(64))
    assert torch.equal(w, src.get("blocks.0.ffn.net.0.proj.weight"))  # order-independent, repeatable
    assert not torch.equal(src.get("blocks.0.attn1.to_q.weight"), src.get("blocks.0.attn1.to_k.weight"))
    sst = src.get("scale_shift_table")
    assert abs(float(sst.std()) * math.sqrt(64) - 1) < 0.3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_empty_model_and_source_equal_load(tiny_adapter, dtype):
    loaded, empty = tiny_adapter.load(dtype), tiny_adapter.load_empty(dtype)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert {n: p.dtype for n, p in loaded.named_parameters()} == {n: p.dtype for n, p in empty.named_parameters()}
    assert all(torch.equal(b, empty.get_buffer(n)) for n, b in loaded.named_buffers())
    src = tiny_adapter.weight_source()
    assert all(torch.equal(src.get(n).to(p.dtype), p) for n, p in loaded.named_parameters())


def test_random_checkpoint_loads_in_diffusers(tmp_path, tiny_adapter):
    """Sharded writer output, read back by diffusers' from_pretrained (independent of our reader)."""
    from trt_sora.models import get_adapter
    from trt_sora.weights.checkpoint import write_random_checkpoint

    summary = write_random_checkpoint(tiny_adapter, tmp_path / "ck", dtype="bf16", shard_bytes=100_000)
    assert len(summary["files"]) > 1 and (tmp_path / "ck" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    ck = get_adapter(str(tmp_path / "ck"))
    theirs = ck.load("fp32")  # diffusers
    ours = tiny_adapter.load("bf16")
    for n, p in theirs.named_parameters():
        assert torch.equal(p, ours.get_parameter(n).float()), n
    src = ck.weight_source()
    assert isinstance(src, CheckpointSource)
    assert src.dtype("blocks.0.attn1.to_q.weight") == torch.bfloat16
    assert src.dtype("condition_embedder.time_embedder.linear_1.weight") == torch.float32  # kept in fp32
    with pytest.raises(ModelError, match="not a random-init|checkpoint already"):
        write_random_checkpoint(ck, tmp_path / "ck2")


def test_check_covers_names_the_problem(tiny_adapter):
    m = tiny_adapter.load_empty()
    full = {n: torch.zeros(p.shape) for n, p in m.named_parameters()}
    check_covers(m, StateDictSource(full))
    missing = {k: v for k, v in full.items() if k != "proj_out.weight"}
    with pytest.raises(ModelError, match="no tensor 'proj_out.weight'"):
        check_covers(m, StateDictSource(missing))
    with pytest.raises(ModelError, match="has shape"):
        check_covers(m, StateDictSource({**full, "proj_out.weight": torch.zeros(1, 1)}))


def test_streamed_forward_equals_loaded(tiny_adapter, tiny_model, tiny_points):
    x = tiny_adapter.example_inputs(tiny_points[1])
    empty = tiny_adapter.load_empty()
    loads = []
    src = tiny_adapter.weight_source()

    class Counting(StateDictSource):
        def get(self, name):
            loads.append(name)
            return src.get(name)

    with streamed(empty, Counting({n: None for n, _ in empty.named_parameters()})) as m:
        with torch.no_grad():
            got = tiny_adapter.forward(m, x)
    torch.testing.assert_close(got, tiny_adapter.forward(tiny_model, x), rtol=0, atol=0)
    assert sorted(loads) == sorted(n for n, _ in empty.named_parameters())  # each weight read once
    assert all(p.device.type == "meta" for p in empty.parameters())  # and dropped afterwards


def test_lockstep_reads_each_weight_once_for_every_input(tiny_adapter, tiny_model, tiny_points):
    from trt_sora.weights.sources import run_lockstep

    src = tiny_adapter.weight_source()
    loads = []

    class Counting(StateDictSource):
        def get(self, name):
            loads.append(name)
            return src.get(name)

    empty = tiny_adapter.load_empty()
    xs = [tiny_adapter.example_inputs(p, seed=i) for i, p in enumerate(tiny_points)]
    with streamed(empty, Counting({n: None for n, _ in empty.named_parameters()}), concurrent=len(xs)) as m:
        with torch.no_grad():
            outs = run_lockstep(m, [lambda x=x: tiny_adapter.forward(m, x) for x in xs])
    assert len(loads) == len(list(empty.parameters()))  # one pass for three inputs of three shapes
    with torch.no_grad():
        for x, y in zip(xs, outs):
            torch.testing.assert_close(y, tiny_adapter.forward(tiny_model, x), rtol=0, atol=0)
