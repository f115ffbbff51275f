"""A clip as a fragmented MP4 streamed in pieces (the gRPC stream's payload).

::

    for piece in fragmented_mp4(frames, fps=16):      # frames: uint8 [F, H, W, 3]
        send(piece.data)                              # <= MAX_PIECE_BYTES, in file order
    fragmented_mp4(groups, fps=16)                    # or groups of frames, encoded as they come

ffmpeg (the ``imageio-ffmpeg`` wheel's, as :func:`trt_sora.runtime.video.write_mp4`) encodes with
the same H.264 settings as the file path and writes a fragmented MP4 to a pipe
(``-movflags frag_keyframe+empty_moov+default_base_moof``, fragments of at most ``-frag_size``
bytes): the ``ftyp`` + ``moov`` init segment, then ``moof`` + ``mdat`` fragments, so a player can
start before the last frame is encoded. :func:`pieces` reads the pipe as it is written and cuts it
where a box begins, keeping an init segment or a fragment whole when it fits in a piece; an ``mdat``
larger than a piece is cut where an H.264 NAL unit begins (its samples are NAL units behind 4-byte
lengths), and only a single NAL unit larger than a piece is cut at a byte count.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import subprocess
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from trt_sora.errors import ConfigError
from trt_sora.runtime.video import DEFAULT_PRESET, VideoError, check_frames, ffmpeg_exe, upscale_frames, x264_args

__all__ = ["BOX", "BYTES", "MAX_PIECE_BYTES", "NAL", "Piece", "fragmented_mp4", "pieces", "top_level_boxes"]

MAX_PIECE_BYTES = 128 * 1024
FRAGMENT_MARGIN = 8 * 1024  # room for a fragment's moof (about 12 bytes per frame) beside its mdat
BOX, NAL, BYTES = "box", "nal", "bytes"  # where a piece starts: a top-level box, a NAL unit, a byte count
_HELD = (b"ftyp", b"moof")  # sent together with the box that follows (moov, mdat)
_INIT = (b"ftyp", b"moov")  # the init segment: never the file's end


@dataclasses.dataclass(frozen=True)
class Piece:
    """``data`` at byte ``offset`` of the MP4; ``boundary``: :data:`BOX`, :data:`NAL` or :data:`BYTES`;
    ``last``: the file's final piece (only once the encoder exited cleanly)."""

    data: bytes
    offset: int
    boundary: str
    last: bool = False


def fragmented_mp4(frames, fps: float, *, scale: int = 1, crf: int = 18,
                   max_piece: int = MAX_PIECE_BYTES) -> Iterator[Piece]:
    """The clip ``frames`` (uint8 ``[F, H, W, 3]``, or an iterable of such groups of one size, fed to
    the encoder as each comes) as fragmented-MP4 pieces of at most ``max_piece`` bytes, yielded as
    ffmpeg writes them. Closing the iterator early stops ffmpeg. VideoError when ffmpeg fails, and
    what the groups raise (the pieces sent so far then lack a ``last`` one)."""
    if max_piece < 2 * FRAGMENT_MARGIN:
        raise ConfigError(f"max_piece={max_piece} must be at least {2 * FRAGMENT_MARGIN} bytes")
    groups = iter([frames] if isinstance(frames, np.ndarray) else frames)
    first = next(groups, None)
    if first is None:
        raise ConfigError("no frames to stream: give uint8 [num_frames, height, width, 3] frames")
    x = upscale_frames(check_frames(first), scale)
    _, h, w, _ = x.shape
    cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", *x264_args(w, h, fps, crf, DEFAULT_PRESET),
           "-movflags", "frag_keyframe+empty_moov+default_base_moof", "-frag_size", str(max_piece - FRAGMENT_MARGIN),
           "-flush_packets", "1", "-f", "mp4", "pipe:1"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    errors: list[bytes] = []
    failed: list[BaseException] = []

    def write(group) -> bool:  # frame by frame: ffmpeg encodes (and writes fragments) while we still feed
        try:
            for frame in group:
                proc.stdin.write(frame.tobytes())
            return True
        except (BrokenPipeError, ValueError):  # ffmpeg exited (an error, or the reader stopped it)
            return False

    def feed() -> None:
        try:
            if all(write(g) for g in itertools.chain([x], (_same_size(g, scale, x.shape) for g in groups))):
                proc.stdin.close()
        except BrokenPipeError:
            pass
        except Exception as exc:  # the groups failed: no clean end for ffmpeg, so no `last` piece
            failed.append(exc)
            proc.kill()

    threads = [threading.Thread(target=feed, daemon=True),
               threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)]
    for t in threads:
        t.start()
    held = None
    try:
        for piece in pieces(iter(lambda: proc.stdout.read1(1 << 16), b""), max_piece):
            if held is not None:
                yield held
                held = None
            if piece.boundary == BOX and piece.data[4:8] in _INIT:  # fragments follow: sent at once
                yield piece
            else:
                held = piece  # until the next, or until ffmpeg exits: the last piece says so
        code = proc.wait()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        if code != 0 or held is None:
            text = b"".join(errors).decode(errors="replace").strip()[-400:]
            raise VideoError(f"ffmpeg could not stream the clip as a fragmented MP4 (exit {code}): {text}")
        yield dataclasses.replace(held, last=True)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for s in (proc.stdin, proc.stdout, proc.stderr):
            try:
                s.close()
            except (BrokenPipeError, OSError):
                pass


