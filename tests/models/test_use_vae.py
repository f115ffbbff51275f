"""ModelAdapter.use_vae: a VAE installed for a place is the one vae_on returns there, the one the family's
frame decoder decodes with, and its description is the decoder's (what a clip's metadata reports)."""
import copy

import pytest
import torch

from trt_sora.errors import ConfigError
from trt_sora.models import get_adapter


def _other(vae):
    """``vae`` with every weight scaled by 0.5: the same layout, other frames."""
    other = copy.deepcopy(vae)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    return other


@pytest.mark.parametrize("name", ["wan-tiny", "hunyuan-tiny"])
def test_the_installed_vae_is_the_one_vae_on_returns_and_the_decoder_uses(name):
    """The decoder over the installed VAE makes what the family's decoder makes of a model whose own VAE it
    is (another adapter's copy-on-place path), not what the model's own VAE makes."""
    adapter, ref = get_adapter(name), get_adapter(name)
    z = torch.randn((1, adapter.latent_channels, 2, 4, 6), generator=torch.Generator().manual_seed(0))
    own = torch.cat(list(adapter.frame_decoder("cpu", torch.float32)[0](z)), dim=2)
    theirs = _other(adapter.vae()[0])
    adapter.use_vae(theirs, "cpu", torch.float32, "the caller's VAE")  # replaces the copy made there
    assert adapter.vae_on("cpu", torch.float32) == (theirs, "the caller's VAE")
    decode_groups, desc = adapter.frame_decoder("cpu", torch.float32)
    assert desc == adapter.decoder("cpu", torch.float32)[1] == "the caller's VAE"
    got = torch.cat(list(decode_groups(z)), dim=2)
    ref.vae = lambda: (theirs, "theirs")
    want = torch.cat(list(ref.frame_decoder("cpu", torch.float32)[0](z)), dim=2)
    assert torch.equal(got, want) and got.shape == own.shape and (got - own).abs().max() > 1e-3
    assert adapter.vae_on()[0] is not theirs and "random" in adapter.vae_on()[1]  # the model's own, untouched
    assert adapter.vae_on("cpu", torch.bfloat16)[0] is not theirs  # another place copies the model's own


def test_no_place_is_refused():
    with pytest.raises(ConfigError, match="needs a device or a dtype"):
        get_adapter("wan-tiny").use_vae(torch.nn.Identity(), None, None, "x")
