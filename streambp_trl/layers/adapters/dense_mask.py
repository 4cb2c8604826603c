"""Code that reads the attention mask as a tensor (a sparse indexed attention's indexer, Doge's dynamic mask
attention, DeepSeek-V4's compressed attention: :func:`~..traits.reads_mask_as_tensor`): each chunk gets its mask
block as one, never a T x T mask."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from ...attention import StreamMask
from ..dynamic_mask import dynamic_mask_modules, full_rows
from ..layer_args import cache_argument
from ..traits import reads_mask_as_tensor
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class DenseMask(LayerAdapter):
    """A layer whose code reads the mask as a tensor; ``dynamic``: its modules that rank their dynamic mask's keys
    themselves (:mod:`..dynamic_mask`)."""

    dynamic: tuple[nn.Module, ...] = ()

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> DenseMask | None:
        if not any(reads_mask_as_tensor(type(m)) for m in layer.modules()):
            return None
        return cls(dynamic_mask_modules(layer))

    def wrap(self, func: Callable) -> Callable:
        return functools.partial(dense_mask_run, func, self.dynamic)


def dense_mask_run(func, dynamic: tuple[nn.Module, ...], layer: nn.Module, x: torch.Tensor, **kwargs):
    """``func`` (a layer's forward) on chunk ``x`` with each :class:`StreamMask` argument as its dense block: queries
    [s, e), keys from the chunk's first key position p to the sequence's end T, (batch, 1, e - s, T - p). A sparse
    indexed attention's own code reads the mask as a tensor: its indexer scores each query against the indexer keys the
    chunk cache serves, positions [p, T) (:meth:`~.carry.ChunkCache.update_indexer`), and masks those scores with it,
    so each row it takes the top-k of is the full-sequence forward's row; the attention then attends to the keys [p, e)
    (the later positions are masked, :func:`~streambp_trl.attention.kernels.stream_attention`). A dynamic mask
    attention (Doge, ``dynamic``) adds a per-key bias from the values of keys [p, e) the cache returns and ranks its
    top-k window over the full forward's rows (:func:`.dynamic_mask.full_rows`), then attends to keys [p, e). Holds one
    chunk x (T - p) block, never a T x T one."""
    cache = cache_argument(kwargs)
    seq_len, kv_start = cache.store.seq_len, 0
    for name, mask in list(kwargs.items()):
        if isinstance(mask, StreamMask):
            # a compressed attention extends the block with its compressed entries' additive bias: keys [p, e)
            # only, additive too (a bool block would read that bias cast to bool, its -inf as "attend")
            end = cache.start + x.shape[1] if cache.compressed else seq_len
            block = mask.materialise(x.shape[1], end - mask.kv_start, x.device)
            if cache.compressed and block.dtype == torch.bool:
                block = torch.zeros(block.shape, dtype=x.dtype, device=x.device).masked_fill(
                    ~block, torch.finfo(x.dtype).min
                )
            kwargs[name] = block
            kv_start = mask.kv_start
    with full_rows(dynamic, kv_start, seq_len):
        return func(layer, x, **kwargs)
