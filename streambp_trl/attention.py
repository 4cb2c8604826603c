"""Chunk-local attention masks and attention, registered through transformers' own interfaces.

During a streamed call (the decoder's training forward, and each layer's recompute in backward; see
:func:`streaming`) the model's attention implementation is ``"streambp"``. The model-level mask functions
(``create_causal_mask``, ``create_sliding_window_causal_mask``, ...) then return a :class:`StreamMask`: a
description of the mask (the model's own index-based ``mask_function``, the 2D padding mask, the sliding window),
not a (T x T) tensor. The stream decoder calls each layer on one chunk of queries
``[q_start, q_start + q_len)`` against keys ``[kv_start, kv_start + kv_len)`` and hands the layer
``mask.at(q_start, kv_start)``; :func:`stream_attention` then builds at most the (q_len x kv_len) block with
``masking_utils.sdpa_mask``, or uses PyTorch's bottom-right-aligned causal kernel when the block is plainly
causal (no padding, packing or window), which dispatches to the flash / memory-efficient kernels on CUDA.

Everything the model's mask function encodes (padding, packed sequences, sliding windows, custom overlays)
is evaluated with absolute indices, so a chunk sees exactly the rows of the full mask it needs.

Outside streamed calls the config names the model's own implementation, so eval, generation and saved
checkpoints are unchanged. Attention dropout is applied by SDPA on each block; the stream decoder replays the
random state of every chunk, so a recompute draws the same dropout mask as the forward did.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from .patching import temporarily

IMPLEMENTATION = "streambp"


@dataclasses.dataclass(frozen=True)
class StreamMask:
    """A causal attention mask described, not materialised.

    Either ``mask_function`` (absolute ``(batch, head, q_idx, kv_idx) -> bool``, as transformers builds it,
    with ``padding`` the (batch, T) bool padding mask or ``None``) or ``dense``, a user-given 4D mask over the
    whole sequence that is only sliced. ``q_start``/``kv_start`` place the current call's queries and keys.
    """

    batch_size: int
    mask_function: Callable | None = None
    padding: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    local_size: int | None = None
    use_vmap: bool = False
    q_start: int = 0
    kv_start: int = 0

    @property
    def plain_causal(self) -> bool:
        """True when the mask is exactly causal: no padding, packing, window or overlay."""
        return self.dense is None and self.mask_function is causal_mask_function and self.padding is None

    def at(self, q_start: int, kv_start: int) -> StreamMask:
        """The same mask, for queries from absolute position ``q_start`` and keys from ``kv_start``."""
        return dataclasses.replace(self, q_start=q_start, kv_start=kv_start)

    def block(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """The (batch, 1, q_len, kv_len) bool block of the mask, or ``None`` for a bottom-right causal block.

        ``None`` is only returned when the queries end where the keys end, which is how the stream decoder
        always calls a layer, so bottom-right causal alignment is the exact mask.
        """
        q_end, kv_end = self.q_start + q_len, self.kv_start + kv_len
        if self.dense is not None:
            return self.dense[:, :, self.q_start : q_end, self.kv_start : kv_end]
        if self.plain_causal and q_end == kv_end:
            return None
        return sdpa_mask(
            batch_size=self.batch_size,
            q_length=q_len,
            kv_length=kv_len,
            q_offset=self.q_start,
            kv_offset=self.kv_start,
            mask_function=self.mask_function,
            attention_mask=self.padding,
            allow_is_causal_skip=False,
            use_vmap=self.use_vmap,
            device=device,
        )


def stream_configs(module: torch.nn.Module, *layers: torch.nn.Module) -> tuple:
    """The transformers configs the mask code of ``module`` (its own config) and the attention code of the streamed
    ``layers`` read (all of ``module``'s submodules when no layers are given), deduplicated."""
    configs = {}
    for m in (module, *(sub for layer in layers for sub in layer.modules())) if layers else module.modules():
        config = getattr(m, "config", None)
        if isinstance(config, PreTrainedConfig):
            configs.setdefault(id(config), config)
    return tuple(configs.values())


@contextlib.contextmanager
def streaming(configs: tuple) -> Iterator[None]:
    """Route attention and mask creation of the models reading ``configs`` through ``"streambp"`` for one call.

    The configs are switched only for the duration of a streamed call (the decoder's training forward, a layer's
    recompute in backward), so the model's own implementation stays what it was everywhere else: eval, generation,
    ``save_pretrained``, ``copy.deepcopy`` and other models sharing the config see no change.
    """
    _register()
    with temporarily(configs, "_attn_implementation_internal", IMPLEMENTATION):
        yield


def stream_mask(**kwargs) -> StreamMask:
    """Mask interface function: a :class:`StreamMask` describing the whole sequence's mask."""
    if kwargs.get("q_offset", 0) or kwargs.get("kv_offset", 0) or kwargs["q_length"] != kwargs["kv_length"]:
        raise ValueError(
            "StreamBP streams whole sequences without a key/value cache, but this call has cached positions "
            f"(q_offset={kwargs.get('q_offset', 0)}, kv_length={kwargs['kv_length']}, q_length={kwargs['q_length']})."
        )
    padding = kwargs.get("attention_mask")
    if padding is not None and bool(padding.all()):
        padding = None
    return StreamMask(
        batch_size=kwargs["batch_size"],
        mask_function=kwargs["mask_function"],
        padding=padding,
        local_size=kwargs.get("local_size"),
        use_vmap=kwargs.get("use_vmap", False),
    )


def stream_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: StreamMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention interface function.

    With a :class:`StreamMask` (training): exact attention of ``query`` (batch, heads, q_len, d) over ``key``/``value``
    (batch, kv_heads, kv_len, d) under the mask block, through PyTorch SDPA. Otherwise the original implementation.
    Holds at most one (q_len x kv_len) mask block and SDPA's own workspace.
    """
    if not isinstance(attention_mask, StreamMask):
        raise RuntimeError(
            f"StreamBP attention in {type(module).__name__} got a {type(attention_mask).__name__} mask instead of a "
            "StreamMask: the model built its attention mask outside transformers' mask interface."
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"StreamBP cannot compute attention with `softcap` exactly for {type(module).__name__}.")
    block = attention_mask.block(query.shape[2], key.shape[2], query.device)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if sinks is not None:
        return _attention_with_sinks(query, key, value, block, sinks, scaling, dropout), None
    if block is not None:
        return sdpa_attention_forward(
            module, query, key, value, block, scaling=scaling, dropout=dropout, is_causal=False
        )
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=causal_lower_right(query.shape[2], key.shape[2]),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None


_SINK_PAD = 8  # extra query/key dimensions, so the head dimension stays a multiple of 8 for the fused kernels


def _attention_with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    sinks: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention whose softmax also runs over one learned logit per head (an attention sink) that carries no value.

    The sink is one extra key: queries get a constant 1 and keys a 0 in an extra dimension, the sink key holds
    ``sink / scale`` there and its value is zero, so its score is exactly the sink logit and the softmax over
    [scores, sink] is the model's. Keys and values are expanded to the query heads (one sink per query head).
    Holds the expanded (batch, heads, kv_len + 1, head_dim + 8) keys and a (q_len x kv_len + 1) boolean mask.
    """
    b, heads, q_len, d = query.shape
    kv_len = key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    pad = query.new_zeros(b, heads, q_len, _SINK_PAD)
    pad[..., 0] = 1
    query = torch.cat([query, pad], dim=-1)
    sink_key = query.new_zeros(b, heads, 1, d + _SINK_PAD)
    sink_key[..., d] = (sinks.to(query.dtype) / scale).view(1, heads, 1).expand(b, heads, 1)
    key = torch.cat([torch.cat([key, key.new_zeros(b, heads, kv_len, _SINK_PAD)], dim=-1), sink_key], dim=2)
    value = torch.cat([value, value.new_zeros(b, heads, 1, value.shape[-1])], dim=2)
    if block is None:  # bottom-right causal
        block = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        block = block.view(1, 1, q_len, kv_len)
    block = block.expand(b, 1, q_len, kv_len)
    mask = torch.cat([block, block.new_ones(b, 1, q_len, 1)], dim=-1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).contiguous()


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, stream_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, stream_mask)
        _registered = True
