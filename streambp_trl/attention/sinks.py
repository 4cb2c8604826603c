"""Attention sinks: a learned logit per head (or per query) that enters each query's softmax and carries no value,
as one extra key.

The sink is one extra key: queries get a constant 1 and keys a 0 in extra dimensions, the sink key holds
``sink / scale`` there and its value is zero, so its score is exactly the sink logit and the softmax over
[scores, sink] is the model's. Used by both paths of :func:`~.kernels.stream_attention` (the CPU's SDPA, CUDA's
memory-efficient kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SINK_PAD = 8  # extra query/key dimensions, so the head dimension stays a multiple of 8 for the fused kernels


def attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention whose softmax also runs over one learned logit per head, or per query (Inkling 2's, a projection of
    each token), an attention sink that carries no value.

    The sink is one extra key: queries get a constant 1 and keys a 0 in an extra dimension, the sink key holds
    ``sink / scale`` there and its value is zero, so its score is exactly the sink logit and the softmax over
    [scores, sink] is the model's (a per-query sink sits in the query's extra dimension instead, against a 1 in the
    sink key). Keys and values are expanded to the query heads (one sink per query head). Holds the expanded
    (batch, heads, kv_len + 1, head_dim + 8) keys and a (q_len x kv_len + 1) mask (boolean, or additive as given).
    """
    query, key, value, mask, scale = sink_inputs(query, key, value, block, sinks, scaling)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).contiguous()


def sink_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Query, keys, values and boolean mask of :func:`attention_with_sinks` (the sink as one extra key), and the
    scale."""
    b, heads, q_len, d = query.shape
    kv_len = key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pad = query.new_zeros(b, heads, q_len, _SINK_PAD)
    sink_key = query.new_zeros(b, heads, 1, d + _SINK_PAD)
    if sinks.dim() == 1:  # one per head: in the sink key, against a constant 1 in every query
        pad[..., 0] = 1
        sink_key[..., d] = (sinks.to(query.dtype) / scale).view(1, heads, 1).expand(b, heads, 1)
    else:  # one per query (batch, heads, q_len, 1): in the queries, against a constant 1 in the sink key
        pad[..., 0] = sinks.to(query.dtype).reshape(b, heads, q_len) / scale
        sink_key[..., d] = 1
    query = torch.cat([query, pad], dim=-1)
    key = torch.cat([torch.cat([key, key.new_zeros(b, heads, kv_len, _SINK_PAD)], dim=-1), sink_key], dim=2)
    value = torch.cat([value, value.new_zeros(b, heads, 1, value.shape[-1])], dim=2)
    if block is None:  # bottom-right causal
        block = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        block = block.view(1, 1, q_len, kv_len)
    block = block.expand(b, block.shape[1], q_len, kv_len)
    sink_column = block.new_ones if block.dtype == torch.bool else block.new_zeros  # the sink is always attended
    mask = torch.cat([block, sink_column(*block.shape[:3], 1)], dim=-1)
    return query, key, value, mask, scale
