"""A layer call whose forward keeps its activations: each chunk's graph is built once, in the forward, and its
backward runs through it, so nothing of the layer is recomputed (the plan's ``keep_activations``, its top layers).

The forward builds, first chunk to last, exactly the graph a recomputing backward builds for that chunk
(:meth:`~.backward.ChunkBackward.build`): ``x[:, s:e]`` and the per-token arguments as leaves, the keys/values of the
prefix [p, s) as leaves over the store of every position's keys/values (written chunk by chunk as the forward goes),
the states entering the chunk as leaves. Its output is the layer's output for those positions. The backward then
takes the chunks last to first through :meth:`~.backward.ChunkBackward._propagate`, the same gradient step as a
recomputing backward's, with the same carry: the gradients are the recomputing plan's, bit for bit (the chunks'
random numbers are drawn once, in the forward, as the recompute replays them).

Memory, held from the layer's forward to its backward: every chunk's saved activations (one layer's activations at
full length, its input among them), the keys/values of every position and, from the second chunk on, their gradient
sums (batch, kv_heads, T, head_dim each per cache slot). In exchange the backward holds no recompute: no key/value
collection pass and no chunk forward. Layers kept this way are the top ones (:meth:`~streambp_trl.sizing.choices.
StepPlan.keeps`): their backwards come first, so their activations are gone before the recomputing layers' backwards.

Not for a layer whose keys/values later layers reuse, a sparse indexed or compressed attention, a layer in a
``keep_every`` segment or whose parameters are sharded (:func:`keeps_activations` says which).
"""

from __future__ import annotations

import torch
from torch import nn

from ..carry import CarryStore, LayerCarry
from ..rng import RngState
from ..sharding import sharded
from .backward import ChunkBackward, KeptGraphs
from .layer_call import ChunkedForward, ForwardRecord, LayerCall


def keeps_activations(layer: nn.Module, kept: bool, shared: object, compressed: bool, segmented: bool) -> bool:
    """Whether a layer call the plan keeps (``kept``) keeps its chunks' graphs: not where its keys/values are shared
    with later layers (``shared``), its attention compresses windows (``compressed``), it belongs to a ``keep_every``
    segment (``segmented``) or its parameters are sharded (gathered only around its own forward and backward); each
    of those recomputes as before."""
    return kept and shared is None and not compressed and not segmented and not sharded(layer)


def forward_kept(
    call: LayerCall, x: torch.Tensor, need_dx: bool, need_extra: tuple[bool, ...]
) -> tuple[ChunkedForward, KeptGraphs]:
    """The layer's forward on ``x`` (batch, T, ...), every chunk's graph kept for its backward (the module's
    docstring); ``need_dx``, ``need_extra``: whether the backward asks for the gradient of ``x`` and of each
    gradient-carrying per-token argument. Returns the forward (its record: each chunk's random state, the cache slots
    and state layout) and the kept graphs."""
    store = CarryStore(call.seq_len, rates=call.compress_rates)
    carry = LayerCarry(store)
    builder = ChunkBackward(call, ForwardRecord())
    extra = builder.extra(need_extra)
    graphs, states, full, streams = [], [], [], ()
    y = None
    for n, (s, e) in enumerate(call.chunks()):
        states.append(RngState(x))
        graph = builder.build(n, s, e, x, carry, extra, need_dx, kept=True)
        if e < call.seq_len and e not in call.resets:
            store.record(n, graph.cache.outgoing)
        if y is None:
            y = x.new_empty(x.shape[:2] + graph.yc.shape[2:], dtype=graph.yc.dtype)
            full = [t.new_empty(x.shape[:2] + t.shape[2:]) for t in graph.extras]
            streams = tuple(j for j, t in enumerate(graph.extras) if t.is_floating_point())
        if len(graph.extras) > len(streams) and call.prefix_start(s) > 0:
            raise ValueError(
                f"StreamBP cannot stream {type(call.layer).__name__}: it returns per-token indices beside its output "
                "while its chunks attend to a window of keys, whose positions such indices would be counted from."
            )
        with torch.no_grad():
            y[:, s:e] = graph.yc
            for t_full, t in zip(full, graph.extras, strict=True):
                t_full[:, s:e] = t
        graphs.append(graph)
    record = ForwardRecord(
        rng=tuple(states), slots=tuple(sorted(store.kv)), state_layout=tuple(store.layout()), streams=streams
    )
    nones = graphs[-1].nones if graphs else None
    return ChunkedForward(y, store, tuple(full), nones, record), KeptGraphs(carry, graphs)
