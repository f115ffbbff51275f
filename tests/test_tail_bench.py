"""benchmarks/tail_bench.py on the CPU with a small Wan VAE: every way runs, the family's group decode streamed
into an MP4 gives the file the serial path (diffusers' whole decode, then one MP4) gives, and the preset rows
carry PSNRs of the decoded MP4s."""
from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("torch")
pytest.importorskip("imageio_ffmpeg")


def test_tail_bench_ways_agree_on_a_small_vae(tmp_path, monkeypatch):
    bench = load_script("benchmarks/tail_bench.py")
    small = bench.vae_for
    monkeypatch.setattr(bench, "vae_for", lambda _model, dev, dtype: small("wan-tiny", dev, dtype))  # base_dim 8
    out = tmp_path / "tail.json"
    bench.main(["--small", "--device", "cpu", "--reps", "1", "--presets", "medium,veryfast", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["latent"] == [1, 16, 3, 8, 12] and res["device"] == "cpu"
    assert res["streamed_mp4_equals_serial_mp4"] is True
    (run,) = res["ways"]["streamed"]["runs"]
    assert run["groups"] == 3 and run["mp4_bytes"] > 0  # one group a latent frame
    assert run["decode_and_encode_s"] + run["encode_finish_s"] <= run["tail_s"]
    (serial,) = res["ways"]["serial"]["runs"]
    assert serial["vae_decode_s"] + serial["to_uint8_host_s"] + serial["mp4_s"] <= serial["tail_s"]
    assert set(res["presets"]) == {"medium", "veryfast"}
    assert {"streamed_medium", "streamed_veryfast"} <= set(res["ways"])
    assert all(20 < p["psnr_db"] < 99 and p["mp4_bytes"] > 0 for p in res["presets"].values())
