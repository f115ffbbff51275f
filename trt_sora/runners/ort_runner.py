"""ONNX Runtime runner for plain and Q/DQ ONNX graphs (CUDA provider first when present)."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trt_sora.errors import ArtifactError, BackendMissingError, ConfigError
from trt_sora.runners.base import Runner, is_torch, to_numpy

log = logging.getLogger("trt_sora")

_ORT_TO_NP = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32"}


def _ensure_outputs(model, names: Sequence[str]) -> list[str]:
    """Add graph outputs for ``names`` that exist in ``model`` (typed via shape inference)."""
    import onnx

    produced = {o for n in model.graph.node for o in n.output}
    existing = {o.name for o in model.graph.output}
    types: dict[str, int] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            types[vi.name] = vi.type.tensor_type.elem_type
    except Exception:  # shape inference is best effort; untyped outputs fall back to float
        pass
    added = []
    for n in names:
        if n in produced and n not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(n, types.get(n) or onnx.TensorProto.FLOAT,
                                                                         None))
            added.append(n)
        elif n in existing:
            added.append(n)
    return added


def providers_for(device: str | None) -> list | None:
    """ONNX Runtime execution providers for a torch-style ``device``: ``None`` = CUDA first when available,
    else CPU; ``"cpu"`` = CPU only; ``"cuda"`` / ``"cuda:N"`` = CUDA device N (CPU for the ops it lacks),
    which :class:`OrtRunner` then requires to be in use."""
    if device is None:
        return None
    d = str(device)
    if d == "cpu":
        return ["CPUExecutionProvider"]
    if d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()):
        return [("CUDAExecutionProvider", {"device_id": int(d[5:] or 0)}), "CPUExecutionProvider"]
    raise ConfigError(f"device {device!r} for ONNX Runtime; use cpu, cuda or cuda:N")


class OrtRunner(Runner):
    """ONNX Runtime session on ``onnx_path`` (plain export or ``model.qdq.onnx``).

    Args:
        onnx_path: the ``.onnx`` file (external data beside it is found automatically).
        providers: ORT providers (:func:`providers_for` maps a device); default CUDA first when available,
            else CPU. When CUDA is asked for first, a session that fell back to CPU (ORT does that
            silently: no onnxruntime-gpu, or its CUDA / cuDNN libraries did not load) raises
            BackendMissingError.
        threads: intra-op threads (None: ORT's default).
        probe_source: an ONNX with the exporter's scope metadata (the plain export) used to map
            probe names to tensor names when ``onnx_path`` lost that metadata (Q/DQ rewrite).

    Feeds are cast to the session's input dtypes (fp16 graphs take fp32 arrays);
    outputs are fp32 numpy (torch tensors when fed torch tensors).
    """

    def __init__(self, onnx_path, *, providers: Sequence[str] | None = None, threads: int | None = None,
                 probe_source=None, name: str | None = None):
        super().__init__()
        self.path = Path(onnx_path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path} does not exist; run the stage that writes it "
                                "(trt-sora export / quantize)")
        self.providers = providers
        self.threads = threads
        self.probe_source = Path(probe_source) if probe_source else None
        self.name = name or f"ort:{self.path.name}"
        self.session = None
        self._in_types: dict[str, str] = {}
        self._probe_sessions: dict[tuple, tuple] = {}

    def _make_session(self, path_or_bytes):
        from trt_sora.onnx_tools import ort_session

        return ort_session(path_or_bytes, providers=self.providers, threads=self.threads)

    def _activate_impl(self) -> None:
        from trt_sora.errors import require

        ort = require("onnxruntime", extra="ort", pip="pip install 'trt_sora[ort]' (CPU) or 'trt_sora[ort-gpu]' (CUDA)")
        del ort
        try:
            self.session = self._make_session(self.path)
        except Exception as exc:  # ORT raises its own pybind types (InvalidProtobuf, Fail, NoSuchFile, ...)
            msg = " ".join(str(exc).split())[:200]
            raise ArtifactError(f"ONNX Runtime cannot load {self.path} ({type(exc).__name__}: {msg}); the file is "
                                "corrupt or incomplete - re-run the stage that wrote it") from None
        self._require_cuda_if_asked()
        self._in_types = {i.name: _ORT_TO_NP.get(i.type, "float32") for i in self.session.get_inputs()}
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        log.debug("%s: providers %s", self.name, self.session.get_providers())

    def _require_cuda_if_asked(self) -> None:
        first = (self.providers or [None])[0]
        if (first[0] if isinstance(first, tuple) else first) != "CUDAExecutionProvider":
            return
        if "CUDAExecutionProvider" not in self.session.get_providers():
            import onnxruntime as ort

            self.session = None
            raise BackendMissingError(
                f"ONNX Runtime {ort.__version__} runs {self.path.name} on {ort.get_available_providers()} only, not "
                "CUDA: install the GPU build in place of the CPU one (pip uninstall onnxruntime; pip install "
                "'trt_sora[ort-gpu]') with the CUDA and cuDNN libraries it was built for, or use device='cpu'")

    def _deactivate_impl(self) -> None:
        self.session = None
        self._probe_sessions.clear()

    @property
    def providers_in_use(self) -> list[str]:
        return list(self.session.get_providers()) if self.session is not None else []

    def _feeds(self, feeds: Mapping[str, Any]) -> dict:
        return {n: to_numpy(feeds[n], self._in_types.get(n)) for n in self.input_names}

    def _wrap(self, names, arrays, as_torch: bool, device=None):
        out = {}
        for n, a in zip(names, arrays):
            a = a.astype("float32", copy=False) if a.dtype.kind == "f" else a
            if as_torch:
                import torch

                t = torch.from_numpy(a)
                out[n] = t.to(device) if device is not None else t
            else:
                out[n] = a
        return out

    def _infer_impl(self, feeds):
        first = feeds[self.input_names[0]]
        as_torch = is_torch(first)
        arrays = self.session.run(list(self.output_names), self._feeds(feeds))
        return self._wrap(self.output_names, arrays, as_torch, first.device if as_torch else None)

    # -- probes ------------------------------------------------------------------------------
    def _probe_session(self, probes: tuple[str, ...]):
        if probes in self._probe_sessions:
            return self._probe_sessions[probes]
        import onnx

        from trt_sora.onnx_tools import probe_tensors

        mapping = probe_tensors(self.path, probes)
        if self.probe_source is not None:
            for p, t in probe_tensors(self.probe_source, probes).items():
                mapping.setdefault(p, t)
        model = onnx.load(str(self.path), load_external_data=False)
        present = _ensure_outputs(model, list(dict.fromkeys(mapping.values())))
        mapping = {p: t for p, t in mapping.items() if t in present}
        has_external = any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
        if has_external:  # keep external data next to the temp model (symlinks, no copy)
            tmp = Path(tempfile.mkdtemp(prefix="trt_sora_probe_"))
            for f in self.path.parent.iterdir():
                if f.is_file() and f.suffix != ".onnx":
                    os.symlink(f.resolve(), tmp / f.name)
            onnx.save(model, str(tmp / self.path.name))
            sess = self._make_session(tmp / self.path.name)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            sess = self._make_session(model.SerializeToString())
        entry = (sess, mapping)
        self._probe_sessions[probes] = entry
        return entry

    def infer_probes(self, feeds, probes: Sequence[str]):
        """Run a copy of the graph with the probes' tensors as extra outputs."""
        self._check_active()
        sess, mapping = self._probe_session(tuple(probes))
        tensor_names = list(dict.fromkeys(mapping.values()))
        names = list(self.output_names) + tensor_names
        arrays = sess.run(names, self._feeds(feeds))
        by_name = dict(zip(names, arrays))
        out = self._wrap(self.output_names, arrays[:len(self.output_names)], False)
        return out, {p: by_name[t].astype("float32") for p, t in mapping.items()}
