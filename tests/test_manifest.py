"""Manifest verification: a file is accepted only with the size and sha256 its manifest recorded."""
import hashlib
import os

import pytest

from trt_sora.errors import ArtifactError
from trt_sora.manifest import verify_file


def _recorded(p):
    data = p.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


def _verify(p, sha, size):
    verify_file(p, sha, size, recorded_in="manifest.json", fix="re-run the stage")


def test_verify_file_accepts_the_recorded_file_and_names_each_kind_of_change(tmp_path):
    p = tmp_path / "model.onnx"
    p.write_bytes(os.urandom(4096))
    sha, size = _recorded(p)
    _verify(p, sha, size)
    data = bytearray(p.read_bytes())
    data[2048] ^= 0x01  # one bit, same size: only the hash can tell
    p.write_bytes(bytes(data))
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later mtime than the cached hash's
    with pytest.raises(ArtifactError, match=r"model\.onnx: sha256 .* differs from manifest\.json.*re-run the stage"):
        _verify(p, sha, size)
    p.write_bytes(bytes(data[:100]))
    with pytest.raises(ArtifactError, match="has 100 bytes, manifest.json says 4096"):
        _verify(p, sha, size)
    p.unlink()
    with pytest.raises(ArtifactError, match="is missing"):
        _verify(p, sha, size)
    p.write_bytes(b"x")
    with pytest.raises(ArtifactError, match="differs"):  # no recorded hash: nothing vouches for the file
        _verify(p, None, None)
