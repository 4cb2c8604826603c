"""A training call given the whole rows on every rank of a sequence group, each rank streaming its share.

With ``enable_streambp(..., sequence_group=group, whole_rows=True)`` every rank of ``group`` is given the same rows
(batch, T) and the same labels, as a trainer whose loss reads whole sequences has them (DPO, KTO, GRPO, RLOO,
distillation: a sequence's log-probability sums over all its tokens). Each rank cuts out its share, positions
[q L, (q + 1) L) with L = ceil(T / R) (the rows right-padded to R L with masked positions that score nothing, which
change no earlier position's output), streams it with the key/value exchange of
:mod:`streambp_trl.layers.sequence_split` (the whole rows' padding mask and positions known on every rank), scores its
positions' labels (shifted over the whole rows) with the logit kernel, and gathers every per-token field back to the
whole rows, so the trainer's loss code runs on the same (batch, T - 1) tensors on every rank as on one process.

Which calls split: a training-mode call (the policy's, with or without grad), and, inside :func:`group_batch` (a
trainer's training step, whose batch every rank of the group was given), an eval-mode model's too (a separate
reference model's no-grad pass). Any other eval-mode call (evaluation, where each rank has rows of its own) streams its
rows unsplit.

Gradients: the gather's backward (``torch.distributed.nn.functional.all_gather``) sums what every rank's loss hands
each share, and every rank computes the same loss, so each rank's gradient is R times its share's: the average over
the group (DDP's, ZeRO's) is the whole rows' gradient. One ``all_reduce`` per call checks that the ranks were given the
same rows (a fingerprint of the inputs), since a share of other rows would train silently wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl.trainer.utils import FusedCausalLMOutput

from ..layers.layer_args import builds_cache
from ..layers.sequence_split import SequenceSplit, packed_documents
from .state import EngineState

_SHARE: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar("streambp_share", default=None)
_GROUP_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar("streambp_group_batch", default=False)


def current_share() -> SequenceSplit | None:
    """The split of the whole-rows call in progress (its decoder call streams this rank's share), or ``None``."""
    return _SHARE.get()


@contextlib.contextmanager
def sharing(split: SequenceSplit) -> Iterator[None]:
    """The decoder calls of a ``with`` block stream this rank's share as ``split`` says (the caller cut the rows)."""
    token = _SHARE.set(split)
    try:
        yield
    finally:
        _SHARE.reset(token)


@contextlib.contextmanager
def group_batch() -> Iterator[None]:
    """The calls of a ``with`` block are on the batch every rank of the sequence group was given (a trainer's training
    step): an eval-mode model enabled with ``whole_rows=True`` splits them too (:func:`splits_rows`)."""
    token = _GROUP_BATCH.set(True)
    try:
        yield
    finally:
        _GROUP_BATCH.reset(token)


def splits_rows(state: EngineState, training: bool) -> bool:
    """Whether a causal LM's call (``training``: the model's mode) on whole rows is cut into this rank's share here:
    with the engine enabled on a group with ``whole_rows=True``, no share cut by a caller yet, in training mode or
    inside :func:`group_batch`."""
    given = training or _GROUP_BATCH.get()
    return state.whole_rows and state.sequence_group is not None and current_share() is None and given


def forward(
    state: EngineState,
    local: Callable,
    kwargs: dict,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch,
    fused_lm_head: bool,
    shifted: bool,
) -> FusedCausalLMOutput | CausalLMOutputWithPast:
    """The call on the whole rows ``kwargs`` hold (``input_ids`` or ``inputs_embeds``, a 2D ``attention_mask``,
    ``position_ids``), its ``labels`` (``shifted``: scored against the next position's, as the model's own loss and
    TRL's fused head pair them) or ``shift_labels``: this rank's share run through ``local`` (the causal LM's stream
    forward, called with the share's inputs and its ``shift_labels``, ``fused_lm_head=True``), its per-token fields
    gathered to the whole rows, and the loss of the whole rows (summed over the scored tokens and divided by
    ``num_items_in_batch``, or by their count)."""
    group = state.sequence_group()
    share = Share.of(group, kwargs, state)
    if shift_labels is None:
        shift_labels = labels[:, 1:] if shifted else labels
    whole = shift_labels.shape[1]
    shift_labels = F.pad(shift_labels, (0, share.split.length * share.split.size - whole), value=-100)
    with sharing(share.split):
        out = local(
            **share.kwargs,
            shift_labels=shift_labels[:, share.mine],
            num_items_in_batch=num_items_in_batch,
            fused_lm_head=True,
            return_dict=True,
        )
    length = share.split.length
    fields = {key: _gathered(value, group)[:, :whole] for key, value in out.items() if _per_token(key, value, length)}
    denominator = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / denominator  # (every per-token field is zero where the label is -100)
    if fused_lm_head:
        return FusedCausalLMOutput(loss=loss, **fields)
    return CausalLMOutputWithPast(loss=loss, logits=None)


def pooled(state: EngineState, decode: Callable, kwargs: dict, positions: torch.Tensor) -> tuple:
    """A sequence classifier's call on the whole rows ``kwargs`` hold: this rank's share decoded (``decode``, called
    with the share's inputs, returns a :class:`~.head_side.HeadSide`), and each row's hidden state at its
    ``positions`` (global, one per row), taken on the rank whose share holds it and summed over the ranks (a
    differentiable all-reduce: every rank then has every row's); returns ``(the head side, the rows)``."""
    group = state.sequence_group()
    share = Share.of(group, kwargs, state)
    with sharing(share.split):
        side = decode(**share.kwargs)
    hidden = side.hidden
    offset, length = share.split.offset, share.split.length
    here = (positions >= offset) & (positions < offset + length)
    local = (positions - offset).clamp(0, length - 1)
    rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), local] * here[:, None].to(hidden.dtype)
    return side, dist_nn.all_reduce(rows, group=group)


