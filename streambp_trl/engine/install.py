"""Installing StreamBP on a Hugging Face causal LM: ``enable_streambp`` / ``disable_streambp``.

After :func:`enable_streambp`, in training mode,

* every decoder layer (each ``GradientCheckpointingLayer`` of ``model.get_decoder()``) runs through the
  stream-checkpointed Function of :mod:`streambp_trl.layers.call.stream_layer`, with attention and masks from
  :mod:`streambp_trl.attention`;
* ``model(..., labels=labels)`` computes the causal-LM loss through the chunked logit kernel of
  :mod:`streambp_trl.logits` (``logits`` is ``None``: they are never built), and
* ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput`` from the same kernel,
  whether or not TRL's ``add_fused_lm_head`` patched the model first.

What the engine found and chose is one :class:`~.state.EngineState`, kept as ``model._streambp``; the forwards and the
layer hooks it installs are bound to it (and each layer's hook to that layer's
:class:`~streambp_trl.layers.LayerFacts`), installed once. They live on the model's own modules, as instance attributes
recorded in each module's ``_streambp_patches`` (so ``copy.deepcopy`` and ``torch.save(model)`` / ``torch.load`` copy a
streaming model, and :func:`disable_streambp` puts back exactly what was there); the model's config is changed only for
the duration of a streamed call. The engine owns the decoder layers' checkpoint hook while enabled: transformers'
``gradient_checkpointing_enable/disable`` (and TRL's ``disable_gradient_checkpointing`` context around reference and
old-policy passes) still apply to every other module, but the decoder layers keep streaming.

In eval mode the layers, the attention and ``labels=`` calls behave as before (``fused_lm_head=True`` still
uses the kernel, as TRL's own head does). Generation works in either mode: a decoder call with a key/value cache and
no grad runs the layers as they were before the engine (with their cache and their own checkpointing settings).
Nothing is saved differently: ``save_pretrained`` writes the same files, loadable by plain transformers.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn
from transformers import PreTrainedModel

from ..attention import stream_configs
from ..layers import LayerFacts, stream_checkpoint
from ..layers.sharding import check_segmentable
from ..logits.forms import HeadForm
from ..logs import get_logger
from ..patching import Method, guarded_set_gradient_checkpointing, patch, unpatch
from ..sizing.auto import AutoChunks
from ..sizing.choices import KVMode, StepPlan
from . import probe
from .decoder_forward import stream_decoder_forward, streamed_decoder_call
from .lm_forward import head_logits, stream_forward
from .model_parts import (
    causal_lm,
    decoder_keywords,
    decoder_layers,
    final_norm,
    final_norm_name,
    find_decoder,
    lm_head_linear,
)
from .options import StreamOptions
from .quantized import holds_bitsandbytes
from .score_head import sequence_classifier, stream_score_forward
from .state import EngineState
from .support import check_peft_method, check_supported, refuse
from .zero3 import mark_zero3_leaves, zero3_enabled

logger = get_logger(__name__)


def enable_streambp(
    model: nn.Module,
    options: StreamOptions | None = None,
    *,
    sequence_group=None,
    whole_rows: bool = False,
    **overrides,
) -> nn.Module:
    """Stream ``model``'s decoder layers and LM head along the sequence in training; returns ``model``.

    Args:
        model: a transformers causal LM, or a decoder's ``*ForSequenceClassification`` (a reward model; its
            score head reads only the last non-pad token of each row: :mod:`.score_head`), or a PEFT model
            wrapping one.
        options: a :class:`~streambp_trl.engine.options.StreamOptions` (e.g. a config's ``to_options()``).
        overrides: :class:`~streambp_trl.engine.options.StreamOptions` fields, given one by one
            (``stream_chunk_size=4096``, ``kv_mode="capture"``, ...) or replacing those of ``options``.
        sequence_group: a ``torch.distributed`` process group (or a function returning it, asked at each call: a
            group the launcher builds later, such as DeepSpeed's sequence-parallel group) whose ranks each hold an
            equal, consecutive share of every row of a training call (rank q positions [q L, (q + 1) L), with their
            global ``position_ids`` and ``shift_labels``): each layer's attention then sees the whole sequence,
            streamed on every rank (:mod:`streambp_trl.layers.sequence_split`). The parameters' gradients are each
            rank's share: summing them over the group (DDP, DeepSpeed or an ``all_reduce``) gives the whole
            sequence's. Eval-mode calls stream whole rows on each rank.
        whole_rows: with ``sequence_group``, every rank is given the same whole rows (and ``labels``), cuts out its
            share and gathers the per-token outputs back (:mod:`.whole_rows`), so a loss over whole sequences runs
            as on one process on every rank; each rank's gradients are then R times its share's, and their average
            over the group (DDP's, ZeRO's) is the whole rows' gradient.

    Returns:
        ``model``, changed in place (see the module docstring); :func:`disable_streambp` undoes it.

    Raises:
        ValueError: a bad option (checked by :class:`StreamOptions`, before anything else), or a model that cannot be
            streamed exactly, naming the model class and the reason: by its configuration and structure, and
            (``verify=True``) by running a short probe input through the model's own forward and through the engine
            (see :mod:`streambp_trl.engine.probe`).
        TypeError: ``model`` is not a transformers model.

    .. warning::
        The engine owns the decoder layers' checkpointing while enabled. Between a streamed forward and its backward,
        parameters must not change in place, and a backward runs once (no ``retain_graph`` second pass, no
        ``create_graph``); each is refused with a clear error. A hook on ``lm_head`` is refused (the logits it would
        see are never formed); other module hooks run, per chunk for the layers' submodules.
    """
    if options is None:
        options = StreamOptions(**overrides)
    elif overrides:
        options = dataclasses.replace(options, **overrides)
    lm = causal_lm(model)
    check_peft_method(model, lm)
    if getattr(lm, "_streambp", None) is not None:
        disable_streambp(lm)
    decoder = find_decoder(lm)
    layers = decoder_layers(decoder) if decoder is not None else []
    classifier = sequence_classifier(lm)  # a *ForSequenceClassification model (reward model): a score head
    check_supported(lm, decoder, layers, lm_head=not classifier)
    if not classifier:
        lm_head_linear(lm)
    if zero3_enabled(lm):
        mark_zero3_leaves(lm)
    check_segmentable(lm, options.choices.keep_every or 1)
    norm_name = final_norm_name(decoder)
    norm = final_norm(decoder, norm_name) if norm_name else None
    baseline = None
    if options.verify:  # a sequence classifier's score head is applied as the model applies it: no logits to check
        probe.check_weights(lm, layers, functools.partial(refuse, lm))
        logits = None if classifier else functools.partial(head_logits, lm)
        baseline = probe.baseline(lm, decoder, logits, functools.partial(refuse, lm), norm)
    if baseline is not None and not baseline.norm_last:
        norm_name = None
    state = _engine_state(lm, decoder, layers, options, norm_name)
    if sequence_group is not None:
        _check_splittable(lm, state)
        state.sequence_group = sequence_group if callable(sequence_group) else GivenGroup(sequence_group)
        state.whole_rows = whole_rows
    _install(lm, state)
    if baseline is not None:
        _check_streamed(lm, state, baseline)
    return model


def _check_streamed(lm: PreTrainedModel, state: EngineState, baseline: probe.ProbeBaseline) -> None:
    """Run the probe through the engine just installed on ``lm``, in chunks of :data:`~.probe.PROBE_CHUNK` tokens with
    the user's other choices, against the model's own forward (``baseline``); where they differ, the engine is removed
    again and the refusal raised."""
    plan = dataclasses.replace(state.options.choices, chunk=probe.PROBE_CHUNK).fixed(probe.PROBE_CHUNK)
    streamed = functools.partial(streamed_decoder_call, state, plan=plan)
    try:
        probe.check_streamed(lm, state.decoder, baseline, streamed, functools.partial(refuse, lm))
    except ValueError:
        disable_streambp(lm)
        raise


class GivenGroup:
    """A sequence group given as it is (``EngineState.sequence_group`` asks a function for it). A copy of the model
    (``copy.deepcopy``: a reference model, an EMA copy) splits across the same group: a process group is not copied."""

    def __init__(self, group: object):
        self.group = group

    def __call__(self) -> object:
        return self.group

    def __deepcopy__(self, memo: dict) -> GivenGroup:
        return self


def _check_splittable(lm: PreTrainedModel, state: EngineState) -> None:
    """Refuse a sequence split for a model whose layers carry more than softmax keys/values between positions or need
    a family adapter the split does not serve (recurrent or convolution mixers, whose state would cross ranks; shared,
    compressed or indexed keys/values; nested or stacked layers), naming the first such layer and what it has."""
    for layer, facts in zip(state.layers, state.facts, strict=True):
        unserved = [a for a in facts.adapters if not a.splits]
        if unserved:
            names = ", ".join(type(a).__name__ for a in unserved)
            refuse(
                lm,
                f"its {type(layer).__name__} layers need the engine's {names} adapter, which a sequence split "
                "across ranks does not serve (only layers of one softmax attention are split); train it without "
                "sequence_group",
            )


def _engine_state(
    lm: PreTrainedModel, decoder: nn.Module, layers: list[nn.Module], options: StreamOptions, norm_name: str | None
) -> EngineState:
    """What the engine runs ``lm`` with: its layers' facts, the per-call plan policy where anything is planned
    (:class:`~streambp_trl.sizing.auto.AutoChunks`), and where the decoder and its final norm are."""
    auto = AutoChunks(lm, options.choices) if options.planned else None
    compiled = options.compiled
    if compiled is not None and any(holds_bitsandbytes(layer) for layer in layers):
        logger.warning(
            "StreamBP: torch_compile=True leaves the decoder layers eager: they hold bitsandbytes' quantized weights, "
            "whose kernels the compiler cannot run chunk by chunk."
        )
        compiled = None
    return EngineState(
        options=options,
        decoder=decoder,
        layers=layers,
        facts=tuple(LayerFacts.of(layer, options.choices, type(decoder), compiled) for layer in layers),
        configs=stream_configs(decoder, *layers),
        decoder_path=next(name for name, module in lm.named_modules() if module is decoder),
        norm_name=norm_name,
        auto=auto,
        decoder_keywords=decoder_keywords(lm, decoder),
    )


def _install(lm: PreTrainedModel, state: EngineState) -> None:
    for layer, facts in zip(state.layers, state.facts, strict=True):
        patch(layer, "gradient_checkpointing", True)
        hook = functools.partial(stream_checkpoint, facts)
        patch(layer, "_gradient_checkpointing_func", hook)
    for module in lm.modules():
        if isinstance(module, PreTrainedModel):
            patch(module, "_set_gradient_checkpointing", Method(guarded_set_gradient_checkpointing, module))
    patch(state.decoder, "forward", Method(stream_decoder_forward, state.decoder, state, wraps="forward"))
    forward = stream_score_forward if sequence_classifier(lm) else stream_forward
    patch(lm, "forward", Method(forward, lm, state, wraps="forward"))
    lm._streambp = state


def disable_streambp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_streambp`; returns ``model``."""
    lm = causal_lm(model)
    if getattr(lm, "_streambp", None) is None:
        return model
    for module in lm.modules():
        unpatch(module)
    lm._streambp = None
    return model


def packed_rows_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s streamed layers cannot take packed rows with sequence descriptors (TRL's padding-free batches),
    or ``None``; asked where a trainer knows it will feed them, so that it refuses at construction."""
    state = getattr(causal_lm(model), "_streambp", None)
    if state is None or (state.decoder_keywords is not None and "cu_seq_lens_q" not in state.decoder_keywords):
        return None  # (a forward that keeps them from its decoder: Mamba's, whose layers then never see them)
    for layer, facts in zip(state.layers, state.facts, strict=True):
        refusal = facts.packing_refusal(layer) if _hooked(layer) else None
        if refusal is not None:
            return refusal
    return None


def _hooked(layer: nn.Module) -> bool:
    """Whether ``layer`` still has the stream hook (checkpointing on, the hook not replaced)."""
    hook = layer._gradient_checkpointing_func
    return layer.gradient_checkpointing and getattr(hook, "func", None) is stream_checkpoint


def is_streaming(model: nn.Module) -> bool:
    """Whether ``model``'s decoder layers stream: StreamBP is enabled and every layer still has the stream hook."""
    state = getattr(causal_lm(model), "_streambp", None)
    return state is not None and bool(state.layers) and all(_hooked(layer) for layer in state.layers)


def chunk_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """``(stream, logits)`` chunk sizes of ``model``'s latest streamed call (fixed ones, or what "auto" chose last;
    ``None`` before any call or without StreamBP)."""
    state = getattr(causal_lm(model), "_streambp", None)
    return (None, None) if state is None else state.last_chunk_sizes()


def last_plan(model: nn.Module) -> StepPlan | None:
    """The plan of the latest streamed call of a streaming ``model`` (:mod:`streambp_trl.sizing.plan`), or ``None``
    (nothing planned: every choice fixed without a memory_budget, or not streaming)."""
    state = getattr(causal_lm(model), "_streambp", None)
    return None if state is None or state.auto is None else state.auto.last_plan


def plan_fields(model: nn.Module) -> dict[str, float]:
    """The latest streamed call of a streaming ``model`` as a Trainer's log fields: ``stream_chunk_size`` (fixed, or
    what the plan chose) and, where a plan was made, whether that call streamed at all (``stream_streamed``: its
    sequence longer than one chunk), the layer inputs it rebuilt in backward (``stream_inputs_rebuilt``), whether it
    offloaded them (``stream_offload``), kept the keys/values from the forward (``stream_kv_capture``) and how many
    layers kept their activations from the forward (``stream_layers_kept``, not recomputed in backward), and its
    predicted device peak (``stream_predicted_peak_gib``, where a memory figure is known). Empty before any call or
    without StreamBP."""
    state = getattr(causal_lm(model), "_streambp", None)
    stream, _ = (None, None) if state is None else state.last_chunk_sizes()
    fields = {} if stream is None else {"stream_chunk_size": stream}
    plan = last_plan(model)
    if plan is None:
        return fields
    fields.update(
        stream_streamed=float(plan.chunk < state.auto.last_shape[1]),
        stream_inputs_rebuilt=plan.layout.rebuilt(len(state.layers)),
        stream_offload=float(plan.offload),
        stream_kv_capture=float(plan.kv_mode == KVMode.CAPTURE),
        stream_layers_kept=min(plan.keep_activations, len(state.layers)),
    )
    if state.auto.last_peak is not None:
        fields["stream_predicted_peak_gib"] = round(state.auto.last_peak / 2**30, 3)
    return fields


def count_optimizer(model: nn.Module, optim: object, owner: object) -> bool:
    """Make the per-call plan of a streaming ``model`` count the state of the optimizer ``optim`` names
    (``TrainingArguments.optim``) from the first step, ``owner`` holding the optimizer once built
    (:meth:`~streambp_trl.sizing.auto.AutoChunks.count_optimizer`). ``False`` where nothing is planned (every choice
    fixed without a memory_budget, or not streaming). Raises ``ValueError`` for an optimizer the memory model does
    not size."""
    state = getattr(causal_lm(model), "_streambp", None)
    if state is None or state.auto is None:
        return False
    state.auto.count_optimizer(optim, owner)
    return True


def check_fits(model: nn.Module, rows: int, seq_len: int, padded: bool = False) -> None:
    """Before training: raise :class:`~streambp_trl.sizing.auto.NoPlanFits` (one line naming the shape, the memory
    and the longest length each way of running allows) where a training call of a streaming ``model`` on ``rows``
    sequences of ``seq_len`` tokens (``padded``: padded or packed rows, whose attention builds mask blocks) fits no
    way of running within its memory_budget (or, on CUDA, the free memory),
    its gradients and counted optimizer state included. Nothing is checked where nothing is planned or no memory
    figure is known (the CPU without a budget)."""
    state = getattr(causal_lm(model), "_streambp", None)
    params = next(model.parameters(), None)
    if state is not None and params is not None:
        state.check_fits(rows, seq_len, params.device, padded)


def last_head_form(model: nn.Module) -> HeadForm | None:
    """The logit kernel's gradient form (``"two-node"``, ``"fused"`` or ``"eager"``) of ``model``'s latest streamed
    call, as chosen for its memory budget or the free memory (``None`` before any call or without StreamBP)."""
    state = getattr(causal_lm(model), "_streambp", None)
    return None if state is None else state.head_form
