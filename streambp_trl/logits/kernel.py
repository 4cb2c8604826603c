"""``chunked_logprobs``: the kernel's entry point, which describes the call and chains its autograd nodes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

from .eager import EagerNode
from .forms import HeadForm
from .nodes import LogitNode, WeightNode
from .tiles import DEFAULT_VOCAB_CHUNK, STAT_OUTPUTS, LogitCall, Transform, acc_dtype, autocast_state


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    token_chunk: int = 4096,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    outputs: tuple[str, ...] = ("log_probs",),
    gathered: Callable[[], ContextManager] | None = None,
    form: HeadForm = HeadForm.FUSED,
) -> dict[str, torch.Tensor | None]:
    """Per-row statistics of ``norm(hidden[rows]) @ weight.T (+ bias)`` at ``targets``; see the module docstring.

    ``hidden`` is (M, H); ``rows`` (N,) selects the rows to score (all M when ``None``); ``targets`` is (N,).
    ``norm`` is a row-wise module (the model's final norm) applied to each tile (its ``forward``), or ``None``.
    ``gathered``: a factory of context managers inside which ``weight``, ``bias`` and the norm's parameters hold their
    whole values (sharded parameters); entered once for the forward and once per backward node.
    ``form`` (:class:`~.forms.HeadForm`): ``FUSED`` forms the weight's (and bias's) gradient in the same sweep as
    the hidden states' (one logit recompute, a (V, H) accumulator beside dh), ``TWO_NODE`` in a weight node of its own
    (two recomputes, never both gradients' buffers at once), ``EAGER`` the gradient's bases in the forward
    (:mod:`.eager`: no recompute when the loss weights every row alike, e.g. a token mean; checked in backward, else
    recomputed as the fused form does); see the module docstring.
    Returns a dict with every name of :data:`STAT_OUTPUTS`; those not in ``outputs`` are ``None``.
    """
    unknown = set(outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"Tile sizes must be positive, got token_chunk={token_chunk}, vocab_chunk={vocab_chunk}.")
    device = hidden.device.type
    cdt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    call = LogitCall(
        Transform(temperature, softcap, logit_scale),
        token_chunk,
        vocab_chunk,
        tuple(outputs),
        norm,
        rows,
        targets,
        cdt,
        acc_dtype(hidden.dtype),
        autocast_state(device),
        weight,
        bias,
        gathered or contextlib.nullcontext,
    )
    # under the gather: the autograd nodes record the parameters' whole shapes
    with call.gathered():
        norm_params = [p for p in norm.parameters() if p.requires_grad] if norm is not None else []
        trained = weight.requires_grad or (bias is not None and bias.requires_grad)
        if form == HeadForm.EAGER and torch.is_grad_enabled() and (trained or hidden.requires_grad or norm_params):
            return _named(EagerNode.apply(call, hidden, weight, bias, *norm_params))
        if form != HeadForm.TWO_NODE or not trained:
            return _named(LogitNode.apply(call, hidden, weight, bias, *norm_params))
        detached_bias = None if bias is None else bias.detach()
        log_z, log_probs, entropy, *rest = LogitNode.apply(call, hidden, weight.detach(), detached_bias, *norm_params)
        zero_lp, zero_ent = WeightNode.apply(
            call, weight, bias, hidden.detach(), log_z, None if entropy is None else entropy.detach()
        )
        log_probs = log_probs + zero_lp
        entropy = entropy if entropy is None else entropy + zero_ent
    return _named((log_z, log_probs, entropy, *rest))


def _named(outputs: tuple) -> dict[str, torch.Tensor | None]:
    """The statistics by name, from the logit node's (log Z, *statistics)."""
    return dict(zip(STAT_OUTPUTS, outputs[1:], strict=True))
