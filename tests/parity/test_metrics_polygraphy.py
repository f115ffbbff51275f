"""Our comparison metrics against Polygraphy's comparators (an independent implementation).

Polygraphy (>= 0.53) judges outputs by cosine similarity and PSNR with thresholds, as our gates do. Its
cosine is ours; its PSNR takes the reference's *max* as the peak (1.0 when that is <= 0), ours the
reference's max - min and says so in every report: for signed tensors such as latents and
velocities Polygraphy's peak depends on the sign of the data, so we keep ours and check both agree
when given the same peak.
"""
from __future__ import annotations

import numpy as np
import pytest

polygraphy = pytest.importorskip("polygraphy")

from trt_sora.config.recipe import ParityGate  # noqa: E402
from trt_sora.parity.metrics import compare, gate_check  # noqa: E402


def _polygraphy(func, ref, got):
    from polygraphy.comparator import IterationResult
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        res = func(IterationResult({"y": ref}, runner_name="ref"), IterationResult({"y": got}, runner_name="got"))
    return res["y"]


CASES = {
    "latent-like (signed)": lambda r: (r.normal(0, 1.5, (2, 4, 3, 8, 8)), 0.03),
    "frames in [0, 1]": lambda r: (r.uniform(0, 1, (1, 3, 5, 16, 16)), 0.01),
    "all negative": lambda r: (-r.uniform(0.5, 2.0, (64, 64)), 0.05),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cosine_and_psnr_agree_with_polygraphy(case):
    import polygraphy.comparator.compare as pc

    rng = np.random.default_rng(0)
    ref, noise = CASES[case](rng)
    ref = ref.astype(np.float32)
    got = (ref + noise * rng.normal(size=ref.shape)).astype(np.float32)
    ours = compare(ref, got)
    cos = _polygraphy(pc.CosineSimilarityCompareFunc(cosine_similarity_threshold=0.99), ref, got)
    assert ours["cosine"] == pytest.approx(cos.cosine_similarity, rel=1e-6)  # Polygraphy sums fp32 in fp32, we in fp64
    psnr = _polygraphy(pc.PsnrCompareFunc(psnr_threshold=20.0), ref, got)
    poly_peak = float(ref.max()) if ref.max() > 0 else 1.0  # Polygraphy's convention
    assert compare(ref, got, peak=poly_peak)["psnr_db"] == pytest.approx(psnr.psnr, rel=1e-6)
    # our default peak is the reference's range, stated in the result
    assert ours["psnr_peak"] == pytest.approx(float(ref.max() - ref.min())) and ours["psnr_peak_def"]
    if case == "all negative":  # Polygraphy's fallback peak of 1.0 understates the signal's range
        assert ours["psnr_db"] > psnr.psnr


@pytest.mark.parametrize("threshold", [0.9, 0.9995, 0.99999])
def test_gate_decisions_agree_with_polygraphy(threshold):
    """A cosine gate passes or fails exactly when Polygraphy's threshold does."""
    import polygraphy.comparator.compare as pc

    rng = np.random.default_rng(1)
    ref = rng.normal(size=(4, 256)).astype(np.float32)
    got = (ref + 0.02 * rng.normal(size=ref.shape)).astype(np.float32)
    ours = gate_check(compare(ref, got), ParityGate(min_cosine=threshold))[0]["passed"]
    theirs = bool(_polygraphy(pc.CosineSimilarityCompareFunc(cosine_similarity_threshold=threshold), ref, got))
    assert ours == theirs
