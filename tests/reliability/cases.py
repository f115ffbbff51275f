"""Hostile inputs for every stage, the runtime and the run folder, as one list of cases.

Each case does one thing a new user or hostile input would do to a wan-tiny run folder built by
``trt-sora engine --model wan-tiny --recipe rtx4090-fp8`` and says what happened:

============  ===============================================================================
outcome       meaning
============  ===============================================================================
typed         a one-line ``trt_sora`` error (non-zero exit for the CLI) naming the problem
ok            the right behaviour (a damaged stage reruns, a good call after bad ones is exact)
traceback     an exception that is not a ``TrtSoraError`` escaped (a raw traceback)
silent        bad input accepted: the command succeeded or the runtime served
leftover      temp folders or a stale report left behind
wrong         a typed error or a result, but the wrong one (wrong reason, wrong artifact)
n/a           the machine cannot run the case (no user namespaces for a tmpfs, ...)
============  ===============================================================================

``tests/reliability/test_reliability.py`` asserts every case's expected outcome. Run as a script
to print the before/after table for whichever ``trt_sora`` is first on ``PYTHONPATH``::

    PYTHONPATH=<checkout> python tests/reliability/cases.py --work /tmp/rel [--only id,id]

Only entry points that every version of trt_sora has are used (the CLI, ``EnginePipeline``,
``runtime.load``), so the same cases describe the code before and after a change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

_TESTS = str(Path(__file__).resolve().parents[1])  # tests/, for prefork when this file runs as a script
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
import prefork  # noqa: E402

RECIPE = "rtx4090-fp8"
MODEL = "wan-tiny"
STAGES = ("export", "calibrate", "quantize", "build", "check")
FOLDER = {"export": "export", "calibrate": "calib", "quantize": "quant", "build": "engine", "check": "parity"}
TEMP_RE = re.compile(r"^\.[^/]*\.(tmp|old)-")


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    group: str
    what: str
    want: str                      # expected outcome now: "typed" or "ok"
    fn: Callable[[Env], Outcome]
    match: str = ""                # regex the typed message (or ok detail) must contain
    subprocess: bool = False       # starts trt-sora processes (kill, signals, concurrency, tmpfs)


class Env:
    """A finished wan-tiny run (``base``: the folder holding ``wan-tiny/rtx4090-fp8``) and a scratch
    folder for copies. ``quick``: check stage-reuse decisions with ``EnginePipeline.plan`` where it
    exists instead of rerunning the stage (the suite reruns one damage per stage for real)."""

    def __init__(self, base: Path, scratch: Path, *, quick: bool = False):
        self.base, self.scratch, self.quick = Path(base), Path(scratch), quick
        self._n = 0
        self._memo: dict[str, Any] = {}

    def once(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` the first time, its result after (cases that continue one another's scenario)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def copy_run(self) -> tuple[Path, Path]:
        """A fresh copy of the base run: ``(out_root, run_dir)``."""
        self._n += 1
        out = self.scratch / f"c{self._n:03d}"
        shutil.copytree(self.base, out, symlinks=True)
        for p in list(out.rglob("*")):  # a lock file of the base run is no part of the copy
            if p.name in (".lock", ".trt_sora.lock"):
                p.unlink()
        return out, out / MODEL / RECIPE

    def fresh_dir(self, name: str) -> Path:
        self._n += 1
        d = self.scratch / f"d{self._n:03d}-{name}"
        d.mkdir(parents=True)
        return d


# -- helpers ---------------------------------------------------------------------------------------------
def _is_typed(exc: BaseException) -> bool:
    from trt_sora.errors import TrtSoraError

    return isinstance(exc, TrtSoraError)


def from_exc(exc: BaseException) -> Outcome:
    if _is_typed(exc):
        msg = str(exc)
        if "\n" in msg:
            return Outcome("wrong", f"{type(exc).__name__} over {msg.count(chr(10)) + 1} lines: {msg[:200]}")
        return Outcome("typed", f"{type(exc).__name__}: {msg}")
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return Outcome("traceback", f"{type(exc).__module__}.{type(exc).__name__}: {first}")


def call(fn, *a, **k) -> tuple[Any, BaseException | None]:
    try:
        return fn(*a, **k), None
    except BaseException as exc:  # noqa: BLE001 - classifying every escape is the point
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, exc


def cli(*argv: str, cwd: Path | None = None) -> tuple[int | None, str, BaseException | None]:
    """``trt-sora ARGV`` in this process: (exit code, stderr, escaped exception)."""
    from trt_sora.cli import main

    err, out = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc, exc = call(main, list(argv))
    finally:
        os.chdir(old)
    return rc, err.getvalue(), exc


def cli_outcome(rc, err: str, exc, *, bad: bool = True) -> Outcome:
    """Classify a CLI run of a bad input: escaped exception, exit 0, or one typed error line."""
    if exc is not None:
        if isinstance(exc, SystemExit) and exc.code not in (0, None):  # argparse usage error: one line
            return Outcome("typed", f"usage error (exit {exc.code})")
        return from_exc(exc)
    if "Traceback (most recent call last)" in err:
        return Outcome("traceback", err.strip().splitlines()[-1][:200])
    if rc == 0:
        return Outcome("silent" if bad else "ok", "exit 0")
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    if len(lines) != 1:
        return Outcome("wrong", f"exit {rc} with {len(lines)} error lines: {err.strip()[-300:]}")
    return Outcome("typed", f"exit {rc}: {lines[0]}")


def leftovers(root: Path) -> list[str]:
    """Temp folders (``.<name>.tmp-*`` / ``.<name>.old-*``) anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if TEMP_RE.match(p.name))


def with_leftovers(out: Outcome, root: Path) -> Outcome:
    left = leftovers(root)
    if left and out.kind not in ("traceback",):
        return Outcome("leftover", f"{out.detail}; left behind: {left}")
    return out


