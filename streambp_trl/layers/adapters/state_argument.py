"""A recurrent state taken as an argument and returned beside the output (xLSTM's blocks: ``forward(x, state) -> (y,
state)``), served by the chunk cache."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..carry import ChunkCache
from ..layer_args import CACHE_KWARGS, STATE_ARGUMENT, parameter_names
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class StateArgument(LayerAdapter):
    """A layer that takes no cache but its state as :data:`~..layer_args.STATE_ARGUMENT`, which then serves as its
    cache argument; a call that gives a state (xLSTM's own eval loop over long sequences, generation) without grad
    runs the layer as it is (:meth:`given_state`)."""

    cache_name = STATE_ARGUMENT

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> StateArgument | None:
        names = parameter_names(layer)
        return cls() if STATE_ARGUMENT in names and not any(k in names for k in CACHE_KWARGS) else None

    def given_state(self, kwargs: Mapping) -> object | None:
        return kwargs.get(STATE_ARGUMENT)

    def wrap(self, func: Callable) -> Callable:
        return functools.partial(state_argument_run, func)


def state_argument_run(func, layer: nn.Module, x: torch.Tensor, *, state: ChunkCache, **kwargs) -> tuple:
    """``func`` (the forward of a layer that takes its recurrent state as an argument and returns its last state
    beside its output: xLSTM's blocks, ``(y, (C, n, m))``) on chunk ``x`` with that state served by the chunk cache
    ``state``, as cache slot 0: the states entering the chunk in (``None`` for the first chunk, as the plain call
    passes), the states it leaves recorded in the cache (:meth:`~.carry.ChunkCache.update_recurrent_state`, one
    state index each). Returns ``(y, None)``: in a streamed call the model keeps no cache (the engine calls its
    decoder without one), so nothing reads the last state; a call that gives a state runs the layer as it is
    (:func:`~..hook.stream_checkpoint`)."""
    incoming: list[torch.Tensor] = []
    while (t := state.get_recurrent_state(0, len(incoming))) is not None:
        incoming.append(t)
    out = func(layer, x, state=tuple(incoming) if incoming else None, **kwargs)
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[1], (tuple, list))
        and all(isinstance(t, torch.Tensor) for t in out[1])
    ):
        raise ValueError(
            f"StreamBP: {type(layer).__name__}.forward takes `state` but does not return (output, state): a state "
            "it neither returns nor continues cannot be carried from chunk to chunk."
        )
    y, last = out
    for i, t in enumerate(last):
        state.update_recurrent_state(t, 0, i)
    return y, None
