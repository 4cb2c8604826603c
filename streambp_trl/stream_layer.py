"""The stream-checkpointed decoder layer: one autograd Function per layer call, chunked along the sequence.

Installed as each Hugging Face decoder layer's ``_gradient_checkpointing_func`` (the hook transformers'
``GradientCheckpointingLayer`` calls in training mode with ``partial(layer.forward, **kwargs)`` and the hidden
states), so the model's own layer code runs, unpatched, on one chunk of the sequence at a time.

Forward (no grad): the layer runs chunk by chunk, first to last, as a prefill against a :class:`_ChunkCache`
that serves the keys/values of earlier chunks. Only the layer input ``x`` (batch, T, hidden) is saved, as with
gradient checkpointing; the forward never holds more than one chunk's activations.

Backward, given dY for the whole sequence: the keys/values K, V of every position (post-norm, post-RoPE; shape
(batch, kv_heads, T, head_dim)) are recomputed under no grad, cheaply, by running each chunk only up to its
cache update (or kept from the forward with ``kv_mode="capture"``). Then for chunks [s, e) from LAST to FIRST the
layer is recomputed on x[:, s:e] with grad, with the prefix K[:, :, p:s], V[:, :, p:s] as detached leaves
(p = 0, or s - window + 1 for a sliding-window layer), and

    dx[:, s:e], dK_p, dV_p, dθ_c = grad((Y_c, K_c, V_c), (x_c, K_p, V_p, θ),
                                        (dY[:, s:e], dK_acc[:, :, s:e], dV_acc[:, :, s:e]))

with dK_acc[:, :, p:s] += dK_p, dV_acc likewise, dθ += dθ_c. Later chunks attend to a chunk's keys and values and
run first, so dK_acc[:, :, s:e] is complete when chunk [s, e) is processed: the result is the exact gradient.
The layer's trainable parameters θ are inputs of the Function, so each receives its gradient once per layer
backward, which is what DDP buckets, FSDP2 and ZeRO hooks expect.

Memory of one layer's backward beyond the saved inputs: dY, dx (batch, T, hidden), K, V, dK_acc, dV_acc
(batch, T, kv_dim each), one chunk's activations and one (chunk x prefix) attention block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers.cache_utils import Cache

from .attention import StreamMask, stream_configs, streaming

KV_MODES = ("recompute", "capture")

# Keyword arguments a layer call may carry that are not per-token tensors to slice: flash-attention's packed
# sequence descriptors, ignored by stream attention, which reads packing from the mask.
_PASS_THROUGH = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
# Per-token keyword arguments with the sequence on their last dimension (batch, T), sliced per chunk.
_PER_TOKEN = {"position_ids", "seq_idx"}


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """How the decoder layers are streamed.

    ``chunk_size``: tokens per chunk (the working set of one layer's forward and backward).
    ``kv_mode``: ``"recompute"`` (default) recomputes every layer's keys/values in backward from its saved input;
    ``"capture"`` keeps them from the forward, costing kv_dim x 2 values per token per layer.
    """

    chunk_size: int
    kv_mode: str = "recompute"


class _KVCollected(Exception):
    """Raised by a collecting cache to stop a layer once its keys/values are known."""


class _ChunkCache(Cache):
    """A ``transformers.Cache`` for one layer call on the chunk of positions starting at ``start``.

    ``update()`` records the chunk's own keys/values and returns them after the prefix ones (positions
    ``[start - prefix_len, start)``). With ``stop`` it raises :class:`_KVCollected` instead, so the layer runs only
    as far as its key/value projections. Queries answer as a cache holding the ``start`` earlier tokens would:
    ``get_seq_length()`` (and so ``get_query_offset()``) is ``start``, ``get_mask_sizes()`` the prefix plus chunk.
    """

    def __init__(
        self,
        start: int,
        prefix_k: torch.Tensor | None = None,
        prefix_v: torch.Tensor | None = None,
        stop: bool = False,
    ):
        super().__init__(layers=[])
        self.start, self.prefix_k, self.prefix_v, self.stop = start, prefix_k, prefix_v, stop
        self.chunk_k: torch.Tensor | None = None
        self.chunk_v: torch.Tensor | None = None

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_k is None else self.prefix_k.shape[-2]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.prefix_len + query_length, self.start - self.prefix_len

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.chunk_k, self.chunk_v = key_states, value_states
        if self.stop:
            raise _KVCollected
        if self.prefix_len == 0:
            return key_states, value_states
        return torch.cat([self.prefix_k, key_states], dim=-2), torch.cat([self.prefix_v, value_states], dim=-2)


class _RngState:
    """The CPU generator's state and that of the tensor's device (if not the CPU), as captured before a chunk."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.dev = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.dev is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.dev, self.device)


@contextlib.contextmanager
def _rng_fork(device: torch.device) -> Iterator[None]:
    """Leave the global random state as it was, whatever the recompute draws (like ``torch.utils.checkpoint``)."""
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        yield


