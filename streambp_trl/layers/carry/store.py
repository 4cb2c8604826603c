"""What one layer call's chunks take from earlier positions, kept for the whole sequence: the keys/values of every
position per cache slot, the recurrent and convolution states entering each chunk, a sparse indexed attention's
indexer keys."""

from __future__ import annotations

import torch

KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # cache slot (layer_idx) -> keys, values
StateKey = tuple[str, int, int]  # ("conv", "recurrent" or "indexer", cache slot (layer_idx), state index)
INDEXER = "indexer"  # the kind of a layout entry that holds a slot's indexer keys of every position
COMPRESSED = "compressed"  # the kind of a compressed attention's entries so far (a running list: see .compressed)
States = dict[StateKey, torch.Tensor]


def recurrent_key(layer_idx: int, state_idx: int = 0) -> StateKey:
    """The key of cache slot ``layer_idx``'s recurrent state (its ``state_idx``-th)."""
    return ("recurrent", layer_idx, state_idx)


class CarryStore:
    """What one layer call's chunks take from earlier positions, filled chunk by chunk.

    ``kv``: keys/values of all positions for each attention cache slot, (batch, kv_heads, T, head_dim) each,
    allocated when a slot is first written. ``states``: for each recurrent or convolution state of the layer
    (linear attention, Mamba, short convolution), the state entering each chunk but the first (chunk index -> state,
    e.g. (batch, heads, d_k, d_v) or the convolution's last ``kernel`` inputs). ``indexer``: a sparse indexed
    attention's indexer keys of all positions per slot, (batch, T, index_head_dim), zeros where not yet written.
    """

    def __init__(
        self,
        seq_len: int,
        kv: KV | None = None,
        states: dict[StateKey, dict[int, torch.Tensor]] | None = None,
        indexer: dict[int, torch.Tensor] | None = None,
        rates: dict[int, int] | None = None,
    ):
        self.seq_len = seq_len
        self.kv: KV = kv or {}
        self.states = states or {}
        self.indexer: dict[int, torch.Tensor] = indexer or {}
        self.rates = rates or {}  # cache slot -> compress rate of a compressed attention (:mod:`.compressed`)
        self.entries: States = {}  # a compressed attention's entries of every window, per (kind, slot, name) key
        self.base: CarryStore | None = None  # the store this one aliases (:meth:`aliased`)

    def aliased(self) -> CarryStore:
        """This store under fresh version counters, for one chunk whose graph outlives the next chunks' writes (a
        forward that keeps its chunks' graphs, :mod:`..call.kept`): its keys/values are aliases of this store's
        memory (``Tensor.data``: the same elements, a version counter of their own), and a slot the chunk allocates
        is allocated here. The chunks write disjoint positions, so what a chunk's graph saved of the store keeps its
        values; the aliases keep autograd from taking a later chunk's write for a change of them."""
        kv = {i: (k.data, v.data) for i, (k, v) in self.kv.items()}
        alias = CarryStore(self.seq_len, kv, self.states, {i: t.data for i, t in self.indexer.items()}, self.rates)
        alias.entries, alias.base = self.entries, self
        return alias

    def incoming(self, n: int) -> States:
        """The states entering chunk ``n`` (none for the first)."""
        return {key: by_chunk[n] for key, by_chunk in self.states.items() if n in by_chunk}

    def record(self, n: int, outgoing: States) -> None:
        """Keep the states chunk ``n`` left, for chunk ``n + 1``: detached copies, since a convolution tail is a view
        of the chunk's whole joined convolution input ((chunk + kernel) x conv_dim), which a kept view would hold. A
        compressed attention's entries so far grow by extension: each chunk's are a view of one buffer of all T // m
        (written as they come), not a copy per chunk boundary."""
        for key, t in outgoing.items():
            if key[0] == COMPRESSED:
                t = self._entries(key, t)
            else:
                t = t.detach().clone()
            self.states.setdefault(key, {})[n + 1] = t

    def _entries(self, key: StateKey, running: torch.Tensor) -> torch.Tensor:
        full = self.entries.get(key)
        if full is None:
            total = self.seq_len // self.rates[key[1]]
            full = self.entries[key] = running.new_empty(running.shape[:1] + (total,) + running.shape[2:])
        with torch.no_grad():
            full[:, : running.shape[1]] = running
        return full[:, : running.shape[1]]

    def layout(self) -> list[tuple[StateKey, int]]:
        """The order of the store's tensors after the keys/values in :meth:`flat`: (state key, chunk) of each state
        entering a chunk, then ``(("indexer", slot, 0), 0)`` for each slot's indexer keys."""
        states = [(key, n) for key in sorted(self.states) for n in sorted(self.states[key])]
        return states + [((INDEXER, i, 0), 0) for i in sorted(self.indexer)]

    def range(self, start: int, end: int) -> KV:
        return {i: (k[:, :, start:end], v[:, :, start:end]) for i, (k, v) in self.kv.items()}

    def slot(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``i``'s full-length keys and values, allocated like ``key``/``value`` on first use."""
        if i not in self.kv and self.base is not None:
            self.kv[i] = tuple(t.data for t in self.base.slot(i, key, value))
        if i not in self.kv:
            full = key.shape[:2] + (self.seq_len,) + key.shape[3:]
            self.kv[i] = (key.new_empty(full), value.new_empty(value.shape[:2] + (self.seq_len,) + value.shape[3:]))
        return self.kv[i]

    def index_keys(self, i: int, keys: torch.Tensor) -> torch.Tensor:
        """Slot ``i``'s indexer keys of every position, (batch, T, index_head_dim), allocated as zeros like ``keys``
        (the chunk's, (batch, chunk, index_head_dim)) on first use. Zeros, not uninitialised memory: a chunk's indexer
        scores the positions not yet written too, and masks them, which a NaN there would survive under an additive
        mask."""
        if i not in self.indexer and self.base is not None:
            self.indexer[i] = self.base.index_keys(i, keys).data
        if i not in self.indexer:
            self.indexer[i] = keys.new_zeros(keys.shape[:1] + (self.seq_len,) + keys.shape[2:])
        return self.indexer[i]

    def flat(self) -> tuple[torch.Tensor, ...]:
        """The store's tensors: keys, values per slot, then the states and indexer keys in :meth:`layout` order."""
        kv = tuple(t for i in sorted(self.kv) for t in self.kv[i])
        rest = (self.indexer[key[1]] if key[0] == INDEXER else self.states[key][n] for key, n in self.layout())
        return kv + tuple(rest)

    @classmethod
    def from_flat(
        cls,
        seq_len: int,
        slots: list[int],
        layout: list[tuple[StateKey, int]],
        flat: tuple[torch.Tensor, ...],
        rates: dict[int, int] | None = None,
    ) -> CarryStore:
        kv = {i: (flat[2 * n], flat[2 * n + 1]) for n, i in enumerate(slots)}
        states: dict[StateKey, dict[int, torch.Tensor]] = {}
        indexer: dict[int, torch.Tensor] = {}
        for (key, n), t in zip(layout, flat[2 * len(slots) :], strict=True):
            if key[0] == INDEXER:
                indexer[key[1]] = t
            else:
                states.setdefault(key, {})[n] = t
        return cls(seq_len, kv, states, indexer, rates)
