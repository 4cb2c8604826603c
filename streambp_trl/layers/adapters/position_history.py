"""A position history: a decoder that hands its layers the rotary embeddings of every position they attend to
(:func:`~..traits.keeps_position_history`: a sparse indexed attention's indexer, Qwen4-Exp). Each chunk then gets
them from its first key position p on, [p, e), and takes its own as the last e - s."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..layer_args import HISTORY_ARGUMENTS
from ..shared_kv import SharedKV
from ..traits import keeps_position_history
from .base import CallArguments, LayerAdapter


@dataclasses.dataclass(frozen=True)
class PositionHistory(LayerAdapter):
    """The layer of a decoder keeping a position history: :data:`~..layer_args.HISTORY_ARGUMENTS` are sliced from
    the chunk's first key position."""

    from_prefix = HISTORY_ARGUMENTS

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> PositionHistory | None:
        return cls() if keeps_position_history(decoder) else None

    def bind(self, layer: nn.Module, args: CallArguments, shared: SharedKV) -> CallArguments:
        """Refuses a position history given with gradient: its slices overlap from chunk to chunk."""
        with_grad = [n for n in self.from_prefix if _requires_grad(args.kwargs.get(n))]
        if with_grad:
            raise ValueError(
                f"StreamBP: {type(layer).__name__} receives {with_grad} with gradient, as a position history spanning "
                "earlier positions, which a stream layer cannot differentiate."
            )
        return args


def _requires_grad(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
