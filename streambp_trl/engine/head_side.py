"""The head side of a streamed call, one rule for every head: the LM head's logit kernel (:func:`.lm_forward.
stream_forward`), a reward model's score head (:func:`.score_head.stream_score_forward`) and the distillation trainer's
divergence kernel, for the student and the teacher alike.

Each runs the (streamed) decoder, then applies the decoder's final norm and its head to some rows of the decoder's
output. Where the probe found the final norm to be the decoder's last step (:meth:`.state.EngineState.final_norm`, the
module the decoder holds at the call), the head applies it itself to the rows it reads (tile by tile, or on the read
rows only) and the decoder's call bypasses it, so no (batch, T, hidden) normed copy is formed: :func:`decode_for_head`
decides that, runs the decoder and hands back its output with the norm left to the head. The norm stays in the decoder
where hidden states are asked for (they are the decoder's output, normed as the model returns them) or where user code
watches a module whose output or gradient the bypass would change (:func:`bypass_watched`): the norm and its
submodules, the decoder and each module between the causal LM and the decoder; their hooks then see what they see
without streaming.

:func:`logits_tile` and :func:`logit_gradient_form` are the engine's choices for a kernel a trainer runs on the head
side itself (the divergence), taking the model, so that no trainer reads the engine's state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..layers.sharding import sharded
from ..patching import bypassed
from .model_parts import causal_lm, lm_head_linear
from .state import EngineState


def hooked(module: nn.Module, global_hooks: bool) -> bool:
    """Whether user code hooks ``module``'s forward or backward: its own hooks (and, with ``global_hooks``, global
    module hooks, forward or backward). The hooks of FSDP2 and DeepSpeed ZeRO-3, which gather a sharded module's
    parameters, are not user code."""
    if sharded(module):
        return False
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    m = nn.modules.module
    watched = (
        m._global_forward_hooks,
        m._global_forward_pre_hooks,
        m._global_backward_hooks,
        m._global_backward_pre_hooks,
    )
    return any(own) or (global_hooks and any(watched))


def bypass_watched(lm: nn.Module, state: EngineState, norm: nn.Module) -> bool:
    """Whether user code would see a difference if the decoder's call bypassed its final ``norm`` (leaving it to the
    head): a hook (:func:`hooked`) on the norm or one of its submodules (the head applies its ``forward`` alone, tile
    by tile), on the decoder or on a module between the causal LM ``lm`` and the decoder (their output would not be
    normed, their output's gradient not the norm's), or a global module hook."""
    parts = state.decoder_path.split(".")
    around = [lm.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
    return hooked(norm, True) or any(hooked(m, False) for m in (*norm.modules(), *around))


def kernel_head(lm: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` of causal LM ``lm``'s head, for a kernel that applies it itself to the hidden states tile by
    tile (:func:`~.model_parts.lm_head_linear`). Refuses a head that user code hooks (:func:`hooked`, its own forward
    and backward hooks): such a hook would not run, as the kernel never calls the head or forms the (tokens x vocab)
    logits it would see. Global module hooks are not refused: they watch every module, and a streamed call has no head
    call."""
    head = lm_head_linear(lm)
    if hooked(lm.get_output_embeddings(), False) or hooked(head, False):
        raise ValueError(
            f"{type(lm).__name__}.lm_head has a forward or backward hook, which would not run: StreamBP computes "
            "the loss from the hidden states tile by tile and never forms the (tokens x vocab) logits the hook would "
            "see. Remove the hook for streamed training calls, or disable_streambp(model) to train with full logits."
        )
    return head


@dataclasses.dataclass(frozen=True)
class HeadSide:
    """A decoder call made for a head: ``decoded``, the decoder's output as its call returned it (a ``ModelOutput``;
    its hidden states, cache and attentions as asked); ``hidden``, its last hidden state (batch, T, hidden), before
    the final norm where ``norm`` is set; ``norm``, the final norm the head applies itself to the rows it reads, or
    ``None`` (the decoder applied it, or it has none)."""

    decoded: Any
    hidden: torch.Tensor
    norm: nn.Module | None


def engine_state(model: nn.Module) -> EngineState:
    """The :class:`~.state.EngineState` of a streaming ``model`` (a causal LM, a sequence classifier or a PEFT model
    wrapping one); a ``ValueError`` without StreamBP."""
    state = getattr(causal_lm(model), "_streambp", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} does not stream: call enable_streambp(model) first.")
    return state


def decode_for_head(model: nn.Module, decode: Callable[[], Any], output_hidden_states: bool | None = None) -> HeadSide:
    """Run ``decode`` (a call of streaming ``model``'s decoder, or of a model around it, returning its
    ``ModelOutput``) for a head applied to rows of its last hidden state.

    The final norm is left to the head (bypassed in the decoder's call) when the probe found it to be the decoder's
    last step, no hidden states are asked for (``output_hidden_states``, the call's argument, or the decoder's config)
    and no user hook watches what the bypass changes (:func:`bypass_watched`); else the decoder applies it. The
    decoder and the norm are those ``model`` holds now (a decoder replaced since enabling is refused). Holds nothing
    beyond what ``decode`` returns: the decoder's (batch, T, hidden) output, not normed where the head applies the
    norm."""
    lm = causal_lm(model)
    state = engine_state(lm)
    state.check_decoder(lm)
    kept = bool(output_hidden_states or state.decoder.config.output_hidden_states)
    norm = None if kept else state.final_norm()
    norm = None if norm is not None and bypass_watched(lm, state, norm) else norm
    with bypassed(norm) if norm is not None else contextlib.nullcontext():
        decoded = decode()
    return HeadSide(decoded=decoded, hidden=decoded.last_hidden_state, norm=norm)


def logits_tile(model: nn.Module, hidden: torch.Tensor) -> int:
    """Tokens per tile of a streaming ``model``'s logit kernels for its (batch, T, hidden) states ``hidden``: the
    fixed ``logits_chunk_size``, or what ``"auto"`` chooses for them."""
    return engine_state(model).logits_tile(hidden)


def logit_gradient_form(
    model: nn.Module, head: nn.Linear, n: int, tile: int, device: torch.device, token_mean: bool
) -> str:
    """The form (``"two-node"``, ``"fused"``, or ``"eager"`` for a token-mean loss, ``token_mean``) of the gradient of
    a logit kernel scoring ``n`` rows of a streaming ``model`` with ``head`` in tiles of ``tile``, as the model's
    memory budget (or the free memory on ``device``) allows; recorded as the model's latest
    (:func:`~.install.last_head_form`)."""
    lm = causal_lm(model)
    return engine_state(lm).logit_gradient_form(lm, head, n, tile, device, token_mean)
