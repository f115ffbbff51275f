"""The gRPC stream of clips (trt_sora/serve/grpc_server.py, fmp4.py) with a real grpc client on
127.0.0.1: progress then fragmented-MP4 pieces (<= 128 KiB, each starting on a box or NAL unit),
whose concatenation decodes to the file path's frames and carries the same H.264 bits; the HTTP
server over the same engine and job store serves the same job; keys, typed status codes, queue
position, and `trt-sora serve --grpc-port 0` end to end.

Nothing waits on the clock: overload is made exact with a runner held at a gate, the CLI's port and
readiness are read from its output."""
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import prefork
import pytest
from http_helpers import HANG, Gated, Lines, http_server

from trt_sora.errors import ConfigError

grpc = pytest.importorskip("grpc")

KEY = "grpc-test-key-0123456789"
LIMIT = 32 * 1024  # the stack's pieces (the default 128 KiB would hold the tiny clip whole)
ROOT = Path(__file__).resolve().parents[2]
PROTO = "trt_sora/serve/proto/trt_sora.proto"


def pb():
    from trt_sora.serve.proto import trt_sora_pb2, trt_sora_pb2_grpc

    return trt_sora_pb2, trt_sora_pb2_grpc


def _keys(tmp_path):
    from trt_sora.serve.auth import ApiKeys

    path = tmp_path / "keys.txt"
    path.write_text(f"alice {KEY}\n")
    return ApiKeys(path)


@contextlib.contextmanager
def _serving(runner, config, *, keys=None, metrics=None, max_piece_bytes=None):
    """A started engine over ``runner`` with ``config`` and its gRPC server on a free port:
    ``(engine, channel)``. On exit a :class:`Gated` runner's gate opens, then the channel, the server
    and the engine (drained) close, whatever the test left running."""
    from trt_sora.serve.grpc_server import GrpcConfig, start_grpc
    from trt_sora.serve.scheduler import Engine

    pieces = {"max_piece_bytes": max_piece_bytes} if max_piece_bytes else {}
    with contextlib.ExitStack() as cleanup:
        engine = Engine(runner, config, metrics=metrics)
        cleanup.callback(engine.close)
        engine.start(block=True)
        cleanup.callback(engine.drain, HANG)
        server = start_grpc(engine, GrpcConfig(port=0, **pieces), keys=keys)
        cleanup.callback(server.stop, grace=None)
        channel = cleanup.enter_context(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
        if isinstance(runner, Gated):
            cleanup.callback(runner.release.set)
        yield engine, channel


@pytest.fixture(scope="module")
def stack(tiny_runner, tmp_path_factory):
    """An engine over the tiny runner with a job store, its gRPC server and its HTTP app, both keyed:
    ``(engine, grpc stub, Http)``."""
    from trt_sora.serve.metrics import ServerMetrics
    from trt_sora.serve.scheduler import ServeConfig
    from trt_sora.serve.server import make_app

    tmp = tmp_path_factory.mktemp("grpc")
    keys, metrics = _keys(tmp), ServerMetrics()
    config = ServeConfig(max_wait_s=0.0, state_dir=str(tmp / "state"))
    with _serving(tiny_runner, config, keys=keys, metrics=metrics, max_piece_bytes=LIMIT) as (engine, channel):
        with http_server(make_app(engine, metrics, keys=keys)) as http:
            yield engine, pb()[1].TrtSoraStub(channel), http


def _auth(key=KEY):
    return (("authorization", f"Bearer {key}"),)


def _boxes(data: bytes):
    from trt_sora.serve.fmp4 import top_level_boxes

    return [(offset, box[4:8].decode(), len(box)) for offset, box in top_level_boxes([data])]


def _check_pieces(mp4_pieces, limit):
    """The pieces are the file in order, each <= ``limit`` and starting where it says: a top-level box,
    or a NAL unit of an mdat (from there, 4-byte lengths chain exactly to the mdat's end)."""
    pb2 = pb()[0]
    data = b"".join(p.data for p in mp4_pieces)
    boxes = _boxes(data)
    starts = {o for o, _, _ in boxes}
    at = 0
    for i, p in enumerate(mp4_pieces):
        assert 0 < len(p.data) <= limit and p.offset == at, (i, len(p.data), p.offset, at)
        assert p.last == (i == len(mp4_pieces) - 1)
        if p.boundary == pb2.Mp4Piece.BOX:
            assert p.offset in starts, f"piece {i} at byte {p.offset} does not start a box"
        elif p.boundary == pb2.Mp4Piece.NAL:
            o, kind, size = max(b for b in boxes if b[0] < p.offset)
            assert kind == "mdat", f"piece {i}: a NAL piece inside a {kind}"
            nal = p.offset
            while nal < o + size:
                nal += 4 + int.from_bytes(data[nal:nal + 4], "big")
            assert nal == o + size, f"piece {i} at byte {p.offset} does not start a NAL unit"
        else:
            assert p.boundary == pb2.Mp4Piece.BYTES
        at += len(p.data)
    return data, boxes


def _h264(path) -> bytes:
    """The file's H.264 stream (Annex B), as the encoder wrote it."""
    from trt_sora.runtime.video import ffmpeg_exe

    res = subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-i", str(path), "-map", "0:v",
                          "-c", "copy", "-bsf:v", "h264_mp4toannexb", "-f", "h264", "-"], capture_output=True,
                         check=True)
    return res.stdout


