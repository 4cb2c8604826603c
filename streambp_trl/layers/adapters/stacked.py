"""Stacked hidden-state streams (Gemma 3n's AltUp: (streams, batch, T, hidden)), streamed as (batch, T, streams,
hidden) views so that the sequence is the second dimension, as for every other layer."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import nn

from ...attention import stream_configs
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class StackedStreams(LayerAdapter):
    """A layer whose hidden states are stacked streams (its config's ``altup_num_inputs`` above 1)."""

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> StackedStreams | None:
        stacked = any((getattr(c, "altup_num_inputs", None) or 1) > 1 for c in stream_configs(layer))
        return cls() if stacked else None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x.movedim(0, 2)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return y.movedim(2, 0)

    def wrap(self, func: Callable) -> Callable:
        return functools.partial(stacked_run, func)


def stacked_run(func, layer: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``func`` (a layer's forward whose hidden states are stacked streams, (streams, batch, chunk, hidden)) on chunk
    ``x`` in the engine's layout, (batch, chunk, streams, hidden), and its output back in that layout (views)."""
    return func(layer, x.movedim(2, 0), *args, **kwargs).movedim(0, 2)
