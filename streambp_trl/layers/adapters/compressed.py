"""Compressed attentions (DeepSeek-V4): attentions whose cache slot compresses every ``rate`` positions into one
entry, carried from chunk to chunk by the carry store (:mod:`~..carry.compressed`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch import nn

from ..carry.compressed import compress_rates
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class CompressedAttention(LayerAdapter):
    """A layer with compressed attentions (``rates``: cache slot -> compress rate). Chunks have at least two tokens: a
    one-token call is a compressed attention's decoding path, which attends to every compressed entry."""

    rates: Mapping[int, int]
    min_chunk = 2

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> CompressedAttention | None:
        rates = compress_rates(layer)
        return cls(rates) if rates else None

    @property
    def compress_rates(self) -> Mapping[int, int]:
        return self.rates