def test_stream_is_progress_then_a_fragmented_mp4_equal_to_the_file_path(stack, tiny_runner, tmp_path):
    """Step i of n for every step, then the MP4 in <= 32 KiB pieces on box boundaries. Its H.264 is
    bit for bit the HTTP ?format=mp4 file's of the same job (same encoder settings, another muxer), so
    the frames decode equal; those match write_mp4 of generate()'s clip, the file path."""
    import trt_sora.runtime as rt
    from trt_sora.runtime.video import read_video, write_mp4

    engine, stub, http = stack
    pb2 = pb()[0]
    scale = 16  # a clip larger than one piece: several fragments
    chunks = list(stub.Generate(pb2.GenerateRequest(prompt="a red circle moving right", seed=7, scale=scale),
                                metadata=_auth(), timeout=HANG))
    job_id = chunks[0].job_id
    assert {c.job_id for c in chunks} == {job_id}
    kinds = [c.WhichOneof("kind") for c in chunks]
    first_mp4 = kinds.index("mp4")
    assert set(kinds[first_mp4:]) == {"mp4"}, "progress after the MP4 began"
    progress = [c.progress for c in chunks[:first_mp4]]
    steps = engine.generator.settings.num_steps
    denoising = [(p.step, p.num_steps) for p in progress if p.phase == pb2.Progress.DENOISING]
    assert denoising == [(i, steps) for i in range(1, steps + 1)]
    assert progress[-1].phase == pb2.Progress.ENCODING
    assert {p.phase for p in progress} <= {pb2.Progress.QUEUED, pb2.Progress.DENOISING, pb2.Progress.ENCODING}

    pieces = [c.mp4 for c in chunks[first_mp4:]]
    data, boxes = _check_pieces(pieces, LIMIT)
    kinds = [k for _, k, _ in boxes]
    assert kinds[:2] == ["ftyp", "moov"] and pieces[0].data.startswith(data[:boxes[2][0]])  # init first, whole
    frag = kinds[2:-1] if kinds[-1] == "mfra" else kinds[2:]
    assert frag == ["moof", "mdat"] * (len(frag) // 2) and len(frag) >= 4, kinds  # several fragments
    assert len(pieces) > 2 and len(data) > LIMIT
    streamed = tmp_path / "streamed.mp4"
    streamed.write_bytes(data)

    status, body, _ = http("GET", f"/v1/jobs/{job_id}/result?format=mp4&scale={scale}", headers=dict(_auth()))
    assert status == 200  # the same job, fetched over HTTP from the same engine and store
    fetched = tmp_path / "fetched.mp4"
    fetched.write_bytes(body)
    assert _h264(streamed) == _h264(fetched)
    frames = read_video(streamed)
    np.testing.assert_array_equal(frames, read_video(fetched))

    want = rt.generate(tiny_runner, "a red circle moving right", seed=7)[0].frames
    np.testing.assert_array_equal(np.load(engine.get(job_id).result_path), want)
    np.testing.assert_array_equal(frames, read_video(write_mp4(want, tmp_path / "file.mp4", 16.0, scale=scale)))
    assert engine.store.get(job_id).key_id == "alice"


def test_mp4_pieces_are_sent_while_the_vae_decodes(stack, monkeypatch, tmp_path):
    """The server's decoder holds the clip's last latent frame back until the client has an MP4 piece:
    the stream sends the MP4 (its init segment, ftyp + moov) from the first decoded frames on, not
    after the clip; the pieces are still the file path's clip."""
    from trt_sora.runtime.video import read_video, write_mp4

    engine, stub, _ = stack
    pb2 = pb()[0]
    gen = engine.generator
    decode_groups = gen._parts()[1]
    events, first_piece = [], threading.Event()

    def held(z):  # Wan decodes latent frame by latent frame: one group each
        for i, x in enumerate(decode_groups(z)):
            if i == z.shape[2] - 1:
                events.append(("last group waited", first_piece.wait(HANG)))
            events.append(f"group {i}")
            yield x

    monkeypatch.setattr(gen, "_decode_groups", held)
    pieces = []
    for chunk in stub.Generate(pb2.GenerateRequest(prompt="a red circle moving right", seed=8), metadata=_auth(),
                               timeout=HANG):
        if chunk.WhichOneof("kind") == "mp4":
            if not pieces:
                events.append("first mp4 piece")
                first_piece.set()
            pieces.append(chunk.mp4)
    assert events[0] == "group 0" and events[-2:] == [("last group waited", True), "group 2"], events
    assert set(events[1:3]) == {"group 1", "first mp4 piece"}, events  # the client's piece and group 1 race
    data, boxes = _check_pieces(pieces, LIMIT)
    assert [k for _, k, _ in boxes][:2] == ["ftyp", "moov"] and pieces[0].data[4:8] == b"ftyp"
    (tmp_path / "streamed.mp4").write_bytes(data)
    frames = np.load(engine.get(chunk.job_id).result_path)
    assert frames.shape[0] == 9
    np.testing.assert_array_equal(read_video(tmp_path / "streamed.mp4"),
                                  read_video(write_mp4(frames, tmp_path / "file.mp4", 16.0)))
def test_keys_are_required(stack):
    engine, stub, _ = stack
    pb2 = pb()[0]
    before = len(engine.store.unfinished()) + engine.queue_depth
    for metadata, said in (((), "no key"), (_auth("not-a-key-of-this-server"), "an unknown key"),
                           ((("authorization", KEY),), "an unknown key")):  # not `Bearer KEY`
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb2.GenerateRequest(prompt="x"), metadata=metadata, timeout=HANG))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and said in e.value.details()
        assert "authorization: Bearer KEY" in e.value.details()
    assert len(engine.store.unfinished()) + engine.queue_depth == before  # nothing was submitted


