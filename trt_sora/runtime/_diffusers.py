"""The diffusers drop-in (imports torch + diffusers; loaded by ``as_diffusers_transformer``)."""
from __future__ import annotations

import contextlib
from typing import Any


def make_transformer(runner, *, dtype=None, device=None):
    import torch
    from diffusers.configuration_utils import FrozenDict
    from diffusers.models.modeling_outputs import Transformer2DModelOutput
    from diffusers.models.modeling_utils import ModelMixin

    class RuntimeTransformer(ModelMixin):
        """Duck-typed ``WanTransformer3DModel``: same call signature, runs ``runner``.

        A ``ModelMixin`` (so ``WanPipeline.from_pretrained(root, transformer=...)`` accepts it and
        pipeline placement works) with no parameters of its own: ``dtype`` and ``device`` say what
        its inputs and outputs are; the weights live in the runner.
        """

        def __init__(self):
            super().__init__()
            self.runner = runner
            self.config = FrozenDict(getattr(runner, "model_config", {}))
            self._dtype = dtype or torch.float32
            self._device = torch.device(device or "cpu")
            self.calls = 0

        @property
        def dtype(self):
            return self._dtype

        @property
        def device(self):
            return self._device

        @contextlib.contextmanager
        def cache_context(self, name: str, **_kw):
            yield

        def to(self, *args, **kwargs):  # pipelines call .to(device/dtype); placement is the runner's
            return self

        def eval(self):
            return self

        def __call__(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                     return_dict: bool = True, attention_kwargs: Any = None, **_kw):
            if encoder_hidden_states_image is not None:
                from trt_sora.errors import ShapeError

                raise ShapeError("image-to-video inputs (encoder_hidden_states_image) are not supported by this "
                                 "artifact; export an image-to-video model")
            dev = hidden_states.device
            t = timestep.to(torch.float32)
            if t.dim() == 0:
                t = t.expand(hidden_states.shape[0])
            if t.dim() == 2 and 1 in (getattr(self.runner, "_dims", {}).get("timestep") or {}):
                # Wan 2.2 TI2V: the pipeline passes a timestep per token [B, F*h*w]; the graph takes one per
                # latent frame [B, F] (every token of a frame shares it)
                t = t.reshape(t.shape[0], hidden_states.shape[2], -1)[:, :, 0]
            feeds = {"hidden_states": hidden_states, "timestep": t.contiguous(),
                     "encoder_hidden_states": encoder_hidden_states}
            out = self.runner.infer(feeds)
            y = next(iter(out.values()))
            if not torch.is_tensor(y):
                y = torch.from_numpy(y)
            y = y.to(dev, hidden_states.dtype)
            self.calls += 1
            if not return_dict:
                return (y,)
            return Transformer2DModelOutput(sample=y)

        forward = __call__

    return RuntimeTransformer()
