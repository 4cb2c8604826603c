"""The ``transformers.Cache`` a streamed layer runs one chunk against (:class:`ChunkCache`), and the collecting
pass's early stop after a chunk's cache update."""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager

import torch
from torch import nn
from transformers.cache_utils import Cache

from ...attention import PrefixGrad
from ...patching import forwards_replaced, opaque_methods
from .compressed import CompressorStates
from .store import KV, CarryStore, States, recurrent_key


class StopAfterCacheUpdate(Exception):  # noqa: N818 (a signal, not an error)
    """The early-stop signal of a collecting cache: raised right after the keys/values of a chunk are written, so the
    layer's own code runs only as far as its key/value projections (as ``torch.utils.checkpoint`` stops a recompute
    once every tensor it needs is rebuilt). The collecting loop catches it; it never leaves the engine."""


def queries_skipped(layer: nn.Module) -> AbstractContextManager[None]:
    """For a collecting pass (each chunk stops at its cache update, before attention reads a query): the layer's query
    projection matmuls return zeros of their output's shape and dtype instead of computing it, for the duration of a
    ``with`` block. That saves one (chunk x hidden x query width) matmul per chunk, the part of a layer up to its
    cache update that the keys/values do not need. Nothing of the queries reaches the keys/values in a layer with its
    own query projection; the exactness sweep checks it.

    Only leaf linear maps are replaced: a module named ``q_proj``, or the ``base_layer`` of an adapter wrapper named so
    (PEFT's LoRA). An adapter's own dropout and products still run, so the random numbers the chunk draws (replayed
    from its recorded state) stay the ones its forward drew, and the keys/values' dropout masks with them."""
    return forwards_replaced(
        {
            m: functools.partial(_zero_output, m)
            for name, m in layer.named_modules()
            if _is_query_matmul(name) and isinstance(getattr(m, "out_features", None), int) and not any(m.children())
        }
    )