def statuses(out_root: Path, stages=STAGES, recipe=RECIPE) -> tuple[dict[str, str], BaseException | None]:
    from trt_sora.pipeline import EnginePipeline

    seen: dict[str, str] = {}
    _, exc = call(lambda: EnginePipeline(recipe, MODEL, out_root, progress=lambda o: seen.__setitem__(
        o.stage, o.status)).run(stages))
    return seen, exc


def feeds(b=2, f=3, h=4, w=6, text=16, seed=0, dtype=np.float32) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"hidden_states": g.standard_normal((b, 16, f, h, w)).astype(dtype),
            "timestep": np.full((b,), 500.0, np.float32),
            "encoder_hidden_states": g.standard_normal((b, text, 64)).astype(dtype)}


def tamper_scale(run: Path, site: str = "blocks.1.ffn.net.0.proj", factor: float = 0.02) -> None:
    """Multiply the activation Q/DQ scale of ``site`` in ``quant/model.qdq.onnx`` (still a valid graph; 0.02
    clips that input to 2 % of its range - a power of two would only shift FP8 exponents)."""
    import onnx
    from onnx import numpy_helper

    qmap = json.loads((run / "quant" / "qdq_map.json").read_text())
    tensor = next(e["tensor"] for e in qmap["sites"] if e["site"] == site)
    path = run / "quant" / "model.qdq.onnx"
    m = onnx.load(str(path))
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    names = {q.input[1]} | {n.input[1] for n in m.graph.node if n.op_type == "DequantizeLinear"
                            and n.input[0] == q.output[0]}
    for init in m.graph.initializer:
        if init.name in names:
            a = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((a * factor).astype(a.dtype), init.name))
    onnx.save(m, str(path))


