"""Grouped-query heads one key/value group at a time, and the prefix's key/value gradient handed past the join.

Used by the CUDA path of :func:`~streambp_trl.attention.kernels.stream_attention`: :class:`_GroupedHeads` keeps a
group's fused-kernel workspace (not all heads') in backward, and with a :class:`PrefixGrad` pair (what the stream
layer's chunk cache records for the joined keys/values of a recompute) adds the prefix positions' gradient straight
into the layer's sums.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.autograd.function import once_differentiable

from .masks import StreamMask


@dataclasses.dataclass(frozen=True)
class PrefixGrad:
    """Where the gradient of joined keys (or values) ``full = cat([prefix, chunk], dim=2)`` of a backward recompute
    may go, bypassing the join: ``chunk`` (the chunk's own keys, in the graph) takes the last positions' part, and
    the prefix positions' part is added into ``acc`` (the layer's gradient sum over those positions, outside any
    graph). The stream layer's cache records one pair (keys, values) per joined tensors it returns, in the chunk
    mask's ``prefix_grads``; an attention that uses it attends to ``full`` (detached), so no (prefix + chunk)-long
    gradient reaches the join and the prefix leaves get none from autograd, while every position's gradient sum is
    the same."""

    full: torch.Tensor  # the joined tensor as the cache returned it (identity tells it apart); attended detached
    chunk: torch.Tensor
    acc: torch.Tensor

    @staticmethod
    def of(mask: StreamMask, key: torch.Tensor, value: torch.Tensor) -> PrefixPair | None:
        """The pair recorded for ``key`` and ``value`` exactly as the cache returned them, else ``None`` (a tensor
        the model derived from them is attended as it is)."""
        return next((pair for pair in mask.prefix_grads if pair[0].full is key and pair[1].full is value), None)


PrefixPair = tuple[PrefixGrad, PrefixGrad]


class _GroupedHeads(torch.autograd.Function):
    """Attention of query heads ``[g * m * G, (g + 1) * m * G)`` against key/value heads ``[g * m, (g + 1) * m)``
    (``m = per_call``, 1 by default), one group ``g`` at a time.

    Forward runs ``attend`` per group and keeps each group's own autograd graph (the kernel's saved tensors: views
    of q, k, v, its output and log-sum-exp, what one call over all heads keeps); backward runs the groups' backwards
    one after another and writes each group's dQ, dK, dV into one gradient tensor each, so the only transient of a
    group's backward is that group's workspace (flash: dK/dV expanded to G heads; memory-efficient: dK/dV of G
    heads), and dK/dV are not assembled from per-group full-size zero tensors. Without gradients it is just the
    per-group calls, which draw dropout in the same order, so a no-grad forward and its recompute agree.

    With ``prefix`` (the :class:`PrefixGrad` pair of a recompute's joined keys/values), ``key``/``value`` are the
    chunk's own keys/values and the attention runs over the joined ones: each group's key/value gradient goes, prefix
    positions into the layer's sums (``acc``), chunk positions into the chunk's gradient. No (prefix + chunk)-long
    gradient of all key/value heads is then held, only one group's.
    """

    @staticmethod
    def forward(ctx, query, key, value, attend, prefix, per_call=1):
        keys, values = (key, value) if prefix is None else (prefix[0].full.detach(), prefix[1].full.detach())
        m = per_call
        group = query.shape[1] // keys.shape[1] * m
        groups = [
            (query[:, g * group : (g + 1) * group], keys[:, g * m : (g + 1) * m], values[:, g * m : (g + 1) * m])
            for g in range(keys.shape[1] // m)
        ]
        need = ctx.needs_input_grad[:3]
        if prefix is not None and any(need):  # the prefix positions' gradient is wanted whatever the chunk's need
            need = (need[0], True, True)
        if not any(need):
            return torch.cat([attend(*t) for t in groups], dim=1)
        with torch.enable_grad():
            leaves = [[t.detach().requires_grad_(n) for t, n in zip(ts, need, strict=True)] for ts in groups]
            outs = [attend(*ts) for ts in leaves]
        ctx.graphs, ctx.need, ctx.prefix, ctx.per_call = list(zip(leaves, outs, strict=True)), need, prefix, m
        ctx.shapes = [(t.shape, t.dtype) for t in (query, key, value)]
        return torch.cat([o.detach() for o in outs], dim=1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        graphs, ctx.graphs = ctx.graphs, None
        prefix, ctx.prefix = ctx.prefix, None
        wanted = ctx.needs_input_grad[:3]
        grads = [grad.new_empty(s, dtype=d) if n else None for (s, d), n in zip(ctx.shapes, wanted, strict=True)]
        sums = (None, None, None) if prefix is None else (None, prefix[0].acc, prefix[1].acc)
        # the key/value positions before the chunk's own (with a prefix), per input
        splits = (0, 0, 0) if prefix is None else (0, prefix[0].acc.shape[2], prefix[1].acc.shape[2])
        group = grad.shape[1] // len(graphs)
        for g in range(len(graphs)):
            leaves, out = graphs[g]
            graphs[g] = None  # the group's graph and output go as soon as its backward has run
            inputs = [t for t, n in zip(leaves, ctx.need, strict=True) if n]
            parts = iter(torch.autograd.grad(out, inputs, grad[:, g * group : (g + 1) * group]))
            del leaves, out, inputs
            widths = (group, ctx.per_call, ctx.per_call)
            for full, acc, split, width, n in zip(grads, sums, splits, widths, ctx.need, strict=True):
                part = next(parts) if n else None
                heads = slice(g * width, (g + 1) * width)
                if acc is not None:
                    acc[:, heads] += part[:, :, :split]
                if full is not None:
                    full[:, heads].copy_(part[:, :, split:])
            del parts, part
        return (*grads, None, None, None)
