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


def test_read_safetensors_names_a_missing_file_and_another_format(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from trt_sora.manifest import read_safetensors

    path = tmp_path / "r.safetensors"
    kw = {"fmt": "trt_sora.test/1", "what": "a test file", "missing": "nothing wrote it", "fix": "write it"}
    with pytest.raises(ArtifactError, match=r"r\.safetensors does not exist: nothing wrote it; write it"):
        read_safetensors(path, **kw)
    save_file({"a": np.arange(3.0)}, str(path), metadata={"format": "trt_sora.other/1"})
    with pytest.raises(ArtifactError, match=r"is not a test file of this trt_sora \('trt_sora\.other/1'\); write it"):
        read_safetensors(path, **kw)
    save_file({"a": np.arange(3.0), "b": np.ones((2, 2), np.float32)}, str(path),
              metadata={"format": "trt_sora.test/1", "k": "v"})
    meta, tensors = read_safetensors(path, **kw)
    assert meta == {"format": "trt_sora.test/1", "k": "v"} and set(tensors) == {"a", "b"}
    np.testing.assert_array_equal(tensors["a"], [0.0, 1.0, 2.0])
    assert tensors["b"].dtype == np.float32 and tensors["b"].shape == (2, 2)


def test_recorded_file_entry_takes_the_manifests_hashes_and_hashes_an_unlisted_file(tmp_path):
    """The export and quantize manifests name their ONNX by the hashes its folder's manifest recorded
    (no second pass over the external data); a file the manifest does not list is hashed."""
    from trt_sora.manifest import file_entry, recorded_file_entry

    onnx, data = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    onnx.write_bytes(b"graph")
    data.write_bytes(b"weights")
    recorded = {"files": {"model.onnx": {"sha256": "a" * 64, "bytes": 5},
                          "model.onnx.data": {"sha256": "b" * 64, "bytes": 7}}}
    assert recorded_file_entry(onnx, recorded) == {
        "path": str(onnx.resolve()), "sha256": "a" * 64, "bytes": 5,
        "external_data": {"path": str(data.resolve()), "sha256": "b" * 64, "bytes": 7}}
    sha, size = _recorded(onnx)
    assert recorded_file_entry(onnx, {"files": {}}) == file_entry(onnx)
    assert recorded_file_entry(onnx, None)["sha256"] == sha and file_entry(onnx)["bytes"] == size
    assert file_entry(onnx)["external_data"]["sha256"] == _recorded(data)[0]
