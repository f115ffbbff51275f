"""Run one command and record what it cost on this machine: wall time, CPU time (user + sys of the
whole process tree), peak RSS (the tree's summed RSS, sampled every 0.5 s, and the kernel's max RSS of
its largest process), the load average while it ran, free memory and disk before and after.

    python benchmarks/measure.py --out results/x.json [--limit-gb 18] [--label L] -- trt-sora export ...

``--trace S``: also keep the tree's RSS every S seconds (where the memory went). ``--limit-gb``: kill
the tree when its summed RSS passes this; ``--min-available-gb``: kill it when the machine's available
memory falls below this (a shared machine must not swap or OOM). The record then says which limit
killed it (``killed_at_limit``) and the tree's RSS at that moment. Exits with the command's code.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GB = 1 << 30


def _tree_rss(pgid: int) -> int:
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ProcessLookupError, ValueError, IndexError):
            continue
    return total


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _snapshot(disk: str) -> dict:
    return {"mem_available_gb": round(_mem_available() / GB, 2),
            "disk_free_gb": round(shutil.disk_usage(disk).free / GB, 2), "loadavg_1m": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--limit-gb", type=float, default=None)
    ap.add_argument("--min-available-gb", type=float, default=None,
                    help="kill the tree when the machine's MemAvailable falls below this (shared machines)")
    ap.add_argument("--disk", default=".", help="filesystem whose free space to record")
    ap.add_argument("--trace", type=float, default=0.0, help="record (seconds, tree RSS GB) every this many seconds")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    before = _snapshot(args.disk)
    t0 = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    peak, loads, killed, min_disk, trace = 0, [], False, before["disk_free_gb"], []
    while proc.poll() is None:
        rss = _tree_rss(proc.pid)
        peak = max(peak, rss)
        if args.trace and (not trace or time.time() - t0 - trace[-1][0] >= args.trace):
            trace.append((round(time.time() - t0, 1), round(rss / GB, 2)))
        loads.append(os.getloadavg()[0])
        min_disk = min(min_disk, shutil.disk_usage(args.disk).free / GB)
        low = args.min_available_gb and _mem_available() < args.min_available_gb * GB
        if (args.limit_gb and rss > args.limit_gb * GB) or low:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = "machine_mem_available_below_min" if low else "tree_rss_over_limit"
            break
        time.sleep(0.5)
    rc = proc.wait()
    wall = time.time() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    rec = {"label": args.label, "cmd": cmd, "rc": rc, "killed_at_limit": killed, "limit_gb": args.limit_gb,
           "min_available_gb": args.min_available_gb, "rss_at_kill_gb": round(rss / GB, 2) if killed else None,
           "wall_s": round(wall, 1), "cpu_user_s": round(ru.ru_utime, 1), "cpu_sys_s": round(ru.ru_stime, 1),
           "cpu_percent": round(100 * (ru.ru_utime + ru.ru_stime) / max(wall, 1e-9), 1),
           "peak_tree_rss_gb": round(peak / GB, 2), "max_rss_largest_process_gb": round(ru.ru_maxrss * 1024 / GB, 2),
           "cores": os.cpu_count(), "loadavg_1m_mean": round(sum(loads) / max(len(loads), 1), 2),
           "loadavg_1m_max": round(max(loads, default=0.0), 2), "min_disk_free_gb": round(min_disk, 2),
           "before": before, "after": _snapshot(args.disk),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))}
    if args.trace:
        rec["rss_trace_s_gb"] = trace
    Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")
    print(json.dumps(rec), file=sys.stderr)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