@pytest.mark.parametrize("fields, named", [
    ({"prompt": ""}, "prompt is empty"),
    ({"steps": -1}, "steps=-1"),
    ({"steps": 10 ** 6}, "--max-steps"),
    ({"num_frames": 10}, "num_frames 10"),
    ({"height": 4096, "width": 4096}, "no bucket"),
    ({"guidance": math.nan}, "guidance_scale=nan"),
    ({"seed": 2 ** 63}, "seed="),
    ({"image": "/etc/passwd"}, '"image" must be the image itself as a data URL'),
    ({"scale": 17}, "scale=17"),
])
def test_a_bad_request_is_invalid_argument_naming_the_field(stack, fields, named):
    _, stub, _ = stack
    pb2 = pb()[0]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb2.GenerateRequest(**{"prompt": "x", **fields}), metadata=_auth(), timeout=HANG))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert named in e.value.details()


def test_a_message_past_the_limit_is_resource_exhausted(stack):
    _, stub, _ = stack
    pb2 = pb()[0]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb2.GenerateRequest(prompt="x" * (65 * 1024)), metadata=_auth(), timeout=HANG))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_queue_position_full_queue_and_draining(tiny_runner):
    """A job waits behind one held in the model: its stream says queue position 1; one more is refused
    RESOURCE_EXHAUSTED with retry-after (the queue holds 1), and UNAVAILABLE once the engine drains.
    CFG split (two transformer calls a step) still reports each step once."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.scheduler import ServeConfig

    pb2, pb2_grpc = pb()
    gated = Gated(tiny_runner)
    with _serving(gated, ServeConfig(max_wait_s=0.0, max_queue=1, cfg="split")) as (engine, channel):
        stub = pb2_grpc.TrtSoraStub(channel)
        gated.arm()
        held = engine.submit(ClipRequest("held"))
        assert gated.entered.wait(HANG)
        waiting = stub.Generate(pb2.GenerateRequest(prompt="waits", seed=1), timeout=HANG)
        first = next(waiting)
        assert first.progress.phase == pb2.Progress.QUEUED and first.progress.queue_position == 1
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb2.GenerateRequest(prompt="one too many"), timeout=HANG))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.value.details()
        assert int(dict(e.value.trailing_metadata())["retry-after"]) >= 1
        engine.begin_drain()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb2.GenerateRequest(prompt="too late"), timeout=HANG))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        gated.release.set()
        rest = list(waiting)  # the accepted job still streams to the end
        assert rest[-1].mp4.last and engine.wait(held.id, HANG).status == "done"
        steps = engine.generator.settings.num_steps
        assert [(c.progress.step, c.progress.num_steps) for c in rest if c.progress.phase == pb2.Progress.DENOISING] \
            == [(i, steps) for i in range(1, steps + 1)]


class _Counted(Gated):
    """A gated runner that counts the calls made once armed."""

    calls = 0

    def infer(self, feeds):
        if self.armed:
            self.calls += 1
        return super().infer(feeds)


def test_a_client_that_cancels_cancels_its_job(tiny_runner, tmp_path):
    """The client cancels while step 1's transformer call is held: the job stops at step 2 (no other
    call) and is cancelled in the engine and the job store; a queued job cancelled leaves the queue."""
    from trt_sora.runtime import ClipRequest
    from trt_sora.serve.scheduler import ServeConfig

    pb2, pb2_grpc = pb()
    gated = _Counted(tiny_runner)
    with _serving(gated, ServeConfig(max_wait_s=0.0, state_dir=str(tmp_path / "state"))) as (engine, channel):
        gated.arm()
        call = pb2_grpc.TrtSoraStub(channel).Generate(pb2.GenerateRequest(prompt="cancel me", seed=2), timeout=HANG)
        job = engine.get(next(call).job_id)
        assert gated.entered.wait(HANG)
        queued = engine.submit(ClipRequest("queued behind it"))
        assert engine.cancel(queued.id) and engine.wait(queued.id, HANG).status == "cancelled"
        assert engine.queue_depth == 0 and not engine.cancel(queued.id)
        call.cancel()
        assert job.cancel_event.wait(HANG), "the server did not see the client cancel"
        gated.release.set()
        assert engine.wait(job.id, HANG).status == "cancelled" and job.result_path is None
        assert gated.calls == 1, f"{gated.calls} transformer calls: the job did not stop at its next step"
        assert {engine.store.get(i).status for i in (job.id, queued.id)} == {"cancelled"}
        assert not engine.cancel(job.id)


def test_a_client_that_cancels_in_a_shared_batch_leaves_the_others_unchanged(tiny_runner, tmp_path):
    """Two streams share one batch (the batcher waits for the second); while its first transformer
    call is held, one client cancels: that job is sent nothing more (no step, no frames) and ends
    cancelled with no result, in the engine and the job store; the other streams to the end, its
    steps, MP4 pieces and clip bit for bit those of the same batch run without the cancel."""
    from trt_sora.serve.grpc_server import GrpcConfig, start_grpc
    from trt_sora.serve.scheduler import Engine, ServeConfig

    pb2, pb2_grpc = pb()
    gated = Gated(tiny_runner)
    engine = Engine(gated, ServeConfig(max_wait_s=HANG, max_batch=2, cfg="split", state_dir=str(tmp_path / "state")))
    engine.start(block=True)
    server = start_grpc(engine, GrpcConfig(port=0, max_piece_bytes=LIMIT))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb2_grpc.TrtSoraStub(channel)

    def both():  # the first job is queued (its first chunk says so) before the second is asked for
        leaves = stub.Generate(pb2.GenerateRequest(prompt="leaves", seed=3), timeout=HANG)
        first = next(leaves)
        assert first.progress.phase == pb2.Progress.QUEUED
        return leaves, engine.get(first.job_id), stub.Generate(pb2.GenerateRequest(prompt="stays", seed=4),
                                                                 timeout=HANG)

    def received(chunks):  # what a client sees of its clip (a QUEUED message may or may not come)
        chunks = list(chunks)
        return ([c.progress.step for c in chunks if c.progress.phase == pb2.Progress.DENOISING],
                [c.mp4.data for c in chunks if c.WhichOneof("kind") == "mp4"], engine.get(chunks[-1].job_id))

    try:
        leaves, _, stays = both()
        want_steps, want_mp4, want_job = received(stays)
        assert received(leaves)[1], "the uncancelled run streams both clips"
        gated.arm()
        leaves, leaving, stays = both()
        assert gated.entered.wait(HANG)  # the batch holds in its first call
        first = next(stays)  # the step 1 message, or the queue position the stream saw first
        assert engine.get(first.job_id).status == leaving.status == "running"  # one batch
        sent = []
        leaving.on_step, leaving.on_frames = (lambda *a: sent.append(a)), sent.append
        leaves.cancel()
        assert leaving.cancel_event.wait(HANG), "the server did not see the client cancel"
        gated.release.set()
        steps, mp4, job = received([first, *stays])
        assert engine.wait(leaving.id, HANG).status == "cancelled" and leaving.result_path is None
        assert engine.store.get(leaving.id).status == "cancelled" and sent == []
        assert steps == want_steps and mp4 == want_mp4 and job.status == "done"
        np.testing.assert_array_equal(np.load(engine.result_file(job)), np.load(engine.result_file(want_job)))
    finally:
        gated.release.set()
        channel.close()
        server.stop(grace=None)
        engine.drain(HANG)
        engine.close()


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, PEM files in ``folder``."""
    x509 = pytest.importorskip("cryptography.x509", reason="TLS test certificates are made with `cryptography`")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_streams_to_a_client_that_trusts_the_certificate(stack, tmp_path):
    """--grpc-tls-cert/--grpc-tls-key: a client trusting the self-signed certificate gets the clip; a
    plaintext client gets no answer; one file without the other, or a file that is no PEM, is a
    ConfigError naming the flag."""
    from trt_sora.serve.grpc_server import GrpcConfig, start_grpc

    engine, _, _ = stack
    pb2, pb2_grpc = pb()
    cert, key = _self_signed(tmp_path)
    server = start_grpc(engine, GrpcConfig(port=0, tls_cert=str(cert), tls_key=str(key)))
    try:
        trusted = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.port}", trusted) as channel:
            chunks = list(pb2_grpc.TrtSoraStub(channel).Generate(pb2.GenerateRequest(prompt="x", steps=1),
                                                                 timeout=HANG))
        assert chunks[-1].mp4.last and chunks[-1].mp4.data
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.RpcError) as e:
                list(pb2_grpc.TrtSoraStub(channel).Generate(pb2.GenerateRequest(prompt="x", steps=1), timeout=HANG))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)
    with pytest.raises(ConfigError, match="--grpc-tls-cert without --grpc-tls-key: give both"):
        GrpcConfig(tls_cert=str(cert))
    with pytest.raises(ConfigError, match="--grpc-tls-key without --grpc-tls-cert"):
        GrpcConfig(tls_key=str(key))
    (tmp_path / "not.pem").write_text("not pem\n")
    with pytest.raises(ConfigError, match=r"--grpc-tls-key .*not a PEM file"):
        GrpcConfig(tls_cert=str(cert), tls_key=str(tmp_path / "not.pem")).tls_pair()
    with pytest.raises(ConfigError, match=r"--grpc-tls-cert .*cannot read it"):
        GrpcConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(key)).tls_pair()


