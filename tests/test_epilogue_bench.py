"""benchmarks/epilogue_bench.py's choice of settings and fp8_bench.py's ``--kernel-settings``, which applies them
(on the CPU: no kernel runs, the module's launch settings are what changes)."""
from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("torch")
pytest.importorskip("triton")


def _rows(ms_of):
    return {name: {"ms": ms} for name, ms in ms_of.items()}


def test_best_settings_take_the_least_time_over_the_norm_forms_and_the_fastest_qkv_row():
    eb = load_script("benchmarks/epilogue_bench.py")
    # warps 8 wins one form by far, but warps 4 is least over the three; prev is no candidate
    norm = {"a": {"by_setting": _rows({"warps16": 5, "warps8": 1, "warps4": 3, "prev": 0.1})},
            "b": {"by_setting": _rows({"warps16": 5, "warps8": 9, "warps4": 3, "prev": 0.1})},
            "c": {"by_setting": _rows({"warps16": 5, "warps8": 3, "warps4": 3, "prev": 0.1})},
            "shipped": {"max_warps": 8}}
    qkv = {"by_setting": _rows({f"post{p}_kv{k}": 2.0 for p, k in eb.QKV_GRID} | {"post4_kv8": 1.5, "prev": 0.1})}
    assert eb.best_settings({"norm": norm, "qkv": qkv}) == {"NORM_MAX_WARPS": 4,
                                                            "EPILOGUE_WARPS": {"post": 4, "kv": 8}}


def test_kernel_settings_set_the_named_launch_settings_and_refuse_unknown_ones(tmp_path, monkeypatch):
    fb = load_script("benchmarks/fp8_bench.py")
    from trt_sora.kernels import triton_ops as t

    monkeypatch.setattr(t, "NORM_MAX_WARPS", t.NORM_MAX_WARPS)
    monkeypatch.setattr(t, "EPILOGUE_WARPS", dict(t.EPILOGUE_WARPS))
    rms = t.EPILOGUE_WARPS["rms"]
    f = tmp_path / "epi.json"
    f.write_text(json.dumps({"gpu": "x", "best": {"NORM_MAX_WARPS": 4, "EPILOGUE_WARPS": {"post": 16, "kv": 4}}}))
    got = fb.set_kernel_settings(str(f))
    assert t.NORM_MAX_WARPS == 4 and t.EPILOGUE_WARPS == {"rms": rms, "post": 16, "kv": 4}  # merged, rms kept
    assert got == {"NORM_MAX_WARPS": 4, "EPILOGUE_WARPS": {"rms": rms, "post": 16, "kv": 4}}
    f.write_text(json.dumps({"NORM_ROWS": 2}))
    with pytest.raises(SystemExit, match="unknown \\['NORM_ROWS'\\]"):
        fb.set_kernel_settings(str(f))
