"""Checkpointed layers inside a layer (Zamba's hybrid layer holds a Mamba decoder layer): each runs its own forward
as it is, inside each chunk of the outer layer and against its chunk cache."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ...patching import forwards_replaced, own_forward
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class NestedLayers(LayerAdapter):
    """The checkpointed layers inside a layer (``nested``)."""

    nested: tuple[nn.Module, ...]

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> NestedLayers | None:
        nested = tuple(m for m in layer.modules() if m is not layer and isinstance(m, GradientCheckpointingLayer))
        return cls(nested) if nested else None

    def wrap(self, func: Callable) -> Callable:
        return functools.partial(nested_run_plain, func, self.nested)


def nested_run_plain(func, nested: tuple[nn.Module, ...], layer: nn.Module, *args, **kwargs):
    """``func`` (a layer's own forward) with each checkpointed layer inside it (``nested``: a hybrid layer's Mamba
    decoder layer, as Zamba's) running its own forward as it is, on the chunk the outer layer is given and against its
    chunk cache. Through transformers' checkpointing wrapper (or the stream hook) it would drop that cache and start
    its scan from a zero state."""
    plain = {m: functools.partial(own_forward(type(m)), m) for m in nested}
    with forwards_replaced(plain):
        return func(layer, *args, **kwargs)
