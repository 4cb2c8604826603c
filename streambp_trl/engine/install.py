"""Installing StreamBP on a Hugging Face causal LM: ``enable_streambp`` / ``disable_streambp``.

After :func:`enable_streambp`, in training mode,

* every decoder layer (each ``GradientCheckpointingLayer`` of ``model.get_decoder()``) runs through the
  stream-checkpointed Function of :mod:`streambp_trl.layers.stream_layer`, with attention and masks from
  :mod:`streambp_trl.attention`;
* ``model(..., labels=labels)`` computes the causal-LM loss through the chunked logit kernel of
  :mod:`streambp_trl.logits` (``logits`` is ``None``: they are never built), and
* ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput`` from the same kernel,
  whether or not TRL's ``add_fused_lm_head`` patched the model first.

Everything the engine installs lives on the model's own modules, as instance attributes recorded in each module's
``_streambp_patches`` (so ``copy.deepcopy`` and ``torch.save(model)`` / ``torch.load`` copy a streaming model, and
:func:`disable_streambp` puts back exactly what was there); the model's config is changed only for the duration of a
streamed call. The engine owns the decoder layers' checkpoint hook while enabled: transformers'
``gradient_checkpointing_enable/disable`` (and TRL's ``disable_gradient_checkpointing`` context around reference and
old-policy passes) still apply to every other module, but the decoder layers keep streaming.

In eval mode the layers, the attention and ``labels=`` calls behave as before (``fused_lm_head=True`` still
uses the kernel, as TRL's own head does). Generation works in either mode: a decoder call with a key/value cache and
no grad runs the layers as they were before the engine (with their cache and their own checkpointing settings).
Nothing is saved differently: ``save_pretrained`` writes the same files, loadable by plain transformers.
"""

from __future__ import annotations

import functools

from torch import nn
from transformers import PreTrainedModel

from ..layers import KV_MODES, StreamSettings, stream_checkpoint
from ..layers.offload import CheckpointOffload
from ..layers.segments import check_segmentable
from ..logits import STAT_OUTPUTS
from ..patching import Method, guarded_set_gradient_checkpointing, patch, unpatch
from ..sizing.auto import AUTO, AutoChunks
from ..sizing.memory_model import parse_budget
from . import probe
from .forwards import StreamState, head_logits, stream_decoder_forward, stream_forward
from .model_parts import causal_lm, decoder_layers, final_norm_name, find_decoder, lm_head_linear
from .support import check_peft_method, check_supported, refuse
from .zero3 import mark_zero3_leaves, zero3_enabled


def _chunk(name: str, value) -> int | str:
    if value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer number of tokens or 'auto', got {value!r}.")
    return value


