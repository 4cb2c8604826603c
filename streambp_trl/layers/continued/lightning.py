"""MiniMax's lightning attention continued from the state a chunk receives.

transformers' ``MiniMaxLightningAttention`` runs a multi-token call block by block from a zero key-value state and
reads a cached state only in its token-by-token decoding loop (whose backward would keep a heads x d x d state for
every token). Its recurrence is linear in the state: per head, with decay rate ``s``, ``S_t = e^{-s} S_{t-1} + k_tᵀ
v_t`` and ``o_t = q_t S_t``, so from the state ``S_0`` a chunk receives

    o_t = o⁰_t + e^{-s (t+1)} q_t S_0,      S_L = S⁰_L + e^{-s L} S_0     (t = 0 .. L-1 within the chunk),

where ``o⁰`` and ``S⁰`` are the block path's results from zero. The chunk cache answers ``get_linear_cache`` with
``None`` (so the model takes its block path, whatever the chunk's length) and records the state the model leaves
(``set_linear_cache``); :func:`lightning_continued` hooks the module for one chunk call to add both terms: the
output's ahead of the module's output norm (its input is the heads' concatenated outputs), from the queries of the
activated projection (``act_fn``'s output, masked as the model masks padding), and the state's to the recorded one
once the module returns. Autograd reaches ``S_0`` through both: its gradient is the carry gradient the chunk hands
back.

Memory: the term holds the chunk's scaled queries and their product with ``S_0``, (batch x heads x chunk x d) each,
beside the layer's own activations.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from ..carry import ChunkCache
from ..traits import names_called

LINEAR_CACHE = "get_linear_cache"  # the lightning attention's cache read, which only its decoding loop continues


def lightning_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The lightning attention modules inside ``layer``: those that read ``get_linear_cache``."""
    return tuple(m for m in layer.modules() if LINEAR_CACHE in names_called(type(m)))


@contextlib.contextmanager
def lightning_continued(modules: tuple[nn.Module, ...], cache: ChunkCache) -> Iterator[None]:
    """Within the block, each module's output and recorded state take the share of the state entering the chunk
    (see the module docstring); the hooks are removed afterwards."""
    handles = []
    for m in modules:
        seen: dict = {}
        handles += [
            m.register_forward_pre_hook(functools.partial(_take_mask, seen), with_kwargs=True),
            m.act_fn.register_forward_hook(functools.partial(_take_projection, seen)),
            m.norm.register_forward_pre_hook(functools.partial(_add_output_share, m, cache, seen)),
            m.register_forward_hook(functools.partial(_add_state_share, m, cache, seen)),
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _take_mask(seen: dict, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Keep the module call's padding mask (batch, L), which the model applies to its projections."""
    seen["mask"] = kwargs.get("attention_mask")


def _take_projection(seen: dict, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    """Keep the activated projection (batch, L, heads x 3 d): the queries, keys and values."""
    seen["qkv"] = out


def _add_output_share(
    m: nn.Module, cache: ChunkCache, seen: dict, module: nn.Module, args: tuple
) -> tuple[torch.Tensor, ...] | None:
    """``o += e^{-s (t+1)} q_t S_0`` on the norm's input (batch, L, heads x d), computed outside autocast in the
    state's dtype (at least float32); keeps ``e^{-s L} S_0`` for the recorded state."""
    state = cache.get_recurrent_state(m.layer_idx)
    if state is None:
        return None
    (out,) = args
    qkv, mask = seen.pop("qkv"), seen.pop("mask")
    if mask is not None:  # the model zeroes the padded positions' projections
        qkv = (qkv * mask[:, :, None]).to(qkv.dtype)
    batch, length = out.shape[:2]
    heads, d = m.num_attention_heads, m.head_dim
    dtype = torch.promote_types(state.dtype, torch.float32)
    with torch.autocast(out.device.type, enabled=False):
        queries = qkv.view(batch, length, heads, 3 * d)[..., :d].transpose(1, 2).to(dtype)  # (batch, heads, L, d)
        slope = m.slope_rate.to(dtype)  # (heads, 1, 1)
        steps = torch.arange(1, length + 1, device=out.device, dtype=dtype)
        decay = torch.exp(-slope * steps[:, None])  # (heads, L, 1): e^{-s (t+1)}
        share = torch.matmul(queries * decay, state.to(dtype))  # (batch, heads, L, d)
        seen["state_share"] = torch.exp(-slope * length) * state.to(dtype)
    return (out + share.transpose(1, 2).reshape(batch, length, heads * d).to(out.dtype), *args[1:])


def _add_state_share(m: nn.Module, cache: ChunkCache, seen: dict, module: nn.Module, args: tuple, out: object) -> None:
    """Add ``e^{-s L} S_0`` to the state the module recorded through the cache."""
    share = seen.pop("state_share", None)
    if share is not None:
        recorded = cache.outgoing_state(m.layer_idx)
        cache.set_linear_cache(m.layer_idx, recorded + share.to(recorded.dtype))
