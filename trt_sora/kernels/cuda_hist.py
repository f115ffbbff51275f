"""Calibration's ``|x|`` histogram as one CUDA kernel, compiled at run time by NVRTC (``torch.cuda._compile_kernel``).

:func:`abs_histogram` counts ``floor(|x| * scale * num_bins)`` for every element of ``x`` (fp32, bf16 or fp16,
read in its own dtype) into int64 ``[num_bins]`` counts: the same bins as ``torch.histc(|x| * scale, num_bins,
0, 1)`` (``scale`` a power of two, so both products are exact; values at or past the range, and NaN, are
skipped as ``histc`` skips them), in one pass and without the fp32 copy of ``|x|`` that ``histc`` needs.

Why a CUDA kernel and not Triton: Triton has no shared-memory atomics; ``tl.histogram`` costs about
``num_bins / 32`` instructions per element (benchmarks/hist_bench.py). Here every block keeps ``COPIES``
int32 sub-histograms in shared memory (warp ``w`` counts into copy ``w % COPIES``), adds one per element
with a shared-memory atomic, and adds its bins into the global int64 counts once.

It beats the Triton pass + ``histc`` whether the data is crowded in the low bins (an outlier), spread,
or all in one bin (zero padding); grouping a warp's equal bins (``__match_any_sync``) and run-length
counting per thread were slower (benchmarks/README.md has the timings).
NVRTC and ``torch.cuda._compile_kernel`` come with torch's CUDA wheels (torch >= 2.8);
where either is missing :func:`available` is False and the caller keeps the Triton + ``histc`` path.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("trt_sora")

__all__ = ["abs_histogram", "available", "max_bins", "supports"]

#: Sub-histograms per block: 2 is the setting whose calibration forwards were benchmarked
#: (benchmarks/README.md; benchmarks/hist_bench.py compares 1, 2 and 4).
DEFAULT_COPIES = 2
THREADS = 256
#: Shared memory a block may use without opting in (48 KB): ``COPIES * num_bins * 4`` bytes.
SMEM_LIMIT = 48 * 1024
#: Elements per launch: ``n`` is a C int in the kernel.
MAX_ELEMENTS = 1 << 30
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_SOURCE = r"""
// KIND 0 fp32 (4 per 16-byte load), 1 bf16 (8), 2 fp16 (8); NB bins; COPIES sub-histograms per block;
// THREADS per block (the launch's).
#define VEC (KIND == 0 ? 4 : 8)

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float elem(unsigned int w, int hi) {  // element `hi` (0/1) of a 32-bit word
#if KIND == 1
    return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16));
#else
    return half_to_float((unsigned short)(hi ? (w >> 16) : (w & 0xffffu)));
#endif
}

__device__ __forceinline__ int bin_of(float v, float scale) {
    float u = fabsf(v) * scale;          // exact: scale is a power of two
    float b = u * (float)NB;             // exact: NB is a power of two
    return b < (float)NB ? (int)b : -1;  // -1: past the range or NaN (histc skips them too)
}

__device__ __forceinline__ void unpack(uint4 q, float* f) {
#if KIND == 0
    f[0] = __uint_as_float(q.x); f[1] = __uint_as_float(q.y); f[2] = __uint_as_float(q.z); f[3] = __uint_as_float(q.w);
#else
    unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { f[2 * j] = elem(w[j], 0); f[2 * j + 1] = elem(w[j], 1); }
#endif
}

