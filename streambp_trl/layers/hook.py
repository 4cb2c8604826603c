"""The stream layers' checkpoint hook: what a decoder layer call becomes in a streamed forward.

:func:`stream_checkpoint`, bound to the layer's :class:`LayerFacts`, is installed once as each Hugging Face decoder
layer's ``_gradient_checkpointing_func`` (the hook transformers' ``GradientCheckpointingLayer`` calls in training mode
with ``partial(layer.forward, **kwargs)`` and the hidden states). It binds the call's arguments and hands them
through the layer's family adapters (:mod:`.adapters`: the only place a model family is special), takes the plan of
the decoder call in progress (:func:`~.decoder_call.active_call`: chunk, kept inputs, offload, key/value mode),
decides what the layer keeps for its backward (its input; or nothing, when the input is rebuilt from the token ids
or by its segment; see :mod:`.kept.rebuild` and :mod:`.kept.segments`) and runs the layer through
:class:`~streambp_trl.layers.call.stream_layer.StreamLayerFunction`.

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

from ..attention import StreamMask, stream_configs
from ..sizing.choices import PlanChoices, StepPlan
from .adapters import CallArguments, LayerAdapter, adapters_of, wrapped
from .call import LayerCall, StreamLayerFunction, keeps_activations, returned
from .carry import ChunkCache
from .compiled import LayerCompile, compiled_forward
from .decoder_call import DecoderCall, active_call
from .kept import Segment
from .layer_args import CACHE_KWARGS, cache_argument, parameter_names, per_token
from .sequence_split import SequenceSplit


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What a stream layer's hook needs that no call changes, found once when the engine is installed: the user's
    plan ``choices``, the transformers ``configs`` its attention reads, the names of its forward's parameters
    and the one that takes the cache, and its family ``adapters`` (:mod:`.adapters`), whose facts it reads:
    the fewest tokens a chunk may have, the arguments sliced from a chunk's first key position, the compressed
    attentions' cache slots; and how its per-chunk body is compiled (``compiled``; ``None``: eager)."""

    choices: PlanChoices
    configs: tuple
    parameter_names: tuple[str, ...]
    cache_name: str
    adapters: tuple[LayerAdapter, ...] = ()
    compiled: LayerCompile | None = None

    @classmethod
    def of(cls, layer: nn.Module, choices: PlanChoices, decoder: type, compiled: LayerCompile | None) -> LayerFacts:
        """The facts of ``layer``, a layer of a ``decoder`` class, streamed with the user's ``choices`` and compiled
        as ``compiled`` says."""
        names = tuple(parameter_names(layer))
        adapters = adapters_of(layer, decoder)
        cache_name = next((k for k in CACHE_KWARGS if k in names), None)
        cache_name = cache_name or next((a.cache_name for a in adapters if a.cache_name is not None), None)
        if cache_name is None:
            raise ValueError(f"StreamBP: {type(layer).__name__}.forward takes no key/value cache argument.")
        return cls(
            choices=choices,
            configs=stream_configs(layer),
            parameter_names=names,
            cache_name=cache_name,
            adapters=adapters,
            compiled=compiled,
        )

    def body(self, forward: object) -> object:
        """What each chunk runs, ``body(layer, x, **kwargs)``: the layer's own ``forward``, compiled where asked,
        with its family's adapters around it."""
        own = forward if self.compiled is None else compiled_forward(forward, self.compiled)
        return wrapped(own, self.adapters)

    @property
    def min_chunk(self) -> int:
        return max((a.min_chunk for a in self.adapters), default=1)

    @property
    def from_prefix(self) -> tuple[str, ...]:
        return tuple(name for a in self.adapters for name in a.from_prefix)

    @property
    def kernel_apart(self) -> bool:
        """Whether the layer's own attention keeps a packed row's documents apart whatever its mask says."""
        return any(a.kernel_apart for a in self.adapters)

    @property
    def compress_rates(self) -> dict[int, int]:
        return {slot: rate for a in self.adapters for slot, rate in a.compress_rates.items()}

    def unplanned(self, seq_len: int) -> StepPlan:
        """The plan of a layer call on ``seq_len`` tokens in a decoder call without one (no length to plan for, or a
        layer called directly): the user's choices at the rule of thumb for its length."""
        return self.choices.fixed(seq_len)

    def packing_refusal(self, layer: nn.Module) -> str | None:
        """Why ``layer`` cannot take packed rows with sequence descriptors (TRL's padding-free rows), or ``None``."""
        return next((r for a in self.adapters if (r := a.packing_refusal(layer)) is not None), None)


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def stream_checkpoint(facts: LayerFacts, forward: functools.partial, *args: torch.Tensor) -> torch.Tensor:
    """A streamed layer's ``_gradient_checkpointing_func``: ``forward`` is ``partial(layer.forward, layer, **kw)``.

    Args:
        facts: the layer's :class:`LayerFacts` (bound when the hook is installed).
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
    names = facts.parameter_names
    kwargs = {**dict(zip(names[1:], args[1:], strict=False)), **forward.keywords}
    given_state = cache_argument(kwargs)
    given_state = next((st for a in facts.adapters if (st := a.given_state(kwargs)) is not None), given_state)
    if given_state is not None and not isinstance(given_state, ChunkCache) and not torch.is_grad_enabled():
        return forward(*args)
    given = args[0]
    x = given
    for adapter in facts.adapters:  # a family's own layout of the hidden states, as the chunks take them
        x = adapter.enter(x)
    batch, seq_len = x.shape[:2]
    decoder = active_call()
    bound = _bound_arguments(facts, layer, kwargs, batch, seq_len, decoder)
    kwargs = bound.kwargs if decoder.split is None else _whole_rows_masked(bound.kwargs, decoder.split)
    sliced, grad_inputs = per_token(layer, kwargs, batch, seq_len)
    index, decoder.layers_called = decoder.layers_called, decoder.layers_called + 1
    run = decoder.plan if decoder.plan is not None else facts.unplanned(seq_len)
    params = [p for p in layer.parameters() if p.requires_grad]
    differentiated = torch.is_grad_enabled() and bool(x.requires_grad or grad_inputs or params)
    rebuildable = differentiated and input_rebuildable(layer, decoder)
    segment = _segment(decoder, decoder.segment_size(index, run), given, rebuildable, differentiated)
    kept = run.keeps(index, decoder.layers)
    whole = keeps_activations(layer, kept, bound.shared, bool(facts.compress_rates), segment is not None)
    split = decoder.split
    call = LayerCall(
        layer=layer,
        func=facts.body(forward.func),
        kwargs=kwargs,
        per_token=sliced,
        kv_mode=run.kv_mode,
        offload=decoder.offload(run),
        seq_len=split.end if split is not None else seq_len,
        autocast=_autocast_state(x.device.type),
        configs=facts.configs,
        cache_name=facts.cache_name,
        grad_inputs=grad_inputs,
        from_prefix=facts.from_prefix,
        resets=bound.resets,
        embedding_source=decoder.embeddings.source_of(given) if rebuildable else None,
        segment=segment,
        position=segment.joined if segment is not None else 0,
        chunk=run.chunk,
        keeps_activations=whole and split is None,  # (a split layer's backward recomputes: :mod:`.sequence_split`)
        keeps_attention=run.keep_attention and not whole,
        min_chunk=facts.min_chunk,
        shared=bound.shared,
        compress_rates=facts.compress_rates,
        split=split,
    )
    if split is not None:
        _check_split(call, seq_len)
    if not differentiated:
        ran = call.forward_chunks(x, recorded=False)
        return returned(_left(ran.y, facts.adapters), ran.extras, ran.nones)
    y, *extras = _outputs(StreamLayerFunction.apply(call, x, *(kwargs[n] for n in grad_inputs), *params))
    nones = StreamLayerFunction.nones_of(y)
    y = _left(y, facts.adapters)
    if segment is not None:
        segment.left(y)
        decoder.segment = segment
    return returned(y, extras, nones)


def _whole_rows_masked(kwargs: dict, split: SequenceSplit) -> dict:
    """A split call's arguments with each :class:`StreamMask` reading the whole rows' padding (``split.padding``:
    every rank's share, gathered) and keeping their documents apart (``split.documents``, in global positions)
    instead of this rank's share's, since its keys span the earlier ranks' positions."""

    def placed(v: object) -> object:
        if not isinstance(v, StreamMask):
            return v
        return dataclasses.replace(v, padding=split.padding, documents=split.documents)

    return {k: {n: placed(m) for n, m in v.items()} if isinstance(v, dict) else placed(v) for k, v in kwargs.items()}


def _check_split(call: LayerCall, seq_len: int) -> None:
    """Refuse a layer call on one rank's share of a split sequence (:mod:`.sequence_split`) that the split does not
    serve: a user-given 4D mask, or an input of another length than the split's share."""
    name = type(call.layer).__name__
    if seq_len != call.split.length:
        raise ValueError(
            f"StreamBP: {name} got {seq_len} tokens on a rank whose share of the sequence is {call.split.length}."
        )
    if any(m.dense is not None for m in call.masks):
        raise ValueError(
            f"StreamBP cannot split the sequence of {name} across ranks with a 4D attention mask: pass a 2D "
            "attention_mask (or none) with the rows' global position_ids, as DeepSpeed's Ulysses data path hands them "
            "out, or train without the sequence split."
        )


def _bound_arguments(
    facts: LayerFacts, layer: nn.Module, kwargs: dict, batch: int, seq_len: int, decoder: DecoderCall
) -> CallArguments:
    """Binding a layer call: its keyword arguments handed through the family adapters in order (documents cut, masks
    kept apart, keys/values shared across the decoder call's layers), without the cache arguments, and with the mask
    as the chunks take it: a :class:`~streambp_trl.attention.StreamMask` (attention layers; a user-given 4D mask
    becomes one, sliced per chunk), a (batch, T) padding mask or ``None`` (recurrent and convolution mixers: sliced
    per chunk as any per-token argument). An attention without a StreamMask is refused by the stream attention."""
    bound = CallArguments(kwargs=kwargs, batch=batch, seq_len=seq_len)
    for adapter in facts.adapters:
        bound = adapter.bind(layer, bound, decoder.shared_kv)
    kwargs = {k: v for k, v in bound.kwargs.items() if k not in (*CACHE_KWARGS, facts.cache_name)}
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == seq_len:
        kwargs["attention_mask"] = StreamMask.of_dense(mask, batch)
    elif isinstance(mask, torch.Tensor) and tuple(mask.shape) != (batch, seq_len):
        raise ValueError(f"StreamBP: unexpected attention mask of shape {tuple(mask.shape)} for {seq_len} tokens.")
    return dataclasses.replace(bound, kwargs=kwargs)


def _segment(
    decoder: DecoderCall, size: int, given: torch.Tensor, rebuildable: bool, differentiated: bool
) -> Segment | None:
    """Deciding what a layer keeps: the segment of the previous stream layer, joined where ``given`` (the layer's
    input) is that layer's output and the segment has room, or a new one of ``size`` layers (the call's plan's for
    this layer) which this layer starts by keeping its input; ``None`` (1: the layer keeps its own input)."""
    segment = decoder.segment_to_join(given) if rebuildable and (size > 1 or decoder.segment is not None) else None
    if segment is None and differentiated and size > 1:
        segment = Segment(size)
    return segment


def _left(y: torch.Tensor, adapters: tuple[LayerAdapter, ...]) -> torch.Tensor:
    """The layer's output hidden states back in its family's own layout (the adapters' ``enter`` undone)."""
    for adapter in reversed(adapters):
        y = adapter.leave(y)
    return y


def _outputs(out: torch.Tensor | tuple) -> tuple:
    """The stream layer Function's outputs as a tuple: the hidden states, then any per-token outputs."""
    return out if isinstance(out, tuple) else (out,)


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
