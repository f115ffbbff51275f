"""trt-sora batch: per-clip outputs + manifest, failures recorded, retries, quality gate, resume after kill -9."""
import hashlib
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import prefork
import pytest
from http_helpers import kill_batch_after_clips, trt_sora_cli

from trt_sora.errors import ConfigError


def _write_jobs(path: Path, lines) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_outputs_manifest_and_recorded_failures(tiny_runner, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "kite", "prompt": "a red kite", "seed": 1},
        {"id": "cat", "prompt": "a cat walks", "seed": 2, "guidance": 1.0},
        {"id": "dog", "prompt": "a dog runs", "seed": 3, "guidance": 1.0},
        "# a comment, then a blank line",
        "",
        {"id": "typo", "prompt": "x", "sed": 1},
        {"id": "size", "prompt": "x", "num_frames": 10},
        "{not json",
    ])
    s = run_batch(tiny_runner, jobs, tmp_path / "out", BatchConfig(formats=("npy", "mp4")))
    d = s.data
    assert (d["total"], d["finished"], d["generated"], d["failed"]) == (6, 3, 3, 3) and not s.ok
    assert d["formed_batches"] == {"1": 1, "2": 1}  # kite alone (CFG pair), cat + dog together (no CFG)
    errors = {f["id"]: f["error"] for f in d["failures"]}
    assert "did you mean 'seed'" in errors["typo"] and "num_frames 10" in errors["size"]
    assert "not JSON" in errors["line-8"]
    out = tmp_path / "out"
    man = json.loads((out / "manifest.json").read_text())
    assert man["stage"] == "batch"
    assert sorted(man["results"]["clips"]) == ["cat", "dog", "kite", "line-8", "size", "typo"]
    want = rt.generate(tiny_runner, ["a cat walks"], seed=2, guidance=1.0)[0].frames
    rec = json.loads((out / "clips" / "cat.json").read_text())
    assert rec["status"] == "done" and rec["metadata"]["sampling"]["guidance_scale"] == 1.0
    assert rec["frames"]["sha256"] == hashlib.sha256(want.tobytes()).hexdigest()
    np.testing.assert_array_equal(np.load(out / "clips" / "cat.npy"), want)
    for o in rec["outputs"].values():
        assert hashlib.sha256((out / o["path"]).read_bytes()).hexdigest() == o["sha256"]
    assert "| 6 | 3 | 3 | 0 | 3 |" in (out / "summary.md").read_text()
    with pytest.raises(ConfigError, match="lines 1 and 2"):
        run_batch(tiny_runner, _write_jobs(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}] * 2), out)


class _Flaky:
    """The runner, failing its first ``fail`` calls with a simulated out-of-memory error."""

    def __init__(self, runner, fail: int):
        self._runner, self.fail, self.calls = runner, fail, 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def infer(self, feeds):
        self.calls += 1
        if self.calls <= self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return self._runner.infer(feeds)


def test_transient_errors_are_retried_then_recorded(tiny_runner, tmp_path):
    from trt_sora.serve.batch import BatchConfig, is_transient, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": "a cat", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    waits = []
    s = run_batch(_Flaky(tiny_runner, 1), jobs, tmp_path / "a", BatchConfig(formats=("npy",), retries=2),
                  sleep=waits.append)
    assert s.ok and s.data["retries"] == 2 and waits == [1.0]
    recs = [json.loads((tmp_path / "a" / "clips" / f"c{i}.json").read_text()) for i in range(2)]
    assert [r["attempts"] for r in recs] == [2, 2]
    assert [r["metadata"]["batch"]["clips"] for r in recs] == [1, 1]  # out of memory: the pair was split
    s = run_batch(_Flaky(tiny_runner, 99), jobs, tmp_path / "b", BatchConfig(formats=("npy",), retries=1),
                  sleep=waits.append)
    assert s.data["failed"] == 2 and "out of memory" in s.data["failures"][0]["error"]
    rec = json.loads((tmp_path / "b" / "clips" / "c0.json").read_text())
    assert rec["status"] == "failed" and rec["error"]["transient"] and rec["attempts"] == 2
    assert is_transient(TimeoutError()) and not is_transient(ConfigError("bad"))


