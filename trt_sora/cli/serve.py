"""``trt-sora serve --run DIR``: the reference HTTP server (dynamic batching, metrics, drain on SIGTERM),
and with ``--grpc-port`` the gRPC stream of clips beside it."""
from __future__ import annotations

import sys

from trt_sora.cli.common import add_cfg_arg, add_runtime_args


def _say(line: str) -> None:
    """One stdout line in one write: print() writes the text and the newline apart, so a line printed
    from another thread (a worker's) could land between them and leave neither at a line's start."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="HTTP server: submit / poll / fetch clips, /healthz, /readyz, /metrics",
                       description="Serve a checked run folder over HTTP (FastAPI on uvicorn): POST /v1/jobs, GET "
                                   "/v1/jobs/ID, GET /v1/jobs/ID/result, POST /v1/generate, /v1/info, /healthz, "
                                   "/readyz, /metrics. Compatible requests are batched; SIGTERM drains.")
    add_runtime_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port, printed "
                   "on the 'serving ... on http://HOST:PORT' line)")
    p.add_argument("--grpc-port", type=int, default=None, help="also serve gRPC streaming (TrtSora.Generate: "
                   "progress, then the clip as fragmented-MP4 pieces) on this port of --host, same engine, keys "
                   "and job store (0: any free port, printed on the 'serving ... over gRPC on HOST:PORT' line)")
    p.add_argument("--grpc-tls-cert", default=None, help="serve gRPC over TLS with this certificate chain (PEM; "
                   "with --grpc-tls-key)")
    p.add_argument("--grpc-tls-key", default=None, help="the private key (PEM) of --grpc-tls-cert")
    p.add_argument("--grpc-max-streams", type=int, default=64, help="gRPC streams at once (default 64; more: "
                   "RESOURCE_EXHAUSTED)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting jobs before 429 (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=50.0, help="how long a job waits for others to join its "
                   "batch (default 50 ms; 0: only what is already queued)")
    p.add_argument("--max-batch", type=int, default=None, help="at most N clips per batch (1: no batching)")
    p.add_argument("--workers", type=int, default=1, help="batches generated at once (default 1)")
    p.add_argument("--memory-headroom", type=float, default=0.1, help="fraction of free memory kept free")
    p.add_argument("--memory-budget-mb", type=float, default=None, help="size the batch cap for this much memory "
                   "instead of the measured free memory")
    p.add_argument("--keep", type=int, default=1000, help="finished jobs kept for fetching (default 1000)")
    p.add_argument("--results", default=None, help="folder for the clips (default: a temp folder; with --state-dir: "
                   "STATE_DIR/results), or s3://bucket/prefix: clips go up to that bucket (endpoint, credentials "
                   "and region from the AWS variables or AWS_PROFILE), visible only once whole, fetched back by ID "
                   "across restarts with --state-dir, deleted by the retention sweep")
    p.add_argument("--state-dir", default=None, help="durable job store (SQLite + clips by sha256): jobs are committed "
                   "before the 202, resumed after a restart or kill -9, results served by ID across restarts")
    p.add_argument("--retention-hours", type=float, default=None, help="drop finished jobs and their clips from "
                   "the store this many hours after they finished (default: only --keep limits them)")
    p.add_argument("--sweep-interval", type=float, default=60.0, help="seconds between retention sweeps")
    p.add_argument("--api-keys-file", default=None, help="API keys, one a line (`KEY` or `ID KEY`); clients send "
                   "`Authorization: Bearer KEY`; reloaded on SIGHUP")
    p.add_argument("--metrics-open", action="store_true", help="serve /metrics without a key")
    p.add_argument("--insecure-no-auth", action="store_true", help="allow a non-loopback --host without "
                   "--api-keys-file")
    p.add_argument("--max-jobs-per-key", type=int, default=None, help="most jobs one key may have queued or "
                   "running (429 past it)")
    p.add_argument("--warmup-steps", type=int, default=1)
    add_cfg_arg(p)
    p.add_argument("--max-steps", type=int, default=250, help="most denoising steps a request may ask for (default "
                   "250; more: 400)")
    p.add_argument("--drain-timeout", type=float, default=600.0, help="longest drain on SIGTERM (s)")
    p.add_argument("--drain-grace", type=float, default=2.0, help="seconds results stay fetchable after the drain")
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024, help="largest request body (default 64 KiB; "
                   "larger: 413 before it is parsed; raise it for data-URL images)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds from a request's headers to its "
                   "body's last byte (default 30; slower: 408)")
    p.add_argument("--max-connections", type=int, default=1024, help="open connections and requests at once "
                   "(default 1024; more: 503)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=run)


def run(args) -> int:
    import trt_sora.runtime as rt
    from trt_sora.serve.scheduler import ServeConfig
    from trt_sora.serve.server import HttpConfig, serve

    config = ServeConfig(max_queue=args.max_queue, max_wait_s=args.max_wait_ms / 1000, max_batch=args.max_batch,
                         workers=args.workers, memory_headroom=args.memory_headroom,
                         memory_budget_bytes=int(args.memory_budget_mb * 2**20) if args.memory_budget_mb else None,
                         keep_results=args.keep, results_dir=args.results, warmup_steps=args.warmup_steps,
                         cfg=args.cfg, max_steps=args.max_steps, state_dir=args.state_dir,
                         retention_s=None if args.retention_hours is None else args.retention_hours * 3600,
                         sweep_interval_s=args.sweep_interval, max_jobs_per_key=args.max_jobs_per_key)
    http = HttpConfig(host=args.host, port=args.port, drain_timeout_s=args.drain_timeout,
                      drain_grace_s=args.drain_grace, log_level=args.log_level, max_body_bytes=args.max_body_bytes,
                      body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                      api_keys_file=args.api_keys_file, metrics_open=args.metrics_open,
                      insecure_no_auth=args.insecure_no_auth)
    http.keys()  # a bad keys file or a public host without keys: refused before the model loads
    grpc_config = None
    if args.grpc_port is None and (args.grpc_tls_cert or args.grpc_tls_key):
        from trt_sora.errors import ConfigError

        raise ConfigError("--grpc-tls-cert/--grpc-tls-key secure the gRPC port: give --grpc-port too")
    if args.grpc_port is not None:
        from trt_sora.errors import require
        from trt_sora.serve.grpc_server import GrpcConfig

        require("grpc", extra="grpc")  # refused before the model loads, as a bad keys file
        grpc_config = GrpcConfig(host=args.host, port=args.grpc_port, max_message_bytes=args.max_body_bytes,
                                 max_streams=args.grpc_max_streams, tls_cert=args.grpc_tls_cert,
                                 tls_key=args.grpc_tls_key)
        grpc_config.tls_pair()  # an unreadable certificate or key: refused before the model loads

    from trt_sora.cli.generate import parallel_from_args

    parallel = parallel_from_args(args)
    if parallel is not None:
        import torch.distributed as dist

        if dist.get_rank() != 0:  # followers: compute rank 0's calls, no HTTP
            rt.load(args.run, backend=args.backend, force=args.force, device=args.device, parallel=parallel).follow()
            return 0

    def load():
        runner = rt.load(args.run, backend=args.backend, force=args.force, device=args.device, threads=args.threads,
                         concurrency=args.workers, parallel=parallel)
        if parallel is not None:
            import atexit

            atexit.register(runner.close)  # releases the followers however the server stops
        return runner

    grpc_servers = []

    def listening(engine, host, port):
        _say(f"serving {args.run} on http://{host}:{port} (ready when /readyz answers 200)")
        if grpc_config is not None:
            grpc_servers.append(_start_grpc(engine, grpc_config, http))
            tls = " with TLS" if grpc_config.tls_cert else ""
            _say(f"serving {args.run} over gRPC{tls} on {host}:{grpc_servers[0].port}")

    def ready(engine):
        _say(f"ready: {engine.generator.runner.backend} backend, batch cap {engine.memory.get('cap')}")

    try:
        return serve(load, config, http, text_encoder=args.text_encoder, on_listen=listening, on_ready=ready,
                     hard_exit=True)
    finally:
        for server in grpc_servers:  # the engine drained: streams still sending get the drain grace
            server.stop(grace=args.drain_grace)


def _start_grpc(engine, grpc_config, http):
    """The gRPC server over the HTTP server's engine, with its own copy of the keys (reloaded on
    SIGHUP after the HTTP server's)."""
    import logging
    import signal

    from trt_sora.errors import ConfigError
    from trt_sora.serve.grpc_server import start_grpc

    keys = http.keys()
    if keys is not None and hasattr(signal, "SIGHUP"):
        before = signal.getsignal(signal.SIGHUP)

        def reload(sig, frame):
            if callable(before):
                before(sig, frame)
            try:
                keys.reload()
            except ConfigError as exc:
                logging.getLogger("trt_sora").error("serve: SIGHUP: gRPC keeps its %d key(s): %s", len(keys), exc)

        signal.signal(signal.SIGHUP, reload)
    return start_grpc(engine, grpc_config, keys=keys)
