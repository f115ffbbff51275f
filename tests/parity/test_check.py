"""The parity matrix on wan-tiny with ONNX Runtime: passing run, and a wrong scale caught + localised."""
import json
import shutil

import pytest
from run_folders import RECIPE, corrupt_scale


def _by_level(rep):
    return {c["level"]: c for c in rep["comparisons"]}


def test_full_matrix_passes(checked_run):
    rep = json.loads((checked_run / "parity" / "report.json").read_text())
    lv = _by_level(rep)
    assert rep["passed"], rep["failed"]
    assert set(lv) == {"export", "qdq", "quality", "trajectory", "loop", "frames"}
    assert lv["export"]["metrics"]["cosine"] >= 0.99999 and lv["export"]["metrics"]["max_abs"] < 1e-4
    assert lv["qdq"]["metrics"]["cosine"] >= 0.999
    # the Q/DQ gate is judged against the rounding floor of the fp16 graph, sample by sample
    assert lv["qdq"]["floor_reference"].endswith("fp16-inputs")
    for m in lv["qdq"]["per_sample"]:
        assert 0 < m["floor_1_minus_cosine"] < 1e-3
        assert m["allowed_1_minus_cosine"] == pytest.approx(max(1e-3, 4 * m["floor_1_minus_cosine"]))
        assert m["distance_over_allowed"] == pytest.approx((1 - m["cosine"]) / m["allowed_1_minus_cosine"])
    assert lv["qdq"]["checks"][0]["value"] <= 1.0
    assert lv["quality"]["metrics"]["psnr_db"] >= 30.0
    assert len(lv["loop"]["per_step"]) == 4
    assert (checked_run / "parity" / "figures" / "trajectory.png").is_file()
    assert "Every step of the deployed trajectory" in (checked_run / "parity" / "report.md").read_text()
    assert lv["frames"]["metrics"]["frames"] >= 1 and 0 < lv["frames"]["metrics"]["worst_ssim"] <= 1
    for c in rep["comparisons"]:  # every comparison carries its numbers and thresholds
        assert c["checks"] and all({"value", "threshold", "op", "passed"} <= set(ch) for ch in c["checks"])
    assert lv["quality"]["metrics"]["psnr_peak_def"] == "reference max - min"
    md = (checked_run / "parity" / "report.md").read_text()
    assert "PASSED" in md and "PSNR peak" in md
    man = json.loads((checked_run / "parity" / "manifest.json").read_text())
    assert man["stage"] == "parity" and "qdq" in man["inputs"] and man["results"]["passed"]


def test_check_plan_lists_the_levels_the_recipe_asks_for(checked_run):
    from trt_sora.parity.check import check_plan

    rep = json.loads((checked_run / "parity" / "report.json").read_text())
    plan = check_plan(checked_run, RECIPE)
    assert plan.levels == ("export", "qdq", "quality", "trajectory", "loop", "frames")  # caching off
    assert plan.levels == tuple(c["level"] for c in rep["comparisons"])  # the check ran what it planned
    loop = _by_level(rep)["loop"]
    assert plan.loop_point == loop["point"] and plan.settings.num_steps == len(loop["per_step"])
    assert plan.caching is None and plan.backend == "ort"


def test_trajectory_gates_every_call_of_the_model_schedule(checked_run):
    """The trajectory level covers the model's own schedule to its last (lowest-noise) step: a loop
    shortened by default, or a gate that skips the last step, fails here."""
    from trt_sora.models import get_adapter

    rep = json.loads((checked_run / "parity" / "report.json").read_text())
    t = _by_level(rep)["trajectory"]
    st = get_adapter("wan-tiny").sampling
    sched = get_adapter("wan-tiny").scheduler(st.shift)
    sched.set_timesteps(st.num_steps)
    assert t["sampling"]["num_steps"] == st.num_steps and "the model's sampling settings" in t["sampling"]["note"]
    assert [r["step"] for r in t["per_step"]] == list(range(st.num_steps))
    assert [round(r["timestep"], 3) for r in t["per_step"]] == [round(float(x), 3) for x in sched.timesteps]
    assert {c["step"] for c in t["calls"]} == set(range(st.num_steps))  # the last step's calls are judged
    worst = min(t["calls"], key=lambda c: c["cosine"])
    assert t["checks"][0]["metric"].startswith("per-call cosine, every call of 4 steps")
    assert t["checks"][0]["value"] == pytest.approx(worst["cosine"])
    assert all(r["contribution_db"] > 20 for r in t["per_step"])


def test_wrong_scale_is_caught_and_localised(base_run, tmp_path):
    from trt_sora.parity import check_artifacts

    run = tmp_path / "bad"
    shutil.copytree(base_run, run)
    site = "blocks.1.ffn.net.0.proj"
    corrupt_scale(run, site, 0.02)  # clips that linear's input to 2% of its range
    rep = check_artifacts(run, RECIPE)
    assert not rep["passed"] and "qdq" in rep["failed"]
    assert _by_level(rep)["qdq"]["checks"][0]["value"] > 1.0  # beyond what rounding explains
    loc = rep["localization"]["qdq"]
    assert loc["first_jump"] == site and loc["block"] == "blocks.1"
    assert site in (run / "parity" / "report.md").read_text()