def test_each_job_is_resolved_once(tiny_runner, tmp_path, resolves):
    """The driver resolves a job once (its fingerprint, its group, its typed error) and the generator,
    the gate's reference and every retry run that resolution; a resumed run resolves each job once
    again (a finished one for its fingerprint only)."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, GateConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}
                                                 for i in range(2)] + [{"id": "size", "prompt": "x", "num_frames": 10}])
    out, cfg = tmp_path / "out", BatchConfig(formats=("npy",), retries=1, gate=GateConfig())
    s = run_batch(_Flaky(tiny_runner, 1), jobs, out, cfg, reference_runner=tiny_runner, sleep=lambda _: None)
    assert (s.data["retries"], s.data["generated"], s.data["failed"]) == (2, 2, 1)
    assert resolves == {"clip 0": 1, "clip 1": 1, "x": 1}
    assert "num_frames 10" in s.data["failures"][0]["error"]
    recs = [json.loads((out / "clips" / f"c{i}.json").read_text()) for i in range(2)]
    got = [(r["attempts"], r["metadata"]["batch"]["clips"], r["gate"]["identical"]) for r in recs]
    assert got == [(2, 1, True)] * 2  # out of memory: the pair split, each retried; the gate ran
    resolves.clear()
    _npy(out, "c0").unlink()
    s = run_batch(tiny_runner, jobs, out, cfg, reference_runner=tiny_runner)
    assert (s.data["skipped"], s.data["generated"]) == (1, 1) and resolves == {"clip 0": 1, "clip 1": 1, "x": 1}
    want = rt.generate(tiny_runner, ["clip 0"], seed=0, guidance=1.0)[0].frames
    np.testing.assert_array_equal(np.load(_npy(out, "c0")), want)


def test_a_ray_worker_runs_the_drivers_resolution(checked_run, tiny_runner, resolves):
    """``trt-sora batch --ray`` without Ray: the driver's generator (run info only) resolves the jobs,
    the resolutions cross to the worker as Ray sends them (pickled), and the worker (and its gate
    reference) run them without resolving again: the clips are generate()'s."""
    import pickle

    import trt_sora.runtime as rt
    from trt_sora.runtime import ClipRequest
    from trt_sora.runtime.generate import Generator
    from trt_sora.serve.ray_fleet import _RunInfo, _Worker

    worker = _Worker(str(checked_run), "ort", False, "ort", "auto", None, 1)
    driver = Generator(_RunInfo(checked_run, "ort"))
    resolved = [driver.resolve(ClipRequest(p, seed=s, guidance=1.0)) for p, s in (("a cat walks", 5),
                                                                                  ("a dog runs", 6))]
    clips, ref = worker.run(pickle.loads(pickle.dumps(resolved)))
    assert resolves == {"a cat walks": 1, "a dog runs": 1}
    want = rt.generate(tiny_runner, ["a cat walks", "a dog runs"], seed=[5, 6], guidance=1.0)
    for got, r, w in zip(clips, ref, want):
        assert got.metadata["worker"] == worker.name and got.metadata["batch"]["clips"] == 2
        np.testing.assert_array_equal(got.frames, w.frames)
        np.testing.assert_array_equal(r.frames, w.frames)


def _npy(out: Path, jid: str) -> Path:
    return out / "clips" / f"{jid}.npy"


