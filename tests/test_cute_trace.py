"""benchmarks/cute_attention.py's reading of the CuTe kernel's clock trace: cycles per phase of a key tile, and
whether the two warpgroups' softmaxes run at once (lockstep) or in turns (what ping-pong is for)."""
import pytest
from script_loader import load_script

torch = pytest.importorskip("torch")

EVENTS = 6


@pytest.fixture(scope="module")
def ca():
    return load_script("benchmarks/cute_attention.py")


def synthetic(shift_wg1: int, step: int = 200, tiles: int = 64):
    """Every warp's events at fixed offsets in a ``step``-cycle tile; warpgroup 1 ``shift_wg1`` cycles later;
    tile 0 unrecorded, as in the kernel (its Q K^T comes before the loop)."""
    tr = torch.zeros(4, 8, tiles, EVENTS, dtype=torch.int64)
    offsets = torch.tensor([0, 10, 40, 140, 170, 180])  # softmax: 100 cycles of the 200
    for j in range(1, tiles):
        for w in range(8):
            tr[:, w, j] = 10_000 + step * j + (shift_wg1 if w >= 4 else 0) + offsets
    return tr


def test_phases_are_the_event_differences(ca):
    got = ca.trace_phases(synthetic(0))
    assert got["tiles"] == 64 - 8 - 1  # tiles 8..63, each step to the next
    for wg in ("wg0", "wg1"):
        assert got[wg] == {"k_wait": 10, "qk": 30, "softmax": 100, "pv_wait": 30, "pack": 10, "gap": 20,
                           "step": 200}


@pytest.mark.parametrize("shift, share", [(0, 1.0), (100, 0.0), (50, 0.5), (150, 0.5)])
def test_softmax_overlap_is_the_share_of_time_both_warpgroups_are_in_it(ca, shift, share):
    assert ca.trace_phases(synthetic(shift))["softmax_overlap"] == pytest.approx(share)


def test_unreached_tiles_are_left_out_and_too_few_refused(ca):
    tr = synthetic(0)
    tr[2, 5, 30:] = 0  # one warp of one CTA stopped at tile 30 (a shorter sequence)
    assert ca.trace_phases(tr)["tiles"] == 30 - 8 - 1
    tr[:, :, 9:] = 0
    with pytest.raises(ValueError, match="fewer than 2"):
        ca.trace_phases(tr)
