"""Model weights one tensor at a time: safetensors I/O without mmap, checkpoint and random-init sources,
streamed loading, and the random-checkpoint writer. Used by export (weightless tracing, weights streamed
into ONNX external data) and by anything that must not hold a whole model in memory.

* :mod:`~trt_sora.weights.safetensors_io` - read / write one tensor at a time.
* :mod:`~trt_sora.weights.sources` - ``WeightSource`` (checkpoint, random init, state dict),
  ``materialize``, ``streamed``.
* :mod:`~trt_sora.weights.random_init` - per-parameter deterministic random weights.
* :mod:`~trt_sora.weights.checkpoint` - write a random-init checkpoint of a named architecture.
"""

#: Part of a random-init model's identity (its model hash): bumped when the random weights of a named config change.
RANDOM_INIT_VERSION = "per-parameter-v1"
