"""Attention of one chunk of queries against its keys/values under a mask block, through PyTorch SDPA.

:func:`stream_attention` is the attention interface function of a streamed call. On the CPU it runs SDPA (with the
mask block, or :class:`~streambp_trl.attention.masks.LowerRight` for a plainly causal chunk). On CUDA the kernel is
chosen explicitly (flash, else memory-efficient; see :func:`_cuda_attention`) and SDPA's math kernel, which would
hold a (chunk x prefix x heads) score tensor, is never used: where no fused kernel applies, a ``RuntimeError`` says
why. Under autocast the inputs are first cast as autocast casts SDPA's (:func:`_autocast_inputs`), so every kernel
computes in the dtype the un-streamed model's SDPA call does. Attention sinks are one extra key
(:func:`_sink_inputs`). Attention dropout is applied by SDPA on each block; the stream decoder replays the random
state of every chunk, so a recompute draws the same dropout mask as the forward did.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .causal_chunk import CPU_FLASH, CUDNN, CausalChunkAttention, cudnn_usable
from .grouped import PrefixGrad, PrefixPair, _GroupedHeads
from .masks import LowerRight, StreamMask
from .softcap import softcap_attention


def stream_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: StreamMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention interface function.

    Exact attention of ``query`` (batch, heads, q_len, d) over ``key``/``value`` (batch, kv_heads, kv_len, d) under
    the mask block, through PyTorch SDPA. The mask is a :class:`StreamMask`, or the dense block of a layer that reads
    its mask as a tensor (a sparse indexed attention: see :func:`_tensor_block`); ``indices`` (batch, q_len, top-k),
    the keys a sparse indexed attention chose for each query, keep only those keys of the block, as the model's own
    eager and SDPA code does. Holds at most one (q_len x kv_len) mask block (and the top-k's selection as one) and
    SDPA's own workspace.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    indices = kwargs.get("indices")
    if isinstance(attention_mask, StreamMask):
        prefix = PrefixGrad.of(attention_mask, key, value)
        block = attention_mask.block(q_len, kv_len, query.device)
        if block is None and indices is not None:
            block = attention_mask.materialise(q_len, kv_len, query.device)
    else:
        prefix, block = None, _tensor_block(module, attention_mask, q_len, kv_len)
    if indices is not None:
        block = _selected(block, indices)
    if block is not None:
        block = block[..., :kv_len]
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    query, key, value, prefix = _autocast_inputs(query, key, value, prefix)
    if kwargs.get("softcap") is not None:
        if sinks is not None or dropout or (block is not None and block.dtype != torch.bool):
            raise ValueError(
                f"StreamBP computes softcapped attention ({type(module).__name__}) without attention sinks, dropout "
                "or an additive mask; set attention_dropout=0.0 (and pass a boolean 4D mask, if any)."
            )
        return softcap_attention(query, key, value, block, scaling, kwargs["softcap"]), None
    attend = _cuda_attention if query.device.type == "cuda" else _cpu_attention
    return attend(module, query, key, value, block, sinks, scaling, dropout, prefix), None


def _tensor_block(module: torch.nn.Module, mask: object, q_len: int, kv_len: int) -> torch.Tensor:
    """The mask of a layer handed its chunk's mask block as a tensor (a sparse indexed attention reads it in its own
    code; :func:`~streambp_trl.layers.hook.stream_checkpoint`), as it is: (batch, 1, q_len, width) for the chunk's
    queries against keys from the chunk's first key position on, width >= kv_len (it reaches to the sequence's end,
    where the indexer scores every position). The keys past the ``kv_len`` attended ones must all be masked (bool
    False, or an additive mask's lowest value), as the later positions of a causal mask are; any other tensor is
    refused. On CUDA the check is a device-side assertion, so the chunk loop waits on no host sync: a failure (a
    model whose own code unmasks later positions) surfaces at the next synchronisation as a device-side assert,
    which leaves the CUDA context unusable; elsewhere it raises at once."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2] != q_len or mask.shape[-1] < kv_len:
        what = f"of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise RuntimeError(
            f"StreamBP attention in {type(module).__name__} got a mask {what} for {q_len} queries against {kv_len} "
            "keys instead of a StreamMask or the chunk's mask block: the model built its attention mask outside "
            "transformers' mask interface."
        )
    later = mask[..., kv_len:]
    attended = (later if later.dtype == torch.bool else later > torch.finfo(later.dtype).min).any()
    message = (
        f"StreamBP attention in {type(module).__name__} got a mask that lets queries attend to later positions than "
        "the chunk's keys (a mask that is not causal), which a chunk cannot attend to."
    )
    if mask.device.type == "cuda":
        torch._assert_async(~attended, message)
    elif attended:
        raise RuntimeError(message)
    return mask


