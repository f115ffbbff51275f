"""Soak of the durable server: N clients for M minutes against `trt-sora serve --state-dir`, with the
server killed by SIGKILL and restarted during the run; every job answered 202 must finish exactly
once with the clip `generate()` makes for its prompt and seed.

    python benchmarks/serve_soak.py --run build/wan-shapes/rtx4090-fp8 --clients 4 --minutes 3 --kills 2 \\
        --out benchmarks/results/cpu_serve_soak_wan-shapes_2026-12-05.json

Each client loops: POST /v1/jobs with a fresh seed (a 429 waits its Retry-After; a refused or broken
connection while the server is down retries), records every 202'd id. The server is killed at
evenly spaced times and restarted on the same state folder. After the last minute the clients stop
submitting, the server (restarted if needed) finishes the backlog, and the script reads every
accepted job: status, attempts, the served clip's sha256 against the store's record and against a
reference clip made in this process (same run folder, backend and seed). Figures: accepted,
finished, failed, lost (202'd but unknown or unfinished at the end), mismatched (a served clip that
differs from its reference), unanswered POSTs (the connection broke before a reply: the client
never learned an id, so the job is not counted as accepted), restarts, jobs re-run after a kill.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class Server:
    def __init__(self, args, state: Path, keys: Path):
        cmd = [sys.executable, "-m", "trt_sora", "serve", "--run", args.run, "--backend", args.backend,
               "--port", "0", "--state-dir", str(state), "--api-keys-file", str(keys), "--max-queue",
               str(args.max_queue), "--warmup-steps", "1", "--drain-grace", "0"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        port = None
        for line in self.proc.stdout:
            m = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
            port = int(m.group(1)) if m else port
            if line.startswith("ready:"):
                break
        if port is None or self.proc.poll() is not None:
            raise SystemExit("the server did not start")
        self.base = f"http://127.0.0.1:{port}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Client:
    def __init__(self, key: str):
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def call(self, base: str, method: str, path: str, body=None, timeout: float = 120):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers


def soak(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trt_sora_soak_"))
    key = secrets.token_urlsafe(24)
    (tmp / "keys").write_text(f"soak {key}\n")
    holder = {"server": Server(args, tmp / "state", tmp / "keys")}
    client = Client(key)
    accepted: dict[str, dict] = {}
    counts = {"posts": 0, "unanswered": 0, "429": 0, "other": 0, "duplicate_ids": 0}
    lock, stop = threading.Lock(), threading.Event()

    def loop(c: int) -> None:
        n = 0
        while not stop.is_set():
            job = {"prompt": args.prompts[(c + n) % len(args.prompts)], "seed": c * 1_000_000 + n,
                   "steps": args.steps}
            try:
                status, raw, headers = client.call(holder["server"].base, "POST", "/v1/jobs", job)
            except (OSError, urllib.error.URLError):
                with lock:
                    counts["unanswered"] += 1
                time.sleep(0.2)  # the server is down: try again shortly
                continue
            with lock:
                counts["posts"] += 1
                if status == 202:
                    job_id = json.loads(raw)["id"]
                    counts["duplicate_ids"] += job_id in accepted
                    accepted[job_id] = job
                    n += 1
                elif status == 429:
                    counts["429"] += 1
                else:
                    counts["other"] += 1
            if status == 429:
                time.sleep(float(headers.get("Retry-After", 1)))

    threads = [threading.Thread(target=loop, args=(c,), daemon=True) for c in range(args.clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    kills, end = [], t0 + args.minutes * 60
    for k in range(args.kills):
        time.sleep(max(0.0, t0 + (k + 1) * args.minutes * 60 / (args.kills + 1) - time.monotonic()))
        with lock:
            before = len(accepted)
        holder["server"].kill()
        kills.append({"at_s": round(time.monotonic() - t0, 1), "accepted_before": before})
        holder["server"] = Server(args, tmp / "state", tmp / "keys")
    time.sleep(max(0.0, end - time.monotonic()))
    stop.set()
    for t in threads:
        t.join()
    submit_s = time.monotonic() - t0
    return {"tmp": str(tmp), "accepted": accepted, "counts": counts, "kills": kills, "submit_s": submit_s,
            "server": holder["server"], "client": client, "t0": t0}


def verify(args, run: dict) -> dict:
    import trt_sora.runtime as rt

    server, client = run["server"], run["client"]
    views = {}
    for i in run["accepted"]:
        while True:
            status, raw, _ = client.call(server.base, "GET", f"/v1/jobs/{i}?wait=60")
            view = json.loads(raw)
            if status != 200 or view["status"] in ("done", "failed"):
                views[i] = view if status == 200 else {"status": f"http {status}"}
                break
    drain_s = time.monotonic() - run["t0"] - run["submit_s"]
    runner = rt.load(args.run, backend=args.backend, threads=args.threads or None)
    mismatched, lost, failed = [], [], []
    refs: dict = {}
    for i, job in run["accepted"].items():
        v = views[i]
        if v["status"] == "failed":
            failed.append(i)
            continue
        if v["status"] != "done":
            lost.append(i)
            continue
        status, raw, _ = client.call(server.base, "GET", f"/v1/jobs/{i}/result?format=npy")
        key = (job["prompt"], job["seed"])
        if key not in refs:
            buf = io.BytesIO()
            np.save(buf, rt.generate(runner, job["prompt"], seed=job["seed"], steps=job["steps"])[0].frames)
            refs[key] = hashlib.sha256(buf.getvalue()).hexdigest()
        got = hashlib.sha256(raw).hexdigest()
        if status != 200 or got != v.get("result_sha256") or got != refs[key]:
            mismatched.append(i)
    server.kill()
    import sqlite3

    with sqlite3.connect(Path(run["tmp"]) / "state" / "jobs.sqlite") as db:
        stored = dict(db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())
    attempts = [views[i].get("attempts", 1) for i in run["accepted"] if views[i]["status"] == "done"]
    return {"accepted": len(run["accepted"]), "finished": len(attempts), "failed": len(failed), "lost": len(lost),
            "mismatched": len(mismatched), "duplicated_ids": run["counts"]["duplicate_ids"],
            "restarts": len(run["kills"]), "store_rows": stored,
            "rerun_after_kill": sum(a > 1 for a in attempts), "posts": run["counts"],
            "kills": run["kills"], "submit_seconds": round(run["submit_s"], 1), "drain_seconds": round(drain_s, 1),
            "examples": {"lost": lost[:5], "failed": failed[:5], "mismatched": mismatched[:5]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--prompts", nargs="+", default=["a red circle moving right", "a blue square moving left",
                                                      "a green triangle moving up"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    run = soak(args)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, **verify(args, run)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = result["lost"] == result["mismatched"] == result["failed"] == result["duplicated_ids"] == 0 and \
        result["finished"] == result["accepted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
