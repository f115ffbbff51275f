"""A new model family is its own file and one registry line: a family written here, outside the
package (a plain PyTorch DiT, not a diffusers class, with its own module names), goes through every
stage on the CPU - export, calibrate, quantize, the TensorRT-RTX build, check - and the runtime
loads what passed and generates a clip, with nothing else in trt_sora told about it."""
from __future__ import annotations

import json
import textwrap

import pytest
from run_folders import ci_recipe

FAMILY_FILE = textwrap.dedent('''
    """tinydit: a plain PyTorch DiT in pixel space (patch 1), its own module names (``layers.N.qkv``)."""
    import math

    import torch
    from torch import nn

    from trt_sora.models.base import ModelAdapter, ModelSpec
    from trt_sora.models.text import HashTextEncoder

    CLASS_NAME = "TinyDiT"
    CONFIG = {"channels": 3, "dim": 32, "heads": 2, "text_dim": 16, "layers": 2}
    DEFAULTS = {"num_steps": 3, "guidance_scale": 4.0, "shift": 2.0, "calib_preset": "tiny", "negative_prompt": None,
                "buckets": [{"name": "tiny", "batch": [1, 2, 2], "latent_frames": [2, 3, 4],
                             "latent_height": [4, 6, 8], "latent_width": [4, 6, 10], "text_len": [4, 16, 16]}]}


    class Block(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.norm = nn.LayerNorm(dim, elementwise_affine=False)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.kv_text = nn.Linear(dim, 2 * dim)
            self.out = nn.Linear(dim, dim)
            self.up = nn.Linear(dim, 2 * dim)
            self.down = nn.Linear(2 * dim, dim)

        def forward(self, x, text, temb):
            h = self.norm(x) + temb[:, None]
            q, k, v = self.qkv(h).chunk(3, dim=-1)
            kt, vt = self.kv_text(text).chunk(2, dim=-1)
            split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
            a = nn.functional.scaled_dot_product_attention(split(q), split(torch.cat([k, kt], 1)),
                                                           split(torch.cat([v, vt], 1)))
            x = x + self.out(a.transpose(1, 2).flatten(2))
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


    class TinyDiT(nn.Module):
        def __init__(self, channels, dim, heads, text_dim, layers):
            super().__init__()
            self.dim = dim
            self.embed = nn.Linear(channels, dim)
            self.time_mlp = nn.Linear(dim, dim)
            self.text_in = nn.Linear(text_dim, dim)
            self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
            self.head = nn.Linear(dim, channels)

        def forward(self, hidden_states, timestep, encoder_hidden_states):
            b, c, f, h, w = hidden_states.shape
            x = self.embed(hidden_states.flatten(2).transpose(1, 2))
            half = self.dim // 2
            freqs = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / half))
            ang = timestep.float()[:, None] * freqs[None]
            temb = self.time_mlp(torch.cat([ang.cos(), ang.sin()], -1).to(x.dtype))
            text = self.text_in(encoder_hidden_states)
            for layer in self.layers:
                x = layer(x, text, temb)
            return self.head(x).transpose(1, 2).reshape(b, c, f, h, w)


    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, timestep, encoder_hidden_states):
            return self.inner(hidden_states, timestep, encoder_hidden_states)


    class TinyDiTAdapter(ModelAdapter):
        family = "tinydit"
        block_container = "layers"
        quant_excludes = {"embed": "patch embedding", "time_mlp": "timestep embedder", "text_in": "text embedder",
                          "head": "final projection"}
        layer_kinds = {"qkv": "attn.qkv", "kv_text": "attn.text_kv", "out": "attn.out", "up": "ffn.up",
                       "down": "ffn.down"}

        patch_size = (1, 1, 1)
        latent_channels = property(lambda self: int(self.spec.config["channels"]))
        text_dim = property(lambda self: int(self.spec.config["text_dim"]))
        num_heads = property(lambda self: int(self.spec.config["heads"]))

        def _construct(self):
            return TinyDiT(**self.spec.config)

        def load_empty(self, dtype="fp32"):
            with torch.device("meta"):
                model = self._construct()
            return model.eval().requires_grad_(False)

        def load(self, dtype="fp32", device="cpu"):
            from trt_sora.weights.sources import materialize

            return materialize(self.load_empty(dtype), self.weight_source(), device).to(device)

        def input_dims(self):
            spatial = {0: "batch", 2: "latent_frames", 3: "latent_height", 4: "latent_width"}
            return {"hidden_states": spatial, "timestep": {0: "batch"},
                    "encoder_hidden_states": {0: "batch", 1: "text_len"}, "sample": dict(spatial)}

        def fixed_axes(self):
            return {"hidden_states": {1: self.latent_channels}, "encoder_hidden_states": {2: self.text_dim}}

        def example_inputs(self, point, *, dtype="fp32", device="cpu", seed=0):
            from trt_sora.models.base import torch_dtype

            g = torch.Generator().manual_seed(seed)
            b, f, h, w, n = (int(point[k]) for k in ("batch", "latent_frames", "latent_height", "latent_width",
                                                     "text_len"))
            td = torch_dtype(dtype)
            return {"hidden_states": torch.randn(b, self.latent_channels, f, h, w, generator=g).to(device, td),
                    "timestep": (torch.rand(b, generator=g) * 999.0).to(device),
                    "encoder_hidden_states": torch.randn(b, n, self.text_dim, generator=g).to(device, td)}

        def export_module(self, model):
            return Wrapper(model)

        def scheduler(self, shift=None):
            import diffusers

            return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                             shift=self.sampling.shift if shift is None else shift)

        def decoder(self, device=None, dtype=None):
            return (lambda z: z.float().clamp(-1, 1)), "identity (pixel space)"

        def text_encoder(self, source=None, device=None):
            return HashTextEncoder(self.text_dim, seed=self.spec.seed)


    ADAPTER = TinyDiTAdapter


    def named_specs():
        return {"tinydit-tiny": ModelSpec(ref="tinydit-tiny", family="tinydit", source="random-init", config=CONFIG,
                                          text_encoder="hash", defaults=DEFAULTS)}


    def spec_from_folder(ref, folder):
        return None


    def spec_from_record(entry):
        return ModelSpec(ref=entry["ref"], family="tinydit", source="checkpoint", config=dict(entry["config"]),
                         path=entry["path"], defaults=DEFAULTS)
''')