def damage(path: Path, how: str) -> None:
    """``corrupt``: garbage over the first bytes and the middle; ``truncate``: half the file;
    ``delete``; ``zero-sha``: every sha256 value of a JSON manifest set to zeros."""
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        data = bytearray(path.read_bytes())
        for start in (0, len(data) // 2):
            for i in range(start, min(len(data), start + 256)):
                data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "zero-sha":
        def zero(v):
            if isinstance(v, dict):
                return {k: ("0" * 64 if "sha256" in k and isinstance(x, str) else zero(x)) for k, x in v.items()}
            if isinstance(v, list):
                return [zero(x) for x in v]
            return v
        path.write_text(json.dumps(zero(json.loads(path.read_text())), indent=2))
    else:
        raise ValueError(how)


def _one(run: Path, rel: str) -> Path:
    hits = sorted(run.glob(rel))
    assert hits, f"{rel} not in {run}"
    return hits[0]


# -- 1. gates ----------------------------------------------------------------------------------------------
def _strict_recipe(env: Env, **parity) -> Path:
    """rtx4090-fp8 with a stricter (valid, reachable-looking, but failing) parity gate; same name so the
    copied run's earlier stages are reused."""
    import yaml

    from trt_sora.config import list_recipes

    data = yaml.safe_load(list_recipes()[RECIPE].read_text())
    for level, gate in parity.items():
        data["parity"][level] = gate
    p = env.fresh_dir("recipe") / f"{RECIPE}.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _gate_step(env: Env, step: int) -> tuple[Path, tuple]:
    """One scenario on one copy: 1) ``engine`` with a parity gate the candidate misses, 2) the same
    again, 3) the original recipe again. Returns the out root and step ``step``'s CLI result."""
    def first():
        out, _ = env.copy_run()
        strict = _strict_recipe(env, quality={"min_cosine": 0.99, "min_psnr_db": 150.0})
        return out, strict, cli("engine", "--recipe", str(strict), "--model", MODEL, "--out", str(out))

    out, strict, r1 = env.once("gate-1", first)
    if step == 1:
        return out, r1
    r2 = env.once("gate-2", lambda: cli("engine", "--recipe", str(strict), "--model", MODEL, "--out", str(out)))
    if step == 2:
        return out, r2
    return out, env.once("gate-3", lambda: cli("engine", "--recipe", RECIPE, "--model", MODEL, "--out", str(out)))


def gate_fails_engine(env: Env) -> Outcome:
    return cli_outcome(*_gate_step(env, 1)[1])


def gate_failed_check_not_reused(env: Env) -> Outcome:
    _, (rc, err, exc) = _gate_step(env, 2)
    if exc is not None:
        return from_exc(exc)
    line = next((ln for ln in err.splitlines() if ln.startswith("[check")), "")
    if "reused" in line:
        return Outcome("silent", f"second run: {line.strip()} (exit {rc})")
    return cli_outcome(rc, err, exc)


def gate_failed_then_original(env: Env) -> Outcome:
    """After the stricter gate failed, the original recipe again: the failed report must not be taken
    for the original recipe's passed check."""
    out, (rc, err, exc) = _gate_step(env, 3)
    if exc is not None:
        return from_exc(exc)
    passed = json.loads((out / MODEL / RECIPE / "parity" / "report.json").read_text()).get("passed")
    line = next((ln.strip() for ln in err.splitlines() if ln.startswith("[check")), "")
    if rc == 0 and not passed:
        return Outcome("silent", f"exit 0 with a FAILED report in place ({line})")
    if rc != 0:
        return cli_outcome(rc, err, exc)
    return Outcome("ok", f"{line}; report passed")


# -- 2. stage reuse trusts content ---------------------------------------------------------------------------
def reuse_case(stage: str, rel: str, how: str, real: bool = False) -> Callable[[Env], Outcome]:
    def fn(env: Env) -> Outcome:
        out, run = env.copy_run()
        target = _one(run, rel)
        damage(target, how)
        stages = STAGES[:STAGES.index(stage) + 1]
        from trt_sora.pipeline import EnginePipeline

        if env.quick and not real and hasattr(EnginePipeline, "plan"):
            plan, exc = call(lambda: EnginePipeline(RECIPE, MODEL, out).plan(stages))
            if exc is not None:
                return from_exc(exc)
            st = {p.stage: p for p in plan}
            if st[stage].action != "run":
                return Outcome("silent", f"plan reuses damaged {rel}: {st[stage]}")
            early = [s for s in stages[:-1] if st[s].action != "reuse"]
            if early:
                return Outcome("wrong", f"plan reruns undamaged {early}")
            return with_leftovers(Outcome("ok", f"plan: {stage} reruns: {st[stage].reason}"), out)
        seen, exc = statuses(out, stages)
        if exc is not None:
            return from_exc(exc)
        if seen.get(stage) == "reused":
            return Outcome("silent", f"{stage} reused with damaged {rel} ({how})")
        early = [s for s in stages[:-1] if seen.get(s) not in ("reused", "skipped")]
        if early:
            return Outcome("wrong", f"undamaged stages reran: {early}: {seen}")
        verify = getattr(__import__("trt_sora.manifest", fromlist=["x"]), "verify_folder", None)
        if verify is not None:
            _, vexc = call(verify, run / FOLDER[stage])
            if vexc is not None:
                return Outcome("wrong", f"{stage} reran but its folder does not verify: {vexc}")
        return with_leftovers(Outcome("ok", f"{stage} {seen.get(stage)} after {how} {rel}"), out)
    return fn


def reuse_qdq_map_full_run(env: Env) -> Outcome:
    """quant/qdq_map.json deleted, then the stages through build: quantize must redo it (the engine is
    reused when the Q/DQ graph comes out byte-identical)."""
    out, run = env.copy_run()
    (run / "quant" / "qdq_map.json").unlink()
    seen, exc = statuses(out, STAGES[:4])
    if exc is not None:
        return from_exc(exc)
    if seen.get("quantize") == "reused":
        return Outcome("silent", f"quantize reused without qdq_map.json: {seen}")
    return Outcome("ok", str(seen))


# -- 3./4. the runtime serves only what was verified --------------------------------------------------------------
def _load(run, **kw):
    import trt_sora.runtime as rt

    kw.setdefault("warmup", False)
    return rt.load(run, **kw)


def _load_refused(run, silent: str, **kw) -> Outcome:
    """Loading ``run`` where the runtime must refuse: the error's outcome, or ``silent`` when it loaded."""
    _, exc = call(_load, run, **kw)
    return Outcome("silent", silent) if exc is None else from_exc(exc)


def _served_diff(clean: Path, tampered: Path, **kw) -> Outcome:
    r, exc = call(_load, tampered, backend="ort", **kw)
    if exc is not None:
        return from_exc(exc)
    ref = _load(clean, backend="ort").infer(feeds())["sample"]
    got = r.infer(feeds())["sample"]
    return Outcome("silent", f"tampered model served; output off by max |d| {float(np.abs(got - ref).max()):.3g}")


def load_tampered_by_abspath(env: Env) -> Outcome:
    """The run checked by a relative path, loaded by its absolute path after a scale was changed."""
    out, run = env.copy_run()
    clean = env.scratch / f"clean-{env._n}"
    shutil.copytree(run, clean, symlinks=True)
    cand = json.loads((run / "parity" / "report.json").read_text())["candidate"]
    if os.path.isabs(cand["path"]):  # a report that names files by path: check by a relative one first
        rc, err, exc = cli("check", "--run", f"{MODEL}/{RECIPE}", "--recipe", RECIPE, cwd=out)
        if rc != 0:
            return Outcome("wrong", f"setup check failed: {err[-300:]} {exc}")
    tamper_scale(run)
    return _served_diff(clean, run.resolve())


def load_tampered_via_symlink(env: Env) -> Outcome:
    out, run = env.copy_run()
    tamper_scale(run)
    link = env.scratch / f"link-{env._n}"
    link.symlink_to(run, target_is_directory=True)
    return _served_diff(env.base / MODEL / RECIPE, link)


def load_tampered_copy(env: Env) -> Outcome:
    _, run = env.copy_run()
    tamper_scale(run)
    return _served_diff(env.base / MODEL / RECIPE, run)


def load_corrupt_onnx(env: Env, force: bool = False) -> Outcome:
    _, run = env.copy_run()
    damage(run / "quant" / "model.qdq.onnx", "corrupt")
    return _load_refused(run, "a corrupt model.qdq.onnx loaded", backend="ort", force=force)


def load_without_quant(env: Env) -> Outcome:
    _, run = env.copy_run()
    shutil.rmtree(run / "quant")
    return _load_refused(run, "served the fp32 export, which was never the checked candidate", backend="ort")


def check_fp8_without_quant(env: Env) -> Outcome:
    _, run = env.copy_run()
    shutil.rmtree(run / "quant")
    rc, err, exc = cli("check", "--run", str(run), "--recipe", RECIPE)
    if exc is None and rc == 0:
        return Outcome("silent", "FP8 recipe passed without a Q/DQ comparison")
    return cli_outcome(rc, err, exc)


def load_trt_checked_on_ort(env: Env) -> Outcome:
    """The report's candidate ran on ONNX Runtime; backend='trt' must refuse for that reason."""
    _, run = env.copy_run()
    r, exc = call(_load, run, backend="trt")
    if exc is None:
        return Outcome("silent", "served an engine that never executed in a parity check")
    o = from_exc(exc)
    if o.kind == "typed" and not re.search(r"(checked|passed).*'?ort'?", o.detail):
        return Outcome("wrong", f"refused for another reason (on a GPU box it would serve): {o.detail}")
    return o


def load_torch_fp8_checked_on_cpu(env: Env) -> Outcome:
    """A torch-fp8 report made on the CPU (reference kernels) does not vouch for FP8 tensor cores."""
    import dataclasses

    from trt_sora.config import load_recipe
    from trt_sora.parity import check_artifacts

    _, run = env.copy_run()
    r = load_recipe(RECIPE)
    cheap = dataclasses.replace(r, parity=dataclasses.replace(r.parity, num_samples=1, loop_steps=2))
    rep, exc = call(check_artifacts, run, cheap, backend="torch-fp8", device="cpu")
    if exc is not None:
        return Outcome("wrong", f"setup: check --backend torch-fp8 --device cpu failed: {from_exc(exc).detail}")
    return _load_refused(run, "torch-fp8 served on a report that never ran on an SM >= 8.9 GPU", backend="torch-fp8",
                         device="cpu")


def import_tensorrt_for_rtx_engine(env: Env) -> Outcome:
    import types

    from trt_sora.runners import trt_runner

    fake = types.ModuleType("tensorrt")
    fake.__version__ = "10.99.0-fake"
    saved = sys.modules.get("tensorrt")
    sys.modules["tensorrt"] = fake
    try:
        try:
            mod, exc = call(trt_runner.import_tensorrt, "tensorrt_rtx")
            if isinstance(exc, TypeError):
                raise exc
        except TypeError:
            mod, exc = call(trt_runner.import_tensorrt)
    finally:
        if saved is None:
            sys.modules.pop("tensorrt", None)
        else:
            sys.modules["tensorrt"] = saved
    if exc is not None:
        return from_exc(exc)
    if mod is fake:
        return Outcome("wrong", "full TensorRT chosen to run a TensorRT-RTX engine")
    return Outcome("ok", f"{mod.__name__} {getattr(mod, '__version__', '?')}")


def report_not_json(env: Env) -> Outcome:
    _, run = env.copy_run()
    (run / "parity" / "report.json").write_text("{not json")
    return _load_refused(run, "loaded with an unreadable report", backend="ort")


# -- 5. raw tracebacks from bad files and folders -------------------------------------------------------------
def recipe_not_utf8(env: Env) -> Outcome:
    p = env.fresh_dir("recipe") / "latin1.yaml"
    p.write_bytes("name: caf\xe9-fp8\nbackend: tensorrt_rtx\n".encode("latin-1"))
    return cli_outcome(*cli("export", "--recipe", str(p), "--out", str(env.fresh_dir("o") / "x")))


def _quantize_args(run: Path, out: Path, onnx: Path | None = None, stats: Path | None = None) -> list[str]:
    return ["quantize", "--onnx", str(onnx or run / "export" / "model.onnx"),
            "--stats", str(stats or run / "calib" / "stats.safetensors"), "--recipe", RECIPE, "--out", str(out)]


def quantize_corrupt(how: str) -> Callable[[Env], Outcome]:
    def fn(env: Env) -> Outcome:
        out, run = env.copy_run()
        damage(run / "export" / "model.onnx", how)
        o = cli_outcome(*cli(*_quantize_args(run, out / "q")))
        return with_leftovers(o, out)
    return fn


def quantize_corrupt_stats(env: Env) -> Outcome:
    out, run = env.copy_run()
    damage(run / "calib" / "stats.safetensors", "corrupt")
    return with_leftovers(cli_outcome(*cli(*_quantize_args(run, out / "q"))), out)


def build_corrupt(how: str) -> Callable[[Env], Outcome]:
    def fn(env: Env) -> Outcome:
        out, run = env.copy_run()
        damage(run / "quant" / "model.qdq.onnx", how)
        o = cli_outcome(*cli("build", "--onnx", str(run / "quant" / "model.qdq.onnx"), "--recipe", RECIPE,
                             "--out", str(out / "e")))
        return with_leftovers(o, out)
    return fn


def check_corrupt(how: str) -> Callable[[Env], Outcome]:
    def fn(env: Env) -> Outcome:
        out, run = env.copy_run()
        damage(run / "quant" / "model.qdq.onnx", how)
        return with_leftovers(cli_outcome(*cli("check", "--run", str(run), "--recipe", RECIPE)), out)
    return fn


def out_is_file(env: Env) -> Outcome:
    out, run = env.copy_run()
    f = out / "a-file"
    f.write_text("x")
    return with_leftovers(cli_outcome(*cli(*_quantize_args(run, f))), out)


def out_under_file(env: Env) -> Outcome:
    out, run = env.copy_run()
    f = out / "a-file"
    f.write_text("x")
    return with_leftovers(cli_outcome(*cli(*_quantize_args(run, f / "q"))), out)


def out_empty(env: Env) -> Outcome:
    out, run = env.copy_run()
    work = env.fresh_dir("cwd")
    o = cli_outcome(*cli(*_quantize_args(run, Path("")), cwd=work))
    return with_leftovers(with_leftovers(o, work), work.parent)


def _tmpfs_quantize(env: Env, opts: str, remount_ro: bool) -> Outcome:
    """``trt-sora quantize`` into a small tmpfs (user + mount namespace: no root needed)."""
    if shutil.which("unshare") is None:
        return Outcome("n/a", "no unshare(1)")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        return Outcome("n/a", f"user namespaces unavailable: {probe.stderr.decode().strip()[:120]}")
    _, run = env.copy_run()
    mnt = env.fresh_dir("mnt")
    argv = " ".join(f"'{a}'" for a in _quantize_args(run, mnt / "q"))
    script = (f"mount -t tmpfs -o {opts} tmpfs '{mnt}' || exit 99; "
              + (f"mount -o remount,ro '{mnt}' || exit 98; " if remount_ro else "")
              + f"'{sys.executable}' -m trt_sora {argv}; rc=$?; echo LEFT:$(ls -A '{mnt}'); exit $rc")
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                       capture_output=True, text=True, timeout=300)
    if p.returncode in (98, 99):
        return Outcome("n/a", f"tmpfs mount failed: {p.stderr.strip()[:120]}")
    o = cli_outcome(p.returncode, p.stderr, None)
    left = next((ln[5:].strip() for ln in p.stdout.splitlines() if ln.startswith("LEFT:")), "")
    if left and o.kind != "traceback":
        return Outcome("leftover", f"{o.detail}; left in the out folder: {left}")
    return o


