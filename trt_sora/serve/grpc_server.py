"""gRPC server streaming of clips (``trt-sora serve --grpc-port N``), beside the HTTP server.

::

    server = start_grpc(engine, GrpcConfig(port=0), keys=keys)   # the HTTP server's engine and keys
    server.port                                                   # the bound port (0: a free one)
    ...
    server.stop(grace=5)

``TrtSora.Generate(GenerateRequest) -> stream Chunk`` (``trt_sora/serve/proto/trt_sora.proto``):
the request is a :class:`~trt_sora.runtime.ClipRequest`, submitted through
:meth:`~trt_sora.serve.scheduler.Engine.submit` like an HTTP ``POST /v1/jobs`` (the same checks,
limits, quota and job store: a job is committed before it is accepted, resumes after a restart, and
its result is fetchable over HTTP by the id of the first chunk). The stream then carries progress
(the queue position while queued, step i of n while denoising) and the clip as a fragmented MP4 in
pieces of at most 128 KiB, each starting where a box (or, inside a large ``mdat``, a NAL unit)
begins (:mod:`trt_sora.serve.fmp4`): the engine hands the stream each group of frames as the VAE
decodes it (``on_frames``; Wan and HunyuanVideo 1.5: latent frame by latent frame), ffmpeg encodes them as they come and
each piece is sent as ffmpeg writes it, the init segment at once; the last piece once the job is
committed.

Auth: with keys, ``authorization: Bearer KEY`` metadata (UNAUTHENTICATED without a valid key).
Status codes: INVALID_ARGUMENT (a bad request, naming the field), RESOURCE_EXHAUSTED (queue full,
the key's quota, with ``retry-after`` trailing metadata; also grpc's own refusal of a message past
``max_message_bytes`` or of more than ``max_streams`` streams), UNAVAILABLE (warming up, draining),
INTERNAL (the job failed). A client that cancels (or leaves) cancels its job: a queued one leaves
the queue, a running one stops at its next denoising step, or, in a batch other jobs still want,
is sent nothing more while the batch finishes and its clip is not decoded (:meth:`Engine.cancel`;
status ``cancelled`` in the job store).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from pathlib import Path

import numpy as np

from trt_sora import tracing
from trt_sora.errors import ConfigError, ShapeError, TrtSoraError, require
from trt_sora.serve.fmp4 import FRAGMENT_MARGIN, fragmented_mp4

log = logging.getLogger("trt_sora")

__all__ = ["GrpcConfig", "GrpcServer", "start_grpc"]

QUEUE_REFRESH_S = 1.0  # how often a queued job's stream re-reads its queue position
_REQUEST_FIELDS = ("negative_prompt", "steps", "guidance", "shift", "num_frames", "height", "width", "image")
_DONE, _GONE = object(), object()


@dataclasses.dataclass(frozen=True)
class GrpcConfig:
    """``host``/``port`` (0: a free port), ``max_message_bytes`` (a larger request is refused by
    grpc with RESOURCE_EXHAUSTED; the HTTP body limit), ``max_streams`` (streams at once, each
    holding a thread until its clip is sent; more are refused with RESOURCE_EXHAUSTED),
    ``max_piece_bytes`` (the largest MP4 piece of a chunk), ``tls_cert`` + ``tls_key`` (PEM files of
    the certificate chain and its private key: TLS; neither: plaintext)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 64 * 1024
    max_streams: int = 64
    max_piece_bytes: int = 128 * 1024
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536 or self.max_message_bytes < 1 or self.max_streams < 1:
            raise ConfigError(f"--grpc-port {self.port} must be in 0..65535, the message limit "
                              f"{self.max_message_bytes} and --grpc-max-streams {self.max_streams} >= 1")
        if self.max_piece_bytes < 2 * FRAGMENT_MARGIN:
            raise ConfigError(f"max_piece_bytes={self.max_piece_bytes} must be at least {2 * FRAGMENT_MARGIN}")
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("cert", "key") if self.tls_key is None else ("key", "cert")
            raise ConfigError(f"--grpc-tls-{given} without --grpc-tls-{missing}: give both (the certificate "
                              "chain and its private key, PEM files) for TLS, or neither for plaintext")

    def tls_pair(self) -> tuple[bytes, bytes] | None:
        """``(private key, certificate chain)`` PEM bytes read from ``tls_key`` / ``tls_cert``; None
        without TLS. ConfigError naming a file that cannot be read or is not PEM."""
        if self.tls_cert is None:
            return None
        pair = []
        for flag, path in (("key", self.tls_key), ("cert", self.tls_cert)):
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"--grpc-tls-{flag} {path}: cannot read it ({exc.strerror})") from None
            if b"-----BEGIN " not in data:
                raise ConfigError(f"--grpc-tls-{flag} {path}: not a PEM file (no -----BEGIN line)")
            pair.append(data)
        return pair[0], pair[1]


