"""8-bit self-attention through cuDNN's fused FP8 flash attention (SM >= 9.0), by its Python frontend.

The other 8-bit kernel of the ``torch-fp8`` backend (``AttentionPolicy(kernel="cudnn-fp8")``), beside
:func:`trt_sora.kernels.triton_ops.attention_fp8`. Its arithmetic is :func:`reference.sdpa_fp8` on the
operands of :func:`reference.sdpa_fp8_operands`: Q, K (smoothed), V in FP8 E4M3 with one scale per
tensor, P in FP8 at ``448``, the output in FP8 (Hopper's only output type), written token-major
[B, S, H*D] straight into ``to_out``'s input. FP8 Q K^T costs accuracy that INT8 per 128-token block
does not (benchmarks/README.md has the cosines): the Triton kernel stays the default.

One cuDNN graph per (device, shape), built on first use and cached; the frontend package is optional
(:func:`require` names the install command), the cuDNN library is torch's own.
"""
from __future__ import annotations

import math
import threading

import torch

from trt_sora.errors import BackendMissingError
from trt_sora.kernels import reference as ref
from trt_sora.sm import HOPPER_SM, device_sm

__all__ = ["PIP", "attention", "attention_fp8", "available", "require", "versions"]

PIP = "pip install nvidia-cudnn-frontend==1.14.0"
#: cuDNN backends whose FP8 SDPA the frontend accepts (>= 9.1.0, not 9.10.0).
MIN_BACKEND, BAD_BACKENDS = 90100, (91000,)
PAD = 128  #: tokens a padded graph rounds up to
_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_graphs: dict[tuple, _Graph] = {}
_handles: dict[int, object] = {}
_lock = threading.Lock()


def require():
    """The ``cudnn`` frontend module, loaded after torch's cuDNN (the frontend finds the library by its
    soname); :class:`BackendMissingError` naming the install command when it or a capable cuDNN is missing."""
    torch.backends.cudnn.version()  # loads torch's libcudnn into the process
    try:
        import cudnn
    except (ImportError, OSError) as exc:
        raise BackendMissingError(f"the cuDNN FP8 attention kernel needs the cuDNN Python frontend ({exc}); "
                                  f"install it with: {PIP}") from exc
    backend = cudnn.backend_version()
    if backend < MIN_BACKEND or backend in BAD_BACKENDS:
        raise BackendMissingError(f"the cuDNN FP8 attention kernel needs cuDNN >= 9.1 (not 9.10.0); this process "
                                  f"has {cudnn.backend_version_string()} - upgrade torch's nvidia-cudnn wheel, or "
                                  "use the default attention kernel ('int8')")
    return cudnn