def test_cli_check_exit_codes(checked_run, tmp_path):
    from trt_sora.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(checked_run, bad)
    corrupt_scale(bad, "blocks.1.ffn.net.0.proj", 0.02)
    assert main(["check", "--run", str(bad), "--recipe", RECIPE]) == 1
    assert not json.loads((bad / "parity" / "report.json").read_text())["passed"]


def test_missing_export_is_a_typed_error(tmp_path):
    from trt_sora.errors import ArtifactError
    from trt_sora.parity import check_artifacts

    with pytest.raises(ArtifactError, match="trt-sora export"):
        check_artifacts(tmp_path, RECIPE)


class _Const:
    """A runner stub: ``infer`` returns the sample's reference output, plus a per-sample error."""

    def __init__(self, name, noise):
        self.name, self.noise = name, noise

    def infer(self, feeds):
        import numpy as np

        x = feeds["x"]
        return {"y": x + self.noise.get(int(feeds["i"][0]), 0.0) * np.cos(np.arange(x.size)).reshape(x.shape)}


@pytest.mark.parametrize("contribution_db, passes", [(50.0, True), (40.0, False)])
def test_quality_level_exempts_a_trajectory_call_only_on_its_measured_contribution(contribution_db, passes):
    """One rule on two levels: a quality sample that is a call of the deployed trajectory and misses the gate
    passes only when its step's measured contribution clears the trajectory level's limit; a missed sample
    that is not a trajectory call (no measurement) always fails the level."""
    import numpy as np

    from trt_sora.config.recipe import ParityGate
    from trt_sora.parity.check import _single_call

    rng = np.random.default_rng(0)
    samples = [({"batch": 1}, {"x": rng.standard_normal((4, 64)).astype(np.float32), "i": np.array([i])})
               for i in range(3)]
    gate = ParityGate(min_cosine=0.99, min_psnr_db=30.0)
    cand = _Const("cand", {2: 0.5})  # sample 2 (the last step) misses the gate
    res = _single_call(_Const("ref", {}), cand, samples, gate, "quality", "q", exempt={2: (19, contribution_db, 45.0)})
    assert res["passed"] is passes
    assert res["per_sample"][2]["exempt"] is passes and res["per_sample"][2]["step"] == 19
    assert any("trajectory step 19" in c["metric"] and c["value"] == contribution_db for c in res["checks"])
    assert res["metrics"]["cosine"] < 0.99 or passes  # an exempt sample leaves the judged worst
    assert not _single_call(_Const("ref", {}), cand, samples, gate, "quality", "q", exempt={})["passed"]
    assert not _single_call(_Const("ref", {}), _Const("cand", {1: 0.5, 2: 0.5}), samples, gate, "quality", "q",
                            exempt={2: (19, 50.0, 45.0)})["passed"]  # sample 1 has no measurement


@pytest.mark.parametrize("with_floor", [False, True])
@pytest.mark.parametrize("metric, key", [("max_abs", "max_abs"), ("max_rel_l2", "rel_l2")])
def test_max_abs_and_max_rel_l2_gates_fail_past_their_threshold(metric, key, with_floor):
    """A recipe's ``max_abs`` / ``max_rel_l2`` gate judges the worst sample: just above the measured
    error the level passes, just below it fails (also beside the Q/DQ level's rounding-floor cosine
    rule, which replaces only the cosine gate). The expected errors are computed here from the
    perturbation itself, not by the checker's metrics."""
    import numpy as np

    from trt_sora.config.recipe import ParityGate
    from trt_sora.parity.check import _single_call

    rng = np.random.default_rng(1)
    samples = [({"batch": 1}, {"x": rng.standard_normal((4, 64)).astype(np.float32), "i": np.array([i])})
               for i in range(3)]
    amp = {0: 0.01, 1: 0.03}
    pert = {i: a * np.cos(np.arange(256, dtype=np.float64)) for i, a in amp.items()}
    x = {i: samples[i][1]["x"].astype(np.float64).ravel() for i in amp}
    want = max(np.abs(pert[i]).max() for i in amp) if key == "max_abs" else \
        max(np.linalg.norm(pert[i]) / np.linalg.norm(x[i]) for i in amp)
    for factor, passes in ((1.01, True), (0.99, False)):
        kw = {metric: want * factor}
        gate = ParityGate(min_cosine=0.9, max_floor_ratio=4.0, **kw) if with_floor else ParityGate(**kw)
        res = _single_call(_Const("ref", {}), _Const("cand", amp), samples, gate, "qdq", "q",
                           floor_ref=_Const("floor", {}) if with_floor else None)
        check = next(c for c in res["checks"] if c["metric"] == key)
        assert check["value"] == pytest.approx(want, rel=1e-5)
        assert check["passed"] is passes and res["passed"] is passes, (factor, res["checks"])