__device__ __forceinline__ float load_one(const void* x, long long i) {
#if KIND == 0
    return ((const float*)x)[i];
#elif KIND == 1
    return __uint_as_float(((unsigned int)((const unsigned short*)x)[i]) << 16);
#else
    return half_to_float(((const unsigned short*)x)[i]);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS) abs_hist(const void* __restrict__ x,
        const float* __restrict__ scale_ptr, unsigned long long* __restrict__ out, int n) {
    extern __shared__ unsigned int sh[];
    for (int i = threadIdx.x; i < COPIES * NB; i += blockDim.x) sh[i] = 0u;
    __syncthreads();
    const float scale = *scale_ptr;
    unsigned int* h = sh + ((threadIdx.x >> 5) % COPIES) * NB;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long nvec = n / VEC;
    const uint4* xv = (const uint4*)x;
    for (long long v = first; v < nvec; v += stride) {
        float f[VEC];
        unpack(__ldg(xv + v), f);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            int b = bin_of(f[j], scale);
            if (b >= 0) atomicAdd(h + b, 1u);
        }
    }
    for (long long i = nvec * VEC + first; i < n; i += stride) {  // the last n % VEC elements
        int b = bin_of(load_one(x, i), scale);
        if (b >= 0) atomicAdd(h + b, 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < NB; b += blockDim.x) {
        unsigned int c = 0u;
#pragma unroll
        for (int k = 0; k < COPIES; k++) c += sh[k * NB + b];
        if (c) atomicAdd(out + b, (unsigned long long)c);
    }
}
"""


def max_bins(copies: int = DEFAULT_COPIES) -> int:
    """Most bins the kernel counts with ``copies`` sub-histograms (below 48 KB of shared memory: no opt-in)."""
    return (SMEM_LIMIT - 1) // (4 * copies)


@functools.cache
def _kernel(kind: int, num_bins: int, copies: int, device_index: int):
    from torch.cuda import _compile_kernel
    from torch.utils import cpp_extension

    opts = [f"-DKIND={kind}", f"-DNB={num_bins}", f"-DCOPIES={copies}", f"-DTHREADS={THREADS}"]
    # torch adds CUDA_HOME/include to NVRTC's include path and raises where no toolkit is installed (a
    # wheel-only machine). The kernel includes no header: point it at torch's own folder meanwhile.
    home = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = home or str(Path(torch.__file__).parent)
    try:
        with torch.cuda.device(device_index):
            return _compile_kernel(_SOURCE, "abs_hist", nvcc_options=opts)
    finally:
        cpp_extension.CUDA_HOME = home


@functools.cache
def _blocks_per_device(device_index: int) -> int:
    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def available() -> bool:
    """True where CUDA, NVRTC and ``torch.cuda._compile_kernel`` work (one probe compile, cached)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    try:
        _kernel(1, 16, DEFAULT_COPIES, torch.cuda.current_device())
    except Exception as err:  # noqa: BLE001 - any NVRTC/driver failure means: keep the Triton + histc path
        log.info("NVRTC histogram kernel unavailable (%s); calibration histograms use Triton + torch.histc", err)
        return False
    return True


def supports(x: torch.Tensor, num_bins: int, copies: int = DEFAULT_COPIES) -> bool:
    """Whether :func:`abs_histogram` takes ``x`` with ``num_bins`` (CUDA, fp32/bf16/fp16, bins in shared memory)."""
    return x.is_cuda and x.dtype in _KINDS and num_bins <= max_bins(copies) and available()


def abs_histogram(x: torch.Tensor, scale: torch.Tensor, num_bins: int, *, copies: int = DEFAULT_COPIES) -> torch.Tensor:
    """int64 ``[num_bins]`` counts of ``floor(|x| * scale * num_bins)`` over ``[0, num_bins)``.

    Args:
        x: CUDA tensor, fp32 / bf16 / fp16, any shape (flattened; a non-contiguous one is copied).
        scale: fp32 0-d CUDA tensor, a power of two (read on the device: no host sync).
        num_bins: a power of two, at most :func:`max_bins` (``copies``).
        copies: int32 sub-histograms per block (module docstring).
    """
    x = x.reshape(-1)
    out = torch.zeros(num_bins, dtype=torch.int64, device=x.device)
    if x.data_ptr() % 16:  # the kernel reads 16-byte vectors
        x = x.clone()
    dev = x.device.index or 0
    kernel = _kernel(_KINDS[x.dtype], num_bins, copies, dev)
    for start in range(0, x.numel(), MAX_ELEMENTS):
        part = x[start:start + MAX_ELEMENTS]  # a multiple of 8 elements: every part stays 16-byte aligned
        blocks = max(1, min(_blocks_per_device(dev), -(-part.numel() // (THREADS * 8))))
        kernel(grid=(blocks, 1, 1), block=(THREADS, 1, 1), args=[part, scale, out, part.numel()],
               shared_mem=4 * copies * num_bins)
    return out