class GrpcServer:
    """A started gRPC server; :attr:`port` is the bound port."""

    def __init__(self, server, port: int):
        self._server, self.port = server, port

    def stop(self, grace: float | None = None) -> None:
        """Refuse new streams; the open ones get ``grace`` seconds to finish (None: cancelled now)."""
        self._server.stop(grace).wait()


def start_grpc(engine, config: GrpcConfig = GrpcConfig(), *, keys=None) -> GrpcServer:
    """Serve :class:`TrtSora` over ``engine`` on ``config.host:config.port``; returns once bound.
    ``keys``: an :class:`~trt_sora.serve.auth.ApiKeys` (None: no auth)."""
    grpc = require("grpc", extra="grpc")
    from trt_sora.serve.proto import trt_sora_pb2_grpc as pb2_grpc

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(config.max_streams, thread_name_prefix="trt-sora-grpc"),
                         maximum_concurrent_rpcs=config.max_streams,
                         options=[("grpc.max_receive_message_length", config.max_message_bytes)])
    pb2_grpc.add_TrtSoraServicer_to_server(_Servicer(engine, keys, config.max_piece_bytes), server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    address, tls = f"{host}:{config.port}", config.tls_pair()
    try:
        port = server.add_insecure_port(address) if tls is None else \
            server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {config.host}:{config.port} ({exc}); pick another "
                          "--grpc-port (0: any free port)" + (", or check --grpc-tls-cert/--grpc-tls-key" if tls
                                                              else "")) from None
    server.start()
    return GrpcServer(server, port)