def enable_streambp(
    model: nn.Module,
    *,
    stream_chunk_size: int | str,
    logits_chunk_size: int | str | None = None,
    kv_mode: str = "recompute",
    temperature: float = 1.0,
    fused_outputs: tuple[str, ...] = ("log_probs",),
    stream_eval: bool = False,
    verify: bool = True,
    offload_checkpoints: bool = False,
    memory_budget: int | str | None = None,
    keep_every: int = 1,
) -> nn.Module:
    """Stream ``model``'s decoder layers and LM head along the sequence in training; returns ``model``.

    Raises ``ValueError`` naming the model class and the reason when the model cannot be streamed exactly: by its
    configuration and structure, and (``verify=True``) by running a short probe input through the model's own
    forward and through the engine (see :mod:`streambp_trl.engine.probe`).

    Args:
        model: a transformers causal LM, or a PEFT model wrapping one.
        stream_chunk_size: tokens per chunk of each decoder layer's forward and backward, or ``"auto"``: for each
            (batch, length) the largest chunk whose estimated peak fits ``memory_budget`` (see
            :mod:`streambp_trl.sizing.auto`).
        logits_chunk_size: tokens per tile of the logit kernel, or ``"auto"`` (default: ``stream_chunk_size``).
        kv_mode: ``"recompute"`` (default) or ``"capture"``, how a layer's backward gets its keys/values.
        temperature: divides the logits of ``fused_lm_head=True`` calls (TRL's GRPO temperature).
        fused_outputs: fields of ``FusedCausalLMOutput`` computed by ``fused_lm_head=True`` calls, among
            ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``.
        stream_eval: stream the decoder in eval mode too (calls without a key/value cache), as the no-grad passes of
            a frozen reference model need to reach the training length; otherwise eval mode is the model's own.
        verify: run the probe (two forward passes of 11 tokens) before returning.
        offload_checkpoints: keep each layer's saved input (and kept keys/values) in pinned host memory between
            forward and backward, brought back one layer ahead (see :mod:`streambp_trl.layers.offload`); a no-op on
            CPU.
        memory_budget: device bytes (or a size such as ``"78GiB"``) the step may use, for ``"auto"`` chunk sizes;
            ``None``: the free memory of the CUDA device when a call starts.
        keep_every: keep only the first input of every ``keep_every`` consecutive decoder layers (on the device, or
            in host memory with ``offload_checkpoints``); each segment's other layers rebuild theirs in backward by
            one more chunked forward (see :mod:`streambp_trl.layers.segments`). Not with ZeRO-3 or FSDP.
    """
    _chunk("stream_chunk_size", stream_chunk_size)
    logits_chunk_size = _chunk("logits_chunk_size", logits_chunk_size or stream_chunk_size)
    budget = None if memory_budget is None else parse_budget(memory_budget)
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {KV_MODES}, got {kv_mode!r}.")
    for name, flag in (("stream_eval", stream_eval), ("verify", verify), ("offload_checkpoints", offload_checkpoints)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}.")
    if isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1:
        raise ValueError(f"keep_every must be a positive integer number of layers, got {keep_every!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}.")
    unknown = set(fused_outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown fused_outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    lm = causal_lm(model)
    check_peft_method(model, lm)
    if getattr(lm, "_streambp", None) is not None:
        disable_streambp(lm)
    decoder = find_decoder(lm)
    layers = decoder_layers(decoder) if decoder is not None else []
    check_supported(lm, decoder, layers)
    lm_head_linear(lm)
    if zero3_enabled(lm):
        mark_zero3_leaves(lm)
    check_segmentable(lm, keep_every)
    reference = None
    norm_name = final_norm_name(decoder)
    if verify:
        reference = probe.reference(
            lm,
            decoder,
            functools.partial(head_logits, lm),
            functools.partial(refuse, lm),
            getattr(decoder, norm_name) if norm_name else None,
        )
        if reference is not None and not reference.norm_last:
            norm_name = None

    offload = CheckpointOffload() if offload_checkpoints else None
    auto = (
        AutoChunks(lm, budget, offload_checkpoints, keep_every)
        if AUTO in (stream_chunk_size, logits_chunk_size)
        else None
    )
    settings = StreamSettings(stream_chunk_size, kv_mode, offload, auto, keep_every)
    _install(lm, decoder, layers, StreamSettings(probe.PROBE_CHUNK, kv_mode) if reference else settings)
    patch(decoder, "_streambp_eval", bool(stream_eval))
    patch(decoder, "_streambp_keep_every", keep_every)
    patch(decoder, "_streambp_auto", None if reference else auto)  # the probe streams in chunks of PROBE_CHUNK
    lm._streambp = StreamState(
        settings=settings,
        logits_chunk_size=logits_chunk_size,
        temperature=float(temperature),
        fused_outputs=tuple(dict.fromkeys(("log_probs", *fused_outputs))),
        final_norm=norm_name,
    )
    if reference is not None:
        try:
            probe.check_streamed(lm, decoder, reference, functools.partial(refuse, lm))
        except ValueError:
            disable_streambp(lm)
            raise
        for layer in layers:
            patch(layer, "_gradient_checkpointing_func", functools.partial(stream_checkpoint, settings))
        patch(decoder, "_streambp_auto", auto)
    return model


def _install(lm: PreTrainedModel, decoder: PreTrainedModel, layers: list, settings: StreamSettings) -> None:
    hook = functools.partial(stream_checkpoint, settings)
    for layer in layers:
        patch(layer, "gradient_checkpointing", True)
        patch(layer, "_gradient_checkpointing_func", hook)
        patch(layer, "_streambp_recycle", False)  # set for a streamed call that keeps no hidden states
        patch(layer, "_streambp_chunk", None)  # set for a streamed call whose chunk "auto" chose
    for module in lm.modules():
        if isinstance(module, PreTrainedModel):
            patch(module, "_set_gradient_checkpointing", Method(guarded_set_gradient_checkpointing, module))
    patch(decoder, "_streambp_layers", layers)  # read on every decoder call (each generated token)
    patch(decoder, "forward", Method(stream_decoder_forward, decoder, wraps="forward"))
    patch(lm, "forward", Method(stream_forward, lm, wraps="forward"))


def disable_streambp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_streambp`; returns ``model``."""
    lm = causal_lm(model)
    if getattr(lm, "_streambp", None) is None:
        return model
    for module in lm.modules():
        unpatch(module)
    lm._streambp = None
    return model


def is_streaming(model: nn.Module) -> bool:
    """Whether ``model``'s decoder layers stream: StreamBP is enabled and every layer still has the stream hook."""
    lm = causal_lm(model)
    if getattr(lm, "_streambp", None) is None:
        return False
    decoder = find_decoder(lm)
    layers = decoder_layers(decoder) if decoder is not None else []
    return bool(layers) and all(
        layer.gradient_checkpointing
        and isinstance(layer._gradient_checkpointing_func, functools.partial)
        and layer._gradient_checkpointing_func.func is stream_checkpoint
        for layer in layers
    )


def chunk_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """``(stream, logits)`` chunk sizes of ``model``'s latest streamed call (fixed ones, or what "auto" chose last;
    ``None`` before any call or without StreamBP)."""
    state = getattr(causal_lm(model), "_streambp", None)
    if state is None:
        return None, None
    stream = state.settings.chunk_size
    if stream == AUTO:
        stream = state.settings.auto.last
    logits = state.logits_chunk_size
    return stream, stream if logits == AUTO else logits
