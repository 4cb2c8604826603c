"""The forward the engine installs on the causal LM, and the loss it computes: the decoder (streamed as
:mod:`.decoder_forward` says), then the LM head through the chunked logit kernel at the labelled positions only (the
final norm inside the kernel when it is the decoder's last step), so neither a (T x T) mask nor (tokens x vocab)
logits exist.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput

from .. import families
from ..attention import streaming
from ..logits import chunked_logprobs
from ..patching import original
from . import whole_rows
from .decoder_forward import check_router_logits, decoder_streams, packing_as_plain
from .head_side import decode_for_head, kernel_head
from .model_parts import lm_head_linear
from .own_loss import check_unshifted_call, labels_shifted
from .state import EngineState
from .whole_rows import current_share
from .zero3 import zero3_gathered

# the arguments of transformers' causal-LM loss (``ForCausalLMLoss``) that the logit kernel's loss takes (or that
# ``stream_forward`` reads): its inputs, ``ignore_index``, ``shift_labels`` and ``num_items_in_batch``
_KERNEL_LOSS_ARGUMENTS = frozenset(
    {"logits", "labels", "vocab_size", "ignore_index", "shift_labels", "num_items_in_batch"}
)


def logit_transform(config) -> tuple[float | None, float]:
    """``(softcap, scale)`` of a model's logits as its own forward applies them, from its text config: the first of
    ``logit_scale`` (Cohere), ``output_multiplier`` (Muse) and ``lm_head_multiplier`` (Falcon-H1) that is set
    multiplies them; else ``logits_scaling`` divides them (Granite, MiniCPM3; HyperCLOVA X multiplies), as TRL's fused
    LM head reads them; then ``final_logit_softcapping`` (Gemma) or ``output_logit_soft_cap`` (xLSTM, which TRL's
    fused head does not read) caps them."""
    scales = [getattr(config, k, None) for k in ("logit_scale", "output_multiplier", "lm_head_multiplier")]
    scale = next((s for s in scales if s is not None), None)
    scaling = getattr(config, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if families.logits_scaling_multiplies(config) else 1.0 / scaling
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "output_logit_soft_cap", None)
    return softcap, 1.0 if scale is None else float(scale)


def head_logits(lm: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the logit kernel computes from ``hidden`` (temperature 1), as one tensor: for the probe only."""
    head = lm_head_linear(lm)
    softcap, scale = logit_transform(lm.config.get_text_config())
    logits = torch.nn.functional.linear(hidden.to(head.weight.device), head.weight, head.bias) * scale
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    valid = (labels == ignore_index) | ((labels >= 0) & (labels < vocab_size))
    if not bool(valid.all()):
        value = labels[~valid][0].item()
        raise ValueError(
            f"labels must be token ids in [0, {vocab_size}) or {ignore_index} (ignore_index: ignored), got {value}. "
            f"Mark positions without a loss with {ignore_index}."
        )


def _loss_arguments(lm: PreTrainedModel, kwargs: dict) -> int:
    """The ``ignore_index`` of a call's loss (popped from ``kwargs``; -100 unless given, as in transformers' loss). Any
    other argument the model's own loss function names (``lm.loss_function``, which a transformers forward hands its
    ``**kwargs``) and the logit kernel does not take is refused, not dropped: the kernel computes the loss itself."""
    ignore_index = kwargs.pop("ignore_index", -100)
    loss = getattr(lm, "loss_function", None)
    named = inspect.signature(loss).parameters if callable(loss) else {}
    dropped = sorted(
        k for k in kwargs if k in named and k not in _KERNEL_LOSS_ARGUMENTS and named[k].kind != named[k].VAR_KEYWORD
    )
    if dropped:
        raise ValueError(
            f"StreamBP computes the loss of {type(lm).__name__} with its logit kernel, which takes labels, "
            f"shift_labels, ignore_index and num_items_in_batch, not {dropped} (arguments of the model's loss "
            f"function); drop them, or disable_streambp(model) to compute the loss from full logits."
        )
    return int(ignore_index)


