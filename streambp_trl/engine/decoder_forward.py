"""The forward the engine installs on the decoder: in a streamed call it switches attention and masks to
``"streambp"`` (the masks become descriptions) and its layers to the stream hook, with the chunk of the call (and,
under a sequence split across ranks, the rank's share of the rows).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..attention import streaming
from ..layers import DecoderCall, decoder_call
from ..layers.layer_args import CACHE_KWARGS, PACKING_KWARGS, builds_cache, cache_argument
from ..layers.sequence_split import SequenceSplit
from ..layers.sharding import check_segmentable
from ..layers.traits import takes_state_argument
from ..patching import hooked_without_grad, original, temporarily, unpatched
from ..sizing.choices import StepPlan
from .mask_blocks import call_masks
from .state import EngineState
from .support import router_loss_refusal
from .whole_rows import current_share


def decoder_streams(training: bool, state: EngineState, kwargs: dict) -> bool:
    """Whether a decoder call with ``kwargs`` (the decoder's or its causal LM's) is streamed: in training (and in eval
    with ``stream_eval``), unless it is generation, a call without grad that brings a key/value cache or, for a decoder
    that builds its cache itself in generation's first call (xLSTM, whose layers take their state as an argument),
    asks for one (``use_cache=True``)."""
    cache = cache_argument(kwargs)
    builds_cache = kwargs.get("use_cache") is True and any(takes_state_argument(type(layer)) for layer in state.layers)
    generating = (cache is not None or builds_cache) and not torch.is_grad_enabled()
    return (training or state.options.stream_eval) and not generating


def stream_decoder_forward(self, state: EngineState, *args, **kwargs):
    """The decoder's forward: a streamed call (:func:`streamed_decoder_call`) where :func:`decoder_streams` says so;
    otherwise the model's own, with the layers as they were before the engine (no checkpoint hook: they fill the
    cache)."""
    if not decoder_streams(self.training, state, kwargs):
        with unpatched(state.layers):
            return original(self, "forward")(*args, **kwargs)
    return streamed_decoder_call(state, args, kwargs)


def streamed_decoder_call(state: EngineState, args: tuple, kwargs: dict, plan: StepPlan | None = None):
    """One streamed decoder call: masks as descriptions, layers chunked as ``plan`` says (else as the call's own plan
    says, :meth:`~.state.EngineState.call_for`). Builds the call's :class:`~streambp_trl.layers.DecoderCall` and
    hands it to the layer hooks."""
    decoder = state.decoder
    cache = cache_argument(kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"StreamBP cannot train {type(decoder).__name__} on top of a filled key/value cache (past_key_values); "
            "pass the whole sequence instead. (PEFT prefix tuning passes its prefix this way: use LoRA, or prompt "
            "tuning / p-tuning, which prepend embeddings.)"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True is not available while StreamBP streams the decoder in training mode: the "
            "(T x T) attention weights are never formed. Call the model in eval mode, or disable_streambp(model)."
        )
    state.check_layers()
    if torch.is_grad_enabled():  # (router logits without grad are exact values)
        check_router_logits(decoder, kwargs, decoder.config)
    packing_as_plain(decoder, args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
    kwargs["use_cache"] = False
    if "logits_to_keep" in kwargs:  # a decoder that would run its last layers on the kept positions only (Gemma 4's
        kwargs["logits_to_keep"] = 0  # KV-shared layers): every position, whose kept rows the head takes as before
    check_segmentable(decoder, state.options.choices.keep_every or 1)  # FSDP/ZeRO-3 may have come after enabling
    hidden_states_kept = bool(kwargs.get("output_hidden_states") or decoder.config.output_hidden_states)
    inputs = _inputs(args, kwargs)
    if plan is not None:
        call = DecoderCall(plan, state.offloader, len(state.layers), inputs_rebuildable=not hidden_states_kept)
    else:
        split = _call_split(state, inputs, kwargs)
        masks = call_masks(decoder.config, kwargs, split, state.kernel_apart)
        call = state.call_for(inputs, not hidden_states_kept, split.size if split else 1, masks)
        if split is not None:
            _split(state, call, split, inputs, kwargs)
        if torch.is_grad_enabled() and call.plan is not None:
            state.say_if_unstreamed(inputs, call.plan.chunk)
    # the layers' own `training` flag (not their submodules') is what makes transformers call the stream hook: set it
    # for an eval-mode streamed call, so dropout and the like stay off
    with (
        streaming(state.configs),
        temporarily(state.layers, "training", True),
        contextlib.nullcontext() if torch.is_grad_enabled() else hooked_without_grad(state.layers),
        decoder_call(call),
        call.embeddings.watch(decoder) if call.inputs_rebuildable else contextlib.nullcontext(),
    ):
        return original(decoder, "forward")(*args, **kwargs)


def _call_split(state: EngineState, inputs: torch.Tensor | None, kwargs: dict) -> SequenceSplit | None:
    """The sequence split a streamed decoder call is one rank's share of, or ``None``: with the rows given whole, the
    share the caller cut (:mod:`.whole_rows`: the causal LM's forward in training, a distillation trainer's student
    and teacher), else in training mode (eval-mode calls stream whole rows) the rows this rank holds (each rank a
    share, checked alike across the group)."""
    if state.sequence_group is None:
        return None
    if state.whole_rows:  # (in any mode: a teacher's no-grad pass on the share its student's trainer cut too)
        share = current_share()
        if share is not None:
            _check_undescribed(kwargs)
        return share
    if not state.decoder.training:
        return None
    if inputs is None or inputs.dim() < 2:
        raise ValueError("StreamBP: a sequence split across ranks needs input_ids or inputs_embeds of (batch, T).")
    _check_undescribed(kwargs)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        mask = None  # (a 4D mask: refused by the layers)
    positions = kwargs.get("position_ids")
    return SequenceSplit.of(
        state.sequence_group(), inputs.shape[1], mask, state.split_draws, positions, state.kernel_apart,
        inputs.shape[0],
    )  # fmt: skip


def _check_undescribed(kwargs: dict) -> None:
    """Refuse a split call given packed rows' sequence descriptors: they describe one rank's share or the whole rows,
    and the split keeps the documents apart by the positions alone."""
    described = [k for k in PACKING_KWARGS if kwargs.get(k) is not None]
    if described:
        raise ValueError(
            f"StreamBP cannot split a call given {', '.join(described)} across ranks: pass packed rows by their "
            "global position_ids alone, which restart where a document starts (the engine keeps the documents apart "
            "across the ranks by them), or train without the sequence split."
        )


def _split(state: EngineState, call: DecoderCall, split: SequenceSplit, inputs: torch.Tensor, kwargs: dict) -> None:
    """Make ``call`` one rank's share of sequences split as ``split`` says: the plan of the group's first rank (every
    rank then issues the same collectives: :mod:`~streambp_trl.layers.sequence_split`), where none are given, global
    ``position_ids`` from the rank's offset and, for packed rows, an all-ones attention mask."""
    call.split = split
    plans = [call.plan]
    dist.broadcast_object_list(plans, src=dist.get_global_rank(split.group, 0), group=split.group)
    call.plan = plans[0]
    if kwargs.get("position_ids") is None:
        positions = torch.arange(split.offset, split.end, device=inputs.device)
        kwargs["position_ids"] = positions.expand(inputs.shape[0], -1)
    if split.documents:
        if "chunked_attention" in (getattr(state.decoder.config, "layer_types", None) or ()):
            raise ValueError(
                f"StreamBP cannot split packed rows across ranks for {type(state.decoder).__name__}'s chunked "
                "attention, whose chunks count from each document's start: train with padded rows, or without the "
                "sequence split."
            )
        # an all-ones mask: transformers reads no packed rows from this rank's share of the positions (they would be
        # its share's documents, not the whole rows'); every layer keeps the split's documents apart instead
        kwargs["attention_mask"] = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)


