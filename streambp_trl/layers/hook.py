"""The stream layers' checkpoint hook: what a decoder layer call becomes in a streamed forward.

:func:`stream_checkpoint`, bound to the layer's :class:`LayerPlan`, is installed once as each Hugging Face decoder
layer's ``_gradient_checkpointing_func`` (the hook transformers' ``GradientCheckpointingLayer`` calls in training mode
with ``partial(layer.forward, **kwargs)`` and the hidden states). It binds the call's arguments, takes the chunk of
the decoder call in progress (:func:`~.decoder_call.active_call`), decides what the layer keeps for its backward
(its input; or nothing, when the input is rebuilt from the token ids or by its segment; see :mod:`.kept.rebuild` and
:mod:`.kept.segments`) and runs the layer through :class:`~streambp_trl.layers.call.stream_layer.StreamLayerFunction`.

Module hooks run outside this hook (transformers checkpoints ``forward``, not ``__call__``): a layer's pre-hooks see
its input before, its forward hooks its input and output after. So the input a layer gets may be held by the
previous layer's forward hooks, its own hooks, the caller (hidden states) or any autograd node; whether its input
gradient may take the input's place is decided in backward, by what then holds the input's memory
(:func:`~streambp_trl.layers.call.guards.sole_holder`), not by which hooks exist.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from transformers.utils.generic import is_flash_attention_requested

from ..attention import StreamMask, stream_configs
from ..sizing.auto import rule_of_thumb
from .adapters import LayerAdapter, adapters_of, wrapped
from .call import LayerCall, StreamLayerFunction, StreamSettings
from .carry import ChunkCache
from .carry.compressed import compress_rates
from .decoder_call import DecoderCall, active_call
from .kept import Segment
from .layer_args import (
    CACHE_KWARGS,
    HISTORY_ARGUMENTS,
    PACKING_KWARGS,
    PASS_THROUGH,
    STATE_ARGUMENT,
    cache_argument,
    document_starts,
    parameter_names,
    per_token,
)
from .traits import carries_state, keeps_documents_apart, passes_keywords


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What a stream layer's hook needs that no call changes, found once when the engine is installed: the
    model-wide ``settings``, the transformers ``configs`` its attention reads, the names of its forward's parameters
    and the one that takes the cache, and the fewest tokens a chunk may have.

    A layer holding a recurrent mixer (a module that reads transformers' cache state interface: Gated DeltaNet,
    Mamba) gets chunks of at least two tokens: on one token such a mixer takes its decoding path, which updates the
    state it is given in place, and a state that later chunks differentiate through cannot be changed in place.
    ``adapters``: its family traits (:mod:`.adapters`: nested layers, continued mixers, stacked streams, a state
    argument, a mask read as a tensor), composed around each chunk's run. ``from_prefix``: the arguments each chunk
    gets from its first key position on, not from its own first position: a decoder's position history
    (:func:`~.traits.keeps_position_history`). ``apart``: whether the layer's recurrent mixers start each document
    of a packed row from a zero state (they hand the row's sequence descriptors to their kernels,
    :func:`~.traits.keeps_documents_apart`), ``False`` where they run across documents, ``None`` where they do so
    in part (or it has none). ``varlen_attention``: the model's own attention implementation (when the engine is
    installed) is a flash attention, whose variable-length kernel keeps a packed row's documents apart whatever the
    mask (:func:`_varlen_documents`). ``recurrent``: it holds a recurrent or convolution mixer
    (:func:`~.traits.carries_state`)."""

    settings: StreamSettings
    configs: tuple
    parameter_names: tuple[str, ...]
    cache_name: str
    min_chunk: int = 1
    adapters: tuple[LayerAdapter, ...] = ()
    from_prefix: tuple[str, ...] = ()
    apart: bool | None = None
    varlen_attention: bool = False
    compress_rates: dict[int, int] = dataclasses.field(default_factory=dict)
    recurrent: bool = False

    @classmethod
    def of(cls, layer: nn.Module, settings: StreamSettings, position_history: bool = False) -> LayerPlan:
        """The plan of ``layer``; ``position_history``: its decoder hands it the rotary embeddings of every cached
        position (:func:`~.traits.keeps_position_history`)."""
        names = tuple(parameter_names(layer))
        cache_name = next((k for k in CACHE_KWARGS if k in names), None)
        if cache_name is None and STATE_ARGUMENT in names:  # its state as an argument (xLSTM): served by the cache
            cache_name = STATE_ARGUMENT
        if cache_name is None and passes_keywords(type(layer)):  # the cache passed on through **kwargs (DeepSeek-V4)
            cache_name = "past_key_values"
        if cache_name is None:
            raise ValueError(f"StreamBP: {type(layer).__name__}.forward takes no key/value cache argument.")
        mixers = {type(m) for m in layer.modules() if carries_state(type(m))}
        recurrent = bool(mixers)
        kinds = {keeps_documents_apart(m) for m in mixers}
        apart = kinds.pop() if len(kinds) == 1 else None  # (None also where a mixer resets its convolution alone)
        rates = compress_rates(layer)
        # (a one-token call is a compressed attention's decoding path: it attends to every compressed entry)
        min_chunk = 2 if recurrent or rates else 1
        from_prefix = HISTORY_ARGUMENTS if position_history else ()
        configs = stream_configs(layer)
        return cls(
            settings=settings,
            configs=configs,
            parameter_names=names,
            cache_name=cache_name,
            min_chunk=min_chunk,
            adapters=adapters_of(layer),
            from_prefix=from_prefix,
            apart=apart,
            varlen_attention=any(is_flash_attention_requested(c) for c in configs),
            compress_rates=rates,
            recurrent=recurrent,
        )


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def stream_checkpoint(plan: LayerPlan, forward: functools.partial, *args: torch.Tensor) -> torch.Tensor:
    """A streamed layer's ``_gradient_checkpointing_func``: ``forward`` is ``partial(layer.forward, layer, **kw)``.

    Args:
        plan: the layer's :class:`LayerPlan` (bound when the hook is installed).
        forward: the layer's undecorated forward with the call's keyword arguments, as transformers passes it.
        args: the call's positional arguments, the hidden states (batch, T, hidden) first.

    Returns:
        The layer's output hidden states, computed chunk by chunk; its backward is the exact gradient.

    A call that brings a real key/value cache, or a recurrent state to continue from (``state``: xLSTM's own eval loop
    over long sequences), without grad (generation while the model is in training mode) runs the layer as it is,
    filling the cache. Every other training call is streamed; a cache or state is then dropped, as Hugging Face
    gradient checkpointing does.

    .. warning::
        The layer's parameters and tensor arguments must not change in place between its forward and its backward,
        the backward runs once and is not differentiable (:mod:`.call.guards`), and the layer must return its hidden
        states, alone or with per-token tensors (:meth:`~.call.LayerCall.run`).
    """
    layer = forward.args[0]
    names = plan.parameter_names
    kwargs = {**dict(zip(names[1:], args[1:], strict=False)), **forward.keywords}
    cache = cache_argument(kwargs)
    if plan.cache_name == STATE_ARGUMENT and kwargs.get(STATE_ARGUMENT) is not None:
        cache = kwargs[STATE_ARGUMENT]  # a state given (xLSTM's own eval loop over long sequences, generation)
    if cache is not None and not isinstance(cache, ChunkCache) and not torch.is_grad_enabled():
        return forward(*args)
    given = args[0]
    x = given
    for adapter in plan.adapters:  # a family's own layout of the hidden states, as the chunks take them
        x = adapter.enter(x)
    batch, seq_len = x.shape[:2]
    attention_documents = _varlen_documents(plan, kwargs, seq_len)  # (before _documents takes the descriptors)
    starts = _documents(plan, layer, kwargs, batch, seq_len)
    for k in (*CACHE_KWARGS, plan.cache_name):
        kwargs.pop(k, None)
    mask = kwargs.get("attention_mask")
    # a StreamMask (attention layers), a user-given 4D mask (sliced per chunk as one), a (batch, T) padding mask or
    # None (recurrent and convolution mixers: sliced per chunk as any per-token argument); an attention without a
    # StreamMask is refused by the stream attention itself
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == seq_len:
        kwargs["attention_mask"] = StreamMask.of_dense(mask, batch)
    elif isinstance(mask, torch.Tensor) and tuple(mask.shape) != (batch, seq_len):
        raise ValueError(f"StreamBP: unexpected attention mask of shape {tuple(mask.shape)} for {seq_len} tokens.")
    if attention_documents:
        kwargs["attention_mask"] = mask.apart(attention_documents)
    sliced, grad_inputs = per_token(layer, kwargs, batch, seq_len)
    if set(grad_inputs) & set(plan.from_prefix):
        raise ValueError(
            f"StreamBP: {type(layer).__name__} receives {sorted(set(grad_inputs) & set(plan.from_prefix))} with "
            "gradient, as a position history spanning earlier positions, which a stream layer cannot differentiate."
        )
    decoder = active_call()
    index, decoder.layers_called = decoder.layers_called, decoder.layers_called + 1
    settings = decoder.settings or plan.settings  # the call's plan may offload otherwise than the model's settings
    params = [p for p in layer.parameters() if p.requires_grad]
    differentiated = torch.is_grad_enabled() and bool(x.requires_grad or grad_inputs or params)
    rebuildable = differentiated and input_rebuildable(layer, decoder)
    # join the segment of the previous stream layer (its output is x) while it has room, or start one of the size
    # the settings' keep_every or the call's plan gives this layer (1: keep its own input, no segment)
    size = decoder.segment_size(index, settings.keep_every)
    segment = decoder.segment_to_join(given) if rebuildable and (size > 1 or decoder.segment is not None) else None
    if segment is None and differentiated and size > 1:
        segment = Segment(size)
    call = LayerCall(
        layer=layer,
        func=wrapped(forward.func, plan.adapters),
        kwargs=kwargs,
        per_token=sliced,
        settings=settings,
        seq_len=seq_len,
        autocast=_autocast_state(x.device.type),
        configs=plan.configs,
        cache_name=plan.cache_name,
        grad_inputs=grad_inputs,
        from_prefix=plan.from_prefix,
        resets=starts,
        embedding_source=decoder.embeddings.source_of(given) if rebuildable else None,
        segment=segment,
        position=segment.joined if segment is not None else 0,
        chunk_size=decoder.chunk_size if decoder.chunk_size is not None else rule_of_thumb(seq_len),
        min_chunk=plan.min_chunk,
        # keys/values shared across layers (Gemma 3n, Gemma 4's E models)
        shared=decoder.shared_kv if kwargs.get("shared_kv_states") is not None else None,
        compress_rates=plan.compress_rates,
    )
    if not differentiated:
        y = call.forward_chunks(x, keep_kv=False, rng="none")[0]
        return call.as_returned(_left(y, plan.adapters), call.take_extras())
    if segment is not None:
        segment.join(call)  # at call.position
    y, *extras = _outputs(StreamLayerFunction.apply(call, x, *(kwargs[n] for n in grad_inputs), *params))
    y = _left(y, plan.adapters)
    if call.segment is not None:
        call.segment.left(y)
        decoder.segment = call.segment
    return call.as_returned(y, extras)


