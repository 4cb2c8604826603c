"""Each chunk's backward of one layer call, last chunk to first: the recompute with grad, the carry handed back to the
earlier chunks, the parameters' gradients summed as they come (the math and memory: :mod:`.stream_layer`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import nn

from ...attention.kept_outputs import replaying
from ...sizing.setup import adapter_sums, whole_numel
from ..carry import INDEXER, CarryStore, ChunkCache, LayerCarry, StopAfterCacheUpdate, queries_skipped
from ..rng import rng_fork
from ..shared_kv import ChunkShared
from .layer_call import ForwardRecord, LayerCall
from .unread import outputs_skipped


@dataclasses.dataclass
class ChunkGraph:
    """One chunk's graph, from its leaves (its input ``xc``, the per-token argument ``leaves``, the carry entering it
    in ``cache``, the shared keys/values in ``shared``) to its outputs (``yc``, ``extras``; ``nones``: how many
    ``None`` the layer returned beside them), for chunk ``n`` = [``s``, ``e``)."""

    n: int
    s: int
    e: int
    cache: ChunkCache
    xc: torch.Tensor
    leaves: dict[str, torch.Tensor]
    yc: torch.Tensor
    extras: tuple[torch.Tensor, ...]
    nones: int | None
    shared: ChunkShared | None


@dataclasses.dataclass
class KeptGraphs:
    """What a forward that keeps its chunks' graphs hands its backward: every chunk's graph (first chunk first) and
    the carry they were built over (the store of every position's keys/values, the gradient sums of its slots)."""

    carry: LayerCarry
    graphs: list[ChunkGraph]


@dataclasses.dataclass(frozen=True)
class ChunkBackward:
    """The backward of one layer call, a function of the call (its chunks, arguments and shared keys/values, and its
    :meth:`~.layer_call.LayerCall.run`) and of what its forward recorded (random states, cache slots, the outputs it
    skips, the keys/values it shares)."""

    call: LayerCall
    record: ForwardRecord

    def backward_chunks(
        self,
        x: torch.Tensor,
        dy: torch.Tensor,
        kv: CarryStore | None,
        params: list[nn.Parameter],
        need_dx: bool,
        need_extra: tuple[bool, ...],
        dx_over_x: bool,
        dstreams: tuple[torch.Tensor | None, ...] = (),
        kept: KeptGraphs | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """``dx_over_x``: nothing but this backward holds ``x``'s memory, so dx may take its place. ``dstreams``: the
        gradients of the floating per-token outputs (``streams``; ``None`` where none reached them). ``kept``: the
        chunks' graphs and carry the forward kept (:mod:`.kept`), taken (emptied) here instead of recomputed."""
        with rng_fork(x):
            return self._backward_chunks(x, dy, kv, params, need_dx, need_extra, dx_over_x, dstreams, kept)

    def _backward_chunks(self, x, dy, kv, params, need_dx, need_extra, dx_over_x, dstreams, kept):
        call = self.call
        if kept is not None:
            carry, graphs = kept.carry, kept.graphs
        else:
            carry, graphs = LayerCarry(kv if kv is not None else self.collect_kv(x)), None
        for kind, slot in self.record.stores.items():  # what the later layers reusing these keys/values handed back
            grads = call.shared.take_grads(kind)
            if grads is not None:
                carry.seed(slot, grads)
        # x[:, s:e] is not read again once chunk [s, e) is done (keys/values are already collected), so its
        # gradient can take its place when nothing else holds x
        dx = (x if dx_over_x else torch.empty_like(x)) if need_dx else None
        extra = self.extra(need_extra)
        dextra = [torch.zeros_like(t) for _, t, _ in extra]
        dparams: list[torch.Tensor | None] = [None] * len(params)
        # the parameters' own tensor hooks are set aside meanwhile: they run once, on the sums this Function returns
        users = [dict(p._backward_hooks) if p._backward_hooks else {} for p in params]
        for p, own in zip(params, users, strict=True):
            if own:
                p._backward_hooks.clear()
        zeros: dict = {}  # one storage-less zero per (dtype, device), shared by every chunk's placeholders
        wide = adapters_only(call.layer, params)
        hooks = [p.register_hook(functools.partial(_absorb, dparams, zeros, wide, j)) for j, p in enumerate(params)]
        try:
            self._chunk_backwards(x, dy, carry, dx, extra, dextra, params, dstreams, graphs)
            if call.split is not None:
                self._later_ranks(x, carry, dx, extra, dextra, params)
        finally:
            for hook in hooks:
                hook.remove()
            for p, own in zip(params, users, strict=True):
                p._backward_hooks.update(own)
        return (
            dx,
            dextra,
            [g if g is None or g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(dparams, params, strict=True)],
        )

    def extra(self, need_extra: tuple[bool, ...]) -> list[tuple[str, torch.Tensor, object]]:
        """The gradient-carrying per-token arguments whose gradient is asked for: (name, tensor, sequence dims)."""
        call = self.call
        return [
            (n, call.kwargs[n], call.per_token[n])
            for n, need in zip(call.grad_inputs, need_extra, strict=True)
            if need
        ]

    def build(
        self,
        n: int,
        s: int,
        e: int,
        x: torch.Tensor,
        carry: LayerCarry,
        extra: list,
        need_dx: bool,
        kept: bool = False,
    ) -> ChunkGraph:
        """Chunk ``n`` = [s, e) run with grad on ``x[:, s:e]`` as a leaf, its incoming carry as leaves over the carry's
        store: its graph. In a backward (``kept`` False) the chunk replays its recorded random state and skips the
        outputs no backward reads; in a forward that keeps its graphs (``kept``) it draws its random numbers as they
        come (the caller records the state), computes every output (the layer's output is the forward's) and runs over
        the store under fresh version counters, since later chunks write the store while this graph waits. A recompute
        takes back the attention outputs its forward kept, if any (:mod:`streambp_trl.attention.kept_outputs`)."""
        call, record = self.call, self.record
        cache = carry.chunk_cache(n, s, call.prefix_start(s), resets=s in call.resets, aliased=kept)
        xc = x[:, call.local(s, e)].detach().requires_grad_(need_dx)
        o = call.offset
        leaves = {name: t.narrow(dim, s - o, e - s).detach().requires_grad_() for name, t, dim in extra}
        if not kept:
            record.rng[n].restore()
        shared = call.shared_view(cache, s - cache.prefix_len, e)
        attention = record.attention[n] if record.attention else None
        with torch.enable_grad(), outputs_skipped(() if kept else record.unread), replaying(attention):
            yc, extras, nones = call.run(xc, s, e, cache, leaves, shared)
        return ChunkGraph(n, s, e, cache, xc, leaves, yc, extras, nones, shared)

    def _chunk_backwards(
        self, x, dy, carry: LayerCarry, dx, extra, dextra, params, dstreams, graphs: list[ChunkGraph] | None = None
    ) -> None:
        """Each chunk's backward, last to first, writing into ``dx``, ``dextra`` and the carry's gradient sums (and,
        through the parameters' hooks, the parameter gradient sums); each chunk's graph is recomputed
        (:meth:`build`), or taken from ``graphs`` (kept from the forward, first chunk first)."""
        for n, (s, e) in reversed(list(enumerate(self.call.chunks()))):
            graph = graphs.pop() if graphs else self.build(n, s, e, x, carry, extra, dx is not None)
            self._propagate(graph, dy, carry, dx, extra, dextra, params, dstreams)
            del graph  # this chunk's graph goes before the next chunk's backward allocates its own
            if self.record.attention:  # and the attention outputs its forward kept
                self.record.attention[n].release()

    def _propagate(self, graph: ChunkGraph, dy, carry: LayerCarry, dx, extra, dextra, params, dstreams) -> None:
        """One chunk's backward through its graph: the chunk's outputs are its hidden states, its floating per-token
        outputs (given ``dstreams``) and what later chunks took from it."""
        n, s, e, cache, shared = graph.n, graph.s, graph.e, graph.cache, graph.shared
        here = self.call.local(s, e)
        need_dx = dx is not None
        reused = shared.leaves_list() if shared is not None else []
        streams = [
            (graph.extras[j], d[:, here]) for j, d in zip(self.record.streams, dstreams, strict=True) if d is not None
        ]
        carried, carried_grads = carry.outgoing(cache, n, e)  # what later chunks took from this one
        outputs = [graph.yc, *(t for t, _ in streams), *carried]
        grad_outputs = [dy[:, here], *(d for _, d in streams), *carried_grads]
        # keys/values computed only from frozen weights and a gradient-free input carry no gradient
        keep = [j for j, out in enumerate(outputs) if out.requires_grad]
        outputs, grad_outputs = [outputs[j] for j in keep], [grad_outputs[j] for j in keep]
        incoming = carry.incoming(cache)
        inputs = ([graph.xc] if need_dx else []) + list(graph.leaves.values()) + incoming + reused
        grads = torch.autograd.grad(outputs, inputs + params, grad_outputs, allow_unused=True)
        it: Iterator = iter(grads)
        if need_dx:
            dx[:, here] = next(it)
        for (_, _, dim), acc in zip(extra, dextra, strict=True):
            g = next(it)
            if g is not None:
                acc.narrow(dim, here.start, e - s).copy_(g)
        carry.absorb(cache, n, [next(it) for _ in incoming])  # (unless the attention added them itself: PrefixGrad)
        if reused:
            shared.absorb([next(it) for _ in reused])
        # the parameters' gradients went into their sums as autograd produced them (:func:`_absorb`); this chunk's
        # gradients (views of the attention's full-length key/value gradients among them) go on return

    def collect_kv(self, x: torch.Tensor) -> CarryStore:
        """Keys/values of every position, each chunk replaying its recorded random state.

        One cache slot: each chunk runs only up to its cache update, its query projection skipped; with an indexer
        (sparse indexed attention) on to its indexer-key update, which the layer makes before any attention (the
        indexer keys are recomputed, like the keys/values, rather than kept: each chunk's come from its own input
        alone, a projection and a norm). Several slots (a later one depends on an earlier one's attention), or
        recurrent/convolution states (each chunk's depend on the whole previous chunk): a no-grad chunked forward.
        None (a layer that carries nothing between chunks): an empty store, without running the layer.
        """
        call, record = self.call, self.record
        states = [key for key, _ in record.state_layout if key[0] != INDEXER]
        indexed = len(states) < len(record.state_layout)
        if not record.slots and not record.state_layout:  # nothing to collect (an MLP-only layer, a KV-reusing one)
            return CarryStore(call.seq_len, rates=call.compress_rates)
        if len(record.slots) != 1 or states:
            return call.replay_chunks(x, record).kv
        kv = CarryStore(call.seq_len, rates=call.compress_rates)
        call.collect(x, kv, record.rng, indexed=indexed)
        return kv

    def _later_ranks(self, x, carry: LayerCarry, dx, extra, dextra, params) -> None:
        """With a sequence split (:mod:`..sequence_split`), once the chunks' backwards are done: the key/value
        gradients this rank's queries took from earlier ranks' positions go to those ranks (a collective every rank
        joins), and what the later ranks' queries returned for this rank's keys/values is backpropagated through each
        chunk's key/value projections (the collecting pass, with grad), into ``dx``, ``dextra`` and, through the
        parameters' hooks, the parameter gradient sums."""
        call, record = self.call, self.record
        returned = call.split.returned_grads({i: carry.grads[i] for i in carry.store.kv})
        if not call.split.returns_grads:
            return
        need_dx = dx is not None
        for n, (s, e) in enumerate(call.chunks()):
            here = call.local(s, e)
            record.rng[n].restore()
            xc = x[:, here].detach().requires_grad_(need_dx)
            leaves = {name: t.narrow(dim, here.start, e - s).detach().requires_grad_() for name, t, dim in extra}
            cache = ChunkCache(carry.store, s, stop=True)
            with torch.enable_grad(), queries_skipped(call.layer):
                try:
                    call.run(xc, s, e, cache, leaves, shared=call.shared_view(cache, s, e))
                except StopAfterCacheUpdate:
                    pass
            outputs, grad_outputs = [], []
            for i, (k, v) in cache.chunk.items():
                for t, g in zip((k, v), returned[i], strict=True):
                    if t.requires_grad:
                        outputs.append(t)
                        grad_outputs.append(g[:, :, here])
            if not outputs:
                continue
            inputs = ([xc] if need_dx else []) + list(leaves.values())
            grads = iter(torch.autograd.grad(outputs, inputs + params, grad_outputs, allow_unused=True))
            if need_dx:
                g = next(grads)
                if g is not None:
                    dx[:, here] += g
            for (_, _, dim), acc in zip(extra, dextra, strict=True):
                g = next(grads)
                if g is not None:
                    acc.narrow(dim, here.start, e - s).add_(g)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def adapters_only(layer: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether ``layer`` trains adapters beside frozen weights (:func:`~streambp_trl.sizing.setup.adapter_sums`):
    ``params`` are its trained parameters. Counted in whole elements (a ZeRO-3 partition's ``ds_numel``)."""
    return adapter_sums(sum(whole_numel(p) for p in params), sum(whole_numel(p) for p in layer.parameters()))


def _absorb(sums: list[torch.Tensor | None], zeros: dict, wide: bool, j: int, grad: torch.Tensor) -> torch.Tensor:
    """Parameter ``j``'s hook during a chunk's backward: its gradient is added to ``sums[j]`` (or becomes it) at once,
    and autograd keeps a storage-less zero in its place (an expanded scalar from ``zeros``, made once per backward).
    So a chunk's backward holds one parameter's fresh gradient at a time beside the sums, not a whole layer's set of
    them until ``autograd.grad`` returns.

    A bfloat16/float16 gradient sums in float32 where it is a vector (a norm's scale, a bias, a per-head parameter
    such as a decay's ``dt_bias``) or an adapter's (``wide``: :func:`adapters_only`, TRL's bfloat16 LoRA adapters
    under QLoRA): each of its elements sums over every position, a low-precision sum rounds at every chunk (its
    error grows with the number of chunks: with 32 chunks, LoRA gradients 1.4x as far from float64 as the plain
    backward's, up to 2x), while the plain backward rounds the total to the low precision once. The layer's backward
    rounds the float32 sum once too (:meth:`ChunkBackward.backward_chunks`); vectors are a few KiB, adapters a small
    part of the layer. A fully trained layer's matrices sum in their own dtype (float32 sums would double its
    gradient memory)."""
    if sums[j] is not None:
        sums[j].add_(grad)
    elif grad.dtype in LOW_PRECISION and (wide or grad.dim() <= 1):
        sums[j] = grad.float()
    else:  # autograd's own buffer becomes the sum, unless elements share memory (an expanded scalar's gradient)
        overlapping = any(stride == 0 and size > 1 for stride, size in zip(grad.stride(), grad.shape, strict=True))
        sums[j] = grad.clone() if overlapping else grad
    key = (grad.dtype, grad.device)
    if key not in zeros:
        zeros[key] = grad.new_zeros(())
    return zeros[key].expand(grad.shape)
