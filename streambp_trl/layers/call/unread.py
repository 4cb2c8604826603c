"""Linear maps whose output no gradient reads, and the backward recompute that skips their matmul.

A chunk's backward recomputes the layer with grad only for its graph: the output ``Y_c`` is a root of
``autograd.grad``, and its value is never read. A linear map ``z = x W^T + b`` whose output reaches ``Y_c`` only
through operations whose backward does not read it (a pre-norm layer's ``down_proj``: ``Y = h + down_proj(a)``) has
gradients ``dx = dz W``, ``dW = dz^T x``, ``db = sum dz`` that need ``x`` and ``W`` but not ``z``. In the recompute
such a map returns zeros of ``z``'s shape and computes only those gradients in backward (:class:`_SkippedLinear`): the
(chunk x in x out) forward matmul is not run, as ``torch.utils.checkpoint`` stops its recompute once every tensor
the backward reads is rebuilt. The gradients are the same matmuls the plain backward runs, so they stay exact.

Which maps qualify is seen, not assumed: :func:`unread_outputs` follows every leaf ``nn.Linear`` output of a layer
through one chunk of its forward (a dispatch mode that sees every aten operation) and keeps a map only if each
operation that reads its output, or anything computed from it, is one whose backward does not read that value:
``add``/``sub``, a product with a Python number, a view, a copy or a dtype cast. A post-norm (Gemma's
``post_feedforward_layernorm``), a router weight (MoE experts, gated shared experts), a clamp, a dropout, a cache
write, an in-place update, or a value read on the host all disqualify it, in the call that does them. Only exact
``nn.Linear`` modules qualify (a PEFT adapter's ``base_layer`` is one; quantised subclasses compute otherwise).

The verdict is taken on the first chunk of every streamed training forward (:meth:`LayerCall.forward_chunks`) and
held by that call alone, so a layer whose code path changes between calls (training mode, adapters, arguments) is
judged again. The check costs one chunk's operations through a Python dispatch mode, once per layer call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...patching import forwards_replaced

_aten = torch.ops.aten
# operations whose backward does not read the value of their tensor inputs (views, copies, sums)
_VALUE_FREE = {
    _aten.add.Tensor,
    _aten.sub.Tensor,
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.alias.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.expand.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.t.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.slice.Tensor,
}
# ... and those whose backward reads only their other operand, when that is a Python number
_SCALED = {_aten.mul.Tensor, _aten.div.Tensor}


class _Tracker(TorchDispatchMode):
    """Follows the outputs of candidate linear maps through the operations of one forward: ``derived`` maps each
    tensor computed from them (by ``id``; ``held`` keeps them alive so no id is reused) to the maps it comes from,
    and ``read`` collects the maps whose output some operation's backward would read."""

    def __init__(self) -> None:
        super().__init__()
        self.derived: dict[int, frozenset[nn.Module]] = {}
        self.held: list[torch.Tensor] = []
        self.read: set[nn.Module] = set()

    def mark(self, t: object, sources: frozenset[nn.Module]) -> None:
        if isinstance(t, torch.Tensor):
            self.derived[id(t)] = self.derived.get(id(t), frozenset()) | sources
            self.held.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        sources = frozenset().union(*(self.derived.get(id(a), frozenset()) for a in tensors))
        if sources:
            value_free = func in _VALUE_FREE or (func in _SCALED and len(tensors) == 1 and len(args) == 2)
            if value_free and not func._schema.is_mutable:
                for t in tree_flatten(out)[0]:
                    self.mark(t, sources)
            else:
                self.read |= sources
        return out


def _candidates(layer: nn.Module) -> list[nn.Module]:
    """The layer's plain ``nn.Linear`` maps whose forward is the class's own (no instance forward: accelerate's
    device hooks, for one, replace it to bring the weights in)."""
    return [m for m in layer.modules() if type(m) is nn.Linear and "forward" not in vars(m)]


def _marked_forward(tracker: _Tracker, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = nn.Linear.forward(module, x)
    tracker.mark(out, frozenset((module,)))
    return out


@contextlib.contextmanager
def unread_outputs(
    layer: nn.Module, carried: Callable[[], Iterable[torch.Tensor]] = tuple
) -> Iterator[list[nn.Module]]:
    """For a ``with`` block running ``layer`` (one chunk of its forward): yields a list that, when the block ends,
    holds the layer's leaf ``nn.Linear`` maps that ran and whose output no backward reads (see the module's
    docstring). ``carried()``, asked when the block ends: the states the chunk hands later chunks, whose code may read
    what this chunk only stored (a compressor's window buffer, read by the chunk that closes the window): a map whose
    output reaches them is read. Nothing the block computes changes."""
    candidates = _candidates(layer)
    result: list[nn.Module] = []
    if not candidates:
        yield result
        return
    tracker = _Tracker()
    marked = {m: functools.partial(_marked_forward, tracker, m) for m in candidates}
    with forwards_replaced(marked), tracker:
        yield result
    for t in carried():
        tracker.read |= tracker.derived.get(id(t), frozenset())
    ran = set().union(*tracker.derived.values()) if tracker.derived else set()
    result.extend(m for m in candidates if m in ran and m not in tracker.read)


class _SkippedLinear(torch.autograd.Function):
    """``linear(x, weight, bias)`` whose output value is not computed: forward returns zeros of its shape and keeps
    ``x`` and ``weight`` (references, as the plain linear's backward keeps them); backward computes ``dx = dz W``,
    ``dW = dz^T x``, ``db = sum dz`` in ``dtype`` (the autocast dtype, or the inputs'), each returned in its input's
    dtype as the plain linear's casts would return it."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias is None else bias.dtype
        return x.new_zeros(*x.shape[:-1], weight.shape[0], dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad = grad.to(ctx.dtype)
        dx = dw = db = None
        if need_x:
            dx = (grad @ weight.to(ctx.dtype)).to(x.dtype)
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w:
            dw = (flat.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        if need_b:
            db = flat.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


def _skipped_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return _SkippedLinear.apply(x, module.weight, module.bias, dtype)


def outputs_skipped(modules: list[nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Each of ``modules`` (found by :func:`unread_outputs`) computes no output in a ``with`` block, only its
    gradients in backward (:class:`_SkippedLinear`)."""
    return forwards_replaced({m: functools.partial(_skipped_forward, m) for m in modules})
