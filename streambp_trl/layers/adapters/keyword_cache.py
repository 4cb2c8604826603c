"""A cache passed on through ``**kwargs``: a layer whose forward names no cache parameter but hands its keyword
arguments on to modules that read ``past_key_values`` (DeepSeek-V4)."""

from __future__ import annotations

import dataclasses

from torch import nn

from ..layer_args import CACHE_KWARGS, STATE_ARGUMENT, parameter_names
from ..traits import passes_keywords
from .base import LayerAdapter


@dataclasses.dataclass(frozen=True)
class KeywordCache(LayerAdapter):
    """A layer taking ``**kwargs`` and no cache or state parameter: its chunk cache goes in as ``past_key_values``."""

    cache_name = "past_key_values"

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> KeywordCache | None:
        names = parameter_names(layer)
        if any(k in names for k in (*CACHE_KWARGS, STATE_ARGUMENT)) or not passes_keywords(type(layer)):
            return None
        return cls()