def out_full(env: Env) -> Outcome:
    return _tmpfs_quantize(env, "size=128k", remount_ro=False)


def out_read_only(env: Env) -> Outcome:
    return _tmpfs_quantize(env, "size=4m", remount_ro=True)


# -- 6. silent accepts ----------------------------------------------------------------------------------------
def recipe_value(section: str, value: Any) -> Callable[[Env], Outcome]:
    """rtx4090-fp8 with one value changed, then ``trt-sora engine --stages export`` (reused: seconds)."""
    def fn(env: Env) -> Outcome:
        import yaml

        from trt_sora.config import list_recipes

        data = yaml.safe_load(list_recipes()[RECIPE].read_text())
        node = data
        keys = section.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        p = env.fresh_dir("recipe") / f"{RECIPE}.yaml"
        p.write_text(yaml.safe_dump(data, sort_keys=False))
        out, _ = env.copy_run()
        return cli_outcome(*cli("engine", "--recipe", str(p), "--model", MODEL, "--out", str(out),
                                "--stages", "export"))
    return fn


def model_empty(env: Env) -> Outcome:
    out, _ = env.copy_run()
    return cli_outcome(*cli("engine", "--recipe", RECIPE, "--model", "", "--out", str(out), "--stages", "export"))


def _served(run: Path, mutate: Callable[[dict], None]) -> Outcome:
    r = _load(run, backend="ort")
    f = feeds()
    mutate(f)
    got, exc = call(r.infer, f)
    if exc is not None:
        return from_exc(exc)
    bad = int((~np.isfinite(got["sample"])).sum())
    return Outcome("silent", f"served; {bad} non-finite output values returned")