def _left(y: torch.Tensor, adapters: tuple[LayerAdapter, ...]) -> torch.Tensor:
    """The layer's output hidden states back in its family's own layout (the adapters' ``enter`` undone)."""
    for adapter in reversed(adapters):
        y = adapter.leave(y)
    return y


def _outputs(out: torch.Tensor | tuple) -> tuple:
    """The stream layer Function's outputs as a tuple: the hidden states, then any per-token outputs."""
    return out if isinstance(out, tuple) else (out,)


def _varlen_documents(plan: LayerPlan, kwargs: dict, seq_len: int) -> tuple[int, ...]:
    """Where a packed row's documents start (but the first), for a layer whose own attention is a flash attention
    given the row's sequence descriptors and a :class:`StreamMask` without padding: ``()`` otherwise. The model's
    own flash attention then runs its variable-length kernel over the documents (``cu_seq_lens``, or a single row's
    position ids where they restart: transformers' ``prepare_fa_kwargs_from_position_ids``), keeping them apart
    whatever the mask says (a model whose mask ignores packing, as Granite 4 hybrid's, built without the
    position ids, does; with SDPA or eager the model's attention follows that mask, and so does the stream's)."""
    mask = kwargs.get("attention_mask")
    if not plan.varlen_attention or not isinstance(mask, StreamMask) or mask.padding is not None:
        return ()
    if all(kwargs.get(k) is not None for k in PASS_THROUGH):
        return document_starts(kwargs["cu_seq_lens_q"], seq_len)
    positions = kwargs.get("position_ids")  # flash's other packed form: position ids that restart, one row
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape == (1, seq_len):
        return tuple(int(i) for i in (positions[0] == positions.min()).nonzero().flatten().tolist() if i > 0)
    return ()


