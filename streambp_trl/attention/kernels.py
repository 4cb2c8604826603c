"""Attention of one chunk of queries against its keys/values under a mask block, through PyTorch SDPA.

:func:`stream_attention` is the attention interface function of a streamed call. On the CPU it runs SDPA (with the
mask block, or :class:`~streambp_trl.attention.masks.LowerRight` for a plainly causal chunk). On CUDA the kernel is
chosen explicitly (cuDNN's form, flash, else memory-efficient; :func:`.cuda.cuda_attention`) and SDPA's math
kernel, which would hold a (chunk x prefix x heads) score tensor, is never used: where no fused kernel applies, a
``RuntimeError`` says why. Under autocast the inputs are first cast as autocast casts SDPA's
(:func:`_autocast_inputs`), so every kernel computes in the dtype the un-streamed model's SDPA call does. Attention
sinks are one extra key (:mod:`.sinks`). Attention dropout is applied by SDPA on each block; the stream decoder
replays the random state of every chunk, so a recompute draws the same dropout mask as the forward did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import cuda
from .causal_chunk import CPU_FLASH, CausalChunkAttention
from .grouped import PrefixGrad, PrefixPair
from .masks import LowerRight, StreamMask
from .sinks import attention_with_sinks
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
    eager and SDPA code does. ``position_bias`` (batch, heads, q_len, kv_len), a model's additive bias of the chunk's
    scores (Inkling 2's relative-position logits, with gradient), joins the block (:func:`_biased`). Holds at most one
    (q_len x kv_len) mask block (and the top-k's selection as one) and SDPA's own workspace.
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
    if kwargs.get("position_bias") is not None:
        block = _biased(block, kwargs["position_bias"], q_len, kv_len)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    query, key, value, prefix = _autocast_inputs(query, key, value, prefix)
    if kwargs.get("softcap") is not None:
        if sinks is not None or dropout or (block is not None and block.dtype != torch.bool):
            raise ValueError(
                f"StreamBP computes softcapped attention ({type(module).__name__}) without attention sinks, dropout "
                "or an additive mask; set attention_dropout=0.0 (and pass a boolean 4D mask, if any)."
            )
        return softcap_attention(query, key, value, block, scaling, kwargs["softcap"]), None
    attend = cuda.cuda_attention if query.device.type == "cuda" else _cpu_attention
    return attend(module, query, key, value, block, sinks, scaling, dropout, prefix), None


def _tensor_block(module: torch.nn.Module, mask: object, q_len: int, kv_len: int) -> torch.Tensor:
    """The mask of a layer handed its chunk's mask block as a tensor (a sparse indexed attention reads it in its own
    code, a dynamic mask attention adds a per-head bias with gradient to it: (batch, heads, q_len, kv_len);
    :func:`~streambp_trl.layers.hook.stream_checkpoint`), as it is: (batch, 1, q_len, width) for the chunk's
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


def _biased(block: torch.Tensor | None, bias: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """The mask block as one additive mask with the model's score bias ``bias`` (batch, heads, q_len, kv_len): the
    bias where the block attends, the bias dtype's lowest value elsewhere (an additive block is added to it); a
    plainly causal block (``None``) is bottom-right causal. The eager attention adds the bias and the mask to the
    scores alike. Holds one bias-sized tensor."""
    if block is None:
        block = torch.ones(q_len, kv_len, dtype=torch.bool, device=bias.device).tril(kv_len - q_len)
    if block.dtype == torch.bool:
        return bias.masked_fill(~block, torch.finfo(bias.dtype).min)
    return bias + block


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
        return attention_with_sinks(query, key, value, block, sinks, scaling, dropout)
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
