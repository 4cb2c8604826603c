"""The key/value cache a streamed layer runs each chunk against, and the full-length keys/values of one layer.

:class:`KVStore` holds every position's keys/values of each cache slot (``layer_idx``), (batch, kv_heads, T,
head_dim) each. :class:`ChunkCache` is a ``transformers.Cache`` for one layer call on one chunk: the model's own
attention code calls its ``update()``, which writes the chunk's keys/values into the store and returns the store's
view of the prefix and the chunk, so no concatenated copy of the prefix is ever made. In a backward recompute the
prefix is a gradient-carrying leaf and :class:`_Extend` joins it to the chunk's keys/values (a view again), handing
the attention's gradient back to both as views; the joined tensors also carry a :class:`PrefixGrad`, with which an
attention kernel can add the prefix's gradient straight into the layer's key/value gradient sums instead.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..attention import PrefixGrad


class KVCollected(Exception):
    """Raised by a collecting cache to stop a layer once its keys/values are known."""


KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # cache slot (layer_idx) -> keys, values


class KVStore:
    """Keys/values of all positions for each cache slot of one layer, filled chunk by chunk:
    (batch, kv_heads, T, head_dim) each, allocated when a slot is first written."""

    def __init__(self, seq_len: int, kv: KV | None = None):
        self.seq_len = seq_len
        self.kv: KV = kv or {}

    def range(self, start: int, end: int) -> KV:
        return {i: (k[:, :, start:end], v[:, :, start:end]) for i, (k, v) in self.kv.items()}

    def slot(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``i``'s full-length keys and values, allocated like ``key``/``value`` on first use."""
        if i not in self.kv:
            full = key.shape[:2] + (self.seq_len,) + key.shape[3:]
            self.kv[i] = (key.new_empty(full), value.new_empty(value.shape[:2] + (self.seq_len,) + value.shape[3:]))
        return self.kv[i]

    def flat(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for i in sorted(self.kv) for t in self.kv[i])

    @classmethod
    def from_flat(cls, seq_len: int, slots: list[int], flat: tuple[torch.Tensor, ...]) -> KVStore:
        return cls(seq_len, {i: (flat[2 * n], flat[2 * n + 1]) for n, i in enumerate(slots)})


class _Extend(torch.autograd.Function):
    """``cat([prefix, chunk], dim=2)`` without a copy: ``chunk`` is written into ``full`` (the store, given as
    ``[full]``, positions [s, e)) and the view ``full[:, :, p:e]`` is returned; ``prefix`` must be (a leaf over)
    ``full[:, :, p:s]``. Backward: the gradient's two parts, as views."""

    @staticmethod
    def forward(ctx, store: list[torch.Tensor], p: int, s: int, prefix: torch.Tensor, chunk: torch.Tensor):
        (full,) = store  # passed in a list: the store is not an input of the graph
        full[:, :, s : s + chunk.shape[2]] = chunk
        ctx.split = s - p
        return full[:, :, p : s + chunk.shape[2]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, None, grad[:, :, : ctx.split], grad[:, :, ctx.split :]


class ChunkCache(Cache):
    """A ``transformers.Cache`` for one layer call on the chunk of positions starting at ``start``.

    ``update()`` records the chunk's own keys/values of each slot (``chunk``), writes them into ``store`` and returns
    the keys/values of positions ``[start - prefix_len, start + chunk length)``. ``prefix`` (a backward recompute)
    gives, per slot, gradient-carrying leaves over the store's prefix, joined to the chunk by :class:`_Extend`;
    ``prefix_sums`` the gradient sums of those prefix positions, handed to the attention as :class:`PrefixGrad`. With
    ``stop`` it raises :class:`KVCollected` after the write, so the layer runs only as far as its key/value
    projections. Queries answer as a cache holding the ``start`` earlier tokens would: ``get_seq_length()`` (and so
    ``get_query_offset()``) is ``start``, ``get_mask_sizes()`` the prefix plus chunk.
    """

    def __init__(
        self,
        store: KVStore,
        start: int,
        prefix_len: int = 0,
        prefix: KV | None = None,
        stop: bool = False,
        prefix_sums: KV | None = None,
    ):
        super().__init__(layers=[])
        self.store, self.start, self.prefix_len, self.prefix, self.stop = store, start, prefix_len, prefix, stop
        self.prefix_sums = prefix_sums
        self.chunk: KV = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.prefix_len + query_length, self.start - self.prefix_len

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.chunk[layer_idx] = (key_states, value_states)
        full = self.store.slot(layer_idx, key_states, value_states)
        p, s = self.start - self.prefix_len, self.start
        if self.prefix is not None:  # a backward recompute: gradient reaches the prefix leaves and the chunk
            if self.prefix_len == 0:
                return key_states, value_states
            pairs = zip(full, self.prefix[layer_idx], (key_states, value_states), strict=True)
            joined = tuple(_Extend.apply([f], p, s, leaf, new) for f, leaf, new in pairs)
            if self.prefix_sums is not None:
                sums = self.prefix_sums[layer_idx]
                for t, new, acc in zip(joined, (key_states, value_states), sums, strict=True):
                    PrefixGrad.attach(t, new, acc)
            return joined
        e = s + key_states.shape[2]
        with torch.no_grad():
            full[0][:, :, s:e] = key_states
            full[1][:, :, s:e] = value_states
        if self.stop:
            raise KVCollected
        return full[0][:, :, p:e], full[1][:, :, p:e]
