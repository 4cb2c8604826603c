"""Which causal LMs the stream engine can train exactly: the checks ``enable_streambp`` runs before installing.

Each refusal names the model class and the reason. What is not refused here is exact by construction (the model's
own layer code runs on each chunk against the earlier chunks' keys/values) and covered by the sweep over every
causal LM of the installed transformers in ``tests/test_every_causal_lm.py``.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import dynamic_rope_update

from ..layers.dynamic_mask import dynamic_mask_modules
from ..layers.layer_args import CACHE_KWARGS, STATE_ARGUMENT
from ..layers.traits import names_called, passes_keywords
from ..logs import get_logger
from .quantized import check_quantized

logger = get_logger(__name__)

# Layer types whose token mixing a chunk receives through the cache: softmax attention (the prefix keys/values; for a
# sparse indexed attention also the indexer keys of every position), the recurrent and convolution mixers of
# transformers' linear-attention cache interface (their states at the chunk boundary); "mlp" / "moe" layers mix no
# tokens. Whether a model's layers really do so is what the probe checks.
_SUPPORTED_LAYER_TYPES = {
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "full_attention",
    "indexed_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
    "conv",
    "mamba",
    "hybrid",
    "hybrid_sliding",
    "mlp",
    "moe",
}
_CROSS_ATTENTION = ("encoder_attn", "crossattention", "cross_attn")
# transformers' builders of masks that let every position attend to every key: an LM class whose own code calls one
# (Gemma 4's speculative-decoding assistants, whose queries read the target model's keys/values through them) has
# outputs that depend on later positions
_BIDIRECTIONAL_MASKS = {"create_bidirectional_mask", "create_bidirectional_sliding_window_mask"}
# What a decoder's own code builds over the whole sequence outside its streamed layers, told by a name it calls: exact,
# but memory the streamed layers do not save (warned at enable, never silent)
_WHOLE_SEQUENCE_CALLS = {
    "_prepare_patch_cross_attention_mask": "its byte/patch cross-attention masks, (patches x bytes) each with the "
    "patch count padded to the byte count, so quadratic in the sequence length",
}
# the code of transformers' rotary-embedding forwards that recompute their frequencies from the positions of each call
# (``dynamic_rope_update``: for the rope types in _PER_CALL_ROPE); a function's code object is shared by every function
# the decorator returns
_DYNAMIC_ROPE_CODE = dynamic_rope_update(lambda self, x, position_ids: None).__code__
# PEFT methods whose trained tokens reach the decoder as a filled key/value cache (past_key_values)
_PREFIX_PEFT = {"PREFIX_TUNING": "prefix tuning", "CARTRIDGE": "cartridges"}


def takes_cache(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward takes a key/value cache, or its recurrent state as an argument (``state``: xLSTM):
    what marks a decoder layer to stream. A layer whose forward passes its keyword arguments on (``**kwargs``) to a
    module that takes a cache does too (DeepSeek-V4)."""
    if _forward_takes_cache(type(layer)):
        return True
    return passes_keywords(type(layer)) and any(
        _forward_takes_cache(type(m)) for m in layer.modules() if m is not layer and hasattr(m, "forward")
    )


@functools.cache
def _forward_takes_cache(cls: type) -> bool:  # read on every decoder call: once per class
    parameters = inspect.signature(cls.forward).parameters
    return any(name in parameters for name in (*CACHE_KWARGS, STATE_ARGUMENT))


def refuse(model: nn.Module, why: str) -> None:
    raise ValueError(f"StreamBP cannot train {type(model).__name__} exactly: {why}.")


def router_loss_refusal(who: str, setting: str, fix: str) -> ValueError:
    """The one refusal of the MoE load-balancing loss, wherever it is asked for (``setting``): in the model's config,
    in a call, or by a trainer's ``router_aux_loss_coef``."""
    return ValueError(
        f"{who}: the MoE load-balancing loss ({setting}) takes gradient from router logits computed inside the "
        f"streamed decoder layers, which StreamBP does not backpropagate. {fix}"
    )