def input_nan(env: Env) -> Outcome:
    return _served(env.base / MODEL / RECIPE, lambda f: f["hidden_states"].__setitem__((0, 0, 0, 0, 0), np.nan))


def input_inf(env: Env) -> Outcome:
    return _served(env.base / MODEL / RECIPE, lambda f: f["encoder_hidden_states"].__setitem__((1, 2, 3), np.inf))


def input_nan_timestep(env: Env) -> Outcome:
    return _served(env.base / MODEL / RECIPE, lambda f: f["timestep"].__setitem__(0, np.nan))


def output_nan(env: Env) -> Outcome:
    """A broken artifact (a NaN Q/DQ scale) loaded with force=True: NaN outputs for finite inputs."""
    _, run = env.copy_run()
    tamper_scale(run, factor=float("nan"))
    r, exc = call(_load, run, backend="ort", force=True)
    if exc is not None:
        return from_exc(exc)
    got, exc = call(r.infer, feeds())
    if exc is not None:
        return from_exc(exc)
    return Outcome("silent", f"{int((~np.isfinite(got['sample'])).sum())} NaN/inf output values returned")


def odd_latent_height(env: Env) -> Outcome:
    r = _load(env.base / MODEL / RECIPE, backend="ort")
    got, exc = call(r.infer, feeds(h=5))  # inside tiny-small's 4..8, not a multiple of the patch (2)
    if exc is not None:
        return from_exc(exc)
    return Outcome("silent", "odd latent height served")


def unknown_input_name(env: Env) -> Outcome:
    r = _load(env.base / MODEL / RECIPE, backend="ort")
    f = feeds()
    f["encoder_hidden_state"] = f["encoder_hidden_states"]  # a typo beside the right name
    got, exc = call(r.infer, f)
    if exc is not None:
        return from_exc(exc)
    return Outcome("silent", "unknown input name ignored")


BAD_FEEDS: dict[str, Callable[[dict], Any]] = {
    "int-dtype": lambda f: f.__setitem__("hidden_states", f["hidden_states"].astype(np.int64)),
    "rank": lambda f: f.__setitem__("hidden_states", f["hidden_states"][0]),
    "outside-buckets": lambda f: f.update(feeds(f=12)),
    "batch-mismatch": lambda f: f.__setitem__("timestep", np.full((3,), 500.0, np.float32)),
    "missing-input": lambda f: f.pop("timestep"),
    "none-value": lambda f: f.__setitem__("encoder_hidden_states", None),
    "python-list": lambda f: f.__setitem__("timestep", [500.0, 500.0]),
    "channels": lambda f: f.__setitem__("hidden_states", np.zeros((2, 8, 3, 4, 6), np.float32)),
    "nan": lambda f: f["hidden_states"].__setitem__((1, 2, 0, 1, 1), np.nan),
    "odd-height": lambda f: f.update(feeds(h=5)),
}


def bad_inputs_then_exact(env: Env) -> Outcome:
    """Every bad input in turn, then the good call: typed errors, and the good result unchanged bit for bit."""
    r = _load(env.base / MODEL / RECIPE, backend="ort")
    want = r.infer(feeds())["sample"].copy()
    kinds: dict[str, str] = {}
    for name, mutate in BAD_FEEDS.items():
        f = feeds()
        mutate(f)
        _, exc = call(r.infer, f)
        kinds[name] = from_exc(exc).kind if exc is not None else "silent"
    got = r.infer(feeds())["sample"]
    exact = bool(np.array_equal(got, want))
    bad = {k: v for k, v in kinds.items() if v != "typed"}
    if bad:
        kind = "traceback" if "traceback" in bad.values() else "silent"
        return Outcome(kind, f"not typed: {bad}; good call after them exact: {exact}")
    return Outcome("ok" if exact else "wrong", f"{len(kinds)} bad inputs typed; good call exact: {exact}")


def threads_bit_identical(env: Env, threads: int = 8, calls: int = 100) -> Outcome:
    r = _load(env.base / MODEL / RECIPE, backend="ort", concurrency=2)
    shapes = [dict(b=1 + i % 2, f=2 + i % 3, h=4 + 2 * (i % 2), w=4 + 2 * (i % 3), text=4 + i, seed=i)
              for i in range(threads)]
    inputs = [feeds(**s) for s in shapes]
    want = [r.infer(x)["sample"].copy() for x in inputs]
    bad: list[str] = []

    def work(i: int) -> None:
        for k in range(calls):
            got = r.infer(inputs[(i + k) % threads])["sample"]
            if not np.array_equal(got, want[(i + k) % threads]):
                bad.append(f"thread {i} call {k}")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    [t.start() for t in ts]
    [t.join() for t in ts]
    dt = time.perf_counter() - t0
    if bad:
        return Outcome("wrong", f"{len(bad)} of {threads * calls} results differ: {bad[:3]}")
    return Outcome("ok", f"{threads} threads x {calls} calls bit-identical to single-threaded ({dt:.1f} s)")


