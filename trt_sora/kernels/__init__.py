"""GPU kernels of the ``torch-fp8`` backend (PyTorch + Triton), with pure-torch references.

* :mod:`trt_sora.kernels.reference` - the math of every kernel in plain torch (CPU or GPU); the
  oracle the GPU tests compare against and the CPU tests check scale math with.
* :mod:`trt_sora.kernels.triton_ops` - the Triton kernels (need CUDA and Triton):

  ==========================  ==========================================================================
  kernel                      replaces (what a TensorRT engine fuses around our Q/DQ placement)
  ==========================  ==========================================================================
  ``residual_norm_quant``     residual (+gate) add, LayerNorm, AdaLN modulation, FP8 quantize
  ``gelu_quant``              GELU(tanh) + FP8 quantize of the FFN hidden state
  ``qkv_rmsnorm_rope``        fused-QKV epilogue: split, RMSNorm across heads, 3-axis RoPE, per-block
                              FP8 quantization of Q, K statistics for smoothing, V channel amax
                              (the GPU implementation of ``plugins/fused_qkv_attention``)
  ``kv_smooth_quant``         K mean-subtraction + per-block FP8 K, per-channel FP8 V (transposed)
  ``attention_fp8``           flash attention with FP8 QK^T and PV on tensor cores, per-block Q/K
                              scales, output written token-major (optionally FP8 for ``to_out``)
  ``heads_to_tokens``         [B, H, S, D] -> [B, S, H*D] (+ FP8 quantize) for a BF16 attention output
  ==========================  ==========================================================================

Importing this package loads nothing heavy.
"""
