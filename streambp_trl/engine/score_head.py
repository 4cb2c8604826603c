"""Sequence-classification decoders (reward models): the score head applied only to the rows it reads.

transformers' ``GenericForSequenceClassification.forward`` (``LlamaForSequenceClassification``,
``Qwen3ForSequenceClassification``, ``MistralForSequenceClassification`` and every other decoder family whose
``*ForSequenceClassification`` keeps that forward) runs the decoder, applies its ``score`` head (hidden ->
``num_labels``) at every position and keeps one row per sequence: the last position whose token is not
``config.pad_token_id`` (the rightmost such position, so left and right padding alike; the last position when no pad
id is set, which it allows for one sequence only, or for ``inputs_embeds``). Its loss is ``self.loss_function`` on
those pooled logits (regression, single- or multi-label classification, by ``config.problem_type``).

After ``enable_streambp`` the decoder streams chunk by chunk exactly as for a causal LM, and
:func:`stream_score_forward` replaces that forward: it picks the same rows of the decoder's output first, then
applies the final norm (where :func:`~.head_side.decode_for_head` leaves it to the head, as for the logit kernel of a
causal LM) and the score head to those ``batch`` rows alone. Beyond the streamed layers, the step holds the decoder's
(batch, T, hidden) output and its gradient (non-zero on the read rows only), and no (batch, T, num_labels) logits or
full-length normed states. The gradient is exact: the norm acts on each position alone, and the score head is
applied as the model applies it (the module itself, so PEFT's ``modules_to_save`` copy or an adapter on it are used
as they are).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from ..logs import get_logger
from ..patching import original
from . import whole_rows
from .head_side import decode_for_head
from .state import EngineState
from .support import refuse

logger = get_logger(__name__)


def sequence_classifier(lm: PreTrainedModel) -> bool:
    """Whether ``lm`` is a sequence classifier the engine serves: one whose forward is transformers'
    ``GenericForSequenceClassification.forward``. Another ``*ForSequenceClassification`` (its own forward, which may
    pool or score differently) is refused, naming it."""
    generic = isinstance(lm, GenericForSequenceClassification)
    if generic and type(lm).forward is GenericForSequenceClassification.forward:
        return True
    if generic or type(lm).__name__.endswith("ForSequenceClassification"):
        refuse(
            lm,
            "its sequence-classification forward is its own code, not transformers' "
            "GenericForSequenceClassification.forward, whose pooling (the last non-pad token) and score head the "
            "engine reproduces; train a decoder family whose *ForSequenceClassification keeps that forward (Llama, "
            "Qwen2/3, Mistral, Gemma, Phi-3, ...), or its causal LM",
        )
    return False


def last_token(config, input_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | int:
    """The position each row's score is read at, as ``GenericForSequenceClassification.forward`` picks it: the
    rightmost token that is not ``pad_token_id``, or ``-1`` (the last position) without a pad id or token ids."""
    pad_token_id = config.get_text_config().pad_token_id
    if pad_token_id is None and batch != 1:
        raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
    if pad_token_id is None:
        return -1
    if input_ids is None:
        logger.warning_once(
            "A sequence classifier will not detect padding tokens in `inputs_embeds`. Results may be unexpected if "
            "using padding tokens in conjunction with `inputs_embeds.`"
        )
        return -1
    non_pad = (input_ids != pad_token_id).to(device, torch.int32)
    positions = torch.arange(input_ids.shape[-1], device=device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


def stream_score_forward(
    self,
    state: EngineState,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
):
    """``GenericForSequenceClassification.forward`` with the decoder streamed and the final norm and score head
    applied to the read rows only (in training, and in eval with ``stream_eval``; otherwise the model's own)."""
    call = dict(position_ids=position_ids, inputs_embeds=inputs_embeds)
    if past_key_values is not None:  # transformers >= 5.24 calls it `cache`, which comes in kwargs
        call["past_key_values"] = past_key_values
    if not (self.training or state.options.stream_eval):
        own = original(self, "forward")
        return own(input_ids, attention_mask, labels=labels, use_cache=use_cache, **call, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = self.config.return_dict
    asked = kwargs.get("output_hidden_states")

    def decoded_side(**inputs):
        return decode_for_head(
            self, lambda: state.decoder(use_cache=use_cache, return_dict=True, **{**call, **kwargs, **inputs}), asked
        )

    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if whole_rows.splits_rows(state, self.training):
        if asked:
            raise ValueError("output_hidden_states=True is not available with the rows split across ranks.")
        given = inputs_embeds if input_ids is None else input_ids
        batch, length = given.shape[:2]
        read = last_token(self.config, input_ids, batch, given.device)
        read = torch.full((batch,), length - 1, device=given.device) if isinstance(read, int) else read
        side, rows = whole_rows.pooled(state, decoded_side, {**call, **inputs}, read)
    else:
        side = decoded_side(**inputs)
        hidden = side.hidden
        batch = hidden.shape[0]
        read = last_token(self.config, input_ids, batch, hidden.device)
        rows = hidden[torch.arange(batch, device=hidden.device), read]
    decoded, norm = side.decoded, side.norm
    logits = self.score(norm(rows) if norm is not None else rows)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
    out = SequenceClassifierOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=decoded.past_key_values,
        hidden_states=decoded.hidden_states,
        attentions=decoded.attentions,
    )
    return out if return_dict else out.to_tuple()
