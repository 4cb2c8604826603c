"""The key/value cache a streamed layer runs each chunk against, and the full-length keys/values of one layer.

:class:`ChunkCache` is a ``transformers.Cache`` for one layer call on one chunk: the model's own attention code calls
its ``update()``, which records the chunk's keys/values per cache slot (``layer_idx``) and returns them after the
prefix's. :class:`KVStore` holds every position's keys/values of each slot, (batch, kv_heads, T, head_dim) each.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class KVCollected(Exception):
    """Raised by a collecting cache to stop a layer once its keys/values are known."""


KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # cache slot (layer_idx) -> keys, values


class ChunkCache(Cache):
    """A ``transformers.Cache`` for one layer call on the chunk of positions starting at ``start``.

    ``update()`` records the chunk's own keys/values of each slot and returns them after the prefix ones (positions
    ``[start - prefix_len, start)``). With ``stop`` it raises :class:`KVCollected` instead, so the layer runs only
    as far as its key/value projections. Queries answer as a cache holding the ``start`` earlier tokens would:
    ``get_seq_length()`` (and so ``get_query_offset()``) is ``start``, ``get_mask_sizes()`` the prefix plus chunk.
    """

    def __init__(self, start: int, prefix_len: int = 0, prefix: KV | None = None, stop: bool = False):
        super().__init__(layers=[])
        self.start, self.prefix_len, self.prefix, self.stop = start, prefix_len, prefix or {}, stop
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
        if self.stop:
            raise KVCollected
        if self.prefix_len == 0:
            return key_states, value_states
        k, v = self.prefix[layer_idx]
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)


class KVStore:
    """Keys/values of all positions for each cache slot of one layer, filled chunk by chunk:
    (batch, kv_heads, T, head_dim) each."""

    def __init__(self, seq_len: int, kv: KV | None = None):
        self.seq_len = seq_len
        self.kv: KV = kv or {}

    def range(self, start: int, end: int) -> KV:
        return {i: (k[:, :, start:end], v[:, :, start:end]) for i, (k, v) in self.kv.items()}

    def write(self, s: int, e: int, cache: ChunkCache) -> None:
        for i, (k, v) in cache.chunk.items():
            if i not in self.kv:
                shape = k.shape[:2] + (self.seq_len,) + k.shape[3:]
                self.kv[i] = (k.new_empty(shape), v.new_empty(v.shape[:2] + (self.seq_len,) + v.shape[3:]))
            self.kv[i][0][:, :, s:e] = k
            self.kv[i][1][:, :, s:e] = v

    def flat(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for i in sorted(self.kv) for t in self.kv[i])

    @classmethod
    def from_flat(cls, seq_len: int, slots: list[int], flat: tuple[torch.Tensor, ...]) -> KVStore:
        return cls(seq_len, {i: (flat[2 * n], flat[2 * n + 1]) for n, i in enumerate(slots)})
