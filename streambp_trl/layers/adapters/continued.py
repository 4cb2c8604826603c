"""Mixers that start from a zero state (Mamba v1's scan, lightning attention): continued from the state each chunk
receives (:mod:`streambp_trl.layers.continued`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from torch import nn

from ..continued import Continued, continued
from ..layer_args import cache_argument
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class ContinuedMixers(LayerAdapter):
    """The layer's mixers that start from zero (``parts``)."""

    parts: Continued

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> ContinuedMixers | None:
        parts = Continued.of(layer)
        return cls(parts) if parts is not None else None

    def wrap(self, func: Callable) -> Callable:
        return functools.partial(continued_run, func, self.parts)


def continued_run(func: Callable, parts: Continued, layer: nn.Module, *args, **kwargs) -> object:
    """``func`` (a layer's forward) with its mixers that start from zero continued from the states its chunk cache
    receives (:mod:`.continued`)."""
    with continued(parts, cache_argument(kwargs)):
        return func(layer, *args, **kwargs)