@pytest.fixture
def tinydit(tmp_path, monkeypatch):
    """The family's file in a folder on ``sys.path`` and its one registry line (undone after the test)."""
    from trt_sora import models

    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "tinydit_family.py").write_text(FAMILY_FILE)
    monkeypatch.syspath_prepend(str(tmp_path / "fam"))
    monkeypatch.setattr(models, "FAMILIES", dict(models.FAMILIES))
    models.register_family("tinydit", "tinydit_family")  # the registry line
    return models.get_adapter("tinydit-tiny")


def test_registering_a_family_makes_its_names_resolvable(tinydit):
    from trt_sora import models
    from trt_sora.errors import ConfigError, ModelError

    assert "tinydit-tiny" in models.list_models() and tinydit.family == "tinydit"
    with pytest.raises(ModelError, match="already registered as tinydit_family"):
        models.register_family("tinydit", "another_module")
    with pytest.raises(ConfigError, match="torch-fp8 cannot run tinydit-tiny: model family 'tinydit'.*'ort'"):
        tinydit.torch_fp8_rewrite()


@pytest.mark.trt_rtx
def test_every_stage_and_the_runtime_on_a_family_from_its_own_file(tinydit, tmp_path):
    import numpy as np

    import trt_sora.runtime as rt
    from trt_sora.pipeline import EnginePipeline

    pipe = EnginePipeline(ci_recipe(), "tinydit-tiny", tmp_path / "runs")
    assert [o.status for o in pipe.run()] == ["ran"] * 5
    exp = json.loads((pipe.folder("export") / "manifest.json").read_text())["results"]
    assert exp["model"]["family"] == "tinydit"
    assert all(p["cosine"] >= 0.99999 and p["max_abs"] < 1e-4 for p in exp["parity"])
    sites = json.loads((pipe.folder("quantize") / "qdq_map.json").read_text())["sites"]
    quantized = {s["site"] for s in sites if s["kind"] == "linear" and not s["excluded"]}
    excluded = {s["site"]: s["reason"] for s in sites if s["kind"] == "linear" and s["excluded"]}
    assert {"layers.0.qkv", "layers.1.down"} <= quantized
    assert excluded["time_mlp"].startswith("default exclusion: timestep embedder")  # the family's own exclusions
    build = json.loads((pipe.folder("build") / "build_report.json").read_text())["analysis"]
    assert build["fp8_gemm_fraction"] == 1.0
    rep = json.loads((pipe.folder("check") / "report.json").read_text())
    assert rep["passed"], rep["failed"]
    assert {c["level"] for c in rep["comparisons"]} == {"export", "qdq", "quality", "trajectory", "loop", "frames"}

    runner = rt.load(pipe.run_dir, backend="ort", warmup=False)
    (clip,) = rt.generate(runner, "a red square moves right", seed=1, steps=2)
    f, h, w = rt.Generator(runner).default_size
    assert clip.frames.shape == (f, h, w, 3) and clip.frames.dtype == np.uint8
