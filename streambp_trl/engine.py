"""Installing StreamBP on a Hugging Face causal LM: ``enable_streambp`` / ``disable_streambp``.

After :func:`enable_streambp`, in training mode,

* every decoder layer (each ``GradientCheckpointingLayer`` of ``model.get_decoder()``) runs through the
  stream-checkpointed Function of :mod:`streambp_trl.stream_layer`, with attention and masks from
  :mod:`streambp_trl.attention`;
* ``model(..., labels=labels)`` computes the causal-LM loss through the chunked logit kernel of
  :mod:`streambp_trl.logits` (``logits`` is ``None``: they are never built), and
* ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput`` from the same kernel,
  whether or not TRL's ``add_fused_lm_head`` patched the model first.

Everything the engine installs lives on the model's own modules, as instance attributes recorded in each module's
``_streambp_patches`` (so ``copy.deepcopy`` copies a streaming model, and :func:`disable_streambp` puts back exactly
what was there); the model's config is changed only for the duration of a streamed call. The engine owns the decoder
layers' checkpoint hook while enabled: transformers' ``gradient_checkpointing_enable/disable`` (and TRL's
``disable_gradient_checkpointing`` context around reference and old-policy passes) still apply to every other
module, but the decoder layers keep streaming.

In eval mode the layers, the attention and ``labels=`` calls behave as before (``fused_lm_head=True`` still
uses the kernel, as TRL's own head does). Generation works in either mode. Nothing is saved differently:
``save_pretrained`` writes the same files, loadable by plain transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput

from . import probe
from .attention import stream_configs, streaming
from .logits import STAT_OUTPUTS, chunked_logprobs
from .offload import CheckpointOffload
from .patching import bind, bypassed, guarded_set_gradient_checkpointing, original, patch, temporarily, unpatch
from .sizing.auto import AUTO, AutoChunks
from .sizing.memory_model import parse_size
from .stream_layer import KV_MODES, StreamSettings, stream_checkpoint
from .support import check_supported, refuse, takes_cache

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StreamState:
    """What :func:`enable_streambp` installed on a model, kept on it as ``model._streambp``."""

    settings: StreamSettings
    logits_chunk_size: int | str  # or "auto": the stream chunk of the call
    temperature: float
    fused_outputs: tuple[str, ...]
    final_norm: str | None = None  # the decoder's final norm, applied by the logit kernel tile by tile


# ---------------------------------------------------------------------------------------------------------------
# Finding the pieces


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper, if any."""
    if hasattr(model, "get_base_model") and callable(model.get_base_model):
        model = model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"StreamBP needs a transformers PreTrainedModel, got {type(model).__name__}.")
    return model


def _decoder(lm: PreTrainedModel) -> PreTrainedModel | None:
    """The decoder (the model that runs the layers), as ``get_decoder()`` finds it, or else the first transformers
    model among ``lm``'s submodules that holds decoder layers."""
    decoder = lm.get_decoder()
    if isinstance(decoder, PreTrainedModel) and decoder is not lm:
        return decoder
    for module in lm.modules():
        if module is not lm and isinstance(module, PreTrainedModel) and _decoder_layers(module):
            return module
    return None


def _decoder_layers(decoder: nn.Module) -> list[GradientCheckpointingLayer]:
    """The layers to stream: those of ``decoder`` that take a key/value cache (causal self-attention layers).

    Other checkpointable layers (a vision or audio encoder inside a multimodal decoder) are left as they are.
    """
    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer) and takes_cache(m)]


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def _final_norm_name(decoder: nn.Module | None) -> str | None:
    """The attribute of ``decoder`` holding its final norm (a leaf module with vector parameters only), if any.

    The logit kernel applies that module tile by tile when the probe shows it is the decoder's last step, so its
    full-length input is the only thing kept for its backward (no float32 copies of the last hidden state).
    """
    for name in _FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module) and not any(True for _ in module.children()):
            if all(p.dim() == 1 for p in module.parameters()):
                return name
    return None


def lm_head_linear(lm: PreTrainedModel) -> nn.Linear:
    """The ``nn.Linear`` the LM head applies, looking through PEFT's ``modules_to_save`` wrapper.

    Subclasses of ``nn.Linear`` that keep its ``forward`` are accepted: FSDP2 turns a sharded module into a dynamic
    subclass (``FSDPLinear``) whose parameters are whole inside the root's forward and backward. Anything that
    computes differently (an adapter such as PEFT's LoRA layer, a quantized linear) is refused.
    """
    head = lm.get_output_embeddings()
    while hasattr(head, "modules_to_save") and hasattr(head, "original_module"):
        active = list(getattr(head, "active_adapters", []))
        use_original = head.disable_adapters or not active or active[0] not in head.modules_to_save
        head = head.original_module if use_original else head.modules_to_save[active[0]]
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        why = f"its LM head is a {type(head).__module__}.{type(head).__name__}, not the torch.nn.Linear the chunked "
        why += "logit kernel applies"
        if hasattr(head, "base_layer"):
            why += " (an adapter on lm_head: keep lm_head out of target_modules, or list it in modules_to_save)"
        refuse(lm, why)
    return head


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (deepspeed is imported only when the model or the run uses ZeRO-3)


