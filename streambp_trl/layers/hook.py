"""The stream layers' checkpoint hook: what a decoder layer call becomes in a streamed forward.

:func:`stream_checkpoint` is installed as each Hugging Face decoder layer's ``_gradient_checkpointing_func`` (the hook
transformers' ``GradientCheckpointingLayer`` calls in training mode with ``partial(layer.forward, **kwargs)`` and the
hidden states). It binds the call's arguments, chooses the chunk, decides what the layer keeps for its backward (its
input; or nothing, when the input is rebuilt from the token ids or by its segment; see :mod:`.rebuild` and
:mod:`.segments`) and runs the layer through :class:`~streambp_trl.layers.stream_layer.StreamLayerFunction`.

Module hooks run outside this hook (transformers checkpoints ``forward``, not ``__call__``): a layer's pre-hooks see
its input before, its forward hooks its input and output after. So the input a layer gets may be held by the
previous layer's forward hooks, its own hooks, the caller (hidden states) or any autograd node; whether its input
gradient may take the input's place is decided in backward, by what then holds the input's memory
(:func:`~streambp_trl.layers.guards.sole_holder`), not by which hooks exist.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..attention import StreamMask, stream_configs
from ..sizing.auto import rule_of_thumb
from .kv_cache import ChunkCache
from .layer_args import CACHE_KWARGS, parameter_names, per_token
from .rebuild import EmbeddingSource
from .segments import Segment
from .stream_layer import LayerCall, StreamLayerFunction, StreamSettings


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def stream_checkpoint(settings: StreamSettings, forward: functools.partial, *args: torch.Tensor) -> torch.Tensor:
    """A streamed layer's ``_gradient_checkpointing_func``: ``forward`` is ``partial(layer.forward, layer, **kw)``.

    A call that brings a real key/value cache without grad (generation while the model is in training mode) runs
    the layer as it is, filling the cache. Every other training call is streamed; a cache is then dropped, as
    Hugging Face gradient checkpointing does.
    """
    layer = forward.args[0]
    names = parameter_names(layer)
    kwargs = {**dict(zip(names[1:], args[1:], strict=False)), **forward.keywords}
    cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is not None and not isinstance(cache, ChunkCache) and not torch.is_grad_enabled():
        return forward(*args)
    cache_name = next((k for k in CACHE_KWARGS if k in names), None)
    if cache_name is None:
        raise ValueError(f"StreamBP: {type(layer).__name__}.forward takes no key/value cache argument.")
    x = args[0]
    batch, seq_len = x.shape[:2]
    for k in CACHE_KWARGS:
        kwargs.pop(k, None)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):  # a user-given 4D mask: sliced per chunk
        if mask.dim() != 4 or mask.shape[-1] != seq_len:
            raise ValueError(f"StreamBP: unexpected attention mask of shape {tuple(mask.shape)} for {seq_len} tokens.")
        kwargs["attention_mask"] = StreamMask(batch_size=batch, dense=mask)
    elif not isinstance(mask, StreamMask):
        raise ValueError(f"StreamBP: {type(layer).__name__} was called without an attention mask.")
    sliced, grad_inputs = per_token(layer, kwargs, batch, seq_len)
    call = LayerCall(
        layer,
        forward.func,
        kwargs,
        sliced,
        settings,
        seq_len,
        _autocast_state(x.device.type),
        stream_configs(layer),
        cache_name,
        grad_inputs,
    )
    chunk = vars(layer).get("_streambp_chunk") or settings.chunk_size
    call.chunk_size = chunk if isinstance(chunk, int) else rule_of_thumb(seq_len)
    params = [p for p in layer.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or grad_inputs or params):
        return call.forward_chunks(x, keep_kv=False, rng="none")[0]
    unobserved = _outputs_unobserved(layer)
    call.source = EmbeddingSource.of(x) if unobserved else None
    if settings.keep_every > 1:  # join the segment of the previous stream layer (its output is x), or start one
        joined = Segment.of(x) if unobserved else None
        call.segment = joined if joined is not None else Segment(settings.keep_every)
        call.position = call.segment.join(call)
    y = StreamLayerFunction.apply(call, x, *(kwargs[n] for n in grad_inputs), *params)
    if call.segment is not None:
        call.segment.mark(y)
    return y


def _outputs_unobserved(layer: nn.Module) -> bool:
    """Whether ``layer``'s input may be rebuilt in backward (from the token ids, or by its segment) rather than kept:
    the decoder does not collect hidden states for this call (it sets ``_streambp_recycle``) and no forward hook other
    than transformers' output capturing (active only when hidden states are collected) watches the layer.

    Otherwise the input is the caller's, or may be a hook's, and rebuilding it would cost a recompute without freeing
    its memory, so the layer keeps it. (Correctness does not rest on this: a rebuilt input is checked to be what the
    layer used, see :mod:`.rebuild` and :mod:`.segments`.)
    """
    if not vars(layer).get("_streambp_recycle", False) or nn.modules.module._global_forward_hooks:
        return False
    return all(getattr(hook, "__name__", "") == "output_capturing_hook" for hook in layer._forward_hooks.values())
