"""Chunk-local attention masks and attention, registered through transformers' own interfaces.

During a streamed call (the decoder's training forward, and each layer's recompute in backward; see
:func:`streaming`) the model's attention implementation is ``"streambp"``. The model-level mask functions
(``create_causal_mask``, ``create_sliding_window_causal_mask``, ...) then return a :class:`StreamMask`: a
description of the mask (the model's own index-based ``mask_function``, the 2D padding mask, the sliding window),
not a (T x T) tensor. The stream decoder calls each layer on one chunk of queries
``[q_start, q_start + q_len)`` against keys ``[kv_start, kv_start + kv_len)`` and hands the layer
``mask.at(q_start, kv_start)``; :func:`stream_attention` then builds at most the (q_len x kv_len) block with
``masking_utils.sdpa_mask``, or uses PyTorch's bottom-right-aligned causal kernel when the block is plainly
causal (no padding, packing or window). On CUDA the kernel is chosen explicitly (cuDNN, flash, else
memory-efficient) and SDPA's math kernel, which would hold a (chunk x prefix x heads) score tensor, is never used:
where no fused kernel applies, a ``RuntimeError`` says why.

* :mod:`.masks`: :class:`StreamMask` (the mask described, and its blocks) and the bottom-right causal bias;
* :mod:`.kernels`: :func:`stream_attention`, on the CPU; :mod:`.cuda`: on CUDA (fused kernels only);
  :mod:`.sinks`: attention sinks as one extra key;
* :mod:`.causal_chunk`: a plainly causal chunk as its prefix and its diagonal block, merged (the CPU's flash kernel,
  cuDNN's on CUDA);
* :mod:`.grouped`: grouped-query heads one group at a time, and :class:`PrefixGrad`;
* :mod:`.softcap`: attention with logit softcapping, tiled over the keys;
* :mod:`.interface`: the registration with transformers and the :func:`streaming` switch.

Outside streamed calls the config names the model's own implementation, so eval, generation and saved
checkpoints are unchanged.
"""

from .grouped import PrefixGrad
from .interface import IMPLEMENTATION, stream_configs, streaming
from .kernels import stream_attention
from .masks import StreamMask, stream_mask

__all__ = [
    "IMPLEMENTATION",
    "PrefixGrad",
    "StreamMask",
    "stream_attention",
    "stream_configs",
    "stream_mask",
    "streaming",
]