def _zero3_params(params) -> list[nn.Parameter]:
    """The parameters among ``params`` that ZeRO-3 partitions (they carry ``ds_id``)."""
    return [p for p in params if p is not None and hasattr(p, "ds_id")]


def zero3_enabled(model: nn.Module) -> bool:
    """Whether ``model`` is (or will be) trained under DeepSpeed ZeRO-3: its parameters are partitioned already
    (``zero.Init``), or transformers' DeepSpeed config (set by ``TrainingArguments``) says stage 3."""
    if _zero3_params(model.parameters()):
        return True
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return is_deepspeed_zero3_enabled()


def mark_zero3_leaves(model: nn.Module) -> None:
    """Make each streamed decoder layer a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_module``).

    ZeRO-3 gathers a module's parameters in forward and backward hooks on every submodule. A streamed layer runs
    its submodules once per chunk, and its autograd Function takes the layer's parameters as inputs (their whole
    shapes must be there when it is applied, and when its gradients arrive), so the layer must be gathered whole:
    as a leaf, its parameters are gathered once for its forward and once for its backward, whatever the number of
    chunks. Must run before ``deepspeed.initialize`` (which registers the hooks); the trainers do this at construction.
    The flag is DeepSpeed's own and stays after ``disable_streambp``: DeepSpeed's hooks were registered by it, and a
    leaf layer runs its own forward just as well.
    """
    lm = _causal_lm(model)
    decoder = _decoder(lm)
    layers = _decoder_layers(decoder) if decoder is not None else []
    if not layers:
        return
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    late = [layer for layer in layers if not z3_leaf_module(layer) and _registered_by_deepspeed(layer)]
    if late:
        logger.warning(
            "StreamBP: %s was prepared by DeepSpeed ZeRO-3 before its decoder layers were made leaf modules; each "
            "chunk may gather parameters again. Install the engine (or call mark_zero3_leaves) before "
            "deepspeed.initialize.",
            type(lm).__name__,
        )
    for layer in layers:
        set_z3_leaf_module(layer, True)


def _registered_by_deepspeed(layer: nn.Module) -> bool:
    """Whether DeepSpeed's ZeRO-3 hooks were registered on ``layer``'s submodules (each then has a ``ds_id``)."""
    return any(hasattr(m, "ds_id") for m in layer.modules() if m is not layer)


def _zero3_gathered(params) -> functools.partial | None:
    """A context factory for the logit kernel: the ZeRO-3 parameters among ``params`` that are partitioned when it is
    entered are gathered, and partitioned again on exit; those DeepSpeed already holds whole (the LM head as an
    external parameter of the causal LM, gathered by its forward and pre-backward hooks) are left to it. Every rank
    runs the same modules, so every rank issues the same gathers; ``None`` without ZeRO-3 parameters."""
    params = _zero3_params(params)
    return functools.partial(_gather_partitioned, params) if params else None


@contextlib.contextmanager
def _gather_partitioned(params: list[nn.Parameter]):
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with GatheredParameters(partitioned, enabled=bool(partitioned)):
        yield