def _is_query_matmul(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "q_proj" or parts[-2:] == ["q_proj", "base_layer"]


def _zero_output(module: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return x.new_zeros(*x.shape[:-1], module.out_features, dtype=dtype)


class _Extend(torch.autograd.Function):
    """``cat([prefix, chunk], dim=2)`` without a copy: ``chunk`` is written into ``full`` (the store, given as
    ``[full]``, positions [s, e)) and the view ``full[:, :, p:e]`` is returned; ``prefix`` must be (a leaf over)
    ``full[:, :, p:s]``. Backward: the gradient's two parts, as views."""

    @staticmethod
    def forward(ctx, store: list[torch.Tensor], p: int, s: int, prefix: torch.Tensor, chunk: torch.Tensor):
        (full,) = store  # passed in a list: the store is not an input of the graph
        full[:, :, s : s + chunk.shape[2]] = chunk
        ctx.split = s - p
        return full[:, :, p : s + chunk.shape[2]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, None, grad[:, :, : ctx.split], grad[:, :, ctx.split :]


@opaque_methods  # run eagerly where a compiled layer calls it: its prefix and state never enter a graph
class ChunkCache(Cache):
    """A ``transformers.Cache`` for one layer call on the chunk of positions starting at ``start``.

    ``update()`` records the chunk's own keys/values of each slot (``chunk``), writes them into ``store`` and returns
    the keys/values of positions ``[start - prefix_len, start + chunk length)``. ``prefix`` (a backward recompute)
    gives, per slot, gradient-carrying leaves over the store's prefix, joined to the chunk by :class:`_Extend`;
    ``prefix_sums`` the gradient sums of those prefix positions, recorded with the joined tensors as
    :class:`PrefixGrad` pairs in ``prefix_grads`` for the attention. With ``stop`` it raises
    :class:`StopAfterCacheUpdate` after the write, so the layer runs only as far as its key/value projections; with
    ``stop`` and ``indexed`` (a layer whose indexer also caches keys) only once the chunk's indexer keys are written
    too, and ``update()`` then returns the chunk's own keys/values, since nothing reads the prefix before the stop (an
    MLA layer would otherwise expand the whole prefix's latents). Queries answer as a cache holding the ``start``
    earlier tokens would: ``get_seq_length()`` (and so ``get_query_offset()``) is ``start``, ``get_mask_sizes()`` the
    prefix plus chunk.

    Indexer keys (``update_indexer``, DeepSeek Sparse Attention): the chunk's are written into the store and the
    store's view of positions ``[start - prefix_len, T)`` is returned, the prefix's, the chunk's and the later
    positions' (zeros in the forward, not yet written). So a chunk's indexer scores each query against as many keys,
    at the same places, as the full-sequence forward does, and its top-k sees the same row: the later positions are
    masked (the layer's mask block reaches to T as well, see :func:`~streambp_trl.layers.hook.stream_checkpoint`),
    and ``torch.topk`` breaks ties among equal scores by the row's length and contents, so a (prefix + chunk)-long
    row could choose other keys than the T-long one where scores tie at the k-th place (exact zeros, from the
    indexer's ReLU, are such ties). As ``transformers``' static indexed cache returns its whole buffer.

    Recurrent and convolution states (transformers' linear-attention cache interface, which Gated DeltaNet, Mamba,
    Mamba2 and short-convolution layers call): ``get_conv_state`` / ``get_recurrent_state`` give the state entering
    the chunk (``incoming``; ``None`` for the first chunk, as an empty cache does, and for the first chunk of each
    document of a packed row, ``resets``, which also answers ``has_previous_state`` with ``False``),
    ``update_conv_state`` returns the incoming convolution inputs joined to the chunk's (zero-padded to the kernel
    size in the first chunk, as a prefill does) and ``update_*`` record the states the chunk leaves (``outgoing``).
    The cache answers ``is_recording_past`` with ``True``, so a one-token chunk takes the model's multi-token path,
    which leaves the incoming state as it is, rather than the decoding kernel that updates it in place. With
    ``scan_starts`` set (a list: a layer with a Mamba v1 mixer, whose scan runs from zero) a recurrent state asked for
    is appended there as ``[state, 0]`` for the continued scan (:mod:`.continued.mamba_scan`) and the mixer is
    answered ``None``.
    """

    def __init__(
        self,
        store: CarryStore,
        start: int,
        prefix_len: int = 0,
        prefix: KV | None = None,
        stop: bool = False,
        prefix_sums: KV | None = None,
        incoming: States | None = None,
        indexed: bool = False,
        resets: bool = False,
    ):
        super().__init__(layers=[])
        self.store, self.start, self.prefix_len, self.prefix, self.stop = store, start, prefix_len, prefix, stop
        self.indexed, self.resets = indexed, resets
        self.indexer_written = False
        self.prefix_sums = prefix_sums
        self.prefix_grads: list = []  # (keys, values) PrefixGrad pairs, read by the attention through the chunk mask
        self.chunk: KV = {}
        self.incoming: States = incoming or {}
        self.outgoing: States = {}
        self.scan_starts: list[list] | None = None  # set for a layer whose scans continue (see .continued)
        self.compressors: dict[int, CompressorStates] = {}  # a compressed attention's cache layers (.compressed)

    @property
    def layers(self) -> _CompressorLayers:
        """``cache.layers[layer_idx]``: a compressed attention's cache layer for slot ``layer_idx``. (A new view on
        each access: kept on the cache, it would make a reference cycle that keeps every chunk's cache, and the
        prefix and gradients it holds, alive until the garbage collector runs.)"""
        return _CompressorLayers(self)

    @layers.setter
    def layers(self, value: list) -> None:  # transformers' Cache.__init__ sets its own list: not used here
        pass

    @property
    def compressed(self) -> bool:
        """Whether the layer's attention compresses windows of keys into extra entries (:mod:`.compressed`)."""
        return bool(self.store.rates)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.incoming.get(("conv", layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        state = self.incoming.get(recurrent_key(layer_idx, state_idx))
        if self.scan_starts is not None:  # a Mamba v1 mixer: its continued scan takes the state (.continued)
            self.scan_starts.append([state, 0])
            return None
        return state

    def get_linear_cache(self, layer_idx: int) -> None:
        """A lightning attention's state: ``None``, so it takes its block path from zero, which
        :mod:`.continued.lightning` continues from the incoming state."""
        return None

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.outgoing[recurrent_key(layer_idx)] = state

    def outgoing_state(self, layer_idx: int) -> torch.Tensor:
        """The recurrent state the chunk left in slot ``layer_idx``."""
        return self.outgoing[recurrent_key(layer_idx)]

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.start > 0 and not self.resets

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **_
    ) -> torch.Tensor:
        key = ("conv", layer_idx, state_idx)
        previous = self.incoming.get(key)
        if conv_kernel_size is None:
            conv_kernel_size = conv_states.shape[-1] if previous is None else previous.shape[-1]
        if previous is not None:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        elif conv_states.shape[-1] < conv_kernel_size:
            full = torch.nn.functional.pad(conv_states, (conv_kernel_size - conv_states.shape[-1], 0))
        else:
            full = conv_states
        self.outgoing[key] = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_
    ) -> torch.Tensor:
        self.outgoing[recurrent_key(layer_idx, state_idx)] = recurrent_states
        return recurrent_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.prefix_len + query_length, self.start - self.prefix_len

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.chunk[layer_idx] = (key_states, value_states)
        full = self.store.slot(layer_idx, key_states, value_states)
        p, s = self.start - self.prefix_len, self.start
        if self.prefix is not None:  # a backward recompute: gradient reaches the prefix leaves and the chunk
            if self.prefix_len == 0:  # (written, as _Extend writes a chunk after a prefix: a forward that keeps its
                with torch.no_grad():  # chunks' graphs fills the store this way, a recompute writes the same values)
                    full[0][:, :, s : s + key_states.shape[2]] = key_states
                    full[1][:, :, s : s + value_states.shape[2]] = value_states
                return key_states, value_states
            pairs = zip(full, self.prefix[layer_idx], (key_states, value_states), strict=True)
            joined = tuple(_Extend.apply([f], p, s, leaf, new) for f, leaf, new in pairs)
            if self.prefix_sums is not None:
                sums = self.prefix_sums[layer_idx]
                pair = zip(joined, (key_states, value_states), sums, strict=True)
                self.prefix_grads.append(tuple(PrefixGrad(*parts) for parts in pair))
            return joined
        e = s + key_states.shape[2]
        with torch.no_grad():
            full[0][:, :, s:e] = key_states
            full[1][:, :, s:e] = value_states
        if self.stop and (not self.indexed or self.indexer_written):
            raise StopAfterCacheUpdate
        if self.stop:  # the indexer keys are still to come, and nothing reads the prefix before them
            return key_states, value_states
        return full[0][:, :, p:e], full[1][:, :, p:e]

    def update_indexer(self, key_states: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        """Write the chunk's indexer keys (batch, chunk, index_head_dim) into the store and return its indexer keys
        of positions [start - prefix_len, T) (a view; no gradient: the indexer's output is integer indices)."""
        full = self.store.index_keys(layer_idx, key_states)
        with torch.no_grad():
            full[:, self.start : self.start + key_states.shape[1]] = key_states
        self.indexer_written = True
        if self.stop and self.chunk:
            raise StopAfterCacheUpdate
        return full[:, self.start - self.prefix_len :]


@opaque_methods
class _CompressorLayers:
    """``cache.layers[layer_idx]`` of a chunk cache: the compressor states of a compressed attention's slot."""

    def __init__(self, cache: ChunkCache):
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> CompressorStates:
        cache = self.cache
        if layer_idx not in cache.store.rates:
            raise IndexError(f"StreamBP: cache slot {layer_idx} has no compressed attention's states.")
        if layer_idx not in cache.compressors:  # (one per slot and chunk: it passes the overlap state on once)
            rate, seq_len = cache.store.rates[layer_idx], cache.store.seq_len
            cache.compressors[layer_idx] = CompressorStates(
                cache.incoming, cache.outgoing, layer_idx, cache.start, seq_len, rate
            )
        return cache.compressors[layer_idx]

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())
