"""The stream-checkpointed decoder layer: one autograd Function per layer call, chunked along the sequence.

Run by each Hugging Face decoder layer's checkpoint hook (:func:`~streambp_trl.layers.hook.stream_checkpoint`), so
the model's own layer code runs, unpatched, on one chunk of the sequence at a time.

Forward (no grad): the layer runs chunk by chunk, first to last, as a prefill against a :class:`ChunkCache`
that serves the keys/values of earlier chunks. Only the layer input ``x`` (batch, T, hidden) is saved, as with
gradient checkpointing (and, for a layer whose keys/values later layers reuse, those keys/values:
:mod:`..shared_kv`); the forward never holds more than one chunk's activations.

Backward, given dY for the whole sequence, hands each chunk its *carry* (what it takes from earlier positions; for
softmax attention the prefix keys/values, :class:`~..carry.LayerCarry`) and sends the carry's gradient back to the
earlier chunks. The keys/values K, V of every position (post-norm, post-RoPE; shape
(batch, kv_heads, T, head_dim)) are recomputed under no grad, cheaply, by running each chunk only up to its
cache update (or kept from the forward with ``kv_mode="capture"``). Then for chunks [s, e) from LAST to FIRST the
layer is recomputed on x[:, s:e] with grad, with the prefix K[:, :, p:s], V[:, :, p:s] as detached leaves
(p = 0, or s - window + 1 for a sliding-window layer), and

    dx[:, s:e], dK_p, dV_p, dθ_c = grad((Y_c, K_c, V_c), (x_c, K_p, V_p, θ),
                                        (dY[:, s:e], dK_acc[:, :, s:e], dV_acc[:, :, s:e]))

with dK_acc[:, :, p:s] += dK_p, dV_acc likewise, dθ += dθ_c. Later chunks attend to a chunk's keys and values and
run first, so dK_acc[:, :, s:e] is complete when chunk [s, e) is processed: the result is the exact gradient.
The layer's trainable parameters θ are inputs of the Function, so each receives its gradient once per layer
backward, which is what DDP buckets, FSDP2 and ZeRO hooks expect. The recompute reads no value of Y_c, only its graph,
so a linear map whose output reaches Y_c only through sums and views (a pre-norm layer's ``down_proj``) runs its
backward products alone (:mod:`.unread`; which maps qualify is seen in the first chunk of the forward).

A layer with several attention sublayers (several cache slots, told apart by ``layer_idx``) gets one K, V and
dK_acc, dV_acc per slot; its keys/values are then recomputed by a no-grad chunked forward, since a later slot's
keys depend on an earlier slot's attention.

Arguments: the layer's positional arguments are bound to their parameter names; per-token ones are sliced per
chunk (``position_ids`` on the last dimension, ``position_embeddings`` (a (cos, sin) pair or one tensor) on the
second to last, any other tensor on its one dimension after the batch whose length is the sequence length).

Randomness: each chunk's random state (CPU and the input's device) is kept from the forward and restored for every
recompute of that chunk, so dropout, LoRA dropout, sampled routing and jitter draw what the forward drew.

Memory of one layer's backward beyond the saved inputs: dY and dx (batch, T, hidden; dx is written over the saved
or rebuilt input when nothing else holds its memory, see :func:`~streambp_trl.layers.call.guards.sole_holder`), K, V,
dK_acc, dV_acc (batch, T, kv_dim each, per slot), the parameter gradient sums and one parameter's fresh gradient, one
chunk's activations and one (chunk x prefix) attention block (with grouped heads, one group's key/value gradients
over the prefix: the attention adds them into dK_acc, dV_acc itself; see :class:`~streambp_trl.attention.PrefixGrad`).
The first layer's input, when it is the input embedding's output, is not kept but rebuilt from the token ids
(:mod:`streambp_trl.layers.kept.rebuild`). With ``offload`` the saved inputs wait in host memory
(:mod:`streambp_trl.layers.kept.offload`), and the device holds the current and the next layer's.

A layer the plan keeps whole (``LayerCall.keeps_activations``, the top ``keep_activations``) builds each chunk's graph
in the forward instead and its backward runs through them, recomputing nothing (:mod:`.kept`).

What the backward reads again besides its saved tensors (the layer's parameters, trainable or frozen, its tensor
arguments) must be as the forward left it, and a layer's backward runs once per forward and is not differentiable:
:mod:`streambp_trl.layers.call.guards` checks both before anything else runs.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...sizing.choices import KVMode
from ..carry import CarryStore
from .backward import ChunkBackward
from .guards import check_backward, saved_tensors_hooked, sole_holder
from .kept import forward_kept
from .layer_call import LayerCall, RecordedCall, layer_name


class StreamLayerFunction(torch.autograd.Function):
    """One decoder layer call, forward and backward chunk by chunk (the math and memory: this module's docstring).

    Args (of ``apply``):
        call: the :class:`LayerCall` (the layer, its bound arguments, its plan's chunk, key/value mode and offload);
            what the forward records lives on ``ctx`` (a :class:`RecordedCall`), nowhere on the layer or the call.
        x: the hidden states (batch, T, hidden).
        inputs: the gradient-carrying per-token arguments (``call.grad_inputs``, also held in ``call.kwargs``), then
            the layer's trainable parameters.

    Returns:
        The layer's output (batch, T, hidden), then the per-token tensors it returns beside it, if any (integer ones
        without gradient; floating ones, a second per-token stream, with it); its backward returns the exact
        gradients of ``x``, of those arguments and of each parameter (once per layer backward).

    .. warning::
        Between forward and backward the layer's parameters (trainable or frozen), its tensor arguments and a kept
        input must not change in place; the backward runs once and is not differentiable (``create_graph=True``).
        Each is refused with a ``RuntimeError`` before anything runs (:mod:`.guards`).
    """

    @staticmethod
    def forward(ctx, call: LayerCall, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor | tuple:
        ctx.graphs, ctx.x = None, None
        if call.keeps_activations:
            need_extra = tuple(ctx.needs_input_grad[2 : 2 + len(call.grad_inputs)])
            ran, ctx.graphs = forward_kept(call, x, ctx.needs_input_grad[1], need_extra)
            ctx.recorded = RecordedCall(call, dataclasses.replace(ran.record, versions=call.versions(None)))
            ctx.params, ctx.nones, ctx.x = inputs[len(call.grad_inputs) :], ran.nones, x.detach()
            return _returned(ctx, ran.y, ran.extras)
        capture = call.kv_mode == KVMode.CAPTURE
        ran = call.forward_chunks(x, recorded=True)
        y, kv, extras = ran.y, ran.kv, ran.extras
        offload = call.offload
        keeps_x = call.embedding_source is None and (call.segment is None or call.position == 0)
        # a tensor of our own over x's memory: whoever else holds x (or a view of it) is seen by `sole_holder`
        kept_x = x.detach() if keeps_x else None
        recorded = RecordedCall(call, dataclasses.replace(ran.record, versions=call.versions(kept_x)))
        ctx.recorded, ctx.params = recorded, inputs[len(call.grad_inputs) :]
        ctx.nones = ran.nones
        if call.segment is not None:  # the segment keeps its first layer's input, for all its layers' backwards
            call.segment.join(recorded, call.position)
            if keeps_x:
                call.segment.keep_first_input(offload.save((kept_x,)) if offload is not None else (kept_x,))
            keeps_x = False
        saved = (*((kept_x,) if keeps_x else ()), *(kv.flat() if capture else ()))
        kept = offload.save(saved) if offload is not None else saved
        ctx.kept = None if isinstance(kept, tuple) else kept
        ctx.save_for_backward(*(kept if ctx.kept is None else ()))
        # a pack hook may keep what save_for_backward is given: x then comes back as nobody's alone
        ctx.packed = keeps_x and ctx.kept is None and saved_tensors_hooked()
        return _returned(ctx, y, extras)

    @staticmethod
    def nones_of(y: torch.Tensor) -> int | None:
        """How many ``None`` the layer returned beside ``y``, the output this Function gave (its node's record)."""
        return getattr(y.grad_fn, "nones", None)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, *dextras: torch.Tensor | None):
        call, record = ctx.recorded.call, ctx.recorded.record
        if dy is None:  # not materialised where the layer returns per-token tensors beside y
            shape, dtype, device = ctx.y_like
            dy = torch.zeros(shape, dtype=dtype, device=device)
        check_backward(ctx, layer_name(call.layer))
        record.versions.check()
        kept, ctx.graphs = ctx.graphs, None
        x, kv, dx_over_x = (ctx.x, None, False) if kept is not None else _inputs_again(ctx, call, record)
        ctx.x = None
        n_extra = len(call.grad_inputs)
        need_extra = tuple(ctx.needs_input_grad[2 : 2 + n_extra])
        dstreams = tuple(dextras[j] for j in record.streams) if dextras else ()
        dx, dextra, dparams = ChunkBackward(call, record).backward_chunks(
            x, dy, kv, list(ctx.params), ctx.needs_input_grad[1], need_extra, dx_over_x, dstreams, kept
        )
        it = iter(dextra)
        return (None, dx, *(next(it) if need else None for need in need_extra), *dparams)


def _inputs_again(ctx, call: LayerCall, record) -> tuple[torch.Tensor, CarryStore | None, bool]:
    """A recomputing backward's input: the layer input (kept, loaded from the host, rebuilt from the token ids or by
    its segment), the keys/values captured in the forward (``None``: recomputed) and whether the input gradient may
    take the input's memory (nothing else holds it)."""
    saved = ctx.saved_tensors if ctx.kept is None else call.offload.load(ctx.kept)
    ctx.kept = None
    if call.segment is not None:
        x, flat = call.segment.input(call.position, functools.partial(_segment_first_input, call)), saved
    elif call.embedding_source is not None:
        x, flat = call.embedding_source.rebuild(call.autocast), saved
    else:
        x, *flat = saved
    kv = None
    if call.kv_mode == KVMode.CAPTURE:
        kv = CarryStore.from_flat(call.seq_len, record.slots, record.state_layout, tuple(flat), call.compress_rates)
    # (a sequence split reads x again after the chunks' backwards: its returned key/value gradients' pass)
    return x, kv, not ctx.packed and call.split is None and sole_holder(x)


def _returned(ctx, y: torch.Tensor, extras: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple:
    """What the Function's forward returns: ``y``, or ``y`` and the layer's per-token outputs (the integer ones
    without gradient; a floating one no later computation read gets no gradient, and no zeros either)."""
    if not extras:
        return y
    ctx.mark_non_differentiable(*(t for t in extras if not t.is_floating_point()))
    ctx.set_materialize_grads(False)
    ctx.y_like = (y.shape, y.dtype, y.device)
    return (y, *extras)


def _segment_first_input(call: LayerCall, kept: object) -> torch.Tensor:
    """A segment's first input again, from what ``call`` (the segment's last layer) finds kept for it."""
    recorded = call.segment.calls[0]()
    first = recorded.call if recorded is not None else None
    if first is not None and first.embedding_source is not None:
        return first.embedding_source.rebuild(first.autocast)
    offload = call.offload
    return (offload.load(kept) if offload is not None else kept)[0]