@pytest.mark.parametrize("damage", ["same-size-flip", "truncate", "delete", "record-points-outside"])
def test_resume_rechecks_finished_clips(tiny_runner, tmp_path, damage):
    """A rerun skips a finished clip only while its outputs still have the recorded size and sha256
    inside the output folder: a clip changed in place (same size), cut short, deleted, or whose
    record names an intact copy outside the folder is generated again; the intact one is left
    untouched."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    out, cfg = tmp_path / "out", BatchConfig(formats=("npy",))
    assert run_batch(tiny_runner, jobs, out, cfg).ok
    kept = (_npy(out, "c1").read_bytes(), _npy(out, "c1").stat().st_mtime_ns)
    p = _npy(out, "c0")
    if damage == "same-size-flip":
        data = bytearray(p.read_bytes())
        data[-1] ^= 0x01  # the last pixel's lowest bit: same size, other sha256
        p.write_bytes(bytes(data))
    elif damage == "truncate":
        p.write_bytes(p.read_bytes()[:-7])
    elif damage == "delete":
        p.unlink()
    else:  # the file moved out of the folder, the record edited to follow it: same bytes, size and sha256
        rec_path = out / "clips" / "c0.json"
        rec = json.loads(rec_path.read_text())
        p.rename(tmp_path / "c0.npy")
        rec["outputs"]["npy"]["path"] = "../c0.npy"
        rec_path.write_text(json.dumps(rec))
    s = run_batch(tiny_runner, jobs, out, cfg)
    assert s.ok and (s.data["skipped"], s.data["generated"], s.data["finished"]) == (1, 1, 2)
    want = rt.generate(tiny_runner, ["clip 0"], seed=0, guidance=1.0)[0].frames
    np.testing.assert_array_equal(np.load(p), want)
    rec = json.loads((out / "clips" / "c0.json").read_text())
    assert rec["outputs"]["npy"]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert (_npy(out, "c1").read_bytes(), _npy(out, "c1").stat().st_mtime_ns) == kept


def test_resume_retries_failed_jobs(tiny_runner, tmp_path):
    """A job recorded as failed is not finished: a rerun generates it, and the summary counts it as
    done, not failed or skipped."""
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"c{i}", "prompt": f"clip {i}", "seed": i, "guidance": 1.0}
                                                 for i in range(2)])
    out, cfg = tmp_path / "out", BatchConfig(formats=("npy",), retries=0)
    s = run_batch(_Flaky(tiny_runner, 99), jobs, out, cfg, sleep=lambda _: None)
    assert s.data["failed"] == 2 and not _npy(out, "c0").exists()
    assert json.loads((out / "clips" / "c0.json").read_text())["status"] == "failed"
    s = run_batch(tiny_runner, jobs, out, cfg)
    assert s.ok and (s.data["failed"], s.data["skipped"], s.data["generated"], s.data["finished"]) == (0, 0, 2, 2)
    for i in range(2):
        want = rt.generate(tiny_runner, [f"clip {i}"], seed=i, guidance=1.0)[0].frames
        np.testing.assert_array_equal(np.load(_npy(out, f"c{i}")), want)
        assert json.loads((out / "clips" / f"c{i}.json").read_text())["status"] == "done"


BAD_IDS = [("", "is empty"), ("../../victim", "path separator"), ("a\\b", "path separator"), ("..", "'..'"),
           ("a\x00b", "NUL"), ("x" * 129, "129 characters"), ("a b", "other than letters"),
           ("a\n", "other than letters"), ([1], "JSON list")]


@pytest.mark.parametrize(("bad", "why"), BAD_IDS, ids=["empty", "dotdot-sep", "backslash", "dotdot", "nul", "long",
                                                        "space", "newline", "list"])
def test_bad_ids_are_refused_before_anything_is_written(tiny_runner, tmp_path, bad, why):
    """An id that cannot name a file inside the output folder stops the batch with a ConfigError
    naming the line, before the output folder exists: no record lands at ``clips/../../victim.json``
    (issue 31) or ``clips/.json``."""
    from trt_sora.serve.batch import run_batch

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "fine", "prompt": "a cat"}, {"id": bad, "prompt": ""}])
    out = tmp_path / "a" / "out"
    with pytest.raises(ConfigError, match=f"jobs.jsonl:2: id .*{why}"):
        run_batch(tiny_runner, jobs, out)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["jobs.jsonl"]


def test_repeated_and_unchecked_ids_are_refused(tiny_runner, tmp_path):
    """Duplicates name both lines; jobs handed over as a list (not read from a file) are checked
    too, before the output folder is made."""
    from trt_sora.runtime.generate import ClipRequest
    from trt_sora.serve.batch import Job, run_batch

    dup = _write_jobs(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"}])
    with pytest.raises(ConfigError, match="'a' appears on lines 1 and 3"):
        run_batch(tiny_runner, dup, tmp_path / "out")
    jobs = [Job("ok", 1, ClipRequest("a cat")), Job("../../victim", 2, error="bad line")]
    with pytest.raises(ConfigError, match="line 2: id '../../victim' holds a path separator"):
        run_batch(tiny_runner, jobs, tmp_path / "sub" / "out")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dup.jsonl"]


def test_writes_stay_in_the_output_folder_without_the_id_check(tiny_runner, tmp_path, monkeypatch):
    """The second line of defence: with the id check switched off, the one path helper every write
    goes through still refuses a record outside the output folder, and a ``clips`` folder that is a
    link to another folder."""
    import trt_sora.serve.batch as batch

    monkeypatch.setattr(batch, "_check_id", lambda jid, where: str(jid))
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "../../victim", "prompt": ""}])
    with pytest.raises(ConfigError, match="outside the batch output folder"):
        batch.run_batch(tiny_runner, jobs, tmp_path / "a" / "out")
    monkeypatch.undo()
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "b"
    elsewhere.mkdir()
    out.mkdir()
    (out / "clips").symlink_to(elsewhere, target_is_directory=True)
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "empty", "prompt": ""}])
    with pytest.raises(ConfigError, match="outside the batch output folder"):
        batch.run_batch(tiny_runner, jobs, out)
    assert not list(elsewhere.iterdir()) and not list(tmp_path.rglob("victim*"))


def test_bad_requests_are_recorded_failed_in_the_output_folder(tiny_runner, tmp_path):
    """Empty, blank or NUL prompts and non-finite or absurd floats fail their own job with the reason
    (recorded under ``clips/``), and nothing is generated for them."""
    from trt_sora.serve.batch import BatchConfig, run_batch

    bad = {"empty": {"prompt": ""}, "blank": {"prompt": " \t "}, "nul": {"prompt": "a\x00b"},
           "huge": {"prompt": "x", "guidance": 1e308}, "nan": {"prompt": "x", "shift": float("nan")},
           "steps": {"prompt": "x", "steps": 10 ** 6}}
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": k, **v} for k, v in bad.items()])
    s = run_batch(tiny_runner, jobs, tmp_path / "out", BatchConfig(formats=("npy",)))
    assert (s.data["failed"], s.data["generated"], s.data["finished"]) == (6, 0, 0)
    errors = {f["id"]: f["error"] for f in s.data["failures"]}
    assert "prompt is empty" in errors["empty"] and "prompt is empty" in errors["blank"]
    assert "NUL" in errors["nul"] and "guidance=1e+308 is out of range" in errors["huge"]
    assert "shift=nan is out of range" in errors["nan"] and "more than 1000" in errors["steps"]
    assert sorted(p.name for p in (tmp_path / "out" / "clips").iterdir()) == sorted(f"{k}.json" for k in bad)


def test_batch_config_refuses_bad_numbers():
    from trt_sora.serve.batch import BatchConfig

    for bad in ({"scale": 0}, {"scale": 65}, {"retry_wait": float("nan")}, {"retry_wait": -1}, {"retries": -1},
                {"max_batch": 0}):
        with pytest.raises(ConfigError):
            BatchConfig(**bad)


def test_quality_gate_against_the_pytorch_model(tiny_runner, checked_run, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.serve.batch import BatchConfig, GateConfig, run_batch

    ref = rt.load(checked_run, backend="torch", warmup=False)
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "kite", "prompt": "a red kite", "seed": 1}])
    s = run_batch(tiny_runner, jobs, tmp_path / "a", BatchConfig(formats=("npy",), gate=GateConfig(vmaf=True)),
                  reference_runner=ref)
    g = json.loads((tmp_path / "a" / "clips" / "kite.json").read_text())["gate"]
    assert s.ok and g["passed"] and g["min_psnr_db"] == 25.0 and "parity" in g["min_psnr_source"]
    assert 25.0 <= g["worst_psnr_db"] < 100 and 0 < g["mean_ssim"] <= 1 and not g["identical"]
    assert isinstance(g["vmaf"], float) or "without libvmaf" in g["vmaf_note"]
    s = run_batch(tiny_runner, jobs, tmp_path / "b", BatchConfig(formats=("npy",), gate=GateConfig(min_psnr_db=99)),
                  reference_runner=ref)
    assert not s.ok and s.data["gate_failed"] == 1 and s.data["gate_failures"][0]["id"] == "kite"


def _vmaf_by_hand(ref: np.ndarray, dis: np.ndarray, tmp: Path) -> float:
    """Mean VMAF of ``dis`` against ``ref`` by a separately written ffmpeg call: the streams labelled
    by role in a filter graph, the model named explicitly (libvmaf's default, vmaf_v0.6.1), the mean
    taken here over the per-frame scores of libvmaf's XML log (that log's own pooled mean is not the
    mean of its frames' scores, which are clipped at 100); frames upscaled (nearest) to at least 256
    rows as the batch documents."""
    from trt_sora.runtime.video import ffmpeg_exe

    _, h, w, _ = ref.shape
    k = -(-256 // h)
    (tmp / "ref.rgb").write_bytes(ref.tobytes())
    (tmp / "dis.rgb").write_bytes(dis.tobytes())
    raw = ["-f", "rawvideo", "-pix_fmt", "rgb24", "-video_size", f"{w}x{h}", "-framerate", "16"]
    up = f"scale={w * k}:{h * k}:flags=neighbor,format=yuv420p"
    graph = (f"[0:v]{up}[ref];[1:v]{up}[dis];"
             f"[dis][ref]libvmaf=model=version=vmaf_v0.6.1:log_fmt=xml:log_path={tmp / 'vmaf.xml'}")
    subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", *raw, "-i", str(tmp / "ref.rgb"), *raw, "-i",
                    str(tmp / "dis.rgb"), "-filter_complex", graph, "-f", "null", "-"], check=True)
    frames = [float(v) for v in re.findall(r'<frame [^>]*vmaf="([\d.]+)"', (tmp / "vmaf.xml").read_text())]
    assert len(frames) == len(ref)
    return float(np.mean(frames))


def test_psnr_and_vmaf_thresholds_fail_the_clip_and_the_command(checked_run, tmp_path, capsys):
    """``batch --psnr-threshold DB --vmaf-threshold S`` against the PyTorch model (the default
    reference): each clip's record keeps its per-frame PSNR and its VMAF, equal to numpy's PSNR and
    to a separate ffmpeg/libvmaf call on the same frames; a bar exactly at a clip's score passes, the
    next float above it fails that clip (status gate_failed, the missed bar named) and exits 1."""
    import trt_sora.runtime as rt
    from trt_sora.cli import main
    from trt_sora.runtime.video import has_ffmpeg_filter

    if not has_ffmpeg_filter("libvmaf"):
        pytest.skip("this ffmpeg has no libvmaf (the imageio-ffmpeg wheel's has it)")
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "kite", "prompt": "a red kite", "seed": 1}])

    def batch(out: str, *bars: str) -> tuple[int, dict, str]:
        rc = main(["batch", "--run", str(checked_run), "--backend", "ort", "--prompts", str(jobs), "--out",
                   str(tmp_path / out), "--formats", "npy", "--threads", "1", "--no-progress", *bars])
        rec = json.loads((tmp_path / out / "clips" / "kite.json").read_text())
        return rc, rec, capsys.readouterr().err

    rc, rec, _ = batch("loose", "--psnr-threshold", "30", "--vmaf-threshold", "50")
    g = rec["gate"]
    assert rc == 0 and rec["status"] == "done" and g["below"] == [] and (g["min_psnr_db"], g["min_vmaf"]) == (30, 50)
    got = np.load(tmp_path / "loose" / "clips" / "kite.npy")
    want = rt.generate(rt.load(checked_run, backend="torch", warmup=False), ["a red kite"], seed=1)[0].frames
    mse = ((got.astype(np.float64) - want.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(g["psnr_db"], 10 * np.log10(255.0 ** 2 / mse), rtol=1e-12)
    assert g["worst_psnr_db"] == min(g["psnr_db"]) and 30 < g["worst_psnr_db"] < 100
    assert g["vmaf"] == pytest.approx(_vmaf_by_hand(want, got, tmp_path), abs=1e-5) and 50 < g["vmaf"] < 100
    man = json.loads((tmp_path / "loose" / "manifest.json").read_text())["results"]["clips"]["kite"]
    assert man["gate"] is True and man["quality"]["vmaf"] == g["vmaf"]

    vmaf, worst = g["vmaf"], g["worst_psnr_db"]
    rc, rec, _ = batch("at-bar", "--psnr-threshold", repr(worst), "--vmaf-threshold", repr(vmaf))
    assert rc == 0 and rec["status"] == "done" and rec["gate"]["vmaf"] == vmaf  # a score equal to its bar passes
    rc, rec, err = batch("vmaf-above", "--vmaf-threshold", repr(float(np.nextafter(vmaf, 101.0))))
    assert rc == 1 and rec["status"] == "gate_failed" and rec["gate"]["below"] == ["vmaf"]
    assert f"below the gate kite (vmaf): worst-frame PSNR {worst:.2f} dB" in err and f"VMAF {vmaf:.2f}" in err
    rc, rec, err = batch("psnr-above", "--psnr-threshold", repr(float(np.nextafter(worst, np.inf))))
    assert rc == 1 and rec["status"] == "gate_failed" and rec["gate"]["below"] == ["psnr"]
    assert rec["gate"]["vmaf"] is None and "below the gate kite (psnr)" in err  # VMAF not asked: not computed
    summary = json.loads((tmp_path / "psnr-above" / "summary.json").read_text())
    assert summary["gate_failed"] == 1 and summary["gate_failures"][0]["below"] == ["psnr"]


def test_vmaf_without_libvmaf_is_refused_before_anything_is_written(tiny_runner, tmp_path, monkeypatch):
    """run_batch asked for VMAF by an ffmpeg without the libvmaf filter (one that has vmafmotion, a
    name that merely contains 'vmaf'): a typed error naming the filter and the fix, no output folder."""
    from trt_sora.serve.batch import BatchConfig, GateConfig, run_batch
    from trt_sora.serve.quality import VmafUnavailableError

    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(_ffmpeg_without_libvmaf(tmp_path)))
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "kite", "prompt": "a red kite"}])
    for gate, flag in ((GateConfig(min_vmaf=80.0), "--vmaf-threshold"), (GateConfig(vmaf=True), "--vmaf")):
        with pytest.raises(VmafUnavailableError, match=f"{flag} needs ffmpeg's 'libvmaf' filter.*imageio-ffmpeg"):
            run_batch(tiny_runner, jobs, tmp_path / "out", BatchConfig(gate=gate), reference_runner=tiny_runner)
    assert not (tmp_path / "out").exists()


def _ffmpeg_without_libvmaf(tmp_path: Path) -> Path:
    """A stand-in ffmpeg whose ``-filters`` lists scale and vmafmotion but not libvmaf."""
    exe = tmp_path / "ffmpeg-no-vmaf"
    exe.write_text("#!/bin/sh\nprintf 'Filters:\\n ... scale V->V Scale the input video size.\\n"
                   " .. vmafmotion V->V Calculate the VMAF Motion score.\\n'\n")
    exe.chmod(0o755)
    return exe


@pytest.mark.slow
def test_resume_after_kill_9(checked_run, tiny_runner, tmp_path):
    """kill -9 mid-batch, leave a partial clip behind, rerun: the exact set of outputs, finished
    clips untouched, the partial one redone, nothing twice."""
    import trt_sora.runtime as rt

    n = 6
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": f"j{i}", "prompt": f"clip number {i}", "seed": i}
                                                 for i in range(n)])
    out = tmp_path / "out"
    cmd, env = trt_sora_cli("-v", "batch", "--run", str(checked_run), "--backend", "ort", "--prompts", str(jobs),
                            "--out", str(out), "--formats", "npy,png", "--threads", "1", "--no-progress")
    kill_batch_after_clips(cmd, env, clips=2)  # no polling: it reads the log as it is written
    finished = {p.stem: (p.read_text(), (out / "clips" / f"{p.stem}.npy").stat().st_mtime_ns)
                for p in (out / "clips").glob("j*.json") if json.loads(p.read_text())["status"] == "done"}
    assert 2 <= len(finished) < n
    todo = sorted(f"j{i}" for i in range(n) if f"j{i}" not in finished)
    (out / "clips" / f"{todo[0]}.npy").write_bytes(b"partial")          # a clip cut off mid-write
    (out / "clips" / f".{todo[-1]}.tmp999.png").write_bytes(b"partial")  # a temp file of a killed writer
    res = prefork.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-1500:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["skipped"], summary["generated"], summary["finished"]) == (len(finished), n - len(finished), n)
    names = sorted(p.name for p in (out / "clips").iterdir())
    assert names == sorted(f"j{i}.{ext}" for i in range(n) for ext in ("json", "npy", "png"))  # no temp, no dup
    for jid, (text, mtime) in finished.items():  # finished clips were not regenerated
        assert (out / "clips" / f"{jid}.json").read_text() == text
        assert (out / "clips" / f"{jid}.npy").stat().st_mtime_ns == mtime
    man = json.loads((out / "manifest.json").read_text())["results"]["clips"]
    assert sorted(man) == sorted(f"j{i}" for i in range(n)) and {c["status"] for c in man.values()} == {"done"}
    want = rt.generate(tiny_runner, [f"clip number {todo[0][1:]}"], seed=int(todo[0][1:]))[0].frames
    np.testing.assert_array_equal(np.load(out / "clips" / f"{todo[0]}.npy"), want)  # the partial one, redone
