"""Model-family adapters: what a family's decoder layer needs to stream, one module per family trait.

An adapter is found once per layer when the engine is installed (``detect(layer, decoder)``, given the layer and its
decoder's class: an instance, or ``None`` where the layer has no such trait) and kept, in :data:`ADAPTERS` order (each
after those its class names in ``after``, :func:`in_order`; otherwise as listed), in
the layer's :class:`~..hook.LayerFacts`, which reads these facts off them (:class:`~.base.LayerAdapter`). For each
call the hook hands the call's arguments through each adapter's ``bind``, in that order, and its hidden states through
``enter`` before the chunks and the output through ``leave`` after; it composes their ``wrap`` around the layer's own
forward, innermost first (the function a chunk's run and each recompute call, ``func(layer, x, *args, **kwargs)``, as
``torch.utils.checkpoint``'s ``context_fn`` wraps a region). A family trait is one new module here and one line in
:data:`ADAPTERS`.

* :mod:`.nested`: checkpointed layers inside the layer (Zamba's hybrid layer) run as they are in each chunk;
* :mod:`.continued`: mixers that start from a zero state (Mamba v1, lightning attention), continued per chunk;
* :mod:`.stacked`: stacked hidden-state streams (Gemma 3n's AltUp), streamed as (batch, T, streams, hidden) views;
* :mod:`.state_argument`: a recurrent state taken as an argument and returned (xLSTM's blocks);
* :mod:`.dense_mask`: code that reads the mask as a tensor (sparse indexed attention, Doge's dynamic mask);
* :mod:`.keyword_cache`: a cache passed on through ``**kwargs`` (DeepSeek-V4);
* :mod:`.position_history`: rotary embeddings of every attended position (Qwen4-Exp's indexer);
* :mod:`.compressed`: compressed attentions (DeepSeek-V4);
* :mod:`.shared_kv`: keys/values shared across layers (Gemma 3n, Gemma 4's E models);
* :mod:`.varlen`: flash attention's variable-length kernel, which keeps a packed row's documents apart;
* :mod:`.recurrent`: recurrent and convolution mixers (two-token chunks, a packed row's documents from zero states).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from .base import CallArguments, LayerAdapter
from .compressed import CompressedAttention
from .continued import ContinuedMixers
from .dense_mask import DenseMask
from .keyword_cache import KeywordCache
from .nested import NestedLayers
from .position_history import PositionHistory
from .recurrent import RecurrentMixers
from .shared_kv import SharedKeysValues
from .stacked import StackedStreams
from .state_argument import StateArgument
from .varlen import VarlenAttention


def in_order(kinds: Sequence[type[LayerAdapter]]) -> tuple[type[LayerAdapter], ...]:
    """``kinds`` with each after every one among them its class names in ``after``, otherwise in the order given (a
    stable topological order); a ``ValueError`` naming them where their ``after`` declarations form a cycle."""
    placed: list[type[LayerAdapter]] = []
    pending = list(kinds)
    while pending:
        ready = next((k for k in pending if not any(a in pending for a in k.after)), None)
        if ready is None:
            raise ValueError(f"the adapters {[k.__name__ for k in pending]} name each other in `after`: a cycle.")
        placed.append(ready)
        pending.remove(ready)
    return tuple(placed)


# wrappers innermost first, arguments bound in this order
ADAPTERS = in_order(
    (
        NestedLayers,
        ContinuedMixers,
        StackedStreams,
        StateArgument,
        DenseMask,
        KeywordCache,
        PositionHistory,
        CompressedAttention,
        SharedKeysValues,
        VarlenAttention,
        RecurrentMixers,
    )
)


def adapters_of(layer: nn.Module, decoder: type) -> tuple[LayerAdapter, ...]:
    """The adapters ``layer`` (a layer of a ``decoder`` class) needs, in :data:`ADAPTERS` order."""
    return tuple(found for kind in ADAPTERS if (found := kind.detect(layer, decoder)) is not None)


def wrapped(func: Callable, adapters: tuple[LayerAdapter, ...]) -> Callable:
    """``func`` (a layer's own forward) with ``adapters`` composed around it, the first innermost."""
    for adapter in adapters:
        func = adapter.wrap(func)
    return func


__all__ = ["ADAPTERS", "CallArguments", "LayerAdapter", "adapters_of", "in_order", "wrapped"]