def _documents(plan: LayerPlan, layer: nn.Module, kwargs: dict, batch: int, seq_len: int) -> tuple[int, ...]:
    """Where the call's packed row starts a new document, for a layer whose recurrent mixers keep documents apart
    (``()`` otherwise). A packed row comes with sequence descriptors (``cu_seq_lens_q``: TRL's padding-free
    collator, ``packing=True``); such a layer's chunks are then cut at every document start and each starts from a
    zero state there, as a new sequence does, so a chunk holds one document and its mixers get no descriptors
    (which describe the whole row). Attention keeps documents apart by its mask; a mixer that ignores the
    descriptors runs across documents, in the plain model and here alike."""
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    if plan.apart is False or not plan.recurrent:
        return ()
    if cu_seq_lens is None:
        if kwargs.get("seq_idx") is not None:
            raise ValueError(
                f"StreamBP: {type(layer).__name__} got `seq_idx` without `cu_seq_lens_q`: a packed row needs both "
                "(TRL's padding-free collator gives both)."
            )
        return ()
    refusal = packing_refusal(plan, layer)
    if refusal is not None:
        raise ValueError(refusal)
    if batch != 1:
        raise ValueError(
            f"StreamBP: packed rows (cu_seq_lens) describe one flattened row, got a batch of {batch} rows for "
            f"{type(layer).__name__}."
        )
    for k in PACKING_KWARGS:
        kwargs.pop(k, None)
    return document_starts(cu_seq_lens, seq_len)