@pytest.mark.parametrize("flags, said", [
    (["--grpc-port", "0", "--grpc-tls-cert", "cert.pem"], "--grpc-tls-cert without --grpc-tls-key: give both"),
    (["--grpc-tls-key", "key.pem", "--grpc-tls-cert", "cert.pem"], "give --grpc-port too"),
])
def test_cli_refuses_tls_flags_that_do_not_go_together(tmp_path, flags, said):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = prefork.run([sys.executable, "-m", "trt_sora", "serve", "--run", str(tmp_path), *flags], env=env,
                      capture_output=True, text=True, timeout=HANG)
    assert res.returncode == 2 and said in res.stderr, res.stderr


def test_pieces_cut_large_boxes_at_nal_units():
    """A real fragmented MP4, read back in 7-byte reads and cut for 2 KiB pieces: fragments larger
    than a piece are cut where NAL units begin, a NAL unit larger than a piece by bytes."""
    from trt_sora.serve.fmp4 import BOX, BYTES, NAL, fragmented_mp4, pieces

    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    data = b"".join(p.data for p in fragmented_mp4(frames, 16.0, scale=2))
    limit = 2048  # the frames' NAL units are about 3 KiB
    out = list(pieces((data[i:i + 7] for i in range(0, len(data), 7)), limit))
    pb2 = pb()[0]
    code = {BOX: pb2.Mp4Piece.BOX, NAL: pb2.Mp4Piece.NAL, BYTES: pb2.Mp4Piece.BYTES}
    as_msgs = [pb2.Mp4Piece(data=p.data, offset=p.offset, boundary=code[p.boundary], last=i == len(out) - 1)
               for i, p in enumerate(out)]
    assert _check_pieces(as_msgs, limit)[0] == data
    assert {p.boundary for p in out} == {BOX, NAL, BYTES}


