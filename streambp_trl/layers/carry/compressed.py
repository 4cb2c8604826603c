"""A compressed attention's carry (DeepSeek-V4): what its compressors keep across positions, served per chunk.

Such a layer's compressors turn each window of ``m`` source tokens into one compressed key/value entry (a softmax-gated
sum of the window's projections), which its attention appends to its sliding-window keys, and (compressed sparse
attention) a lightning indexer picks among entries compressed the same way. Each runs through its cache layer
(``past_key_values.layers[layer_idx]``), one entry name each (``"compressor"``, ``"indexer"``):

* ``store_compression_weights(name, kv, gate)``: the chunk's projections after the *buffer* (the incomplete window's
  projections left by earlier positions, s mod m tokens), cut to whole windows; the rest is the next buffer. Its
  windows start at position (s // m) m.
* ``update_overlap_state(name, kv, gate, head_dim)``: the previous window's first half (compressed sparse attention's
  overlapping windows), and the chunk's last window's, kept for the next.
* ``update_compressor_states(name, compressed)``: the entries of earlier positions, the chunk's new ones after them,
  and zeros for the entries of later positions, T // m in all: the full-sequence forward's count, so the attention
  appends as many entries (the later ones masked by the layer's own block bias) and the indexer's top-k ranks rows of
  the same length and contents as it does (its scores of later entries are masked) and picks the same ones.

Each of these is a *state* of :class:`~.store.CarryStore`: what enters chunk n is a leaf with grad in its backward,
and what it leaves carries the gradient chunk n + 1 handed back (:class:`~.layer_carry.LayerCarry`). Keys
``(kind, layer_idx, 0 | 1)`` (compressor, indexer) with kind one of :data:`KINDS`. Holds the entries of every window
once ((batch, T // m, head_dim) per name: each boundary's are a view, :meth:`~.store.CarryStore.record`) and, per
chunk boundary, the buffer and overlap ((batch, < m, 2 head_dim) each).
"""

from __future__ import annotations

import torch

from ...patching import opaque_methods
from .store import COMPRESSED, StateKey, States

NAMES = ("compressor", "indexer")
KINDS = (COMPRESSED, "window_kv", "window_gate", "overlap_kv", "overlap_gate")


def _key(kind: str, layer_idx: int, name: str) -> StateKey:
    return (kind, layer_idx, NAMES.index(name))


@opaque_methods  # run eagerly where a compiled layer calls it (..compiled)
class CompressorStates:
    """The cache layer a compressed attention's compressors call for slot ``layer_idx`` of the chunk starting at
    ``start`` (of ``seq_len`` positions), compress rate ``rate``: reads ``incoming``, writes ``outgoing`` (the chunk
    cache's state dicts)."""

    def __init__(self, incoming: States, outgoing: States, layer_idx: int, start: int, seq_len: int, rate: int):
        self.incoming, self.outgoing = incoming, outgoing
        self.layer_idx, self.start, self.seq_len, self.rate = layer_idx, start, seq_len, rate
        for name in NAMES:  # a chunk that closes no window passes its overlap state on unchanged
            for kind in ("overlap_kv", "overlap_gate"):
                key = _key(kind, layer_idx, name)
                if key in incoming:
                    outgoing[key] = incoming[key]

    def store_compression_weights(
        self, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        window_kv = self.incoming.get(_key("window_kv", self.layer_idx, name))
        if window_kv is not None and window_kv.shape[1]:
            kv = torch.cat([window_kv.to(kv.dtype), kv], dim=1)
            gate = torch.cat([self.incoming[_key("window_gate", self.layer_idx, name)].to(gate.dtype), gate], dim=1)
        usable = kv.shape[1] // self.rate * self.rate
        self.outgoing[_key("window_kv", self.layer_idx, name)] = kv[:, usable:]
        self.outgoing[_key("window_gate", self.layer_idx, name)] = gate[:, usable:]
        return kv[:, :usable], gate[:, :usable], self.start // self.rate * self.rate

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        prior_kv = self.incoming.get(_key("overlap_kv", self.layer_idx, name))
        prior_gate = self.incoming.get(_key("overlap_gate", self.layer_idx, name))
        self.outgoing[_key("overlap_kv", self.layer_idx, name)] = chunk_kv[:, -1, :, :head_dim]
        self.outgoing[_key("overlap_gate", self.layer_idx, name)] = chunk_gate[:, -1, :, :head_dim]
        return prior_kv, prior_gate

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        earlier = self.incoming.get(_key(COMPRESSED, self.layer_idx, name))
        if earlier is not None and earlier.shape[1]:
            compressed = torch.cat([earlier.to(compressed.dtype), compressed], dim=1)
        self.outgoing[_key(COMPRESSED, self.layer_idx, name)] = compressed
        total = self.seq_len // self.rate
        later = compressed.new_zeros(compressed.shape[:1] + (total - compressed.shape[1],) + compressed.shape[2:])
        return torch.cat([compressed, later], dim=1)


def compress_rates(layer: torch.nn.Module) -> dict[int, int]:
    """Cache slot -> compress rate of ``layer``'s compressed attentions (a module with a ``layer_idx`` and a
    ``compressor`` with a ``compress_rate``)."""
    rates = {}
    for module in layer.modules():
        compressor = getattr(module, "compressor", None)
        rate = getattr(compressor, "compress_rate", None)
        if isinstance(rate, int) and isinstance(getattr(module, "layer_idx", None), int):
            rates[module.layer_idx] = rate
    return rates
