"""The adapter base: what a family trait changes about a layer's streaming, and the identity where it changes nothing.

A trait may change the plan (the fewest tokens a chunk may have, the arguments sliced from the chunk's first key
position, the compressed attentions' cache slots, the name the layer takes its cache under), a call's arguments
before they are chunked (:meth:`LayerAdapter.bind`: documents cut, masks kept apart, shared keys/values), whether a
call runs unstreamed (:meth:`LayerAdapter.given_state`), the hidden states' layout (``enter``/``leave``) and each
chunk's run (``wrap``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import nn

from ..shared_kv import SharedKV


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """A layer call's arguments as the chunks take them: the bound keyword arguments (the hidden states aside), the
    call's batch size and sequence length, where its chunks must be cut because a packed row's document starts there
    (each such chunk starting from a zero state), and the decoder call's keys/values shared across layers, where the
    layer reads or writes them."""

    kwargs: Mapping
    batch: int
    seq_len: int
    resets: tuple[int, ...] = ()
    shared: SharedKV | None = None


class LayerAdapter:
    """One family trait of a decoder layer: each attribute and method here is what a layer without the trait gets.

    ``min_chunk``: the fewest tokens a chunk may have. ``from_prefix``: the arguments each chunk gets from its first
    key position on. ``compress_rates``: cache slot -> compress rate of compressed attentions. ``cache_name``: the
    argument the layer takes its cache under, where none of transformers' cache names is a parameter of its forward.
    ``after``: the adapters this one must follow where a layer has both (their ``bind`` runs first, their ``wrap``
    inside this one's), declared by the trait that needs it (:func:`~..adapters.in_order`). ``kernel_apart``: the
    layer's own attention keeps a packed row's documents apart whatever its mask says. ``splits``: a sequence split
    across ranks (:mod:`~..sequence_split`) serves the trait.
    """

    after: ClassVar[tuple[type[LayerAdapter], ...]] = ()
    min_chunk: int = 1
    from_prefix: tuple[str, ...] = ()
    compress_rates: Mapping[int, int] = types.MappingProxyType({})
    cache_name: str | None = None
    kernel_apart: ClassVar[bool] = False
    splits: ClassVar[bool] = False

    def given_state(self, kwargs: Mapping) -> object | None:
        """A state the call gives the layer to continue from, outside transformers' cache arguments (``None``)."""
        return None

    def bind(self, layer: nn.Module, args: CallArguments, shared: SharedKV) -> CallArguments:
        """``args`` as this trait hands them to the chunks; ``shared``: the decoder call's shared keys/values."""
        return args

    def packing_refusal(self, layer: nn.Module) -> str | None:
        """Why ``layer`` cannot take packed rows with sequence descriptors, or ``None``."""
        return None

    def wrap(self, func: Callable) -> Callable:
        """The function each chunk's run and recompute calls, ``func(layer, x, **kwargs)``, around ``func``."""
        return func

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The call's hidden states as the chunks take them: (batch, T, ...)."""
        return x

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output back in its family's layout (``enter`` undone)."""
        return y