def test_fragments_come_out_while_groups_of_frames_still_come_in():
    """Groups of frames fed to the encoder as they come: the source holds its last group back until a
    fragment (moof + mdat) has come out, so fragments are sent while frames are still being made; the
    MP4 is the one of the whole array, byte for byte."""
    from trt_sora.serve.fmp4 import BOX, fragmented_mp4

    frames = np.random.default_rng(1).integers(0, 256, (120, 32, 48, 3), dtype=np.uint8)
    fragment, events = threading.Event(), []

    def groups():
        for i in range(0, 116, 4):
            yield frames[i:i + 4]
        assert fragment.wait(HANG), "no fragment came out before the last group"
        events.append("last group")
        yield frames[116:]

    out = []
    for piece in fragmented_mp4(groups(), 16.0, max_piece=16 * 1024):
        out.append(piece)
        if piece.boundary == BOX and piece.data[4:8] == b"moof" and not fragment.is_set():
            events.append("fragment")
            fragment.set()
    assert events == ["fragment", "last group"] and out[-1].last
    assert b"".join(p.data for p in out) == b"".join(p.data for p in fragmented_mp4(frames, 16.0, max_piece=16 * 1024))
    with pytest.raises(ConfigError, match="every group of a clip has the clip's size"):
        list(fragmented_mp4(iter([frames[:2], frames[:2, :16]]), 16.0))


