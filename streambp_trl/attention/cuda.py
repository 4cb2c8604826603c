"""Attention of a chunk on CUDA tensors: an explicitly chosen fused SDPA kernel (cuDNN's form, flash,
memory-efficient), never SDPA's math kernel, which would hold a (chunk x prefix x heads) score tensor; where no fused
kernel applies, a ``RuntimeError`` says why. The CUDA half of :func:`~.kernels.stream_attention`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .causal_chunk import CUDNN, CausalChunkAttention, cudnn_usable
from .grouped import PrefixPair, _GroupedHeads
from .masks import LowerRight
from .sinks import sink_inputs

# CUDA: fused kernels only. The math kernel would materialise a (batch, heads, q_len, kv_len) score tensor (and its
# softmax, and their gradients): at a chunk of 4096 after a prefix of 128k, 32 heads, bf16, that is 32 GiB.

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_MASK_ALIGN = 16  # the memory-efficient kernel wants each mask row to start 16-element aligned (else torch pads)
_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
# cuDNN builds an execution plan per (queries, keys) shape (on an H200 the first 16k step after a 2k warm-up took
# 0.6 to 1.7 s more than the next, with 8 new plans); so its calls run on chunk lengths rounded up to a multiple of
# this (:class:`~.causal_chunk.CausalChunkAttention`'s ``align``), and only after a prefix that is one: full chunks
# of the usual sizes have prefixes that are multiples of the chunk, so over a training run of varying lengths the
# shapes stay few. A chunk after another prefix (a chunk size no multiple of it) takes flash, which needs no plan.
CUDNN_ALIGN = 256


def cuda_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    prefix: PrefixPair | None = None,
) -> torch.Tensor:
    """:func:`stream_attention` on CUDA tensors, through an explicitly chosen fused SDPA kernel, never math.

    * cuDNN attention (float16/bfloat16, no mask block or dropout, head_dim <= 128, equal q/k/v head dims, a prefix
      length that is a multiple of :data:`CUDNN_ALIGN`, a GPU of compute capability 9.0+ where its check passes):
      the plain chunk as its prefix and its diagonal block, merged
      (:class:`~.causal_chunk.CausalChunkAttention`); about twice flash's speed on Hopper GPUs;
    * flash attention (float16/bfloat16, no mask block, head_dim <= 256, equal q/k/v head dims): the plain chunk is
      bottom-right causal (:class:`LowerRight`), which flash computes natively;
    * memory-efficient attention otherwise (float32; padding, packing, sliding window, user masks, passed as one
      additive mask; attention sinks), or when flash is not available on the GPU.

    Grouped-query heads run a few key/value heads at a time (:class:`_GroupedHeads`): flash's backward expands
    dK/dV to the query heads in a (batch, kv_len, heads, head_dim) workspace, the memory-efficient kernel needs equal
    head counts; per group that is one key/value head's query heads (expanded as a view), not all of them. cuDNN
    takes grouped heads natively and its backward joins the prefix's and the chunk's key/value gradients, so it runs
    :func:`cudnn_kv_heads` key/value heads per call: about the bytes of flash's one-head workspace. A per-head or
    differentiable mask block (a dynamic mask attention's bias) runs all heads in one memory-efficient call, so the
    bias gets its gradient: grouped keys/values are then copied to the query heads, (batch, heads, kv_len, d) each.
    Raises ``RuntimeError`` naming the model, dtype and head dimension when no fused kernel applies.
    """
    if sinks is not None:  # the sink is an extra key with its own mask column: memory-efficient, equal heads
        q, k, v, mask, scale = sink_inputs(query, key, value, block, sinks, scaling)
        mask = _additive_mask(mask, q.dtype)
        tried = []
        if q.dtype in _FUSED_DTYPES:
            try:
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
                return out.transpose(1, 2).contiguous()
            except RuntimeError as e:
                if not _no_kernel(e):
                    raise
                tried.append(f"efficient: {_first_line(e)}")
        raise RuntimeError(_no_kernel_message(module, query, value, "attention sinks (a mask block)", dropout, tried))
    kernels = []
    plain = block is None and not dropout and value.shape[-1] == query.shape[-1]
    aligned = (key.shape[2] - query.shape[2]) % CUDNN_ALIGN == 0
    if plain and aligned and cudnn_usable(query.device, query.dtype, query.shape[-1]):
        kernels.append("cudnn")
    if (
        query.dtype in _FLASH_DTYPES
        and block is None
        and query.shape[-1] <= _FLASH_MAX_HEAD_DIM
        and value.shape[-1] == query.shape[-1]
    ):
        kernels.append("flash")
    if query.dtype in _FUSED_DTYPES:
        kernels.append("efficient")
    tried = []
    for kernel in kernels:  # flash falls back to efficient only where the GPU or build has no flash kernel
        try:
            out = _fused_attention(kernel, query, key, value, block, scaling, dropout, prefix)
        except RuntimeError as e:
            if not _no_kernel(e):
                raise
            tried.append(f"{kernel}: {_first_line(e)}")
            continue
        return out.transpose(1, 2).contiguous()
    what = "causal" if block is None else "a mask block (padding, packing, sliding window or a user mask)"
    raise RuntimeError(_no_kernel_message(module, query, value, what, dropout, tried))


def _fused_attention(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    scale: float | None,
    dropout: float,
    prefix: PrefixPair | None,
) -> torch.Tensor:
    """(batch, heads, q_len, d_v) attention through ``kernel`` (``"cudnn"``, ``"flash"`` or ``"efficient"``) only;
    ``prefix``: the :class:`PrefixGrad` pair of a recompute's joined keys/values."""
    q_len, kv_len = query.shape[2], key.shape[2]
    per_call = 1
    if kernel == "cudnn":
        per_call = cudnn_kv_heads(key.shape[1], query.shape[1] // key.shape[1])

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return CausalChunkAttention.apply(q, k, v, scale, CUDNN, CUDNN_ALIGN)

    elif kernel == "flash":

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=LowerRight(q_len, kv_len),
                dropout_p=dropout,
                scale=scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )

    else:
        mask = LowerRight(q_len, kv_len) if block is None else _additive_mask(block, query.dtype)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if k.shape[1] == 1:  # one key/value head against its query heads: a stride-0 view, no copy
                k, v = k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
            elif k.shape[1] != q.shape[1]:  # all grouped heads in one call (a per-head mask): copies
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)

    with sdpa_kernel([_BACKENDS[kernel]]) if kernel in _BACKENDS else contextlib.nullcontext():
        if key.shape[1] == query.shape[1] and kernel != "cudnn":  # multi-head: one group per head
            return attend(query, key, value)
        if block is not None and (block.requires_grad or block.shape[1] > 1):
            # a per-head or differentiable mask (a dynamic mask attention's bias) goes with all heads in one call:
            # per group, its heads would not match and its gradient would not leave the group's graph
            return attend(query, key, value)
        if prefix is not None:  # a recompute: the prefix's key/value gradient goes straight into the layer's sums
            return _GroupedHeads.apply(query, prefix[0].chunk, prefix[1].chunk, attend, prefix, per_call)
        if key.shape[1] == per_call:  # one group
            return attend(query, key, value)
        return _GroupedHeads.apply(query, key, value, attend, None, per_call)


