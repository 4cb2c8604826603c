"""Keys/values shared across layers (Gemma 3n, Gemma 4's E models: ``num_kv_shared_layers``), streamed exactly.

In such a model one layer of each layer type *stores* its keys/values K, V (post-norm, post-RoPE, every position) in
the decoder's ``shared_kv_states`` mapping, and the last layers *reuse* them instead of projecting their own: a
reusing layer attends to the storing layer's K, V, and its attention's gradient reaches the storing layer's key and
value projections through them.

Streamed, each layer call gets a :class:`ChunkShared` view of one decoder call's :class:`SharedKV` in place of the
mapping. A storing layer's chunk writes its (prefix + chunk) keys/values, which the view only notes (the layer type,
and the cache slot the chunk's cache last updated); when the layer's forward has run every chunk, its full-length
K, V (the carry store's, detached) become ``SharedKV.kv[type]``. A reusing layer's chunk [s, e), whose keys start at
p, reads K, V[:, :, p:e]; in its backward recompute as leaves with grad, whose gradient is added to
``SharedKV.grads[type]`` (batch, kv_heads, T, head_dim). Reusing layers come after the storing one, so their backwards
run first: when the storing layer's backward starts, the sums are complete, and they join its own keys/values'
gradient sums (:class:`~.carry.LayerCarry` ``seeded``), every chunk's keys/values then being outputs of its backward.

Holds, per shared layer type, the storing layer's K, V from its forward until its backward, and their gradient sums
from the first reusing layer's backward until then: (batch, kv_heads, T, head_dim) x 4.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict

import torch

from ..patching import opaque_methods
from .carry import ChunkCache

KV = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class SharedKV:
    """The keys/values storing layers share with reusing ones, for one decoder call, by layer type."""

    kv: dict[str, KV] = dataclasses.field(default_factory=dict)
    grads: dict[str, KV] = dataclasses.field(default_factory=dict)

    def read(self, kind: str, p: int, e: int) -> KV:
        if kind not in self.kv:
            raise RuntimeError(
                f"StreamBP: a layer reads the shared keys/values of layer type {kind!r} before any layer stored them."
            )
        k, v = self.kv[kind]
        return k[:, :, p:e], v[:, :, p:e]

    def add_grads(self, kind: str, p: int, grads: KV) -> None:
        k, v = self.kv[kind]
        if kind not in self.grads:
            self.grads[kind] = (torch.zeros_like(k), torch.zeros_like(v))
        for acc, g in zip(self.grads[kind], grads, strict=True):
            if g is not None:
                acc[:, :, p : p + g.shape[2]] += g

    def take_grads(self, kind: str) -> KV | None:
        """The gradient sums of ``kind``'s shared keys/values (``None`` where no reusing layer had any), handed to the
        storing layer's backward; the shared keys/values are no longer read after it and go too."""
        self.kv.pop(kind, None)
        return self.grads.pop(kind, None)


@opaque_methods  # run eagerly where a compiled layer calls it (..compiled)
class ChunkShared(UserDict):
    """A layer chunk's ``shared_kv_states``: what a storing layer writes is noted (its layer types, and ``slot``, the
    cache slot its chunk cache last updated), what a reusing layer reads is the :class:`SharedKV` keys/values of the
    chunk's key positions [p, e), as leaves with grad (``leaves``) where the chunk runs with grad."""

    def __init__(self, shared: SharedKV, cache: ChunkCache, p: int, e: int):
        super().__init__()
        self.shared, self.cache, self.p, self.e = shared, cache, p, e
        self.stored: dict[str, int] = {}  # layer type -> cache slot
        self.leaves: dict[str, KV] = {}

    def __setitem__(self, kind: str, kv: KV) -> None:
        if not self.cache.chunk:
            raise RuntimeError(
                f"StreamBP: a layer stores keys/values of layer type {kind!r} for later layers without having "
                "updated its key/value cache; only keys/values the cache returned can be shared."
            )
        self.stored[kind] = next(reversed(self.cache.chunk))  # the slot of the keys/values just written

    def __getitem__(self, kind: str) -> KV:
        k, v = self.shared.read(kind, self.p, self.e)
        if not torch.is_grad_enabled():
            return k, v
        if kind not in self.leaves:
            self.leaves[kind] = (k.detach().requires_grad_(), v.detach().requires_grad_())
        return self.leaves[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self.shared.kv or kind in self.stored

    def absorb(self, grads: list[torch.Tensor | None]) -> None:
        """Add the gradients of :meth:`leaves_list`'s leaves (in its order) into the shared sums."""
        it = iter(grads)
        for kind in sorted(self.leaves):
            self.shared.add_grads(kind, self.p, (next(it), next(it)))

    def leaves_list(self) -> list[torch.Tensor]:
        return [t for kind in sorted(self.leaves) for t in self.leaves[kind]]
