"""StreamBP's attention implementation, registered through transformers' own interfaces, and the switch to it.

During a streamed call (the decoder's training forward, and each layer's recompute in backward; see
:func:`streaming`) the model's attention implementation is ``"streambp"``: transformers' ``AttentionInterface``
calls :func:`~streambp_trl.attention.kernels.stream_attention` and its ``AttentionMaskInterface``
:func:`~streambp_trl.attention.masks.stream_mask`. Outside streamed calls the config names the model's own
implementation, so eval, generation and saved checkpoints are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface

from ..patching import opaque, temporarily
from .kernels import stream_attention
from .masks import stream_mask

IMPLEMENTATION = "streambp"


def stream_configs(module: torch.nn.Module, *layers: torch.nn.Module) -> tuple:
    """The transformers configs the mask code of ``module`` (its own config) and the attention code of the streamed
    ``layers`` read (all of ``module``'s submodules when no layers are given), deduplicated."""
    configs = {}
    for m in (module, *(sub for layer in layers for sub in layer.modules())) if layers else module.modules():
        config = getattr(m, "config", None)
        if isinstance(config, PreTrainedConfig):
            configs.setdefault(id(config), config)
    return tuple(configs.values())


@contextlib.contextmanager
def streaming(configs: tuple) -> Iterator[None]:
    """Route attention and mask creation of the models reading ``configs`` through ``"streambp"`` for one call.

    The configs are switched only for the duration of a streamed call (the decoder's training forward, a layer's
    recompute in backward), so the model's own implementation stays what it was everywhere else: eval, generation,
    ``save_pretrained``, ``copy.deepcopy`` and other models sharing the config see no change.
    """
    _register()
    with temporarily(configs, "_attn_implementation_internal", IMPLEMENTATION):
        yield


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        # run eagerly where a compiled layer calls it (a graph break): the prefix keys/values never enter a graph
        AttentionInterface.register(IMPLEMENTATION, opaque(stream_attention))
        AttentionMaskInterface.register(IMPLEMENTATION, stream_mask)
        _registered = True
