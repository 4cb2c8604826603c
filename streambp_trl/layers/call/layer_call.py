"""One decoder-layer call able to run any chunk of the sequence: its forward chunk by chunk, the key/value collection
pass and each chunk's backward recompute (the math and memory they implement: :mod:`.stream_layer`, whose autograd
Function drives them).

:class:`LayerCall` describes one call (its layer, bound arguments and what the call's plan says for it: chunk,
key/value mode, offload), built once; its forward returns a :class:`ChunkedForward` with the
:class:`ForwardRecord` its backward needs (each chunk's random state, the cache slots and carried states, the linear
maps its recompute skips); the chunks' backward, :class:`~.backward.ChunkBackward`, is a function of the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Mapping

import torch
from torch import nn

from ...attention import StreamMask, streaming
from ...attention.kept_outputs import KeptOutputs, recording, replaying
from ...sizing.choices import KVMode
from ..carry import CarryStore, ChunkCache, StopAfterCacheUpdate, queries_skipped
from ..kept import CheckpointOffload, EmbeddingSource, Segment
from ..layer_args import slice_arg
from ..rng import RngState, rng_fork
from ..sequence_split import SequenceSplit
from ..shared_kv import ChunkShared, SharedKV
from .guards import Versions
from .unread import unread_outputs


@dataclasses.dataclass(frozen=True)
class ForwardRecord:
    """What a layer call's forward recorded for its backward: each chunk's random state (``rng``: every recompute of a
    chunk draws the same random numbers, dropout masks, sampled routing, jitter, as the forward did), the cache slots
    and the (state key, chunk) of the states entering chunks (how its keys/values and carried states are laid out),
    the linear maps whose output no backward reads (``unread``, which the recompute skips), the layer types whose
    keys/values later layers reuse (``stores``: type -> cache slot), which per-token outputs are floating (``streams``:
    a second per-token stream, with gradient), once the Function has its kept input, the versions of what the
    backward reads again (``versions``), and each chunk's attention outputs where the call keeps them
    (``attention``, :mod:`streambp_trl.attention.kept_outputs`; ``()`` otherwise)."""

    rng: tuple[RngState, ...] = ()
    slots: tuple[int, ...] = ()
    state_layout: tuple = ()
    unread: tuple[nn.Module, ...] = ()
    stores: Mapping[str, int] = dataclasses.field(default_factory=dict)
    streams: tuple[int, ...] = ()
    versions: Versions | None = None
    attention: tuple[KeptOutputs, ...] = ()


@dataclasses.dataclass(frozen=True)
class ChunkedForward:
    """One chunked forward of a layer call: its output ``y`` (batch, T, ...), the keys/values and states its chunks
    handed on (``kv``, kept when asked), the per-token tensors the layer returned beside its output (full length, in
    the forward that records; ``()`` in a replay), how many ``None`` the layer returns beside its output
    (``nones``: attention weights not asked for), and the :class:`ForwardRecord` (the one replayed, in a replay)."""

    y: torch.Tensor
    kv: CarryStore
    extras: tuple[torch.Tensor, ...]
    nones: int | None
    record: ForwardRecord


def returned(y: torch.Tensor, extras: tuple | list, nones: int | None) -> torch.Tensor | tuple:
    """``y`` in the form the layer's own forward returns its output: the tensor, ``(y, None, ...)`` (``nones`` of
    them), or ``(y, *extras)`` (its full-length per-token outputs)."""
    if extras:
        return (y, *extras)
    return y if nones is None else (y, *[None] * nones)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One decoder-layer call, able to run any chunk of the sequence: the layer, its bound arguments and what the
    plan and the decoder call decided for it. Nothing here changes once built; what a forward records is its
    :class:`ForwardRecord`.

    ``per_token`` maps each argument to slice to its sequence dimension (a tuple of them for a tuple argument); those
    named in ``from_prefix`` are sliced from the chunk's first key position, not its own first position (a position
    history, see :mod:`..layer_args`).

    Positions are global: with a sequence ``split`` across ranks (:mod:`..sequence_split`) the call's input holds
    positions [``offset``, ``seq_len``) and its chunks start at ``offset``; every per-token tensor is sliced at
    :meth:`local` positions. Without one, ``offset`` is 0 and ``seq_len`` the input's length.
    """

    layer: nn.Module
    func: object  # the layer's undecorated forward, with its family's adapters around it
    kwargs: Mapping
    per_token: Mapping
    kv_mode: KVMode  # how its backward gets its keys/values (the call's plan)
    offload: CheckpointOffload | None  # where its kept input (and captured keys/values) waits: None, on the device
    seq_len: int
    autocast: Mapping
    configs: tuple
    cache_name: str
    grad_inputs: tuple[str, ...] = ()  # per-token arguments that carry gradient (besides the hidden states)
    from_prefix: tuple[str, ...] = ()  # per-token arguments a chunk gets from its first key position on
    resets: tuple[int, ...] = ()  # where a packed row's documents start: chunks are cut there, from a zero state
    embedding_source: EmbeddingSource | None = None  # x is rebuilt from the token ids in backward, not kept
    segment: Segment | None = None  # with keep_every > 1: the segment of layers this call belongs to
    position: int = 0  # its place in the segment (0: the one keeping its input)
    chunk: int = 0  # tokens per chunk of this call (the call's plan)
    keeps_activations: bool = False  # its chunks' graphs are kept from the forward, not recomputed (:mod:`.kept`)
    keeps_attention: bool = False  # its attention outputs are kept from the forward for the recompute
    min_chunk: int = 1  # the fewest tokens a chunk may have (2 for a layer with a recurrent mixer)
    shared: SharedKV | None = None  # the decoder call's keys/values shared across layers (``shared_kv_states``)
    compress_rates: Mapping[int, int] = dataclasses.field(default_factory=dict)  # compressed attentions' slots
    split: SequenceSplit | None = None  # the sequence split across ranks this call is one rank's share of

    @property
    def offset(self) -> int:
        """The global position of the call's first token (0 without a sequence split)."""
        return self.split.offset if self.split is not None else 0

    def local(self, s: int, e: int) -> slice:
        """Global positions [s, e) as a slice of the call's per-token tensors."""
        return slice(s - self.offset, e - self.offset)

    def versions(self, kept: torch.Tensor | None) -> Versions:
        """The versions of the layer's parameters, its tensor arguments and the input it keeps (``kept``)."""
        named = [(f"the parameter `{n}`", p) for n, p in self.layer.named_parameters()]
        for name, value in self.kwargs.items():
            if isinstance(value, StreamMask):
                value = (value.padding, value.dense)
            elif isinstance(value, dict):
                value = [
                    t for v in value.values() for t in ((v.padding, v.dense) if isinstance(v, StreamMask) else (v,))
                ]
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    named.append((f"the argument `{name}`", t))
        if kept is not None:
            named.append(("the kept input (hidden states)", kept))
        return Versions.record(layer_name(self.layer), named)

    @property
    def masks(self) -> list[StreamMask]:
        """The :class:`StreamMask` arguments: ``attention_mask``, the one a hybrid layer hands its attention beside
        its mixer's (batch, T) padding mask (Zamba's ``causal_mask``), or those in a mapping of masks (Zaya's
        ``{"causal": ..., "conv": ...}``)."""
        values = [
            v for value in self.kwargs.values() for v in (value.values() if isinstance(value, dict) else (value,))
        ]
        return [v for v in values if isinstance(v, StreamMask)]

    def chunks(self) -> list[tuple[int, int]]:
        """The chunks [s, e) of the sequence, ``chunk_size`` tokens each but the last, also cut where a document
        starts (``resets``); a chunk shorter than ``min_chunk`` that starts no document joins the one before (a
        document's first chunk starts from a zero state, so it may be shorter)."""
        c = max(self.chunk, self.min_chunk)
        cuts = sorted({*range(self.offset, self.seq_len, c), *self.resets})
        bounds: list[tuple[int, int]] = []
        for s, e in zip(cuts, [*cuts[1:], self.seq_len], strict=True):
            if bounds and e - s < self.min_chunk and s not in self.resets:
                bounds[-1] = (bounds[-1][0], e)
            else:
                bounds.append((s, e))
        return bounds

    def prefix_start(self, s: int) -> int:
        """First key position any query of a chunk starting at ``s`` can attend to."""
        starts = [max(0, s - mask.local_size + 1) if mask.local_size else 0 for mask in self.masks]
        return min(starts, default=0)

    def run(
        self,
        x: torch.Tensor,
        s: int,
        e: int,
        cache: ChunkCache,
        leaves: dict | None = None,
        shared: ChunkShared | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int | None]:
        """The layer's own forward on x (= the hidden states of positions [s, e)) against the cache's prefix;
        ``leaves`` replaces the chunk's slices of the gradient-carrying arguments. Returns the chunk's hidden states,
        the per-token tensors the layer returns beside them, (batch, e - s, ...) each, and how many ``None`` it
        returns beside them instead (attention weights that were not asked for; ``None`` if it returns no tuple).
        Integer per-token tensors (a sparse indexed attention's top-k key indices, which the next layer's shared
        indexer reuses) carry no gradient; floating ones are a second per-token stream through the layers (Zaya's
        router hidden states, which the next layer's router reads), whose gradient the backward chains beside the
        hidden states'. Any other second output is refused. ``shared``: the chunk's view of the keys/values shared
        across layers, as ``shared_kv_states``."""
        p = s - cache.prefix_len

        def placed(v: object) -> object:
            return v.at(s, p, cache.prefix_grads) if isinstance(v, StreamMask) else v

        kwargs = {
            name: {k: placed(v) for k, v in value.items()} if isinstance(value, dict) else placed(value)
            for name, value in self.kwargs.items()
        }
        for name, dims in self.per_token.items():
            first = p if name in self.from_prefix else s
            kwargs[name] = slice_arg(kwargs[name], dims, first - self.offset, e - self.offset)
        kwargs.update(leaves or {})
        if shared is not None:
            kwargs["shared_kv_states"] = shared
        kwargs[self.cache_name] = cache
        with torch.autocast(**self.autocast), streaming(self.configs):
            out = self.func(self.layer, x, **kwargs)
        extras: tuple[torch.Tensor, ...] = ()
        nones = None
        if isinstance(out, (tuple, list)) and out and all(o is None for o in out[1:]):
            nones, out = len(out) - 1, out[0]
        elif isinstance(out, (tuple, list)) and out and all(_per_token(o, x) for o in out[1:]):
            out, extras = out[0], tuple(out[1:])
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"StreamBP expects {type(self.layer).__name__} to return a tensor, or a tensor and per-token "
                f"tensors, got {type(out).__name__}"
                + (f" of {[type(o).__name__ for o in out]}" if isinstance(out, (tuple, list)) else "")
                + "."
            )
        return out, extras, nones

    def forward_chunks(self, x: torch.Tensor, recorded: bool) -> ChunkedForward:
        """The layer's forward, first chunk to last under no grad, keys/values and carried states handed on in its
        store. ``recorded``: a backward follows (the stream layer Function's forward), so each chunk's random state is
        recorded (every recompute of the chunk draws the same numbers), the first chunk finds which outputs no backward
        reads, and the per-token outputs are checked against a window of keys; otherwise (a call without gradient)
        nothing is recorded. Either way the keys/values later layers reuse go to the decoder call's shared ones."""
        kv = CarryStore(self.seq_len, rates=self.compress_rates)
        y, full, streams, states, unread, stores, nones = None, [], (), [], [], {}, None
        attention: list[KeptOutputs] = []
        # with a sequence split, every chunk's state is known before the collecting pass runs them
        split, count = self.split, len(self.chunks())
        drawn = RngState.drawn(x, count, split.rank, split.place(count)) if split is not None else None
        with torch.no_grad(), rng_fork(x) if drawn is not None else contextlib.nullcontext():
            if drawn is not None:
                self.collect(x, kv, drawn)
            for i, (s, e) in enumerate(self.chunks()):
                if drawn is not None:
                    drawn[i].restore()
                if recorded:
                    states.append(drawn[i] if drawn is not None else RngState(x))
                kept = KeptOutputs() if recorded and self.keeps_attention else None
                attention += [kept] if kept is not None else []
                with recording(kept):
                    out, extras, nones, shared, found = self._chunk(x, kv, i, s, e, find_unread=recorded and i == 0)
                unread = found if i == 0 else unread
                stores.update(shared.stored if shared is not None else {})
                if y is None:
                    y = x.new_empty(x.shape[:2] + out.shape[2:], dtype=out.dtype)
                    full = [t.new_empty(x.shape[:2] + t.shape[2:]) for t in extras]
                    streams = tuple(j for j, t in enumerate(extras) if t.is_floating_point())
                y[:, self.local(s, e)] = out
                if len(extras) > len(streams) and self.prefix_start(s) > 0:
                    raise ValueError(
                        f"StreamBP cannot stream {type(self.layer).__name__}: it returns per-token indices beside its "
                        "output while its chunks attend to a window of keys, whose positions such indices would be "
                        "counted from."
                    )
                for t_full, t in zip(full, extras, strict=True):
                    t_full[:, self.local(s, e)] = t
        for kind, slot in stores.items():  # the keys/values later layers reuse: every position's, detached
            self.shared.kv[kind] = tuple(t.detach() for t in kv.kv[slot])
        made = ForwardRecord(
            rng=tuple(states),
            slots=tuple(sorted(kv.kv)),
            state_layout=tuple(kv.layout()),
            unread=tuple(unread),
            stores=types.MappingProxyType(stores),
            streams=streams,
            attention=tuple(attention),
        )
        return ChunkedForward(y, kv, tuple(full), nones, made)

    def replay_chunks(self, x: torch.Tensor, record: ForwardRecord) -> ChunkedForward:
        """The recorded forward again from its input ``x``, first chunk to last under no grad, each chunk with the
        random state ``record`` holds for it: a segment's rebuilt input, or a backward's collection of the keys/values
        and carried states. Its per-token outputs are the forward's, not formed again; its attention outputs too,
        where the forward kept them."""
        kv = CarryStore(self.seq_len, rates=self.compress_rates)
        if self.split is not None:
            self.collect(x, kv, record.rng)
        y, nones = None, None
        with torch.no_grad():
            for i, (s, e) in enumerate(self.chunks()):
                record.rng[i].restore()
                with replaying(record.attention[i] if record.attention else None):
                    out, _, nones, _, _ = self._chunk(x, kv, i, s, e)
                if y is None:
                    y = x.new_empty(x.shape[:2] + out.shape[2:], dtype=out.dtype)
                y[:, self.local(s, e)] = out
        return ChunkedForward(y, kv, (), nones, record)

    def collect(
        self, x: torch.Tensor, kv: CarryStore, rng: tuple[RngState, ...] | list, indexed: bool = False
    ) -> None:
        """The collecting pass: each chunk run from its random state in ``rng`` only as far as its cache update (its
        query projection skipped, :func:`~..carry.queries_skipped`), under no grad, so ``kv`` holds the keys/values of
        every position of the call (with ``indexed``, on to its indexer-key update); with a sequence split, then
        those of the earlier ranks' positions too (:meth:`~..sequence_split.SequenceSplit.gather_prefix`)."""
        with torch.no_grad(), queries_skipped(self.layer):
            for i, (s, e) in enumerate(self.chunks()):
                rng[i].restore()
                try:  # stops before attention
                    cache = ChunkCache(kv, s, stop=True, indexed=indexed)
                    self.run(x[:, self.local(s, e)], s, e, cache, shared=self.shared_view(cache, s, e))
                except StopAfterCacheUpdate:
                    pass
                else:
                    raise RuntimeError(f"{type(self.layer).__name__} never updated its key/value cache.")
        if self.split is None:
            return
        if len(kv.kv) != 1 or kv.states or kv.indexer:
            raise ValueError(
                f"StreamBP cannot split the sequence of {layer_name(self.layer)} across ranks: only a layer of one "
                "softmax attention (its keys/values the one carry between positions) is split; train it on one "
                "process per sequence (no sequence_group)."
            )
        self.split.gather_prefix(kv)

    def _chunk(
        self, x: torch.Tensor, kv: CarryStore, i: int, s: int, e: int, find_unread: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], int | None, ChunkShared | None, list[nn.Module]]:
        """The ``i``-th chunk [s, e) against the prefix ``kv`` holds, its outgoing carry recorded there (unless the
        next chunk starts a packed row's document, which nothing enters): its output, per-token outputs, ``None``
        count, shared keys/values view and, with ``find_unread``, the linear maps whose output nothing reads."""
        p = self.prefix_start(s)
        cache = ChunkCache(kv, s, s - p, incoming=kv.incoming(i), resets=s in self.resets)
        shared = self.shared_view(cache, p, e)
        unread: list[nn.Module] = []
        if find_unread:
            with unread_outputs(self.layer, cache.outgoing.values) as unread:
                out, extras, nones = self.run(x[:, self.local(s, e)], s, e, cache, shared=shared)
        else:
            out, extras, nones = self.run(x[:, self.local(s, e)], s, e, cache, shared=shared)
        if e < self.seq_len and e not in self.resets:
            kv.record(i, cache.outgoing)
        return out, extras, nones, shared, unread

    def shared_view(self, cache: ChunkCache, p: int, e: int) -> ChunkShared | None:
        """The chunk's ``shared_kv_states`` (keys from position ``p`` to ``e``), where the layer takes one."""
        return ChunkShared(self.shared, cache, p, e) if self.shared is not None else None


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """A layer call and what its forward recorded: what its backward is a function of (:class:`~.backward.
    ChunkBackward`), and what a ``keep_every`` segment replays to rebuild its later layers' inputs."""

    call: LayerCall
    record: ForwardRecord

    def replay(self, x: torch.Tensor) -> torch.Tensor:
        """The call's output again from its input ``x``, each chunk with the random state its forward drew."""
        return self.call.replay_chunks(x, self.record).y


def _per_token(t: object, x: torch.Tensor) -> bool:
    """Whether ``t`` is a real tensor of one value set per position of the chunk ``x`` (batch, chunk, ...)."""
    return (
        isinstance(t, torch.Tensor)
        and not t.is_complex()
        and t.dim() >= 2
        and tuple(t.shape[:2]) == tuple(x.shape[:2])
    )


def layer_name(layer: nn.Module) -> str:
    index = getattr(layer, "layer_idx", getattr(getattr(layer, "self_attn", None), "layer_idx", None))
    return f"decoder layer {index} ({type(layer).__name__})" if index is not None else type(layer).__name__