def cudnn_kv_heads(kv_heads: int, group: int) -> int:
    """Key/value heads per cuDNN call: the largest divisor of ``kv_heads`` not above ``group // 2`` (at least 1; half
    the heads with equal counts), so a call's joined key/value gradients (two per head: the parts and their join) take
    about the bytes of flash's backward workspace for one key/value head (``group`` expanded heads)."""
    limit = max(1, group // 2) if group > 1 else max(1, kv_heads // 2)
    return max(m for m in range(1, kv_heads + 1) if kv_heads % m == 0 and m <= limit)


def _additive_mask(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean (True = attend) or additive mask block as one additive mask in ``dtype`` (what SDPA converts a
    boolean mask to), with 16-element aligned rows, so every kernel call (and each head group) shares it."""
    *lead, kv_len = block.shape
    mask = torch.zeros(*lead, -(-kv_len // _MASK_ALIGN) * _MASK_ALIGN, dtype=dtype, device=block.device)[..., :kv_len]
    if block.dtype == torch.bool:
        return mask.masked_fill_(block.logical_not(), float("-inf"))
    return mask.copy_(block)


def _no_kernel(error: RuntimeError) -> bool:
    return "No available kernel" in str(error)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _no_kernel_message(
    module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor, what: str, dropout: float, tried: list[str]
) -> str:
    config = getattr(module, "config", None)
    model = getattr(config, "model_type", None) or "this model"
    head_dim = query.shape[-1]
    return (
        f"StreamBP found no fused CUDA attention kernel for {model} ({type(module).__name__}): dtype "
        f"{str(query.dtype).removeprefix('torch.')}, head_dim {head_dim} (value head_dim {value.shape[-1]}), "
        f"{query.shape[1]} query heads, {what}, dropout {dropout}"
        + (f"; tried {'; '.join(tried)}" if tried else "")
        + ". StreamBP does not fall back to SDPA's math kernel, which would hold a (chunk x prefix x heads) score "
        "tensor. Flash attention needs float16/bfloat16, head_dim <= 256 (equal for values) and an sm80+ GPU; "
        "memory-efficient attention needs float16, bfloat16 or float32. Load the model in bfloat16 "
        "(dtype=torch.bfloat16, or bf16=True in the trainer config) or float32, on a GPU and torch build with these "
        "kernels."
    )
