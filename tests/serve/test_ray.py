"""Ray on a local cluster: `trt-sora batch --ray` (workers on the cluster, resume from the driver) and
the Ray Serve deployment (HTTP through Ray's proxy, batching inside the replica)."""
import io
import json
import os
import socket
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from http_helpers import HANG

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'trt_sora[ray]'")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers inherit it: tiny clips, 2 shared cores
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                             os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def test_batch_on_ray_workers_resumes(cluster, checked_run, tiny_runner, tmp_path):
    import trt_sora.runtime as rt
    from trt_sora.cli import main

    jobs = tmp_path / "jobs.jsonl"
    lines = [{"id": f"r{i}", "prompt": f"ray clip {i}", "seed": i} for i in range(3)]
    jobs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    argv = ["batch", "--run", str(checked_run), "--backend", "ort", "--threads", "1", "--prompts", str(jobs), "--out",
            str(out), "--formats", "npy", "--ray", "--workers", "2", "--no-progress"]
    assert main(argv) == 0
    recs = {p.stem: json.loads(p.read_text()) for p in (out / "clips").glob("*.json")}
    assert sorted(recs) == ["r0", "r1", "r2"] and {r["status"] for r in recs.values()} == {"done"}
    assert len({r["worker"] for r in recs.values()}) == 2  # spread over both workers
    for i in range(3):
        want = rt.generate(tiny_runner, f"ray clip {i}", seed=i)[0].frames
        np.testing.assert_array_equal(np.load(out / "clips" / f"r{i}.npy"), want)
    # resume on Ray: one clip damaged, one job added -> those two made, the rest skipped
    (out / "clips" / "r1.npy").write_bytes(b"partial")
    with jobs.open("a") as f:
        f.write(json.dumps({"id": "r3", "prompt": "ray clip 3", "seed": 3}) + "\n")
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["skipped"], s["generated"], s["finished"]) == (2, 2, 4)
    np.testing.assert_array_equal(np.load(out / "clips" / "r1.npy"),
                                  rt.generate(tiny_runner, "ray clip 1", seed=1)[0].frames)


def test_ray_serve_deployment(cluster, checked_run, tiny_runner):
    from ray import serve

    import trt_sora.runtime as rt
    from trt_sora.serve.ray_fleet import deployment
    from trt_sora.serve.scheduler import ServeConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(deployment(checked_run, backend="ort", threads=1, config=ServeConfig(max_wait_s=HANG, max_batch=2)),
              route_prefix="/", name="trt_sora")
    base = f"http://127.0.0.1:{port}"
    assert json.loads(urllib.request.urlopen(base + "/readyz", timeout=30).read())["status"] == "ready"
    jobs = [{"prompt": "a cat walks", "seed": 1, "guidance": 1.0}, {"prompt": "a dog runs", "seed": 2, "guidance": 1.0}]
    got = [None, None]

    def client(i):
        req = urllib.request.Request(base + "/v1/generate?format=npy", data=json.dumps(jobs[i]).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            got[i] = np.load(io.BytesIO(r.read()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for job, frames in zip(jobs, got):
        want = rt.generate(tiny_runner, job["prompt"], seed=job["seed"], guidance=1.0)[0].frames
        np.testing.assert_array_equal(frames, want)
    metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    assert 'trt_sora_batches_total{clips="2"} 1.0' in metrics  # both requests in one batch inside the replica
    serve.delete("trt_sora")
