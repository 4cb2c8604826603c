"""One decoder-layer call able to run any chunk of the sequence: its forward chunk by chunk, the key/value collection
pass and each chunk's backward recompute (the math and memory they implement: :mod:`.stream_layer`, whose autograd
Function drives them).

:class:`StreamSettings` says how the decoder layers are streamed; :class:`LayerCall` holds one call's layer, bound
arguments and per-call state (chunk size, each chunk's random state, the cache slots and carried states, the linear
maps its recompute skips); its chunks' backward is :class:`~.backward.ChunkBackward`'s.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...attention import StreamMask, streaming
from ..carry import INDEXER, CarryStore, ChunkCache, StopAfterCacheUpdate, queries_skipped
from ..kept import CheckpointOffload, EmbeddingSource, Segment
from ..layer_args import slice_arg
from ..rng import RngState
from ..shared_kv import ChunkShared, SharedKV
from .backward import ChunkBackward
from .guards import Versions
from .unread import unread_outputs

KV_MODES = ("recompute", "capture")


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """How the decoder layers are streamed, whatever the call (the chunk is the call's:
    :class:`~..decoder_call.DecoderCall`).

    ``kv_mode``: ``"recompute"`` (default) recomputes every layer's keys/values in backward from its saved input;
    ``"capture"`` keeps them from the forward, costing kv_dim x 2 values per token per layer.
    ``offload``: where each layer's saved input (and kept keys/values) waits between forward and backward, when not
    on the device (see :mod:`streambp_trl.layers.kept.offload`).
    ``keep_every``: only the first of every ``keep_every`` consecutive layers keeps its input; the others rebuild
    theirs in backward (see :mod:`streambp_trl.layers.kept.segments`).
    """

    kv_mode: str = "recompute"
    offload: CheckpointOffload | None = None
    keep_every: int = 1


@dataclasses.dataclass
class LayerCall(ChunkBackward):
    """One decoder-layer call, able to run any chunk of the sequence.

    ``per_token`` maps each argument to slice to its sequence dimension (a tuple of them for a tuple argument); those
    named in ``from_prefix`` are sliced from the chunk's first key position, not its own first position (a position
    history, see :mod:`..layer_args`). ``rng`` holds each chunk's random state from the forward (when it is recorded),
    so every recompute of a chunk draws the same random numbers (dropout masks, sampled routing, jitter) as the
    forward did.
    """

    layer: nn.Module
    func: object  # the layer's undecorated forward
    kwargs: dict
    per_token: dict
    settings: StreamSettings
    seq_len: int
    autocast: dict
    configs: tuple
    cache_name: str
    grad_inputs: tuple[str, ...] = ()  # per-token arguments that carry gradient (besides the hidden states)
    from_prefix: tuple[str, ...] = ()  # per-token arguments a chunk gets from its first key position on
    resets: tuple[int, ...] = ()  # where a packed row's documents start: chunks are cut there, from a zero state
    embedding_source: EmbeddingSource | None = None  # x is rebuilt from the token ids in backward, not kept
    segment: Segment | None = None  # with keep_every > 1: the segment of layers this call belongs to
    position: int = 0  # its place in the segment (0: the one keeping its input)
    chunk_size: int = 0  # tokens per chunk of this call
    min_chunk: int = 1  # the fewest tokens a chunk may have (2 for a layer with a recurrent mixer)
    output_nones: int | None = None  # the layer returns (hidden states, None, ...): how many Nones
    extras: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per-token outputs, until returned
    streams: tuple[int, ...] = ()  # which of them are floating: a second per-token stream, with gradient
    rng: list[RngState] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    state_layout: list = dataclasses.field(default_factory=list)  # (state key, chunk) of the states entering chunks
    unread: list[nn.Module] = dataclasses.field(default_factory=list)  # linear maps the backward recompute skips
    versions: Versions | None = None  # what the backward reads again, as the forward left it
    shared: SharedKV | None = None  # the decoder call's keys/values shared across layers (``shared_kv_states``)
    stores: dict[str, int] = dataclasses.field(default_factory=dict)  # layer types it shares (-> its cache slot)
    compress_rates: dict[int, int] = dataclasses.field(default_factory=dict)  # compressed attentions' slots

    def record_versions(self, kept: torch.Tensor | None) -> None:
        """Record the versions of the layer's parameters, its tensor arguments and the input it keeps (``kept``)."""
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
        self.versions = Versions.record(layer_name(self.layer), named)

    @property
    def masks(self) -> list[StreamMask]:
        """The :class:`StreamMask` arguments: ``attention_mask``, the one a hybrid layer hands its attention beside
        its mixer's (batch, T) padding mask (Zamba's ``causal_mask``), or those in a mapping of masks (Zaya's
        ``{"causal": ..., "conv": ...}``)."""
        values = [
            v for value in self.kwargs.values() for v in (value.values() if isinstance(value, dict) else (value,))
        ]
        return [v for v in values if isinstance(v, StreamMask)]

    def take_extras(self) -> list[torch.Tensor]:
        """The full-length per-token outputs the forward assembled beside the hidden states (:meth:`run`), handed
        over, not kept: the call lives until its backward, which never reads them."""
        extras, self.extras = self.extras, []
        return extras

    def as_returned(self, y: torch.Tensor, extras: tuple | list = ()) -> torch.Tensor | tuple:
        """``y`` in the form the layer's own forward returns its output: the tensor, ``(y, None, ...)``, or ``(y,
        *extras)`` (its full-length per-token outputs, :meth:`take_extras`)."""
        if extras:
            return (y, *extras)
        return y if self.output_nones is None else (y, *[None] * self.output_nones)

    def chunks(self) -> list[tuple[int, int]]:
        """The chunks [s, e) of the sequence, ``chunk_size`` tokens each but the last, also cut where a document
        starts (``resets``); a chunk shorter than ``min_chunk`` that starts no document joins the one before (a
        document's first chunk starts from a zero state, so it may be shorter)."""
        c = max(self.chunk_size, self.min_chunk)
        cuts = sorted({*range(0, self.seq_len, c), *self.resets})
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
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The layer's own forward on x (= the hidden states of positions [s, e)) against the cache's prefix;
        ``leaves`` replaces the chunk's slices of the gradient-carrying arguments. Returns the chunk's hidden states
        and the per-token tensors the layer returns beside them, (batch, e - s, ...) each: integer ones (a sparse
        indexed attention's top-k key indices, which the next layer's shared indexer reuses) carry no gradient;
        floating ones are a second per-token stream through the layers (Zaya's router hidden states, which the next
        layer's router reads), whose gradient the backward chains beside the hidden states'. Any other second output
        is refused. ``shared``: the chunk's view of the keys/values shared across layers, as ``shared_kv_states``."""
        p = s - cache.prefix_len

        def placed(v: object) -> object:
            return v.at(s, p, cache.prefix_grads) if isinstance(v, StreamMask) else v

        kwargs = {
            name: {k: placed(v) for k, v in value.items()} if isinstance(value, dict) else placed(value)
            for name, value in self.kwargs.items()
        }
        for name, dims in self.per_token.items():
            kwargs[name] = slice_arg(kwargs[name], dims, p if name in self.from_prefix else s, e)
        kwargs.update(leaves or {})
        if shared is not None:
            kwargs["shared_kv_states"] = shared
        kwargs[self.cache_name] = cache
        with torch.autocast(**self.autocast), streaming(self.configs):
            out = self.func(self.layer, x, **kwargs)
        extras: tuple[torch.Tensor, ...] = ()
        if isinstance(out, (tuple, list)) and out and all(o is None for o in out[1:]):
            self.output_nones = len(out) - 1  # (hidden states, None): attention weights that were not asked for
            out = out[0]
        elif isinstance(out, (tuple, list)) and out and all(_per_token(o, x) for o in out[1:]):
            out, extras = out[0], tuple(out[1:])
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"StreamBP expects {type(self.layer).__name__} to return a tensor, or a tensor and per-token "
                f"tensors, got {type(out).__name__}"
                + (f" of {[type(o).__name__ for o in out]}" if isinstance(out, (tuple, list)) else "")
                + "."
            )
        return out, extras

    def forward_chunks(self, x: torch.Tensor, keep_kv: bool, rng: str) -> tuple[torch.Tensor, CarryStore]:
        """Prefill, first chunk to last, under no grad; returns the output and the keys/values (if ``keep_kv``).

        ``rng``: ``"record"`` each chunk's random state, ``"replay"`` the recorded ones, or ``"none"``.
        """
        y = None
        kv = CarryStore(self.seq_len, rates=self.compress_rates)
        with torch.no_grad():
            for i, (s, e) in enumerate(self.chunks()):
                if rng == "record":
                    self.rng.append(RngState(x))
                elif rng == "replay":
                    self.rng[i].restore()
                p = self.prefix_start(s)
                cache = ChunkCache(kv, s, s - p, incoming=kv.incoming(i), resets=s in self.resets)
                shared = self.shared_view(cache, p, e)
                if i == 0 and rng == "record":  # the forward a backward will follow: which outputs it never reads
                    with unread_outputs(self.layer, cache.outgoing.values) as self.unread:
                        out, extras = self.run(x[:, s:e], s, e, cache, shared=shared)
                else:
                    out, extras = self.run(x[:, s:e], s, e, cache, shared=shared)
                if shared is not None and rng != "replay":
                    self.stores.update(shared.stored)
                if e < self.seq_len and e not in self.resets:  # the next chunk starts a document: nothing enters it
                    kv.record(i, cache.outgoing)
                if y is None:
                    y = x.new_empty(x.shape[:2] + out.shape[2:], dtype=out.dtype)
                    if rng != "replay":  # a replay's per-token outputs are the forward's again
                        self.extras = [t.new_empty(x.shape[:2] + t.shape[2:]) for t in extras]
                        self.streams = tuple(j for j, t in enumerate(extras) if t.is_floating_point())
                y[:, s:e] = out
                if len(extras) > len(self.streams) and p > 0:
                    raise ValueError(
                        f"StreamBP cannot stream {type(self.layer).__name__}: it returns per-token indices beside its "
                        "output while its chunks attend to a window of keys, whose positions such indices would be "
                        "counted from."
                    )
                if rng != "replay":
                    for full, t in zip(self.extras, extras, strict=True):
                        full[:, s:e] = t
        self.slots, self.state_layout = sorted(kv.kv), kv.layout()
        if rng != "replay":  # the keys/values later layers reuse: every position's, detached
            for kind, slot in self.stores.items():
                self.shared.kv[kind] = tuple(t.detach() for t in kv.kv[slot])
        return y, kv

    def shared_view(self, cache: ChunkCache, p: int, e: int) -> ChunkShared | None:
        """The chunk's ``shared_kv_states`` (keys from position ``p`` to ``e``), where the layer takes one."""
        return ChunkShared(self.shared, cache, p, e) if self.shared is not None else None

    def collect_kv(self, x: torch.Tensor) -> CarryStore:
        """Keys/values of every position, each chunk replaying its recorded random state.

        One cache slot: each chunk runs only up to its cache update, its query projection skipped; with an indexer
        (sparse indexed attention) on to its indexer-key update, which the layer makes before any attention (the
        indexer keys are recomputed, like the keys/values, rather than kept: each chunk's come from its own input
        alone, a projection and a norm). Several slots (a later one depends on an earlier one's attention), or
        recurrent/convolution states (each chunk's depend on the whole previous chunk): a no-grad chunked forward.
        None (a layer that carries nothing between chunks): an empty store, without running the layer.
        """
        states = [key for key, _ in self.state_layout if key[0] != INDEXER]
        indexed = len(states) < len(self.state_layout)
        if not self.slots and not self.state_layout:  # nothing to collect (an MLP-only layer, a KV-reusing one)
            return CarryStore(self.seq_len, rates=self.compress_rates)
        if len(self.slots) != 1 or states:
            return self.forward_chunks(x, keep_kv=True, rng="replay")[1]
        kv = CarryStore(self.seq_len, rates=self.compress_rates)
        with torch.no_grad(), queries_skipped(self.layer):
            for i, (s, e) in enumerate(self.chunks()):
                self.rng[i].restore()
                try:  # stops before attention
                    cache = ChunkCache(kv, s, stop=True, indexed=indexed)
                    self.run(x[:, s:e], s, e, cache, shared=self.shared_view(cache, s, e))
                except StopAfterCacheUpdate:
                    pass
                else:
                    raise RuntimeError(f"{type(self.layer).__name__} never updated its key/value cache.")
        return kv


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