def _scored_rows(
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    logits_to_keep,
    shifted: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels of a call and, in the same shape, the rows of the flattened (batch x T, hidden) states whose logits
    they score, as the model's own forward pairs them.

    The model's own forward computes the logits of ``hidden[:, -k:]`` for an int ``logits_to_keep`` k (0: every
    position) or ``hidden[:, idx]`` for a 1D tensor ``idx``, and scores the i-th kept position against
    ``labels[:, i + 1]`` of the same length (``shifted``: the last kept position has no label), or against
    ``shift_labels[:, i]``; a model whose own loss does not shift its labels (``shifted=False``,
    :func:`~.own_loss.labels_shifted`) against ``labels[:, i]``.
    """
    batch, seq_len = hidden.shape[:2]
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    if isinstance(positions, torch.Tensor):
        if positions.dim() != 1:
            raise ValueError(
                f"StreamBP takes logits_to_keep as an int or a 1D tensor of positions with labels, got a tensor of "
                f"shape {tuple(positions.shape)}; mark the positions to skip with -100 in the labels instead."
            )
        positions = positions.to(hidden.device)
    rows = torch.arange(batch * seq_len, device=hidden.device).view(batch, seq_len)[:, positions]
    given, name = (labels, "labels") if shift_labels is None else (shift_labels, "shift_labels")
    if given.shape != rows.shape:
        kept = "" if isinstance(logits_to_keep, int) and logits_to_keep == 0 else f" (logits_to_keep={logits_to_keep})"
        raise ValueError(
            f"{name} of shape {tuple(given.shape)} do not match the logits the model computes{kept}: pass {name} of "
            f"shape {tuple(rows.shape)}, one per position whose logits are kept."
        )
    if shift_labels is None and shifted:
        given, rows = given[:, 1:], rows[:, :-1]
    return given.to(hidden.device), rows


def stream_forward(
    self,
    state: EngineState,
    *args,
    labels=None,
    fused_lm_head=False,
    shift_labels=None,
    num_items_in_batch=None,
    **kwargs,
):
    """The causal LM's forward; in training with labels, and with ``fused_lm_head=True``, the decoder streamed and
    the loss (and TRL's fused-head fields) from the logit kernel at the labelled positions. ``logits_to_keep``
    selects the scored positions as in the model's own forward (see :func:`_scored_rows`). The LM head is looked up
    on every call: PEFT's ``modules_to_save`` may switch it with the active adapter."""
    has_labels = labels is not None or shift_labels is not None
    if not fused_lm_head and not (self.training and has_labels):
        given = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
        return _model_forward(self, state, args, {**kwargs, **{k: v for k, v in given.items() if v is not None}})
    if not has_labels:
        raise ValueError("fused_lm_head=True needs `labels` (or `shift_labels`).")
    if state.sequence_group is not None and self.training and shift_labels is None and not state.whole_rows:
        raise ValueError(
            "StreamBP: with the sequence split across ranks, a rank's last label is the next rank's first token: "
            "pass shift_labels (the labels shifted by one over the whole sequence, then split like the inputs, as "
            "DeepSpeed's Ulysses data path does), and num_items_in_batch for the whole sequence's token count."
        )
    logits_to_keep, ignore_index, shifted = _loss_call(self, kwargs, fused_lm_head)
    if whole_rows.splits_rows(state, self.training):
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0) or not shifted or args:
            raise ValueError(
                "StreamBP splits whole rows across ranks for a keyword call scoring every position's next-token "
                "label: pass the inputs as keywords, without logits_to_keep (mask labels with -100 instead)."
            )
        if kwargs.get("output_hidden_states"):
            raise ValueError("output_hidden_states=True is not available with the rows split across ranks.")
        return_dict = kwargs.pop("return_dict", None)
        local = functools.partial(stream_forward, self, state, ignore_index=ignore_index)
        out = whole_rows.forward(
            state, local, kwargs, labels, shift_labels, num_items_in_batch, fused_lm_head, shifted
        )
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()
    if not shifted:  # a mean over the labels that are not -100, which reads no loss argument (see .own_loss)
        check_unshifted_call(self, shift_labels, ignore_index)
        num_items_in_batch = None  # ignored as the model ignores it (transformers' Trainer passes it)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = self.config.return_dict
    packing_as_plain(state.decoder, args, kwargs)  # (before the call's use_cache is set aside)
    kwargs["use_cache"] = False
    if state.decoder_keywords is not None:  # the model's forward hands its decoder these alone (the rest: its loss)
        kwargs = {k: v for k, v in kwargs.items() if k in state.decoder_keywords}
    decoder = state.decoder
    head = kernel_head(self)  # (looked up per call: PEFT's modules_to_save may switch it with the active adapter)
    # the final norm runs inside the logit kernel as decode_for_head decides (the decoder's last step, no hidden
    # states asked, no hook on it)
    side = decode_for_head(
        self, lambda: decoder(*args, return_dict=True, **kwargs), kwargs.get("output_hidden_states")
    )
    hidden = side.hidden.to(head.weight.device)
    labels, scored = _scored_rows(hidden, labels, shift_labels, logits_to_keep, shifted)
    _check_labels(labels, head.weight.shape[0], ignore_index)
    mask = labels != ignore_index
    split = current_share() is not None or (
        state.sequence_group is not None and self.training and not state.whole_rows
    )
    # (a rank's share may hold no label: loss 0)
    if not fused_lm_head and num_items_in_batch is None and not split and not bool(mask.any()):
        raise ValueError(f"Every label is {ignore_index} (ignored): there is no token to compute the loss on.")
    per_token = _kernel_scores(self, state, head, hidden, side.norm, labels, scored[mask], mask, fused_lm_head)
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -per_token["log_probs"].sum() / denominator
    if fused_lm_head:  # the fields of TRL's own fused head
        out = FusedCausalLMOutput(loss=loss, label_mask=mask, **per_token)
    else:
        out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=side.decoded.get("hidden_states"))
    return out if return_dict else out.to_tuple()