def versions() -> dict:
    """Frontend and cuDNN versions as this process sees them (an ``error`` instead where the frontend fails)."""
    info = {"torch_cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        cudnn = require()
    except BackendMissingError as exc:
        return info | {"error": str(exc)}
    return info | {"frontend": cudnn.__version__, "backend": cudnn.backend_version_string()}


def available(device=None) -> bool:
    """Whether this process can run :func:`attention` on ``device`` (CUDA, SM >= 9.0, frontend, cuDNN)."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return False
    if (device_sm(device) or 0) < HOPPER_SM:
        return False
    try:
        require()
    except BackendMissingError:
        return False
    return True


class _Graph:
    """One built FP8 SDPA forward graph: Q, K, V [B, H, S, D] contiguous FP8, O FP8 token-major [B, S, H*D].

    ``pad``: the tokens padded to a multiple of 128 with a key/query padding mask (the fallback for a
    cuDNN whose FP8 kernel wants aligned sequence lengths); the caller copies into padded buffers."""

    def __init__(self, cudnn, handle, shape: tuple[int, int, int, int], device: torch.device, pad: bool):
        b, h, s, d = shape
        sp = -(-s // PAD) * PAD if pad else s
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        dims, stride = [b, h, sp, d], [h * sp * d, sp * d, d, 1]
        self.qkv = [g.tensor(name=n, dim=dims, stride=stride, data_type=e4m3) for n in ("q", "k", "v")]
        one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        self.scales = [g.tensor(name=n, **one) for n in _SCALES]
        kw, self.lens = {}, {}
        if pad:
            lens = [g.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
                    for n in ("seq_len_q", "seq_len_kv")]
            kw = dict(use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
            self.lens = dict.fromkeys(lens, torch.full((b, 1, 1, 1), s, device=device, dtype=torch.int32))
        o, _, amax_s, amax_o = g.sdpa_fp8(*self.qkv, *self.scales, is_inference=True, attn_scale=1.0 / math.sqrt(d),
                                          use_causal_mask=False, name="sdpa_fp8", **kw)
        o.set_output(True).set_dim(dims).set_stride([sp * h * d, d, h * d, 1]).set_data_type(e4m3)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.o, self.amax, self.padded_len = g, o, (amax_s, amax_o), sp
        self.workspace = torch.empty(max(1, g.get_workspace_size()), device=device, dtype=torch.uint8)
        self.amax_buf = torch.empty(2, 1, 1, 1, 1, device=device, dtype=torch.float32)
        self.s_scales = torch.tensor([1.0 / ref.FP8_MAX, ref.FP8_MAX], device=device).reshape(2, 1, 1, 1, 1)


def _graph(shape, device: torch.device) -> _Graph:
    """The cached graph of ``shape`` on ``device``: unpadded, else padded to 128 tokens (both failing:
    :class:`BackendMissingError` with the frontend's reasons and the versions)."""
    key = (device.index, tuple(shape))
    with _lock:
        g = _graphs.get(key)
        if g is None:
            cudnn = require()
            handle = _handles.get(device.index)
            if handle is None:
                with torch.cuda.device(device):
                    handle = _handles[device.index] = cudnn.create_handle()
            errors = []
            for pad in (False, True) if shape[2] % PAD else (False,):
                try:
                    with torch.cuda.device(device):
                        g = _graphs[key] = _Graph(cudnn, handle, shape, device, pad)
                    break
                except Exception as exc:  # the frontend's errors say what is unsupported
                    errors.append(f"{'padded' if pad else 'unpadded'}: {exc}")
            if g is None:
                raise BackendMissingError(f"cuDNN FP8 SDPA for [B, H, S, D] = {list(shape)} failed to build "
                                          f"({'; '.join(errors)}) with {versions()}; use the 'int8' kernel")
        return g


def _padded(x8: torch.Tensor, sp: int) -> torch.Tensor:
    """FP8 [B, H, S, D] -> [B, H, sp, D], zeros past S."""
    out = torch.zeros((*x8.shape[:2], sp, x8.shape[3]), device=x8.device, dtype=torch.uint8)
    out[:, :, :x8.shape[2]] = x8.view(torch.uint8)
    return out.view(x8.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_scale: torch.Tensor | None = None):
    """Softmax attention of bf16 ``q``/``k``/``v`` [B, H, S, D] on cuDNN's FP8 SDPA -> [B, S, H*D]
    token-major: FP8 at ``out_scale`` (fp32 0-d, ``to_out``'s input scale), else bf16 (FP8 at V's scale,
    dequantized). The same math as :func:`reference.sdpa_fp8` on :func:`reference.sdpa_fp8_operands`."""
    return attention_fp8(*ref.sdpa_fp8_operands(q, k, v), out_scale=out_scale)


def attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, out_scale=None) -> torch.Tensor:
    """:func:`attention` on ready operands (:func:`reference.sdpa_fp8_operands`: FP8 [B, H, S, D]
    contiguous, descales [1, 1, 1, 1] fp32)."""
    q8, k8, v8 = (x.contiguous() for x in (q8, k8, v8))
    b, h, s, d = q8.shape
    g = _graph(q8.shape, q8.device)
    sp = g.padded_len
    if sp != s:
        q8, k8, v8 = (_padded(x, sp) for x in (q8, k8, v8))
    so = (v_descale if out_scale is None else out_scale.reshape(1, 1, 1, 1).float()).reciprocal()
    out = torch.empty((b, sp, h * d), device=q8.device, dtype=ref.FP8)
    cudnn = require()
    handle = _handles[q8.device.index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    scales = (q_descale, k_descale, v_descale, g.s_scales[0], g.s_scales[1], so)
    pack = dict(zip(g.qkv, (q8, k8, v8))) | dict(zip(g.scales, scales)) | g.lens
    pack |= {g.o: out, g.amax[0]: g.amax_buf[0], g.amax[1]: g.amax_buf[1]}
    g.graph.execute(pack, g.workspace, handle=handle)
    if sp != s:
        out = out.view(torch.uint8)[:, :s].contiguous().view(ref.FP8)
    return out if out_scale is not None else (out.float() * v_descale.reshape(())).to(torch.bfloat16)
