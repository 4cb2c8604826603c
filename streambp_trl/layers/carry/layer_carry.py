"""A layer backward's carry: each chunk's incoming keys/values and states as gradient-carrying leaves, and the
gradient sums later chunks hand back to earlier ones."""

from __future__ import annotations

import torch

from .cache import ChunkCache
from .store import KV, CarryStore, States


class LayerCarry:
    """What chunks of one layer's backward hand each other: the layer's *carry*.

    A chunk [s, e) takes from earlier positions only its carry: for attention the keys/values of the prefix [p, s)
    (p > 0 for a sliding window); for a recurrent or convolution mixer the states at the chunk's start. In backward
    the chunks run last to first; chunk n = [s, e):

    * receives its incoming carry as leaves that require grad (:meth:`chunk_cache`: the prefix over ``store``, and
      the states entering the chunk);
    * returns its outgoing carry (its own keys/values, the states it leaves) with the gradient that later chunks
      handed back for them as their grad_outputs (:meth:`outgoing`);
    * hands the gradient of its incoming carry back to the earlier chunks (:meth:`absorb`): into the keys/values'
      gradient sums ``grads``, and as the gradient of the states chunk n - 1 left (``state_grads``).

    Holds the keys/values of every position (``store``, per cache slot) and their gradient sums, (batch, kv_heads,
    T, head_dim) each; the states entering every chunk and the gradient of one chunk boundary's states.
    """

    def __init__(self, store: CarryStore):
        self.store = store
        self.grads: KV = {i: (torch.zeros_like(k), torch.zeros_like(v)) for i, (k, v) in store.kv.items()}
        self.state_grads: dict[int, States] = {}  # chunk n -> gradient of the states entering it
        self.seeded = False

    def seed(self, slot: int, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Start slot ``slot``'s gradient sums from ``grads`` (what later layers that reuse its keys/values handed
        back: :mod:`..shared_kv`), so every chunk's own keys/values, the last one's too, are outputs of its
        backward."""
        self.grads[slot] = grads
        self.seeded = True

    def chunk_cache(self, n: int, s: int, p: int, resets: bool = False, aliased: bool = False) -> ChunkCache:
        """The cache of chunk ``n`` = [s, ...) in backward: the prefix [p, s) and the incoming states as leaves with
        grad (when not empty), the prefix's gradient sums for the attention (:class:`PrefixGrad`); ``resets``: the
        chunk starts a document of a packed row, whose mixers start from a zero state (no states enter it).
        ``aliased``: over the store under fresh version counters (:meth:`CarryStore.aliased`), for a graph built in
        the forward while the store fills (the sums of slots written so far are allocated then)."""
        store = self.store.aliased() if aliased else self.store
        for i, (k, v) in self.store.kv.items():
            if i not in self.grads:
                self.grads[i] = (torch.zeros_like(k), torch.zeros_like(v))
        prefix = {
            i: (k.detach().requires_grad_(s > p), v.detach().requires_grad_(s > p))
            for i, (k, v) in store.range(p, s).items()
        }
        sums = {i: (dk[:, :, p:s], dv[:, :, p:s]) for i, (dk, dv) in self.grads.items()}
        incoming = {key: _leaf(t) for key, t in self.store.incoming(n).items()}
        return ChunkCache(store, s, s - p, prefix, prefix_sums=sums, incoming=incoming, resets=resets)

    @staticmethod
    def incoming(cache: ChunkCache) -> list[torch.Tensor]:
        """The leaves of ``cache``'s incoming carry, in the order :meth:`absorb` takes their gradients."""
        kv = [t for i in sorted(cache.prefix) for t in cache.prefix[i]] if cache.prefix_len else []
        return kv + [cache.incoming[key] for key in sorted(cache.incoming) if cache.incoming[key].requires_grad]

    def outgoing(self, cache: ChunkCache, n: int, e: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The chunk's own keys/values and the states it left, with the gradient later chunks (and, ``seeded``, later
        layers) handed back for them (none for the last chunk of an unseeded carry)."""
        if e >= self.store.seq_len and not self.seeded:
            return [], []
        s = cache.start
        outputs, grads = [], []
        for i, (k, v) in cache.chunk.items():
            outputs += [k, v]
            grads += [self.grads[i][0][:, :, s:e], self.grads[i][1][:, :, s:e]]
        handed_back = self.state_grads.pop(n + 1, {})
        for key in sorted(cache.outgoing):
            if key in handed_back:
                outputs.append(cache.outgoing[key])
                grads.append(handed_back[key])
        return outputs, grads

    def absorb(self, cache: ChunkCache, n: int, grads: list[torch.Tensor | None]) -> None:
        """Take the gradient of ``cache``'s incoming carry (what autograd gave its leaves): the prefix positions' into
        the sums (nothing where the attention added it itself), the incoming states' for chunk ``n - 1``."""
        p, s = cache.start - cache.prefix_len, cache.start
        it = iter(grads)
        for i in sorted(cache.prefix) if cache.prefix_len else []:
            for acc in self.grads[i]:
                g = next(it)
                if g is not None:
                    acc[:, :, p:s] += g
        states = {key: next(it) for key in sorted(cache.incoming) if cache.incoming[key].requires_grad}
        self.state_grads[n] = {key: g for key, g in states.items() if g is not None}


def _leaf(state: torch.Tensor) -> torch.Tensor:
    """An incoming state as a leaf with grad; an integer state (token ids a layer keeps as a "convolution state" for
    its n-gram embedding, Qwen4-Exp) as it is: no gradient flows through integers."""
    return state.detach().requires_grad_() if state.is_floating_point() else state