# -- 7. leftovers: kill -9, SIGTERM, SIGINT, a crashed check, two runs at once -----------------------------------
def _spawn(argv: list[str], cwd: Path | None = None):
    """``python -m trt_sora ARGV`` in its own session, forked from tests/prefork.py's preloaded server: SIGINT
    raises KeyboardInterrupt there, as in a command a user runs in a terminal (a test run started in the
    background, ``make test &``, inherits SIGINT ignored, and a fresh Python would keep it ignored)."""
    return prefork.popen([sys.executable, "-m", "trt_sora", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=cwd, start_new_session=True)


def _wait_for(pred: Callable[[], bool], proc, timeout: float = 240.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        if proc.poll() is not None:
            return pred()
        time.sleep(0.002)
    return False


def _drop_state(run: Path, stage: str) -> None:
    st = run / "pipeline.json"
    state = json.loads(st.read_text())
    state.pop(stage, None)
    st.write_text(json.dumps(state))


def _stage_busy(run: Path, stage: str) -> Callable[[], bool]:
    folder = FOLDER[stage]

    def busy() -> bool:
        if any(p.name.startswith(f".{folder}.tmp-") for p in run.iterdir()):
            return True
        # a check that started has invalidated the previous report
        return stage == "check" and not (run / "parity" / "report.json").exists()
    return busy


def kill_in_stage(stage: str, sig: int = signal.SIGKILL) -> Callable[[Env], Outcome]:
    """``trt-sora engine --stages STAGE --force`` on a finished run, signalled while STAGE writes its
    temp folder (check: once it started). Then the next run: the stage's previous artifact must be
    intact and reused (check: redone, its old verdict was voided), the dead run's temp folders gone."""
    def fn(env: Env) -> Outcome:
        out, run = env.copy_run()
        stages = STAGES[:STAGES.index(stage) + 1]
        p = _spawn(["engine", "--recipe", RECIPE, "--model", MODEL, "--out", str(out), "--stages", stage, "--force"])
        caught = _wait_for(_stage_busy(run, stage), p)
        if not caught or p.poll() is not None:
            p.kill()
            p.communicate()
            return Outcome("n/a", f"{stage} finished before the signal could land (exit {p.returncode})")
        os.kill(p.pid, sig)
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            return Outcome("wrong", f"did not stop on signal {sig}")
        if "Traceback (most recent call last)" in err:
            return Outcome("traceback", err.strip().splitlines()[-1][:200])
        if sig != signal.SIGKILL:  # SIGTERM / SIGINT: the process itself must leave nothing behind
            left = leftovers(out)
            if left:
                return Outcome("leftover", f"exit {p.returncode}; left behind: {left}")
            if p.returncode in (-sig, 0):
                return Outcome("wrong", f"exit {p.returncode}: the signal was not handled")
            return Outcome("ok", f"exit {p.returncode}, nothing left behind")
        # kill -9: nothing can clean up inside the process; the next run must
        seen, exc = statuses(out, stages)
        if exc is not None:
            return from_exc(exc)
        left = leftovers(out)
        if left:
            return Outcome("leftover", f"rerun {seen}; the dead run's temp folders remain: {left}")
        if stage != "check" and seen.get(stage) != "reused":
            return Outcome("wrong", f"the previous {stage} artifact was not kept intact: rerun {seen}")
        if stage == "check" and not json.loads((run / "parity" / "report.json").read_text()).get("passed"):
            return Outcome("wrong", "rerun check did not pass")
        return Outcome("ok", f"next run: {stage} {seen.get(stage)}, nothing left behind")
    return fn


def crashed_check_keeps_old_report(env: Env) -> Outcome:
    """A check is killed after it started: the previous passed report must not stay behind."""
    out, run = env.copy_run()
    assert json.loads((run / "parity" / "report.json").read_text())["passed"]
    p = _spawn(["check", "--run", str(run), "--recipe", RECIPE])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    started = _wait_for(lambda: any("[check] running" in ln for ln in lines), p)
    t0 = time.monotonic()
    # it removes the old report as it starts (an older trt_sora never does: give it 1.5 s of work)
    _wait_for(lambda: not (run / "parity" / "report.json").exists() or time.monotonic() - t0 > 1.5, p)
    if not started or p.poll() is not None:
        p.kill()
        p.wait()
        return Outcome("n/a", "the check finished before it could be killed")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    reader.join(timeout=10)
    rp = run / "parity" / "report.json"
    if rp.exists() and json.loads(rp.read_text()).get("passed"):
        return Outcome("leftover", "the crashed check left the previous passed report in place")
    r, exc = call(_load, run, backend="ort")
    if exc is None:
        return Outcome("wrong", "the runtime still loads after a crashed check")
    return Outcome("ok", f"no report; load refuses: {from_exc(exc).detail[:120]}")


def two_runs_one_out(env: Env) -> Outcome:
    out, run = env.copy_run()
    _drop_state(run, "build")
    argv = ["engine", "--recipe", RECIPE, "--model", MODEL, "--out", str(out), "--stages",
            "export,calibrate,quantize,build"]
    a, b = _spawn(argv), _spawn(argv)
    ea, eb = a.communicate(timeout=600)[1], b.communicate(timeout=600)[1]
    if "Traceback" in ea + eb:
        return Outcome("traceback", (ea + eb).strip().splitlines()[-1][:200])
    builds = [ln.split("]")[1].split()[0] for ln in (ea + eb).splitlines() if ln.startswith("[build")]
    left = leftovers(out)
    if left:
        return Outcome("leftover", f"{left}")
    if a.returncode or b.returncode:
        return Outcome("wrong", f"exit codes {a.returncode}, {b.returncode}: {(ea + eb)[-300:]}")
    if builds.count("ran") != 1:
        return Outcome("silent", f"build statuses {builds}: both runs did the work")
    return Outcome("ok", f"build statuses {sorted(builds)}: one run built, the other waited and reused")


# -- 8. the fake-quant context restores an instance forward ---------------------------------------------------------
def fakequant_restores_instance_forward(env: Env) -> Outcome:
    import torch

    from trt_sora.calibrate.fakequant_model import fake_quantized

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    lin = net[0]
    own = lin.forward  # an instance forward, as accelerate's hooks install one

    def hooked(x):
        return own(x) + 0.0
    lin.forward = hooked
    with fake_quantized(net, {"0": 1.0}, "fp8_e4m3"):
        pass
    if lin.__dict__.get("forward") is not hooked:
        return Outcome("wrong", f"instance forward after the context: {lin.__dict__.get('forward')}")
    return Outcome("ok", "instance forward restored")


# -- the list -----------------------------------------------------------------------------------------------------
def _cases() -> list[Case]:
    c: list[Case] = [
        Case("gate-fails-engine", "gate", "trt-sora engine with a parity gate the candidate misses", "typed",
             gate_fails_engine, match=r"exit 1:.*parity"),
        Case("gate-failed-check-rerun", "gate", "second trt-sora engine after a failed check", "typed",
             gate_failed_check_not_reused, match=r"exit 1:.*parity"),
        Case("gate-failed-then-original", "gate", "a stricter gate fails, then the original recipe again", "ok",
             gate_failed_then_original, match=r"check\s*\] ran"),
    ]
    damaged = [("export", "export/model.onnx"), ("calibrate", "calib/stats.safetensors"),
               ("quantize", "quant/model.qdq.onnx"), ("quantize", "quant/qdq_map.json"),
               ("build", "engine/*.plan"), ("check", "parity/report.json")]
    for stage, rel in damaged:
        for how in ("corrupt", "truncate", "delete"):
            real = how == "truncate" and stage in ("quantize", "build") and rel != "quant/qdq_map.json"
            c.append(Case(f"reuse-{how}-{rel.replace('/', '-').replace('*', 'x')}", "reuse",
                          f"{how} {rel}, rerun stages up to {stage}", "ok", reuse_case(stage, rel, how, real)))
    for stage, rel in [("export", "export/manifest.json"), ("calibrate", "calib/manifest.json"),
                       ("quantize", "quant/manifest.json"), ("build", "engine/manifest.json"),
                       ("check", "parity/manifest.json")]:
        c.append(Case(f"reuse-zero-sha-{rel.split('/')[0]}", "reuse", f"every sha256 in {rel} zeroed", "ok",
                      reuse_case(stage, rel, "zero-sha")))
    c.append(Case("reuse-qdq-map-full-run", "reuse", "quant/qdq_map.json deleted, stages through build", "ok",
                  reuse_qdq_map_full_run))
    c += [
        Case("load-tampered-abspath", "runtime", "tampered model.qdq.onnx, run loaded by its absolute path",
             "typed", load_tampered_by_abspath, match=r"model\.qdq\.onnx"),
        Case("load-tampered-symlink", "runtime", "tampered model.qdq.onnx, loaded through a symlink", "typed",
             load_tampered_via_symlink, match=r"model\.qdq\.onnx"),
        Case("load-tampered-copy", "runtime", "tampered model.qdq.onnx in a copied run folder", "typed",
             load_tampered_copy, match=r"model\.qdq\.onnx"),
        Case("load-corrupt-onnx", "runtime", "garbage bytes in model.qdq.onnx, load", "typed",
             load_corrupt_onnx, match=r"model\.qdq\.onnx"),
        Case("load-corrupt-onnx-force", "runtime", "garbage bytes in model.qdq.onnx, load(force=True)", "typed",
             lambda e: load_corrupt_onnx(e, force=True), match=r"model\.qdq\.onnx"),
        Case("load-no-quant", "runtime", "quant/ removed, load(backend='ort')", "typed", load_without_quant,
             match=r"quant"),
        Case("check-fp8-no-quant", "runtime", "quant/ removed, trt-sora check with an FP8 recipe", "typed",
             check_fp8_without_quant, match=r"quant"),
        Case("load-trt-checked-on-ort", "runtime", "load(backend='trt') with a report from ONNX Runtime", "typed",
             load_trt_checked_on_ort),
        Case("load-torch-fp8-checked-on-cpu", "runtime", "load(backend='torch-fp8') with a CPU-made torch-fp8 "
             "report", "typed", load_torch_fp8_checked_on_cpu, match=r"8\.9|SM"),
        Case("import-tensorrt-rtx-engine", "runtime", "TensorRT runtime chosen for a TensorRT-RTX engine with "
             "both installed", "ok", import_tensorrt_for_rtx_engine, match=r"tensorrt_rtx"),
        Case("report-not-json", "traceback", "parity/report.json not JSON, load", "typed", report_not_json,
             match=r"report\.json"),
        Case("recipe-not-utf8", "traceback", "a Latin-1 recipe file", "typed", recipe_not_utf8, match="UTF-8"),
        Case("quantize-corrupt-onnx", "traceback", "garbage bytes in export/model.onnx, trt-sora quantize", "typed",
             quantize_corrupt("corrupt"), match=r"model\.onnx"),
        Case("quantize-truncated-onnx", "traceback", "truncated export/model.onnx, trt-sora quantize", "typed",
             quantize_corrupt("truncate"), match=r"model\.onnx"),
        Case("quantize-corrupt-stats", "traceback", "garbage bytes in stats.safetensors, trt-sora quantize",
             "typed", quantize_corrupt_stats, match=r"stats\.safetensors"),
        Case("build-corrupt-onnx", "traceback", "garbage bytes in model.qdq.onnx, trt-sora build", "typed",
             build_corrupt("corrupt"), match=r"model\.qdq\.onnx"),
        Case("build-truncated-onnx", "traceback", "truncated model.qdq.onnx, trt-sora build", "typed",
             build_corrupt("truncate"), match=r"model\.qdq\.onnx"),
        Case("check-corrupt-onnx", "traceback", "garbage bytes in model.qdq.onnx, trt-sora check", "typed",
             check_corrupt("corrupt"), match=r"model\.qdq\.onnx"),
        Case("check-truncated-onnx", "traceback", "truncated model.qdq.onnx, trt-sora check", "typed",
             check_corrupt("truncate"), match=r"model\.qdq\.onnx"),
        Case("out-is-file", "traceback", "--out is an existing file", "typed", out_is_file, match=r"--out|file"),
        Case("out-under-file", "traceback", "--out below a file", "typed", out_under_file, match=r"--out|file"),
        Case("out-empty", "traceback", "--out ''", "typed", out_empty, match=r"--out"),
        Case("out-full", "traceback", "--out on a full file system (128 KiB tmpfs)", "typed", out_full,
             match=r"space|full", subprocess=True),
        Case("out-read-only", "traceback", "--out on a read-only file system", "typed", out_read_only,
             match=r"read-only|writable", subprocess=True),
        Case("input-odd-height", "traceback", "latent height 5 inside a bucket's 4..8 (patch 2)", "typed",
             odd_latent_height, match=r"patch"),
    ]
    bad_values = [("parity.quality.min_cosine", 7), ("parity.quality.min_cosine", -0.5),
                  ("parity.qdq.min_psnr_db", float("nan")), ("parity.loop.min_psnr_db", -5.0),
                  ("parity.export.max_abs", -1.0), ("parity.frames.min_ssim", 2.0),
                  ("parity.qdq.max_floor_ratio", 0.0), ("parity.num_samples", 0), ("parity.loop_steps", 0),
                  ("parity.jump_factor", 0.5), ("build.requirements.min_fp8_gemm_fraction", 1.5),
                  ("build.workspace_gb", -3), ("build.workspace_gb", float("inf")),
                  ("export.min_cosine", 2.0), ("calibration.num_bins", 0)]
    for key, value in bad_values:
        c.append(Case(f"recipe-{key.split('.')[-1].replace('_', '-')}-{value}", "silent",
                      f"recipe {key}: {value}", "typed", recipe_value(key, value),
                      match=key.split(".")[-1]))
    c += [
        Case("model-empty", "silent", "--model ''", "typed", model_empty, match=r"model"),
        Case("input-nan", "silent", "NaN in hidden_states", "typed", input_nan, match=r"NaN|finite"),
        Case("input-inf", "silent", "inf in encoder_hidden_states", "typed", input_inf, match=r"NaN|finite"),
        Case("input-nan-timestep", "silent", "NaN timestep", "typed", input_nan_timestep, match=r"NaN|finite"),
        Case("output-nan", "silent", "NaN outputs from a broken artifact loaded with force=True", "typed",
             output_nan, match=r"NaN|finite"),
        Case("input-unknown-name", "silent", "an extra, misspelt input name", "typed", unknown_input_name,
             match=r"encoder_hidden_state"),
        Case("bad-inputs-then-exact", "runtime", f"{len(BAD_FEEDS)} bad inputs, then the good call", "ok",
             bad_inputs_then_exact),
        Case("threads-8x100", "runtime", "8 threads x 100 calls vs single-threaded", "ok", threads_bit_identical),
    ]
    for stage in STAGES:
        c.append(Case(f"kill9-{stage}", "leftover", f"kill -9 during {stage} (--force), then a normal run", "ok",
                      kill_in_stage(stage), subprocess=True))
    c += [
        Case("sigterm-export", "leftover", "SIGTERM during export", "ok", kill_in_stage("export", signal.SIGTERM),
             subprocess=True),
        Case("sigint-quantize", "leftover", "SIGINT during quantize", "ok", kill_in_stage("quantize", signal.SIGINT),
             subprocess=True),
        Case("crashed-check-report", "leftover", "kill -9 during a re-check of a passed run", "ok",
             crashed_check_keeps_old_report, subprocess=True),
        Case("two-runs-one-out", "leftover", "two trt-sora engine runs on one --out at once", "ok",
             two_runs_one_out, subprocess=True),
        Case("fakequant-instance-forward", "fakequant", "fake_quantized over a linear with an instance forward",
             "ok", fakequant_restores_instance_forward),
    ]
    return c


CASES = _cases()


def run_case(case: Case, env: Env) -> Outcome:
    """The case's outcome; a typed error that does not name what the case expects counts as wrong."""
    out, exc = call(case.fn, env)
    if exc is not None:
        return Outcome("traceback", f"(in the case itself) {from_exc(exc).detail}")
    if out.kind == "typed" and case.match and not re.search(case.match, out.detail):
        return Outcome("wrong", f"typed, but not about /{case.match}/: {out.detail}")
    return out


def build_base(root: Path) -> Path:
    """``trt-sora engine --model wan-tiny --recipe rtx4090-fp8 --out root`` (once)."""
    from trt_sora.pipeline import EnginePipeline

    if not (root / MODEL / RECIPE / "parity" / "report.json").is_file():
        EnginePipeline(RECIPE, MODEL, root).run()
    return root


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True, help="scratch folder (the base run is kept in WORK/base)")
    ap.add_argument("--only", default="", help="comma-separated case ids")
    ap.add_argument("--skip-subprocess", action="store_true")
    ap.add_argument("--json", default=None, help="write the outcomes here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    work = Path(args.work)
    base = build_base(work / "base")
    scratch = Path(tempfile.mkdtemp(prefix="cases-", dir=work))
    env = Env(base, scratch)
    want = set(filter(None, args.only.split(",")))
    rows = []
    for case in CASES:
        if want and case.id not in want:
            continue
        if args.skip_subprocess and case.subprocess:
            continue
        t0 = time.perf_counter()
        out = run_case(case, env)
        rows.append({"id": case.id, "group": case.group, "what": case.what, "kind": out.kind,
                     "detail": out.detail, "want": case.want, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{case.id:40s} {out.kind:9s} {out.detail[:150]}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["kind"]] = counts.get(r["kind"], 0) + 1
    print("totals:", counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