class _Servicer:
    """``TrtSora``'s handlers (grpc finds them by name)."""

    def __init__(self, engine, keys, max_piece: int):
        self.engine, self.keys, self.max_piece = engine, keys, max_piece

    def _refuse(self, context, code, reason: str, message: str, retry_after: int | None = None):
        if self.engine.metrics is not None:
            self.engine.metrics.rejected.labels(reason=reason).inc()
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(retry_after)),))
        context.abort(code, message)  # raises

    def Generate(self, request, context):  # noqa: N802 (the proto's method name)
        import grpc

        from trt_sora.serve.proto import trt_sora_pb2 as pb2
        from trt_sora.serve.scheduler import FAILED, Draining, NotReady, QueueFull, QuotaExceeded

        key_id = None
        if self.keys is not None:
            auth = dict(context.invocation_metadata()).get("authorization")
            key_id = self.keys.identify(auth)
            if key_id is None:
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "unauthorized",
                             f"{'an unknown key' if auth else 'no key'}: send `authorization: Bearer KEY` "
                             "metadata with a key of this server's --api-keys-file")
        try:
            clip, scale = _clip_request(request)
        except ConfigError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(exc))
        events: queue.SimpleQueue = queue.SimpleQueue()
        with tracing.span("gRPC Generate") as span:
            try:
                job = self.engine.submit(clip, key_id=key_id, trace_parent=span,
                                         on_step=lambda step, n: events.put((step, n)), on_frames=events.put)
            except (QueueFull, QuotaExceeded) as exc:
                self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             "queue_full" if isinstance(exc, QueueFull) else "quota", str(exc),
                             self.engine.retry_after())
            except (Draining, NotReady) as exc:
                self._refuse(context, grpc.StatusCode.UNAVAILABLE,
                             "draining" if isinstance(exc, Draining) else "not_ready", str(exc), 5)
            except (ConfigError, ShapeError) as exc:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request", str(exc))
            log.info("serve: gRPC job %s accepted%s", job.id, f" for key {key_id}" if key_id else "")

            def gone():  # the stream ended: a job not finished by then lost its client
                events.put(_GONE)
                self.engine.cancel(job.id)

            if not context.add_callback(gone):
                gone()
            if job.trace_id:
                context.send_initial_metadata((("x-trace-id", job.trace_id),))
            threading.Thread(target=lambda: (job.done_event.wait(), events.put(_DONE)), daemon=True).start()

            def progress(phase, **fields):
                return pb2.Chunk(job_id=job.id, progress=pb2.Progress(phase=phase, **fields))

            position = self.engine.queue_position(job.id)
            if position is not None:
                yield progress(pb2.Progress.QUEUED, queue_position=position)
            while True:
                try:
                    event = events.get(timeout=QUEUE_REFRESH_S)
                except queue.Empty:
                    moved = self.engine.queue_position(job.id)
                    if moved is not None and moved != position:
                        position = moved
                        yield progress(pb2.Progress.QUEUED, queue_position=position)
                    continue
                if event is _GONE:
                    log.info("serve: gRPC client of job %s left", job.id)
                    return
                if event is _DONE:
                    break
                if isinstance(event, np.ndarray):  # the first frames are decoded: the MP4 begins
                    yield progress(pb2.Progress.ENCODING)
                    yield from self._mp4(job, scale, context, _decoded(event, events, job.resolved.size[0]))
                    return
                yield progress(pb2.Progress.DENOISING, step=event[0], num_steps=event[1])
            if job.status == FAILED:
                context.abort(grpc.StatusCode.INTERNAL, f"job {job.id} failed: {job.error}")
            yield progress(pb2.Progress.ENCODING)
            try:  # no frames came while it ran (a job resumed before the stream began): the result file
                frames = np.load(self.engine.result_file(job))
            except TrtSoraError as exc:
                context.abort(grpc.StatusCode.INTERNAL, f"job {job.id}: {exc}")
            yield from self._mp4(job, scale, context, frames)

    def _mp4(self, job, scale: int, context, frames):
        """The MP4 pieces of ``frames`` (an array, or groups as they are decoded); the last piece only
        once the job is done (committed to the job store), INTERNAL if it is not."""
        import grpc

        from trt_sora.serve.proto import trt_sora_pb2 as pb2
        from trt_sora.serve.scheduler import DONE

        boundary = {"box": pb2.Mp4Piece.BOX, "nal": pb2.Mp4Piece.NAL, "bytes": pb2.Mp4Piece.BYTES}
        with tracing.span("encode_video", format="fmp4", scale=scale, job_id=job.id):
            stream = fragmented_mp4(frames, self.engine.generator.adapter.fps, scale=scale, max_piece=self.max_piece)
            try:
                for piece in stream:
                    if not context.is_active():
                        return
                    if piece.last and not (job.done_event.wait() and job.status == DONE):
                        context.abort(grpc.StatusCode.INTERNAL, f"job {job.id} {job.status}: {job.error}")
                    yield pb2.Chunk(job_id=job.id, mp4=pb2.Mp4Piece(
                        data=piece.data, offset=piece.offset, boundary=boundary[piece.boundary], last=piece.last))
            except TrtSoraError as exc:
                if context.is_active():
                    context.abort(grpc.StatusCode.INTERNAL, f"job {job.id}: {exc}")
            finally:
                stream.close()


class _Ended(TrtSoraError):
    """The job ended, or its stream did, before the clip's last frame was decoded."""


def _decoded(first: np.ndarray, events: queue.SimpleQueue, num_frames: int):
    """The clip's groups of frames from ``first`` on, as the engine decodes them (read from the
    stream's ``events``), until ``num_frames``; :class:`_Ended` if the job or the stream ends first."""
    got = len(first)
    yield first
    while got < num_frames:
        event = events.get()
        if event is _DONE or event is _GONE:
            raise _Ended(f"the job ended with {got} of its {num_frames} frames decoded; fetch its result over "
                         "HTTP (GET /v1/jobs/ID/result) if it is done")
        if isinstance(event, np.ndarray):
            got += len(event)
            yield event


def _clip_request(request):
    """``(ClipRequest, scale)`` from a GenerateRequest; ConfigError naming the field."""
    from trt_sora.runtime.generate import ClipRequest

    where = "GenerateRequest"
    d = {"prompt": request.prompt, "seed": request.seed, "truncate": request.truncate}
    d.update({k: getattr(request, k) for k in _REQUEST_FIELDS if request.HasField(k)})
    if d.get("image") is not None and not d["image"].startswith("data:"):
        # a path would read files of the server's machine: images travel in the request
        raise ConfigError(f'{where}: "image" must be the image itself as a data URL '
                          '("data:image/png;base64,..."), not a path')
    scale = request.scale or 1
    if not 1 <= scale <= 16:
        raise ConfigError(f"{where}: scale={scale} must be in 1..16 (0: 1)")
    return ClipRequest.from_dict(d, where=where), scale
