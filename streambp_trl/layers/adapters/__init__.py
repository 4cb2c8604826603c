"""Model-family adapters: what a family's decoder layer needs around each chunk's run, one module per family trait.

An adapter is found once per layer when the engine is installed (``detect(layer)``: an instance, or ``None`` where
the layer has no such trait) and kept, in :data:`ADAPTERS` order, in the layer's :class:`~..hook.LayerPlan`. For each
call the hook composes them around the layer's own forward, innermost first (``wrap(func)``: the function a chunk's
run and each recompute call, ``func(layer, x, *args, **kwargs)``, as ``torch.utils.checkpoint``'s ``context_fn``
wraps a region), and hands the call's hidden states through ``enter`` before the chunks and the output through
``leave`` after (identity unless the family lays its hidden states out otherwise). A family trait is one new module
here and one line in :data:`ADAPTERS`.

* :mod:`.nested`: checkpointed layers inside the layer (Zamba's hybrid layer) run as they are in each chunk;
* :mod:`.continued`: mixers that start from a zero state (Mamba v1, lightning attention), continued per chunk;
* :mod:`.stacked`: stacked hidden-state streams (Gemma 3n's AltUp), streamed as (batch, T, streams, hidden) views;
* :mod:`.state_argument`: a recurrent state taken as an argument and returned (xLSTM's blocks);
* :mod:`.dense_mask`: code that reads the mask as a tensor (sparse indexed attention, Doge's dynamic mask).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from .continued import ContinuedMixers
from .dense_mask import DenseMask
from .nested import NestedLayers
from .stacked import StackedStreams
from .state_argument import StateArgument


class LayerAdapter(Protocol):
    """One family trait of a decoder layer (see the module docstring)."""

    def wrap(self, func: Callable) -> Callable: ...

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, y: torch.Tensor) -> torch.Tensor: ...


# innermost first: the order their wrappers compose around the layer's forward
ADAPTERS = (NestedLayers, ContinuedMixers, StackedStreams, StateArgument, DenseMask)


def adapters_of(layer: nn.Module) -> tuple[LayerAdapter, ...]:
    """The adapters ``layer`` needs, in :data:`ADAPTERS` order."""
    return tuple(found for kind in ADAPTERS if (found := kind.detect(layer)) is not None)


def wrapped(func: Callable, adapters: tuple[LayerAdapter, ...]) -> Callable:
    """``func`` (a layer's own forward) with ``adapters`` composed around it, the first innermost."""
    for adapter in adapters:
        func = adapter.wrap(func)
    return func


__all__ = ["ADAPTERS", "LayerAdapter", "adapters_of", "wrapped"]
