"""CLI: generate (MP4 + sidecar metadata + contact sheet), ls, and the recipe a run folder records."""
import json
import shutil

import numpy as np
import pytest

from trt_sora.errors import ConfigError


def test_generate_writes_clip_metadata_and_sheet(checked_run, tmp_path, capsys):
    from trt_sora.cli import main
    from trt_sora.runtime import video

    out = tmp_path / "clip.mp4"
    rc = main(["generate", "--run", str(checked_run), "--backend", "ort", "a red kite", "a cat walks", "-o", str(out),
               "--seed", "7", "--steps", "2", "--scale", "2", "--sheet", str(tmp_path / "sheet.png")])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'clip-0.mp4'}  9x32x48  seed 7  2 steps, CFG 5 (batched)")
    meta = json.loads((tmp_path / "clip-1.mp4.json").read_text())
    assert meta["seed"] == 8 and meta["prompt"] == "a cat walks" and meta["sampling"]["num_steps"] == 2
    assert video.read_video(tmp_path / "clip-1.mp4").shape == (9, 64, 96, 3)
    from PIL import Image

    assert np.asarray(Image.open(tmp_path / "sheet.png")).shape == (2 * 64 + 2, 9 * 96 + 8 * 2, 3)
    assert main(["generate", "--run", str(checked_run), "x", "-o", str(tmp_path / "x.avi")]) == 2  # typed error


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