def check_peft_method(model: nn.Module, lm: PreTrainedModel) -> None:
    """Raise ``ValueError`` if ``model`` is a PEFT model with an adapter that hands the decoder its trained prefix as
    a filled key/value cache (prefix tuning): a streamed call runs whole sequences from position 0. Prompt tuning and
    p-tuning prepend trained embeddings to the input instead, and stream exactly."""
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        peft_type = getattr(config, "peft_type", None)
        peft_type = getattr(peft_type, "value", peft_type)  # a peft.PeftType, a str enum
        method = _PREFIX_PEFT.get(peft_type)
        if method is not None:
            refuse(
                lm,
                f"PEFT {method} (adapter {name!r}, peft_type={peft_type}) passes its trained prefix to the "
                "decoder as a filled key/value cache (past_key_values), which the streamed layers do not take; use "
                "LoRA (peft.LoraConfig) or prompt tuning / p-tuning (PromptTuningConfig, PromptEncoderConfig), "
                "which prepend trained embeddings and stream exactly",
            )


def check_supported(
    lm: PreTrainedModel, decoder: PreTrainedModel | None, layers: list[nn.Module], lm_head: bool = True
) -> None:
    """Raise ``ValueError`` if ``lm`` cannot be streamed exactly; ``layers`` are its decoder's layers; ``lm_head``:
    it must have an LM head (``False`` for a sequence classifier, whose score head :mod:`.score_head` serves)."""
    check_quantized(lm)
    config = lm.config.get_text_config()
    if getattr(lm.config, "is_encoder_decoder", False):
        refuse(lm, "encoder-decoder models are not supported, only decoder-only causal LMs")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        refuse(lm, "its attention is bidirectional, so a chunk would need keys from later positions")
    bidirectional = sorted(names_called(type(lm)) & _BIDIRECTIONAL_MASKS)
    if bidirectional:
        refuse(
            lm,
            f"its forward builds bidirectional attention masks ({', '.join(bidirectional)}): every position attends "
            "to the keys at later positions, so a chunk would need keys from later positions",
        )
    if lm_head and lm.get_output_embeddings() is None:
        refuse(lm, "it has no LM head (get_output_embeddings() is None)")
    if decoder is None:
        refuse(lm, "get_decoder() does not return a separate transformers decoder model")
    unserved = sorted(set(getattr(config, "layer_types", None) or ()) - _SUPPORTED_LAYER_TYPES)
    if unserved:  # before the layers: a layer that takes its cache through **kwargs is not found as one
        refuse(
            lm,
            f"layer types {unserved} are neither softmax attention nor a recurrent or convolution mixer served "
            "through transformers' cache interface",
        )
    if not layers:
        refuse(
            lm,
            "its decoder has no transformers GradientCheckpointingLayer layers that take a key/value cache "
            "(causal self-attention layers) to stream",
        )
    if not lm._can_set_attn_implementation():
        refuse(lm, "its attention does not go through transformers' AttentionInterface")
    if getattr(config, "attn_logit_softcapping", None) is not None and getattr(config, "attention_dropout", 0.0):
        refuse(
            lm,
            "its softcapped attention would need attention dropout, which the softcap kernel has not; set "
            "attention_dropout=0.0",
        )
    if getattr(config, "output_router_logits", False):
        raise router_loss_refusal(
            f"StreamBP cannot train {type(lm).__name__} exactly",
            "output_router_logits=True",
            "Set config.output_router_logits=False.",
        )
    _check_modules(lm, layers)
    _say_what_is_not_saved(lm, decoder, layers)