def _model_forward(self, state: EngineState, args: tuple, kwargs: dict):
    """The model's own forward (no loss of ours: eval mode, or no labels), whose decoder call streams as
    :func:`decoder_streams` says: masks the model builds around the decoder (a vision-language model's, before its
    language model) are then the stream's too."""
    streams = decoder_streams(state.decoder.training, state, kwargs)
    if streams:
        state.check_decoder(self)
    with streaming(state.configs) if streams else contextlib.nullcontext():
        return original(self, "forward")(*args, **kwargs)


def _loss_call(self, kwargs: dict, fused_lm_head: bool) -> tuple[int, int, bool]:
    """``(logits_to_keep, ignore_index, shifted)`` of a call whose loss the logit kernel computes, taken out of
    ``kwargs``; ``shifted``: the labels paired as the model's own loss pairs them, or as TRL's fused head does
    (shifted, whatever the model). Refuses what the kernel cannot serve: router logits, ``logits_to_keep`` with the
    fused head, a ``loss_function`` set on the model."""
    check_router_logits(self, kwargs, self.config.get_text_config())
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    if fused_lm_head and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            f"logits_to_keep={logits_to_keep!r} has no meaning with fused_lm_head=True: the fused head (TRL's and "
            "StreamBP's) scores every position whose label is not -100, with outputs of shape (batch, seq_len - 1). "
            "Set the labels of the positions to skip to -100 instead (as TRL's GRPO does), and drop logits_to_keep."
        )
    ignore_index = _loss_arguments(self, kwargs)
    shifted = fused_lm_head or labels_shifted(type(self))
    if not fused_lm_head and shifted and "_loss_function" in vars(self):  # set through transformers' setter
        raise ValueError(
            f"StreamBP computes the causal-LM loss of {type(self).__name__} with its logit kernel, not the "
            f"loss_function set on the model ({getattr(self._loss_function, '__name__', self._loss_function)!r}), "
            "which the plain call computes; compute it from full logits with disable_streambp(model), or remove it "
            "(del model._loss_function) to train the causal-LM loss."
        )
    return logits_to_keep, ignore_index, shifted


def _kernel_scores(
    self,
    state: EngineState,
    head: nn.Linear,
    hidden: torch.Tensor,
    norm: nn.Module | None,
    labels: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor,
    fused_lm_head: bool,
) -> dict:
    """The logit kernel's per-token outputs at the labelled positions ``mask`` (zeros elsewhere): the decoded
    ``hidden`` states' ``rows`` (the labelled positions as rows of the (batch x length, hidden) states: no gathered
    copy) through ``norm`` (where the kernel applies the final norm) and ``head``, with the model's own logit
    transform."""
    gathered = zero3_gathered([head.weight, head.bias, *(norm.parameters() if norm is not None else ())])
    softcap, scale = logit_transform(self.config.get_text_config())
    tile = state.logits_tile(hidden)
    # without fused_lm_head the loss is ours, a token mean: the gradient may be formed in the forward
    token_mean = not fused_lm_head or state.options.token_mean_loss
    form = state.logit_gradient_form(self, head, rows.numel(), tile, hidden.device, token_mean)
    stats = chunked_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        head.bias,
        labels[mask],
        rows=rows,
        norm=norm,
        temperature=state.options.temperature if fused_lm_head else 1.0,
        softcap=softcap,
        logit_scale=scale,
        token_chunk=tile,
        outputs=state.options.fused_outputs if fused_lm_head else ("log_probs",),
        gathered=gathered,
        form=form,
    )
    # masked_scatter keeps the outputs connected to the graph even when no label is valid
    return {k: None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in stats.items()}
