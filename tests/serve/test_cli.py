"""CLI: generate (MP4 + sidecar metadata + contact sheet), ls, and the recipe a run folder records."""
import json
import re
import shutil

import numpy as np
import pytest

from trt_sora.errors import ConfigError


def test_generate_writes_clip_metadata_and_sheet(checked_run, tmp_path, capsys):
    from trt_sora.cli import main
    from trt_sora.runtime import video

    out = tmp_path / "clip.mp4"
    rc = main(["generate", "--run", str(checked_run), "--backend", "ort", "a red kite", "a cat walks", "-o", str(out),
               "--seed", "7", "--steps", "2", "--scale", "2", "--sheet", str(tmp_path / "sheet.png"),
               "--preset", "veryfast"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'clip-0.mp4'}  9x32x48  seed 7  2 steps, CFG 5 (batched)")
    meta = json.loads((tmp_path / "clip-1.mp4.json").read_text())
    assert meta["seed"] == 8 and meta["prompt"] == "a cat walks" and meta["sampling"]["num_steps"] == 2
    assert "preset veryfast" in meta["tail"] and meta["seconds"]["decode_and_encode"] > 0  # encoded while decoding
    assert video.read_video(tmp_path / "clip-1.mp4").shape == (9, 64, 96, 3)
    from PIL import Image

    assert np.asarray(Image.open(tmp_path / "sheet.png")).shape == (2 * 64 + 2, 9 * 96 + 8 * 2, 3)
    assert main(["generate", "--run", str(checked_run), "x", "-o", str(tmp_path / "x.avi")]) == 2  # typed error


BAD_GENERATE = {
    "avi": (["x", "-o", "{tmp}/clip.avi"], "-o .*clip.avi: unknown suffix"),
    "scale-0": (["x", "--scale", "0"], "--scale 0: give an integer from 1 to 64"),
    "scale-huge": (["x", "--scale", "1000"], "--scale 1000"),
    "sheet-jpg": (["x", "--sheet", "{tmp}/s.jpg"], "--sheet .*s.jpg: a contact sheet is a PNG"),
    "out-under-a-file": (["x", "-o", "{tmp}/jobs.txt/clip.mp4"], "jobs.txt is a file"),
    "threads-0": (["x", "--threads", "0"], "--threads 0"),
    "steps-0": (["x", "--steps", "0"], "steps=0 must be an integer >= 1"),
    "steps-huge": (["x", "--steps", "5000"], "steps=5000 is more than 1000"),
    "guidance-nan": (["x", "--guidance", "nan"], "guidance=nan is out of range"),
    "guidance-1e308": (["x", "--guidance", "1e308"], "guidance=1e\\+308 is out of range"),
    "guidance-negative": (["x", "--guidance", "-1"], "guidance=-1.0 is out of range"),
    "shift-0": (["x", "--shift", "0"], "shift=0.0 is out of range"),
    "shift-inf": (["x", "--shift", "inf"], "shift=inf is out of range"),
    "frames-0": (["x", "--frames", "0"], "num_frames=0"),
    "seed": (["x", "--seed", "-1"], "seed=-1"),
    "empty": ([""], "prompt is empty"),
    "blank": (["x", " \t"], "prompt is empty"),
    "image-missing": (["x", "--image", "{tmp}/none.png"], "none.png' is not a file"),
    "images-count": (["x", "y", "--image", "a.png", "--image", "b.png", "--image", "c.png"], "given 3 times"),
}


@pytest.mark.parametrize("case", list(BAD_GENERATE))
def test_generate_checks_arguments_before_the_model_loads(tmp_path, monkeypatch, capsys, case):
    """A bad argument fails at once with a typed error (exit 2) naming it: the loader is never
    called (it would take seconds to minutes), the run folder is never read, nothing is written."""
    import trt_sora.cli.generate as gen_cli
    import trt_sora.runtime as rt
    from trt_sora.cli import main

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(gen_cli, "load_runner", never)
    monkeypatch.setattr(rt, "load", never)
    (tmp_path / "jobs.txt").write_text("a file, not a folder")
    args, message = BAD_GENERATE[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "clip.mp4")]
    assert main(["generate", "--run", str(tmp_path / "no-run-folder"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trt-sora generate: error: ") and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.txt"]


def test_batch_checks_ids_and_numbers_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import trt_sora.cli.generate as gen_cli
    from trt_sora.cli import main

    def never(*a, **k):
        raise AssertionError("the model was loaded before the jobs file was checked")

    monkeypatch.setattr(gen_cli, "load_runner", never)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "ok", "prompt": "a cat"}) + "\n" + json.dumps({"id": "../../x", "prompt": "a"}))
    run = ["batch", "--run", str(tmp_path / "no-run-folder"), "--prompts", str(jobs), "--out", str(tmp_path / "out")]
    assert main(run) == 2
    assert "jobs.jsonl:2: id '../../x' holds a path separator" in capsys.readouterr().err
    jobs.write_text(json.dumps({"prompt": "a cat"}))
    assert main([*run, "--retry-wait", "nan"]) == 2 and "retry_wait=nan" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.jsonl"]