def _selected(block: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``block`` (batch, 1, q_len, width) keeping only the keys in ``indices`` (batch, q_len, top-k; positions
    counted from the block's first key): what the model's own eager and SDPA code attends to, ``mask & selected``
    (bool) or the mask with its dtype's lowest value at the others (additive). Holds a (batch, q_len, width) bool
    selection."""
    width = block.shape[-1]
    # an index past the block is a later position than the chunk's keys (a shared indexer reuses the previous
    # layer's top-k, chosen over the whole row): causally masked in the full forward, so it lands in a dropped column
    selected = indices.new_zeros(*indices.shape[:-1], width + 1, dtype=torch.bool)
    selected = selected.scatter_(-1, indices.long().clamp(max=width), True)[..., :width].unsqueeze(1)
    if block.dtype == torch.bool:
        return block & selected
    return block.masked_fill(~selected, torch.finfo(block.dtype).min)


def _autocast_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: PrefixPair | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefixPair | None]:
    """``query``, ``key``, ``value`` cast as autocast casts SDPA's inputs (each floating one but float64, to the
    autocast dtype), else as they are. The un-streamed model's SDPA call computes in that dtype; the stream kernels
    reach SDPA's kernels past autocast (the causal bias dispatches in Python, the CUDA path picks its kernel by
    dtype). Under autocast on float32 weights, RoPE and q/k norms leave queries and keys float32, values bfloat16.
    The joined keys/values' :class:`PrefixGrad` pair goes with the cast: each chunk is cast in the graph, each sum
    is kept. Holds the keys/values in the autocast dtype, as autocast does."""
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value, prefix
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if not t.is_floating_point() or t.dtype in (dtype, torch.float64) else t.to(dtype)

    key, value = cast(key), cast(value)
    if prefix is not None:
        prefix = tuple(PrefixGrad(full, cast(p.chunk), p.acc) for full, p in zip((key, value), prefix, strict=True))
    return cast(query), key, value, prefix


def _cpu_attention(
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
    """:func:`stream_attention` on the CPU: SDPA with the mask block; a plainly causal chunk as its prefix and its
    diagonal block, two unmasked flash calls merged (:class:`.causal_chunk.CausalChunkAttention`), or with dropout
    bottom-right causal (:class:`LowerRight`); attention sinks as one extra key. ``prefix`` is not used: on the CPU the
    prefix's key/value gradient goes back through the join, by autograd."""
    if sinks is not None:
        return _attention_with_sinks(query, key, value, block, sinks, scaling, dropout)
    if block is not None:
        return sdpa_attention_forward(
            module, query, key, value, block, scaling=scaling, dropout=dropout, is_causal=False
        )[0]
    if not dropout:
        return CausalChunkAttention.apply(query, key, value, scaling, CPU_FLASH).transpose(1, 2).contiguous()
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=LowerRight(query.shape[2], key.shape[2]),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous()


_SINK_PAD = 8  # extra query/key dimensions, so the head dimension stays a multiple of 8 for the fused kernels


def _attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention whose softmax also runs over one learned logit per head (an attention sink) that carries no value.

    The sink is one extra key: queries get a constant 1 and keys a 0 in an extra dimension, the sink key holds
    ``sink / scale`` there and its value is zero, so its score is exactly the sink logit and the softmax over
    [scores, sink] is the model's. Keys and values are expanded to the query heads (one sink per query head).
    Holds the expanded (batch, heads, kv_len + 1, head_dim + 8) keys and a (q_len x kv_len + 1) boolean mask.
    """
    query, key, value, mask, scale = _sink_inputs(query, key, value, block, sinks, scaling)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).contiguous()


def _sink_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Query, keys, values and boolean mask of :func:`_attention_with_sinks` (the sink as one extra key), and the
    scale."""
    b, heads, q_len, d = query.shape
    kv_len = key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pad = query.new_zeros(b, heads, q_len, _SINK_PAD)
    pad[..., 0] = 1
    query = torch.cat([query, pad], dim=-1)
    sink_key = query.new_zeros(b, heads, 1, d + _SINK_PAD)
    sink_key[..., d] = (sinks.to(query.dtype) / scale).view(1, heads, 1).expand(b, heads, 1)
    key = torch.cat([torch.cat([key, key.new_zeros(b, heads, kv_len, _SINK_PAD)], dim=-1), sink_key], dim=2)
    value = torch.cat([value, value.new_zeros(b, heads, 1, value.shape[-1])], dim=2)
    if block is None:  # bottom-right causal
        block = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        block = block.view(1, 1, q_len, kv_len)
    block = block.expand(b, 1, q_len, kv_len)
    mask = torch.cat([block, block.new_ones(b, 1, q_len, 1)], dim=-1)
    return query, key, value, mask, scale


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


def _cuda_attention(
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
        q, k, v, mask, scale = _sink_inputs(query, key, value, block, sinks, scaling)
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