def check_router_logits(model: nn.Module, kwargs: dict, config) -> None:
    """Refuse a streamed call that asks for an MoE model's router logits (the call's ``output_router_logits``, else
    its ``config``'s, which the user may have set after enabling): their load-balancing loss would be missing from
    the streamed loss, or get no gradient (:func:`~.support.router_loss_refusal`)."""
    asked = kwargs.get("output_router_logits")
    if asked is None and getattr(config, "output_router_logits", False):
        setting = "config.output_router_logits=True"
    elif asked:
        setting = "output_router_logits=True in the call"
    else:
        return
    raise router_loss_refusal(
        f"StreamBP cannot train {type(model).__name__} exactly",
        setting,
        "Call without output_router_logits and keep config.output_router_logits=False.",
    )


def packing_as_plain(decoder: nn.Module, args: tuple, kwargs: dict) -> None:
    """Give a decoder call with ``position_ids`` and no attention mask an all-ones one where its plain forward would
    build a key/value cache: the streamed call then attends as the plain one does.

    transformers reads packed rows from position ids that restart only in a call without a cache (masking_utils'
    packed-sequence detection: "generally a training setup"). A decoder's own forward builds a cache when
    ``use_cache`` is on (the argument, else ``config.use_cache``, which is on by default; off under Hugging Face
    gradient checkpointing in training), so such a call (``model(input_ids, position_ids=..., labels=...)`` with
    ``use_cache`` left at its default) attends across the documents. A streamed call has no cache; an all-ones mask
    turns the detection off as the cache does and masks nothing (TRL's padding-free batches pass
    ``use_cache=False``: their documents stay apart, in both)."""
    inputs = _inputs(args, kwargs)
    if (
        builds_cache(decoder, kwargs)
        and kwargs.get("position_ids") is not None
        and kwargs.get("attention_mask") is None
        and len(args) <= 1  # (a positional attention mask would follow the inputs)
        and inputs is not None
    ):
        kwargs["attention_mask"] = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)


def _inputs(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The token ids (or input embeddings) of a decoder call, if recognisable."""
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args and isinstance(args[0], torch.Tensor):
        inputs = args[0]
    return inputs