BAD_GATE = {
    "vmaf-150": (["--vmaf-threshold", "150"], r"min_vmaf \(--vmaf-threshold\) = 150.0 is outside \[0, 100\]"),
    "vmaf-nan": (["--vmaf-threshold", "nan"], r"min_vmaf \(--vmaf-threshold\) = nan is outside"),
    "psnr-negative": (["--psnr-threshold", "-1"], r"min_psnr_db \(--psnr-threshold\) = -1.0 is outside \[0, 200\]"),
    "min-psnr-alias": (["--min-psnr", "inf"], r"min_psnr_db \(--psnr-threshold\) = inf is outside"),
    "no-libvmaf": (["--vmaf-threshold", "80"], r"--vmaf-threshold needs ffmpeg's 'libvmaf' filter, and this ffmpeg "
                   r"\(.*ffmpeg-no-vmaf\) was built without it .*fix: pip install -U imageio-ffmpeg"),
    "no-libvmaf-report": (["--gate-against", "ort", "--vmaf"], r"--vmaf needs ffmpeg's 'libvmaf' filter"),
}


@pytest.mark.parametrize("case", list(BAD_GATE))
def test_batch_checks_quality_bars_and_libvmaf_before_the_model_loads(tmp_path, monkeypatch, capsys, case):
    """A bar out of range, or VMAF asked of an ffmpeg whose -filters lists no libvmaf (a stand-in
    that lists vmafmotion, whose name merely contains 'vmaf'): exit 2 with a typed error naming the
    option and the fix; neither model is loaded and nothing is written."""
    import trt_sora.cli.generate as gen_cli
    import trt_sora.runtime as rt
    from trt_sora.cli import main

    def never(*a, **k):
        raise AssertionError("a model was loaded before the quality bars were checked")

    monkeypatch.setattr(gen_cli, "load_runner", never)
    monkeypatch.setattr(rt, "load", never)
    exe = tmp_path / "ffmpeg-no-vmaf"
    exe.write_text("#!/bin/sh\nprintf 'Filters:\\n ... scale V->V Scale the input video size.\\n"
                   " .. vmafmotion V->V Calculate the VMAF Motion score.\\n'\n")
    exe.chmod(0o755)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(exe))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "kite", "prompt": "a red kite"}) + "\n")
    args, message = BAD_GATE[case]
    assert main(["batch", "--run", str(tmp_path / "no-run-folder"), "--prompts", str(jobs), "--out",
                 str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trt-sora batch: error: ") and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ffmpeg-no-vmaf", "jobs.jsonl"]


def test_ls_shows_gates_backends_and_sizes(checked_run, base_run, capsys):
    from trt_sora.cli import main

    assert main(["ls", str(checked_run.parent), "--json"]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    checked, unchecked = runs[str(checked_run)], runs[str(base_run)]
    assert checked["parity"] == "passed" and checked["recipe"] == "rtx4090-fp8" and unchecked["parity"] == "unchecked"
    assert "ort (Q/DQ)" in checked["backends"] and checked["bytes"]["quant"] > 0
    assert checked["sampling"] == {"num_steps": 4, "guidance_scale": 5.0, "shift": 3.0}
    assert main(["ls", str(checked_run.parent)]) == 0
    assert "parity passed (ort)" in capsys.readouterr().out


def test_check_reads_the_recipe_recorded_in_the_run_folder(tmp_path, checked_run):
    from trt_sora.cli.common import run_recipe
    from trt_sora.config import dump_recipe, load_recipe

    assert run_recipe(checked_run)[0].name == "rtx4090-fp8"  # named by its parity report
    run = tmp_path / "mine"
    run.mkdir()
    with pytest.raises(ConfigError, match="pass --recipe"):
        run_recipe(run)
    (run / "recipe.yaml").write_text(dump_recipe(load_recipe("h100-fp8")))
    recipe, source = run_recipe(run)
    assert recipe.name == "h100-fp8" and source.endswith("recipe.yaml")
    shutil.move(str(run), tmp_path / "l40s-fp8")
    (tmp_path / "l40s-fp8" / "recipe.yaml").unlink()
    assert run_recipe(tmp_path / "l40s-fp8")[0].name == "l40s-fp8"  # build/<model>/<recipe>/