@dataclasses.dataclass(frozen=True)
class Share:
    """This rank's share of whole rows: its :class:`SequenceSplit` (the whole rows' padding mask in it), the call's
    keyword arguments cut to it (inputs, 2D mask, positions) and its positions of the (padded) whole rows."""

    split: SequenceSplit
    kwargs: dict
    mine: slice

    @classmethod
    def of(cls, group: dist.ProcessGroup, kwargs: dict, state: EngineState) -> Share:
        """The share of a call on the whole rows ``kwargs`` hold (``input_ids`` or ``inputs_embeds``, a 2D
        ``attention_mask``, ``position_ids``: the model's own from 0 where none are given; packed rows' documents
        kept apart as :func:`~streambp_trl.layers.sequence_split.packed_documents` says for ``state``'s decoder),
        the rows right-padded to a multiple of the ranks with masked positions, its split drawing from the engine's
        count of split layer calls."""
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        inputs = kwargs.get(name)
        if inputs is None:
            raise ValueError("StreamBP: a call split across ranks needs input_ids or inputs_embeds as a keyword.")
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError(
                "StreamBP cannot split the rows of a call with a 4D attention mask across ranks: pass a 2D padding "
                "mask (or none), or train without the sequence split."
            )
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        _check_same_rows(group, inputs)
        batch, length = inputs.shape[:2]
        share = -(-length // ranks)
        pad = share * ranks - length
        device = inputs.device
        masked = mask is not None or builds_cache(state.decoder, kwargs)  # (a cache: transformers reads no packing)
        mask = torch.ones(batch, length, dtype=torch.long, device=device) if mask is None else mask
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=device).expand(batch, -1)
        documents = packed_documents(positions, masked, not bool(mask.all()), state.kernel_apart)
        if pad:  # masked positions after the rows' last: no earlier position attends to them, none is scored
            inputs = F.pad(inputs, (0, 0, 0, pad) if name == "inputs_embeds" else (0, pad))
            mask = F.pad(mask, (0, pad))
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=device)], dim=1)
        mine = slice(rank * share, (rank + 1) * share)
        padded = None if bool(mask.all()) else mask.bool()
        split = SequenceSplit(group, rank, ranks, share, padded, documents, state.split_draws)
        call = {**kwargs, name: inputs[:, mine], "attention_mask": mask[:, mine], "position_ids": positions[:, mine]}
        return cls(split, call, mine)


def _per_token(key: str, value: object, share: int) -> bool:
    return key != "loss" and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == share


def _gathered(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's share of a per-token field (batch, L), joined along the positions; a floating one with gradient,
    whose backward hands each share the sum of what every rank's loss gives it."""
    if t.is_floating_point():
        return torch.cat(dist_nn.all_gather(t.contiguous(), group=group), dim=1)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _check_same_rows(group: dist.ProcessGroup, inputs: torch.Tensor) -> None:
    """Refuse a call whose ranks were given different rows, or the same rows in another order (one ``all_reduce`` of
    a fingerprint: the shape and a sum of the inputs weighted by row and position)."""
    rows, length = inputs.shape[:2]
    weights = torch.arange(1, rows * length + 1, device=inputs.device, dtype=torch.float64).view(rows, length)
    values = inputs.double() if inputs.dim() == 2 else inputs.double().sum(-1)
    fingerprint = torch.tensor(
        [*inputs.shape[:2], float((values * weights).sum())], dtype=torch.float64, device=inputs.device
    )
    both = torch.cat([fingerprint, -fingerprint])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(both[:3], -both[3:]):
        raise ValueError(
            "StreamBP: the ranks of the sequence split were given different rows (or the same in another order): "
            "with whole_rows=True every rank of the group must be given the same batch (each streams its share of "
            "it); a trainer's data path hands the group one batch at a time."
        )
