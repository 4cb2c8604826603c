"""Installing StreamBP on a Hugging Face causal LM: ``enable_streambp`` / ``disable_streambp``.

After :func:`enable_streambp`, in training mode,

* every decoder layer (each ``GradientCheckpointingLayer``) runs through the stream-checkpointed Function of
  :mod:`streambp_trl.stream_layer`, with attention and masks from :mod:`streambp_trl.attention`;
* ``model(..., labels=labels)`` computes the causal-LM loss through the chunked logit kernel of
  :mod:`streambp_trl.logits` (``logits`` is ``None``: they are never built), and
* ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's ``FusedCausalLMOutput`` from the same kernel,
  whether or not TRL's ``add_fused_lm_head`` patched the model first.

In eval mode the layers, the attention and ``labels=`` calls behave as before (``fused_lm_head=True`` still
uses the kernel, as TRL's own head does). Nothing is saved differently: ``save_pretrained`` writes the same
files, loadable by plain transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput

from . import attention
from .logits import STAT_OUTPUTS, chunked_logprobs
from .stream_layer import KV_MODES, StreamSettings, check_no_dropout, stream_checkpoint

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclasses.dataclass(frozen=True)
class StreamState:
    """What :func:`enable_streambp` installed on a model, kept on it as ``model._streambp``."""

    settings: StreamSettings
    logits_chunk_size: int
    temperature: float
    fused_outputs: tuple[str, ...]
    original_forward: object
    had_instance_forward: bool


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper, if any."""
    if hasattr(model, "get_base_model") and callable(model.get_base_model):
        model = model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"StreamBP needs a transformers PreTrainedModel, got {type(model).__name__}.")
    return model


def _refuse(model: PreTrainedModel, why: str) -> None:
    raise ValueError(f"StreamBP cannot train {type(model).__name__} exactly: {why}.")


def _validate(model: PreTrainedModel, layers: list[nn.Module]) -> None:
    config = model.config.get_text_config()
    if getattr(model.config, "is_encoder_decoder", False):
        _refuse(model, "encoder-decoder models are not supported, only decoder-only causal LMs")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        _refuse(model, "its attention is bidirectional, so a chunk would need keys from later positions")
    if model.get_output_embeddings() is None:
        _refuse(model, "it has no LM head (get_output_embeddings() is None)")
    if not layers:
        _refuse(model, "it has no transformers GradientCheckpointingLayer decoder layers to stream")
    if not model._can_set_attn_implementation():
        _refuse(model, "its attention does not go through transformers' AttentionInterface")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        _refuse(model, "attention-logit softcapping has no exact fused kernel here")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - _SUPPORTED_LAYER_TYPES:
        _refuse(model, f"layer types {sorted(layer_types - _SUPPORTED_LAYER_TYPES)} are not softmax attention")
    if getattr(config, "output_router_logits", False):
        _refuse(
            model,
            "the MoE load-balancing loss (output_router_logits=True) would take gradient from router logits "
            "computed inside the streamed layers; set config.output_router_logits=False",
        )
    for name, value in vars(config).items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
            _refuse(model, f"config.{name}={value}: dropout cannot be replayed chunk by chunk; set it to 0")
    for layer in layers:
        check_no_dropout(layer)
        for module in layer.modules():
            if getattr(module, "is_causal", True) is False:
                _refuse(model, f"{type(module).__name__} is not causal")


def _decoder_layers(model: nn.Module) -> list[GradientCheckpointingLayer]:
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer number of tokens, got {value!r}.")
    return value