def _say_what_is_not_saved(lm: PreTrainedModel, decoder: nn.Module, layers: list[nn.Module]) -> None:
    """Warn where a served model differs from the plain call or keeps whole-sequence memory: fully masked query rows
    (left padding) that give zero output, and masks or biases its decoder builds on the whole sequence outside the
    streamed layers."""
    config = lm.config.get_text_config()
    padded = _masked_rows_differ(config, layers)
    if padded is not None:
        why, fix = padded
        logger.warning(
            f"StreamBP streams {type(lm).__name__} with attention whose fully masked query rows (the padding of a "
            f"left-padded row) give zero output, as SDPA's do on a boolean mask; {why}. So the loss term of the first "
            "real token of a left-padded row, which the logits of the pad before it score, differs from a plain "
            "model(..., labels=...) call; every other term and gradient is the same. TRL's trainers never score that "
            f"token; elsewhere set its label to -100, {fix}."
        )
    for module in decoder.modules():
        for called in sorted(names_called(type(module)) & _WHOLE_SEQUENCE_CALLS.keys()):
            logger.warning(
                f"StreamBP streams {type(lm).__name__}'s decoder layers exactly, but {type(module).__name__} builds "
                f"{_WHOLE_SEQUENCE_CALLS[called]} ({called}), on the whole sequence outside those layers, as the "
                'plain model does: that memory is not saved, and the memory model behind "auto" and max-len does '
                "not count it."
            )


def _masked_rows_differ(config, layers: list[nn.Module]) -> tuple[str, str] | None:
    """Why the plain model's attention gives a fully masked query row a non-zero output where the stream gives zero,
    and the fixes: eager attention (a softmax of tied lowest-value scores) or a dynamic mask attention (Doge's finite
    per-key bias on the masked positions, under any implementation); ``None`` where the two agree."""
    if any(dynamic_mask_modules(layer) for layer in layers):
        return (
            "its dynamic mask adds a finite per-key bias to the masked positions, so under any attention "
            "implementation the plain model takes a softmax over them there, a weighted average over the keys of the "
            "row, later ones included",
            "or pad on the right",
        )
    if getattr(config, "_attn_implementation", None) == "eager":
        return (
            "its eager attention instead takes the softmax of tied lowest-value scores there, an average over every "
            "key of the row, later ones included (NaN in float64, where the scores overflow)",
            "pad on the right, or use attn_implementation='sdpa'",
        )
    return None


def _check_modules(lm: PreTrainedModel, layers: list[nn.Module]) -> None:
    """Refuse a decoder whose streamed layers mix tokens in a way no chunk reproduces: a module that is not causal, or
    an attention that updates the cache and takes its softmax itself (not through transformers' AttentionInterface, so
    it never sees the chunk's mask)."""
    for layer in layers:
        for name, module in layer.named_modules():
            if any(part in name for part in _CROSS_ATTENTION):
                continue  # attends to encoder states, which a causal LM call never has
            if getattr(module, "is_causal", True) is False:
                refuse(lm, f"{type(module).__name__} is not causal")
            rope_type = _per_call_rope(module)
            if rope_type is not None:
                refuse(
                    lm,
                    f"{type(module).__name__}, inside its decoder layers, computes rotary embeddings whose "
                    f"frequencies depend on the highest position of each call (rope_type {rope_type!r}), so each "
                    "chunk would rotate by other frequencies than the whole sequence does; use a rope type whose "
                    "frequencies are fixed (e.g. rope_parameters rope_type 'linear' or 'yarn' instead of 'dynamic' / "
                    "'longrope')",
                )
            called = names_called(type(module))
            if {"update", "softmax"} <= called and "ALL_ATTENTION_FUNCTIONS" not in called:
                refuse(
                    lm,
                    "its attention does not go through transformers' AttentionInterface "
                    f"({type(module).__name__} adds the mask to its scores and takes the softmax itself)",
                )


def _per_call_rope(module: nn.Module) -> str | None:
    """The rope type of ``module`` if it is a rotary embedding whose frequencies depend on the positions of each call
    (transformers' ``dynamic_rope_update``: a dynamic NTK rope rescales them for the highest position seen, a longrope
    switches its factors past the original context), else ``None``. Computed once per decoder call (by the decoder,
    for every position) such a rope is exact; computed inside a layer (Moshi's attention, DeepSeek-V4's compressor and
    indexer), each chunk would see its own highest position."""
    forward = type(module).forward
    while getattr(forward, "__code__", None) is not _DYNAMIC_ROPE_CODE:  # under other decorators (torch.no_grad)
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return None
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else (rope_type,)
    return next((t for t in types if isinstance(t, str) and ("dynamic" in t or t == "longrope")), None)
