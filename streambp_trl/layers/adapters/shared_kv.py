"""Keys/values shared across layers (Gemma 3n, Gemma 4's E models, ``shared_kv_states``): a layer that stores or
reuses them reads and writes the decoder call's :class:`~..shared_kv.SharedKV` through a per-chunk view
(:mod:`..shared_kv`)."""

from __future__ import annotations

import dataclasses
import inspect

from torch import nn

from ..shared_kv import SharedKV
from .base import CallArguments, LayerAdapter

SHARED_KV_ARGUMENT = "shared_kv_states"


@dataclasses.dataclass(frozen=True)
class SharedKeysValues(LayerAdapter):
    """A layer with a module taking :data:`SHARED_KV_ARGUMENT`; a call that passes it gets the decoder call's shared
    keys/values."""

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> SharedKeysValues | None:
        takes = any(SHARED_KV_ARGUMENT in inspect.signature(type(m).forward).parameters for m in layer.modules())
        return cls() if takes else None

    def bind(self, layer: nn.Module, args: CallArguments, shared: SharedKV) -> CallArguments:
        if args.kwargs.get(SHARED_KV_ARGUMENT) is None:
            return args
        return dataclasses.replace(args, shared=shared)
