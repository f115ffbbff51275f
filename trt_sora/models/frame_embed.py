"""Absolute frame-index embedding for Wan transformers (used by the wan-shapes model).

Wan 2.x has only rotary position embeddings: attention sees *relative* frame
offsets, never which frame is first. From pure noise, a model with relative
positions only cannot tell "moves up" from "moves down played backwards"
(the two are the same clip reversed in time), so a small model trained for
minutes picks the sign of the motion at random (held-out direction 48-53 %
with the axis right; see moving_shapes/MODEL_CARD.md). Wan itself gets an absolute anchor
from its causal VAE (latent frame 0 encodes one frame, the others four);
this pixel-space model has no VAE, so it gets one here.

The embedding is added to the patch tokens, right after the patch
convolution: ``tokens[:, :, f] += W @ [sin(f w_k), cos(f w_k)]_k`` with fixed
frequencies ``w_k`` and a learned ``W`` [dim, 2K] that starts at zero (a model
with ``W = 0`` is exactly the stock ``WanTransformer3DModel``). It is computed
from the token grid's frame count, so it exports with a dynamic
``latent_frames`` axis (Range, Sin, Cos, MatMul in ONNX).

Implementation: the model's ``patch_embedding`` Conv3d instance is given this
module's subclass and one extra parameter, ``patch_embedding.frame_weight``;
every other key of the state dict, and the rest of the model, stay stock
diffusers. ``WanTransformer3DModel.from_pretrained`` alone ignores the key
(with a warning); :func:`load` restores it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

#: sin/cos pairs; frequencies 1, 1/2, ..., 1/2**(K-1) radians per frame
NUM_FREQS = 4
PARAM_NAME = "patch_embedding.frame_weight"


class FrameEmbeddedConv3d(nn.Conv3d):
    """Wan's patch convolution plus a learned absolute frame-index embedding."""

    frame_weight: nn.Parameter  # [out_channels, 2 * NUM_FREQS]

    def frame_embedding(self, num_frames: int, device, dtype) -> torch.Tensor:
        """[out_channels, num_frames] embedding of frames 0..num_frames-1."""
        f = torch.arange(num_frames, device=device, dtype=torch.float32)
        freqs = 2.0 ** -torch.arange(NUM_FREQS, device=device, dtype=torch.float32)
        angles = f[:, None] * freqs[None, :]  # [F, K]
        feats = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)  # [F, 2K]
        return (self.frame_weight.float() @ feats.T).to(dtype)  # [C, F]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C_in, F, H, W]
        y = super().forward(x)  # [B, C, F', H', W'] (temporal patch 1: F' = F)
        emb = self.frame_embedding(y.shape[2], y.device, y.dtype)
        return y + emb[None, :, :, None, None]


def attach(model, weight: torch.Tensor | None = None) -> None:
    """Give ``model.patch_embedding`` the frame embedding (zeros unless ``weight``)."""
    conv = model.patch_embedding
    if isinstance(conv, FrameEmbeddedConv3d):
        if weight is not None:
            conv.frame_weight.data.copy_(weight)
        return
    if conv.kernel_size[0] != 1:
        raise ValueError(f"frame embedding needs a temporal patch of 1, got {conv.kernel_size}")
    conv.__class__ = FrameEmbeddedConv3d
    init = torch.zeros(conv.out_channels, 2 * NUM_FREQS, dtype=conv.weight.dtype, device=conv.weight.device)
    conv.frame_weight = nn.Parameter(init if weight is None else weight.to(init))


def stored_weight(folder: Path | str) -> torch.Tensor | None:
    """The ``frame_weight`` tensor saved in a checkpoint folder, or None (a stock model)."""
    from safetensors import safe_open

    path = Path(folder) / "diffusion_pytorch_model.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(PARAM_NAME) if PARAM_NAME in f.keys() else None


def stored_weight_shape(folder: Path | str) -> tuple[int, ...] | None:
    """Shape of the checkpoint's ``frame_weight`` from the safetensors header alone, or None (a stock model)."""
    from trt_sora.weights.safetensors_io import SafetensorsFile

    path = Path(folder) / "diffusion_pytorch_model.safetensors"
    if not path.exists():
        return None
    entry = SafetensorsFile(path).entries.get(PARAM_NAME)
    return None if entry is None else entry[1]


def load(folder: Path | str, dtype: torch.dtype = torch.float32):
    """``WanTransformer3DModel`` from ``folder`` with its frame embedding, if it has one."""
    import logging

    from diffusers import WanTransformer3DModel

    # diffusers warns about the one key the stock class does not know; it is restored just below
    dlog = logging.getLogger("diffusers.models.modeling_utils")
    level = dlog.level
    dlog.setLevel(logging.ERROR)
    try:
        model = WanTransformer3DModel.from_pretrained(str(folder), torch_dtype=dtype)
    finally:
        dlog.setLevel(level)
    weight = stored_weight(folder)
    if weight is not None:
        attach(model, weight.to(dtype))
    return model