def test_committed_stubs_match_the_proto(tmp_path):
    """The generated modules in the package are what grpcio-tools makes of the proto (`make proto`)."""
    pytest.importorskip("grpc_tools")
    from grpc_tools import protoc

    assert protoc.main(["protoc", "-I", str(ROOT), f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", str(ROOT / PROTO)]) == 0
    for name in ("trt_sora_pb2.py", "trt_sora_pb2_grpc.py", "trt_sora_pb2.pyi"):
        made = (tmp_path / "trt_sora/serve/proto" / name).read_text()
        assert made == (ROOT / "trt_sora/serve/proto" / name).read_text(), f"{name} is stale: run `make proto`"


def test_cli_serves_grpc_beside_http(checked_run, tmp_path):
    """`trt-sora serve --port 0 --grpc-port 0 --api-keys-file K`: both ports printed, a keyed stream
    ends with the MP4's last piece, and SIGTERM drains to exit 0."""
    pb2, pb2_grpc = pb()
    (tmp_path / "keys.txt").write_text(f"{KEY}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = prefork.popen([sys.executable, "-m", "trt_sora", "serve", "--run", str(checked_run), "--backend", "ort",
                          "--port", "0", "--grpc-port", "0", "--threads", "1", "--max-wait-ms", "0",
                          "--api-keys-file", str(tmp_path / "keys.txt"), "--drain-grace", "0"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        out.wait_for(r"on http://127\.0\.0\.1:\d+ ")
        port = int(out.wait_for(r"over gRPC on 127\.0\.0\.1:(\d+)$").group(1))
        out.wait_for(r"^ready: ort backend")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            chunks = list(pb2_grpc.TrtSoraStub(channel).Generate(pb2.GenerateRequest(prompt="x", steps=1),
                                                                 metadata=_auth(), timeout=HANG))
            assert chunks[-1].mp4.last and chunks[-1].mp4.data
            with pytest.raises(grpc.RpcError) as e:  # the HTTP server's keys guard the gRPC port too
                list(pb2_grpc.TrtSoraStub(channel).Generate(pb2.GenerateRequest(prompt="x"), timeout=HANG))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG) == 0, err.text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