def _same_size(group, scale: int, shape) -> np.ndarray:
    x = upscale_frames(check_frames(group), scale)
    if x.shape[1:] != shape[1:]:
        raise ConfigError(f"a group of frames of {x.shape[2]}x{x.shape[1]} after {shape[2]}x{shape[1]} ones (at "
                          f"scale {scale}); every group of a clip has the clip's size")
    return x


def top_level_boxes(reads: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """``(offset, box)`` for each whole top-level box of an MP4 given as successive byte strings
    (any split). VideoError for a malformed header or a stream that ends inside a box."""
    buf, offset = bytearray(), 0
    for data in reads:
        buf += data
        while len(buf) >= 8:
            size = int.from_bytes(buf[:4], "big")
            if size == 1:  # a 64-bit size follows the type
                if len(buf) < 16:
                    break
                size = int.from_bytes(buf[8:16], "big")
            if size < 8:
                raise VideoError(f"MP4 box at byte {offset} has size {size} (a box of unknown length or a "
                                 "corrupt header); the encoder output is not a fragmented MP4")
            if len(buf) < size:
                break
            yield offset, bytes(buf[:size])
            del buf[:size]
            offset += size
    if buf:
        raise VideoError(f"the MP4 ended inside a box at byte {offset} ({len(buf)} bytes of it)")


def pieces(reads: Iterable[bytes], max_piece: int = MAX_PIECE_BYTES) -> Iterator[Piece]:
    """The MP4 of ``reads`` cut into pieces of at most ``max_piece`` bytes, yielded once each box is
    complete: ``ftyp`` + ``moov`` and ``moof`` + ``mdat`` as one piece when they fit, else box by
    box, and a box larger than a piece cut at NAL units (``mdat``) or bytes."""
    unit: list[tuple[int, bytes]] = []
    for offset, box in top_level_boxes(reads):
        unit.append((offset, box))
        if box[4:8] not in _HELD:
            yield from _cut(unit, max_piece)
            unit = []
    yield from _cut(unit, max_piece)


def _cut(boxes: list[tuple[int, bytes]], max_piece: int) -> Iterator[Piece]:
    if not boxes:
        return
    if sum(len(b) for _, b in boxes) <= max_piece:
        yield Piece(b"".join(b for _, b in boxes), boxes[0][0], BOX)
        return
    for offset, box in boxes:
        starts = _nal_starts(box) if box[4:8] == b"mdat" else []
        cuts = sorted({0, *starts, len(box)})
        at = 0
        while at < len(box):
            i = bisect.bisect_right(cuts, at + max_piece) - 1
            end = cuts[i] if cuts[i] > at else at + max_piece  # one NAL unit larger than a piece: bytes
            kind = BOX if at == 0 else NAL if at in starts else BYTES
            yield Piece(box[at:end], offset + at, kind)
            at = end


def _nal_starts(mdat: bytes) -> list[int]:
    """Offsets in ``mdat`` (a whole box) where its length-prefixed NAL units begin; [] when its
    payload does not parse as 4-byte-length NAL units."""
    header = 16 if int.from_bytes(mdat[:4], "big") == 1 else 8
    starts, at = [], header
    while at + 4 <= len(mdat):
        starts.append(at)
        at += 4 + int.from_bytes(mdat[at:at + 4], "big")
    return starts if at == len(mdat) else []