def _chunk(name: str, value) -> int | str:
    if value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer number of tokens or 'auto', got {value!r}.")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Public API


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
) -> nn.Module:
    """Stream ``model``'s decoder layers and LM head along the sequence in training; returns ``model``.

    Raises ``ValueError`` naming the model class and the reason when the model cannot be streamed exactly: by its
    configuration and structure, and (``verify=True``) by running a short probe input through the model's own
    forward and through the engine (see :mod:`streambp_trl.probe`).

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
            forward and backward, brought back one layer ahead (see :mod:`streambp_trl.offload`); a no-op on CPU.
        memory_budget: device bytes (or a size such as ``"78GiB"``) the step may use, for ``"auto"`` chunk sizes;
            ``None``: the free memory of the CUDA device when a call starts.
    """
    _chunk("stream_chunk_size", stream_chunk_size)
    logits_chunk_size = _chunk("logits_chunk_size", logits_chunk_size or stream_chunk_size)
    budget = None if memory_budget is None else parse_size(memory_budget)
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {KV_MODES}, got {kv_mode!r}.")
    for name, flag in (("stream_eval", stream_eval), ("verify", verify), ("offload_checkpoints", offload_checkpoints)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}.")
    unknown = set(fused_outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown fused_outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    lm = _causal_lm(model)
    if getattr(lm, "_streambp", None) is not None:
        disable_streambp(lm)
    decoder = _decoder(lm)
    layers = _decoder_layers(decoder) if decoder is not None else []
    check_supported(lm, decoder, layers)
    lm_head_linear(lm)
    if zero3_enabled(lm):
        mark_zero3_leaves(lm)
    reference = None
    norm_name = _final_norm_name(decoder)
    if verify:
        reference = probe.reference(
            lm,
            decoder,
            functools.partial(_head_logits, lm),
            functools.partial(refuse, lm),
            getattr(decoder, norm_name) if norm_name else None,
        )
        if reference is not None and not reference.norm_last:
            norm_name = None

    offload = CheckpointOffload() if offload_checkpoints else None
    auto = AutoChunks(lm, budget, offload_checkpoints) if AUTO in (stream_chunk_size, logits_chunk_size) else None
    settings = StreamSettings(chunk_size=stream_chunk_size, kv_mode=kv_mode, offload=offload, auto=auto)
    _install(lm, decoder, layers, StreamSettings(probe.PROBE_CHUNK, kv_mode) if reference else settings)
    patch(decoder, "_streambp_eval", bool(stream_eval))
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
        patch(layer, "_can_checkpoint_with_cache", True)  # a generation cache reaches the hook, which keeps it
        patch(layer, "_streambp_recycle", False)  # set for a streamed call that keeps no hidden states
        patch(layer, "_streambp_chunk", None)  # set for a streamed call whose chunk "auto" chose
    for module in lm.modules():
        if isinstance(module, PreTrainedModel):
            patch(module, "_set_gradient_checkpointing", bind(guarded_set_gradient_checkpointing, module))
    patch(decoder, "forward", bind(_stream_decoder_forward, decoder, wraps=type(decoder).forward))
    patch(lm, "forward", bind(_stream_forward, lm, wraps=type(lm).forward))


def disable_streambp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_streambp`; returns ``model``."""
    lm = _causal_lm(model)
    if getattr(lm, "_streambp", None) is None:
        return model
    for module in lm.modules():
        unpatch(module)
    lm._streambp = None
    return model


def is_streaming(model: nn.Module) -> bool:
    """Whether ``model``'s decoder layers stream: StreamBP is enabled and every layer still has the stream hook."""
    lm = _causal_lm(model)
    if getattr(lm, "_streambp", None) is None:
        return False
    decoder = _decoder(lm)
    layers = _decoder_layers(decoder) if decoder is not None else []
    return bool(layers) and all(
        layer.gradient_checkpointing
        and isinstance(layer._gradient_checkpointing_func, functools.partial)
        and layer._gradient_checkpointing_func.func is stream_checkpoint
        for layer in layers
    )


# ---------------------------------------------------------------------------------------------------------------
# The patched forwards

_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _stream_decoder_forward(self, *args, **kwargs):
    """The decoder's forward; in training (and in eval with ``stream_eval``), a streamed call: masks as
    descriptions, layers chunked. Calls that bring a key/value cache without grad (generation) are the model's own."""
    forward = original(self, "forward")
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    streams = self.training or vars(self).get("_streambp_eval", False)
    if not streams or (cache is not None and not torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            f"StreamBP cannot train {type(self).__name__} on top of a filled key/value cache (past_key_values); "
            "pass the whole sequence instead."
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True is not available while StreamBP streams the decoder in training mode: the "
            "(T x T) attention weights are never formed. Call the model in eval mode, or disable_streambp(model)."
        )
    for k in _CACHE_KWARGS:
        kwargs.pop(k, None)
    kwargs["use_cache"] = False
    layers = _decoder_layers(self)
    hidden_states_kept = kwargs.get("output_hidden_states") or self.config.output_hidden_states
    auto = vars(self).get("_streambp_auto")
    chunk = _auto_chunk(auto, args, kwargs) if auto is not None else None
    # the layers' own `training` flag (not their submodules') is what makes transformers call the stream hook: set it
    # for an eval-mode streamed call, so dropout and the like stay off
    with (
        streaming(stream_configs(self, *layers)),
        temporarily(layers, "training", True),
        temporarily(layers, "_streambp_recycle", not hidden_states_kept),
        temporarily(layers, "_streambp_chunk", chunk),
    ):
        return forward(*args, **kwargs)


def _auto_chunk(auto: AutoChunks, args: tuple, kwargs: dict) -> int | None:
    """The chunk ``auto`` chooses for a decoder call on these inputs (``None`` without a recognisable input)."""
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args and isinstance(args[0], torch.Tensor):
        inputs = args[0]
    if inputs is None or inputs.dim() < 2:
        return None
    return auto.choose(inputs.shape[0], inputs.shape[1], inputs.device)


def chunk_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """``(stream, logits)`` chunk sizes of ``model``'s latest streamed call (fixed ones, or what "auto" chose last;
    ``None`` before any call or without StreamBP)."""
    state = getattr(_causal_lm(model), "_streambp", None)
    if state is None:
        return None, None
    stream = state.settings.chunk_size
    if stream == AUTO:
        stream = state.settings.auto.last
    logits = state.logits_chunk_size
    return stream, stream if logits == AUTO else logits


def _logit_transform(config) -> tuple[float | None, float]:
    """The model's final-logit softcapping and logit scale, as its own forward applies them."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = 1.0 / config.logits_scaling
    return softcap, 1.0 if scale is None else float(scale)


def _head_logits(lm: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the logit kernel computes from ``hidden`` (temperature 1), as one tensor: for the probe only."""
    head = lm_head_linear(lm)
    softcap, scale = _logit_transform(lm.config.get_text_config())
    logits = torch.nn.functional.linear(hidden.to(head.weight.device), head.weight, head.bias) * scale
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _logits_tile(state: StreamState, hidden: torch.Tensor) -> int:
    if state.logits_chunk_size != AUTO:
        return state.logits_chunk_size
    return state.settings.auto.choose(hidden.shape[0], hidden.shape[1], hidden.device)


def _check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    valid = (labels == -100) | ((labels >= 0) & (labels < vocab_size))
    if not bool(valid.all()):
        value = labels[~valid][0].item()
        raise ValueError(
            f"labels must be token ids in [0, {vocab_size}) or -100 (ignored), got {value}. Mark positions "
            "without a loss with -100."
        )


def _stream_forward(
    self, *args, labels=None, fused_lm_head=False, shift_labels=None, num_items_in_batch=None, **kwargs
):
    state: StreamState = self._streambp
    has_labels = labels is not None or shift_labels is not None
    if not fused_lm_head and not (self.training and has_labels):
        for name, value in (
            ("labels", labels),
            ("shift_labels", shift_labels),
            ("num_items_in_batch", num_items_in_batch),
        ):
            if value is not None:
                kwargs[name] = value
        return original(self, "forward")(*args, **kwargs)
    if not has_labels:
        raise ValueError("fused_lm_head=True needs `labels` (or `shift_labels`).")
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "StreamBP cannot backpropagate the MoE load-balancing loss through streamed layers; "
            "call without output_router_logits (and keep config.output_router_logits=False)."
        )
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = self.config.return_dict
    kwargs["use_cache"] = False
    decoder = _decoder(self)
    # the final norm runs inside the logit kernel (when it is the decoder's last step and no hidden states are asked)
    norm = getattr(decoder, state.final_norm) if state.final_norm and not kwargs.get("output_hidden_states") else None
    with bypassed(norm) if norm is not None else contextlib.nullcontext():
        decoded = decoder(*args, return_dict=True, **kwargs)
    hidden = decoded.last_hidden_state
    head = lm_head_linear(self)
    gathered = _zero3_gathered([head.weight, head.bias, *(norm.parameters() if norm is not None else ())])
    hidden = hidden.to(head.weight.device)
    labels = (labels[:, 1:] if shift_labels is None else shift_labels).to(head.weight.device)
    _check_labels(labels, head.weight.shape[0])
    mask = labels != -100
    if not fused_lm_head and num_items_in_batch is None and not bool(mask.any()):
        raise ValueError("Every label is -100: there is no token to compute the loss on.")
    softcap, scale = _logit_transform(self.config.get_text_config())
    # the labelled positions as rows of the (batch x length, hidden) states: no gathered copy
    batch_idx, position = mask.nonzero(as_tuple=True)
    rows = batch_idx * hidden.shape[1] + position
    stats = chunked_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        head.bias,
        labels[mask],
        rows=rows,
        norm=norm,
        temperature=state.temperature if fused_lm_head else 1.0,
        softcap=softcap,
        logit_scale=scale,
        token_chunk=_logits_tile(state, hidden),
        outputs=state.fused_outputs if fused_lm_head else ("log_probs",),
        gathered=gathered,
    )
    # masked_scatter keeps the outputs connected to the graph even when no label is valid
    per_token = {k: None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in stats.items()}
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -per_token["log_probs"].sum() / denominator
    if fused_lm_head:  # the fields of TRL's own fused head
        out = FusedCausalLMOutput(loss=loss, label_mask=mask, **per_token)
    else:
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=decoded.get("hidden_states"))
    return out if return_dict else out.to_tuple()