def packing_refusal(plan: LayerPlan, layer: nn.Module) -> str | None:
    """Why ``layer`` (streamed by ``plan``) cannot take packed rows with sequence descriptors, or ``None``: its
    recurrent mixers keep the documents apart in part."""
    if plan.apart is not None or not plan.recurrent:
        return None
    return (
        f"StreamBP cannot stream packed rows (cu_seq_lens) through {type(layer).__name__}: its recurrent mixers keep "
        "the documents apart in part (some mixers and not others, or the convolution and not the scan). Train "
        "without packing / padding_free (padded rows)."
    )


def input_rebuildable(layer: nn.Module, decoder: DecoderCall) -> bool:
    """Whether ``layer``'s input may be rebuilt in backward (from the token ids, or by its segment) rather than kept:
    the decoder call collects no hidden states (``decoder.inputs_rebuildable``) and no forward hook other than
    transformers' output capturing (active only when hidden states are collected) watches the layer.

    Otherwise the input is the caller's, or may be a hook's, and rebuilding it would cost a recompute without freeing
    its memory, so the layer keeps it. (Correctness does not rest on this: a rebuilt input is checked to be what the
    layer used, see :mod:`.kept.rebuild` and :mod:`.kept.segments`.)
    """
    if not decoder.inputs_rebuildable or nn.modules.module._global_forward_hooks:
        return False
    return all(getattr(hook, "__name__", "") == "output_capturing_hook" for hook in layer._forward_hooks.values())