@dataclasses.dataclass
class _LayerCall:
    """One decoder-layer call, able to run any chunk of the sequence.

    ``rng`` holds each chunk's random state from the forward (when it is recorded), so every recompute of a chunk
    draws the same random numbers (dropout masks, sampled routing, jitter) as the forward did.
    """

    forward: functools.partial  # partial(layer.forward, layer, **kwargs) from GradientCheckpointingLayer
    settings: StreamSettings
    seq_len: int
    autocast: dict
    configs: tuple
    cache_name: str
    rng: list[_RngState] = dataclasses.field(default_factory=list)

    @property
    def layer(self) -> nn.Module:
        return self.forward.args[0]

    @property
    def mask(self) -> StreamMask | None:
        mask = self.forward.keywords.get("attention_mask")
        return mask if isinstance(mask, StreamMask) else None

    def chunks(self) -> list[tuple[int, int]]:
        c = self.settings.chunk_size
        return [(s, min(s + c, self.seq_len)) for s in range(0, self.seq_len, c)]

    def prefix_start(self, s: int) -> int:
        """First key position any query of a chunk starting at ``s`` can attend to."""
        window = self.mask.local_size if self.mask is not None else None
        return max(0, s - window + 1) if window else 0

    def run(self, x: torch.Tensor, s: int, e: int, cache: _ChunkCache) -> torch.Tensor:
        """The layer's own forward on x (= the hidden states of positions [s, e)) against the cache's prefix."""
        kwargs = dict(self.forward.keywords)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, StreamMask):
            kwargs["attention_mask"] = mask.at(s, s - cache.prefix_len)
        for name, value in kwargs.items():
            if name == "position_embeddings" and value is not None:
                kwargs[name] = tuple(t[..., s:e, :] for t in value)
            elif name in _PER_TOKEN and value is not None:
                kwargs[name] = value[..., s:e]
        kwargs[self.cache_name] = cache
        with torch.autocast(**self.autocast), streaming(self.configs):
            out = self.forward.func(self.layer, x, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"StreamBP expects {type(self.layer).__name__} to return a tensor, got {type(out).__name__}."
            )
        return out

    def forward_chunks(
        self, x: torch.Tensor, keep_kv: bool, record_rng: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Prefill, first chunk to last, under no grad; returns the output and, if ``keep_kv``, K and V."""
        y = None
        kv = _KVBuffer(self.seq_len)
        with torch.no_grad():
            for s, e in self.chunks():
                if record_rng:
                    self.rng.append(_RngState(x.device))
                cache = _ChunkCache(s, *kv.range(self.prefix_start(s), s))
                out = self.run(x[:, s:e], s, e, cache)
                kv.write(s, e, cache)
                if y is None:
                    y = x.new_empty(x.shape[:2] + out.shape[2:], dtype=out.dtype)
                y[:, s:e] = out
        return y, (kv.k, kv.v) if keep_kv else ()

    def collect_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every position, running each chunk (from its recorded random state) up to its cache update."""
        kv = _KVBuffer(self.seq_len)
        with torch.no_grad():
            for i, (s, e) in enumerate(self.chunks()):
                self.rng[i].restore()
                cache = _ChunkCache(s, stop=True)
                try:
                    self.run(x[:, s:e], s, e, cache)  # stops before attention: no prefix needed
                except _KVCollected:
                    pass
                else:
                    raise RuntimeError(f"{type(self.layer).__name__} never updated its key/value cache.")
                kv.write(s, e, cache)
        return kv.k, kv.v

    def backward_chunks(
        self,
        x: torch.Tensor,
        dy: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        params: list[nn.Parameter],
        need_dx: bool,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        with _rng_fork(x.device):
            return self._backward_chunks(x, dy, kv, params, need_dx)

    def _backward_chunks(self, x, dy, kv, params, need_dx):
        k_all, v_all = kv if kv else self.collect_kv(x)
        dk, dv = torch.zeros_like(k_all), torch.zeros_like(v_all)
        dx = torch.empty_like(x) if need_dx else None
        dparams: list[torch.Tensor | None] = [None] * len(params)
        for i, (s, e) in reversed(list(enumerate(self.chunks()))):
            p = self.prefix_start(s)
            xc = x[:, s:e].detach().requires_grad_(need_dx)
            kp = k_all[:, :, p:s].detach().requires_grad_(s > p)
            vp = v_all[:, :, p:s].detach().requires_grad_(s > p)
            cache = _ChunkCache(s, kp, vp)
            self.rng[i].restore()
            with torch.enable_grad():
                yc = self.run(xc, s, e, cache)
            outputs, grad_outputs = [yc], [dy[:, s:e]]
            if e < self.seq_len:  # later chunks attended to this chunk's keys and values
                outputs += [cache.chunk_k, cache.chunk_v]
                grad_outputs += [dk[:, :, s:e], dv[:, :, s:e]]
            # keys/values computed only from frozen weights and a gradient-free input carry no gradient
            keep = [j for j, out in enumerate(outputs) if out.requires_grad]
            outputs, grad_outputs = [outputs[j] for j in keep], [grad_outputs[j] for j in keep]
            inputs = [xc] if need_dx else []
            inputs += [kp, vp] if s > p else []
            grads = torch.autograd.grad(outputs, inputs + params, grad_outputs, allow_unused=True)
            it: Iterator = iter(grads)
            if need_dx:
                dx[:, s:e] = next(it)
            if s > p:
                for acc in (dk, dv):
                    g = next(it)
                    if g is not None:
                        acc[:, :, p:s] += g
            for j, g in enumerate(it):
                if g is not None:
                    dparams[j] = g if dparams[j] is None else dparams[j].add_(g)
        return dx, dparams


class _KVBuffer:
    """Keys/values of all positions of one layer, filled chunk by chunk: (batch, kv_heads, T, head_dim) each."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def range(self, start: int, end: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k is None:
            return None, None
        return self.k[:, :, start:end], self.v[:, :, start:end]

    def write(self, s: int, e: int, cache: _ChunkCache) -> None:
        if self.k is None:
            k, v = cache.chunk_k, cache.chunk_v
            self.k = k.new_empty(k.shape[:2] + (self.seq_len,) + k.shape[3:])
            self.v = v.new_empty(v.shape[:2] + (self.seq_len,) + v.shape[3:])
        self.k[:, :, s:e] = cache.chunk_k
        self.v[:, :, s:e] = cache.chunk_v


class _StreamLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _LayerCall, x: torch.Tensor, *params: nn.Parameter) -> torch.Tensor:
        capture = call.settings.kv_mode == "capture"
        y, kv = call.forward_chunks(x, keep_kv=capture, record_rng=True)
        ctx.call, ctx.params = call, params
        ctx.save_for_backward(x, *kv)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *kv = ctx.saved_tensors
        dx, dparams = ctx.call.backward_chunks(x, dy, tuple(kv), list(ctx.params), ctx.needs_input_grad[1])
        return (None, dx, *dparams)


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def _check_kwargs(layer: nn.Module, kwargs: dict, seq_len: int) -> None:
    """Refuse per-token inputs the stream decoder does not know how to slice, and inputs that carry gradient."""
    for name, value in kwargs.items():
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if t.requires_grad:
                raise ValueError(
                    f"StreamBP: {type(layer).__name__} receives `{name}` with gradient; only the hidden states and "
                    "the layer's parameters can carry gradient through a streamed layer."
                )
            known = name in ("attention_mask", "position_embeddings") or name in _PER_TOKEN | _PASS_THROUGH
            if not known and t.dim() >= 2 and seq_len in t.shape:
                raise ValueError(
                    f"StreamBP does not know how to split the per-token argument `{name}` of "
                    f"{type(layer).__name__} along the sequence."
                )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and (mask.dim() != 4 or mask.shape[-1] != seq_len):
        raise ValueError(f"StreamBP: unexpected attention mask of shape {tuple(mask.shape)} for {seq_len} tokens.")
    if mask is None:
        raise ValueError(f"StreamBP: {type(layer).__name__} was called without an attention mask.")


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _cache_name(layer: nn.Module) -> str:
    """The keyword under which ``layer`` takes its key/value cache."""
    params = inspect.signature(type(layer).forward).parameters
    name = next((k for k in _CACHE_KWARGS if k in params), None)
    if name is None:
        raise ValueError(f"StreamBP: {type(layer).__name__}.forward takes no key/value cache argument.")
    return name


def stream_checkpoint(settings: StreamSettings, forward: functools.partial, *args: torch.Tensor) -> torch.Tensor:
    """A streamed layer's ``_gradient_checkpointing_func``: ``forward`` is ``partial(layer.forward, layer, **kw)``.

    A call that brings a real key/value cache without grad (generation while the model is in training mode) runs
    the layer as it is, filling the cache. Every other training call is streamed; a cache is then dropped, as
    Hugging Face gradient checkpointing does.
    """
    layer = forward.args[0]
    kwargs = dict(forward.keywords)
    cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
    if cache is not None and not isinstance(cache, _ChunkCache) and not torch.is_grad_enabled():
        return forward(*args)
    if len(args) != 1:
        raise ValueError(
            f"StreamBP expects a decoder layer called with the hidden states only, got {len(args)} inputs."
        )
    (x,) = args
    seq_len = x.shape[1]
    for k in _CACHE_KWARGS:
        kwargs.pop(k, None)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):  # a user-given 4D mask: sliced per chunk
        kwargs["attention_mask"] = StreamMask(batch_size=x.shape[0], dense=mask)
    _check_kwargs(layer, kwargs, seq_len)
    call = _LayerCall(
        functools.partial(forward.func, layer, **kwargs),
        settings,
        seq_len,
        _autocast_state(x.device.type),
        stream_configs(layer),
        _cache_name(layer),
    )
    params = [p for p in layer.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return call.forward_chunks(x, keep_kv=False, record_rng=False)[0]
    return _StreamLayerFunction.apply(call, x, *params)
