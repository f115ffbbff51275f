"""API keys: the keys file (typed errors naming the line), the constant-time lookup, the routes a key
guards (401 counted by route), a key seeing only its own jobs, per-key quotas (429), and the refusal
to serve a public address without keys. In-process on 127.0.0.1; the subprocess run (kill -9,
SIGHUP reload) is test_durable.py."""
import json

import pytest
from http_helpers import HANG, Gated, http_server

from trt_sora.errors import ConfigError
from trt_sora.serve.auth import ApiKeys, is_loopback

ALICE, BOB = "alice-" + "k" * 16, "bob-" + "q" * 16


def _keys(tmp_path, text):
    p = tmp_path / "keys"
    p.write_text(text)
    return ApiKeys(p)


@pytest.mark.parametrize("text, fragment", [
    ("", "holds no key"),
    ("# only a comment\n\n", "holds no key"),
    ("short\n", "keys:1: the key has 5 characters; use at least 16"),
    (f"a {ALICE}\na {BOB}\n", "keys:2: id 'a' appears twice"),
    (f"a b {ALICE}\n", "keys:1: expected `KEY` or `ID KEY`, got 3 fields"),
    (f"../x {ALICE}\n", "keys:1: id '../x'"),
])
def test_a_bad_keys_file_names_the_line(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("`", ".")):
        _keys(tmp_path, text)


def test_keys_are_identified_by_id_never_by_a_prefix(tmp_path):
    import hashlib

    keys = _keys(tmp_path, f"# ops\nalice {ALICE}\n{BOB}\n")
    assert keys.identify(f"Bearer {ALICE}") == "alice" and keys.identify(f"bearer  {ALICE} ") == "alice"
    assert keys.identify(f"Bearer {BOB}") == "key-" + hashlib.sha256(BOB.encode()).hexdigest()[:8]
    for bad in (None, "", ALICE, f"Basic {ALICE}", f"Bearer {ALICE[:-1]}", f"Bearer {ALICE}x", "Bearer "):
        assert keys.identify(bad) is None, bad
    (tmp_path / "keys").write_text("x\n")  # a bad reload keeps the old keys
    with pytest.raises(ConfigError):
        keys.reload()
    assert keys.identify(f"Bearer {ALICE}") == "alice"
    (tmp_path / "keys").write_text(f"bob {BOB}\n")
    assert keys.reload() == 1 and keys.identify(f"Bearer {ALICE}") is None and keys.identify(f"Bearer {BOB}") == "bob"


def test_only_loopback_may_serve_without_keys():
    from trt_sora.serve.server import HttpConfig

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org"))
    assert HttpConfig(host="127.0.0.1").keys() is None
    with pytest.raises(ConfigError, match="--host 0.0.0.0 reaches beyond this machine .* --api-keys-file"):
        HttpConfig(host="0.0.0.0").keys()
    assert HttpConfig(host="0.0.0.0", insecure_no_auth=True).keys() is None


def test_serve_refuses_a_public_host_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import trt_sora.runtime as rt
    from trt_sora.cli import main

    monkeypatch.setattr(rt, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--run", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err
    (tmp_path / "keys").write_text("short\n")
    assert main(["serve", "--run", str(tmp_path), "--api-keys-file", str(tmp_path / "keys")]) == 2
    assert "keys:1: the key has 5 characters" in capsys.readouterr().err


@pytest.fixture(scope="module")
def keyed(tiny_runner, tmp_path_factory):
    """An engine on the tiny runner held at a gate, served with keys alice and bob, one job a key."""
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine, ServeConfig
    from trt_sora.serve.server import make_app

    tmp = tmp_path_factory.mktemp("keys")
    keys = _keys(tmp, f"alice {ALICE}\nbob {BOB}\n")
    gated, metrics = Gated(tiny_runner), ServerMetrics()
    engine = Engine(gated, ServeConfig(max_wait_s=0.0, max_jobs_per_key=1), metrics=metrics)
    engine.start(block=True)
    try:
        with http_server(make_app(engine, metrics, keys=keys)) as http:
            yield http, gated, engine
    finally:
        gated.release.set()
        engine.drain(HANG)  # no thread left inside the model when the interpreter exits
        engine.close()


def _as(key):
    return {"headers": {"Authorization": f"Bearer {key}"}}


def test_routes_need_a_key_but_health_and_readiness(keyed):
    http, _, _ = keyed
    for method, path in (("GET", "/v1/info"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/x"), ("GET", "/metrics"),
                         ("POST", "/v1/generate"), ("GET", "/docs")):
        for headers in ({}, {"Authorization": "Bearer not-a-key-of-this-server"}):
            status, raw, h = http(method, path, {"prompt": "x"} if method == "POST" else None, headers=headers)
            assert status == 401 and h["WWW-Authenticate"] == "Bearer", (method, path, raw)
            assert "Authorization: Bearer KEY" in json.loads(raw)["error"]
    assert http("GET", "/healthz")[0] == 200 and http("GET", "/readyz")[0] == 200
    assert http("GET", "/v1/info", **_as(ALICE))[0] == 200
    metrics = http("GET", "/metrics", **_as(BOB))[1].decode()
    assert 'trt_sora_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="401"} 2.0' in metrics
    assert 'trt_sora_rejected_total{reason="unauthorized"} 12.0' in metrics


def test_a_key_sees_its_own_jobs_within_its_quota(keyed):
    http, gated, engine = keyed
    gated.arm()
    status, a = http.json("POST", "/v1/jobs", {"prompt": "a cat", "seed": 1}, **_as(ALICE))
    assert status == 202 and a["key_id"] == "alice" and gated.entered.wait(HANG)
    status, raw, headers = http("POST", "/v1/jobs", {"prompt": "a dog", "seed": 2}, **_as(ALICE))
    assert status == 429 and "key alice has 1 jobs queued or running" in json.loads(raw)["error"]
    assert int(headers["Retry-After"]) >= 1
    status, b = http.json("POST", "/v1/jobs", {"prompt": "a dog", "seed": 2}, **_as(BOB))  # bob's own quota
    assert status == 202
    for path in (f"/v1/jobs/{a['id']}", f"/v1/jobs/{a['id']}/result"):
        assert http("GET", path, **_as(BOB))[0] == 404  # alice's job does not exist for bob
    gated.release.set()
    assert engine.wait(a["id"], HANG).status == "done" and engine.wait(b["id"], HANG).status == "done"
    assert http("GET", f"/v1/jobs/{a['id']}/result?format=npy", **_as(ALICE))[0] == 200
    assert http("GET", f"/v1/jobs/{b['id']}/result?format=npy", **_as(ALICE))[0] == 404
    assert http.json("POST", "/v1/jobs", {"prompt": "a dog", "seed": 3}, **_as(ALICE))[0] == 202  # quota freed


def test_metrics_open_lets_scrapers_in_without_a_key(tiny_runner, tmp_path):
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import Engine
    from trt_sora.serve.server import make_app

    metrics = ServerMetrics()
    app = make_app(Engine(tiny_runner, metrics=metrics), metrics, keys=_keys(tmp_path, f"{ALICE}\n"),
                   metrics_open=True)
    with http_server(app) as http:
        assert http("GET", "/metrics")[0] == 200 and http("GET", "/v1/info")[0] == 401