def enable_streambp(
    model: nn.Module,
    *,
    stream_chunk_size: int,
    logits_chunk_size: int | None = None,
    kv_mode: str = "recompute",
    temperature: float = 1.0,
    fused_outputs: tuple[str, ...] = ("log_probs",),
) -> nn.Module:
    """Stream ``model``'s decoder layers and LM head along the sequence in training; returns ``model``.

    Args:
        model: a transformers causal LM, or a PEFT model wrapping one.
        stream_chunk_size: tokens per chunk of each decoder layer's forward and backward.
        logits_chunk_size: tokens per tile of the logit kernel (default: ``stream_chunk_size``).
        kv_mode: ``"recompute"`` (default) or ``"capture"``, how a layer's backward gets its keys/values.
        temperature: divides the logits of ``fused_lm_head=True`` calls (TRL's GRPO temperature).
        fused_outputs: fields of ``FusedCausalLMOutput`` computed by ``fused_lm_head=True`` calls, among
            ``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``.
    """
    _positive("stream_chunk_size", stream_chunk_size)
    logits_chunk_size = _positive("logits_chunk_size", logits_chunk_size or stream_chunk_size)
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {KV_MODES}, got {kv_mode!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}.")
    unknown = set(fused_outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown fused_outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    lm = _causal_lm(model)
    if getattr(lm, "_streambp", None) is not None:
        disable_streambp(lm)
    layers = _decoder_layers(lm)
    _validate(lm, layers)

    settings = StreamSettings(chunk_size=stream_chunk_size, kv_mode=kv_mode)
    attention.attach(lm, lm.config)
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(stream_checkpoint, settings)
    had_instance_forward = "forward" in vars(lm)
    lm._streambp = StreamState(
        settings=settings,
        logits_chunk_size=logits_chunk_size,
        temperature=float(temperature),
        fused_outputs=tuple(dict.fromkeys(("log_probs", *fused_outputs))),
        original_forward=lm.forward,
        had_instance_forward=had_instance_forward,
    )
    lm.forward = types.MethodType(functools.wraps(type(lm).forward)(_stream_forward), lm)
    return model


def disable_streambp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_streambp`; returns ``model``."""
    lm = _causal_lm(model)
    state: StreamState | None = getattr(lm, "_streambp", None)
    if state is None:
        return model
    for layer in _decoder_layers(lm):
        layer.gradient_checkpointing = False
        vars(layer).pop("_gradient_checkpointing_func", None)
    if state.had_instance_forward:
        lm.forward = state.original_forward
    else:
        del lm.forward
    attention.detach(lm, lm.config)
    lm._streambp = None
    return model


def _logit_transform(config) -> tuple[float | None, float]:
    """The model's final-logit softcapping and logit scale, as its own forward applies them."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = 1.0 / config.logits_scaling
    return softcap, 1.0 if scale is None else float(scale)


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
        return state.original_forward(*args, **kwargs)
    if not has_labels:
        raise ValueError("fused_lm_head=True needs `labels` (or `shift_labels`).")
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "StreamBP cannot backpropagate the MoE load-balancing loss through streamed layers; "
            "call without output_router_logits (and keep config.output_router_logits=False)."
        )
    kwargs["use_cache"] = False
    hidden = self.base_model(*args, **kwargs).last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    head = self.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"StreamBP's logit kernel needs a plain nn.Linear LM head, got {type(head).__name__}.")
    hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
    mask = labels != -100
    if not fused_lm_head and num_items_in_batch is None and not bool(mask.any()):
        raise ValueError("Every label is -100: there is no token to compute the loss on.")
    softcap, scale = _logit_transform(self.config.get_text_config())
    stats = chunked_logprobs(
        hidden[mask],
        head.weight,
        head.bias,
        labels[mask],
        temperature=state.temperature if fused_lm_head else 1.0,
        softcap=softcap,
        logit_scale=scale,
        token_chunk=state.logits_chunk_size,
        outputs=state.fused_outputs if fused_lm_head else ("log_probs",),
    )
    # masked_scatter keeps the outputs connected to the graph even when no label is valid
    per_token = {k: None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in stats.items()}
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -per_token["log_probs"].sum() / denominator
    if not fused_lm_head:
        return CausalLMOutputWithPast(loss=loss, logits=None)
    return FusedCausalLMOutput(loss=loss, label_mask=mask, **per_token)
