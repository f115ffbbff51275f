"""GPU kernels of the ``torch-fp8`` backend (PyTorch + Triton), with pure-torch references.

* :mod:`trt_sora.kernels.reference` - the math of every kernel in plain torch (CPU or GPU); the
  oracle the GPU tests compare against and the CPU tests check scale math with.
* :mod:`trt_sora.kernels.triton_ops` - the Triton kernels (need CUDA and Triton):

  ==========================  ==========================================================================
  kernel                      replaces (what a TensorRT engine fuses around our Q/DQ placement)
  ==========================  ==========================================================================
  ``residual_norm_quant``     residual (+gate) add, LayerNorm, AdaLN modulation, FP8 quantize
  ``gelu_quant``              GELU(tanh) + FP8 quantize of the FFN hidden state
  ``rms_stats``               per-token 1/rms of Q and K over all heads (taken before a Ulysses
                              all-to-all, which leaves each rank only some heads)
  ``qkv_rmsnorm_rope``        fused-QKV epilogue: split, RMSNorm across heads, 3-axis RoPE, INT8
                              per-block Q; K minus its mean (smoothing) in INT8 per block; V in FP8
                              per channel, transposed, keys in the P V operand's order
                              (``reference.vt_key_order``) (the GPU implementation of
                              ``plugins/fused_qkv_attention``)
  ``attention_fp8``           flash attention with INT8 QK^T and FP8 PV on tensor cores, per-block
                              Q/K scales, output written token-major (optionally FP8 for ``to_out``)
  ``heads_to_tokens``         [B, H, S, D] -> [B, S, H*D] (+ FP8 quantize) for a BF16 attention output
  ``abs_scaled``              calibration: fp32 ``|x| * 2**-e`` in one pass, the input of the
                              ``|x|`` histogram (:func:`trt_sora.calibrate.histogram.batch_counts`)
  ==========================  ==========================================================================

* :mod:`trt_sora.kernels.gluon_attention` - ``attention_fp8`` on SM 9.x warp-specialized in Gluon: the same
  arithmetic and bits (a TMA producer warp, two consumer warpgroups with asynchronous products and
  ping-pong turns, FlashAttention-3's schedule); ``attention_fp8(..., ws=True)`` or ``triton_ops.ATTN_WS``
  picks it, ``triton_ops.attention_kernel`` says which one runs (the Triton kernel by default: faster
  since V^T is stored in the operand's key order).
* :mod:`trt_sora.kernels.cute_attention` - ``attention_fp8``'s operands on SM 9.0a in NVIDIA's CuTe DSL (the
  ``cute`` extra): TMA producer warp, two consumer warpgroups, the softmax of one key tile beside the products
  of the next and the previous, P packed to FP8 in registers; the ``int8-cute`` attention kernel of a recipe
  (dense heads of 128; the rest on the Triton kernel).
* :mod:`trt_sora.kernels.cuda_hist` - calibration's ``|x|`` histogram as one CUDA kernel compiled by
  NVRTC at run time (shared-memory atomics, which Triton lacks); the same bins as ``torch.histc``.

Importing this package loads nothing heavy.
"""
