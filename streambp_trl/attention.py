"""Chunk-local attention masks and attention, registered through transformers' own interfaces.

While StreamBP is enabled the model's attention implementation is ``"streambp"``. In training mode the
model-level mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``) then return a
:class:`StreamMask`: a description of the mask (the model's own index-based ``mask_function``, the 2D padding
mask, the sliding window), not a (T x T) tensor. The stream decoder calls each layer on one chunk of queries
``[q_start, q_start + q_len)`` against keys ``[kv_start, kv_start + kv_len)`` and hands the layer
``mask.at(q_start, kv_start)``; :func:`stream_attention` then builds at most the (q_len x kv_len) block with
``masking_utils.sdpa_mask``, or uses PyTorch's bottom-right-aligned causal kernel when the block is plainly
causal (no padding, packing or window), which dispatches to the flash / memory-efficient kernels on CUDA.

Everything the model's mask function encodes (padding, packed sequences, sliding windows, custom overlays)
is evaluated with absolute indices, so a chunk sees exactly the rows of the full mask it needs.

In eval mode both functions delegate to the implementation the model had before StreamBP was enabled, so
inference is unchanged.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    causal_mask_function,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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


@dataclasses.dataclass
class _ModelEntry:
    config: weakref.ref
    model: weakref.ref
    inner: str


# id(config) -> the model whose config it is and the attention implementation it had before StreamBP.
_MODELS: dict[int, _ModelEntry] = {}


def attach(model: torch.nn.Module, config) -> None:
    """Record ``model``'s current attention implementation and switch it to ``"streambp"``."""
    _register()
    entry = _MODELS.get(id(config))
    if entry is not None and entry.config() is config:
        return
    inner = config._attn_implementation or "sdpa"
    _MODELS[id(config)] = _ModelEntry(weakref.ref(config), weakref.ref(model), inner)
    model.set_attn_implementation(IMPLEMENTATION)


def detach(model: torch.nn.Module, config) -> None:
    """Give ``model`` back the attention implementation recorded by :func:`attach`."""
    entry = _MODELS.pop(id(config), None)
    if entry is not None:
        model.set_attn_implementation(entry.inner)


def _entry(config) -> _ModelEntry:
    entry = _MODELS.get(id(config))
    if entry is None or entry.config() is not config:
        raise RuntimeError(
            f"{type(config).__name__} uses attn_implementation='{IMPLEMENTATION}' but StreamBP is not enabled on its "
            "model; call streambp_trl.enable_streambp(model, ...) or set another attention implementation."
        )
    return entry


def _streaming(config) -> bool:
    model = _entry(config).model()
    return model is not None and model.training


def stream_mask(**kwargs) -> StreamMask | torch.Tensor | None:
    """Mask interface function: a :class:`StreamMask` in training, the original implementation's mask otherwise."""
    config = kwargs["config"]
    if not _streaming(config):
        inner = _entry(config).inner
        # Like transformers: an implementation without a mask function of its own gets no mask.
        return ALL_MASK_ATTENTION_FUNCTIONS[inner](**kwargs) if inner in ALL_MASK_ATTENTION_FUNCTIONS else None
    if kwargs.get("q_offset", 0) or kwargs.get("kv_offset", 0) or kwargs["q_length"] != kwargs["kv_length"]:
        raise ValueError(
            "StreamBP streams a whole sequence without a key/value cache; generating with the model in training mode "
            "is not supported while it is enabled. Call model.eval() before generate()."
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


def _model_eager_attention(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` that the module's own modeling file defines."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} has no eager attention function to fall back to.")
    return fn


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
        inner = _entry(module.config).inner
        fn = _model_eager_attention(module) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"StreamBP cannot compute attention with `{name}` exactly for {type(module).__name__}.")
    if dropout:
        raise ValueError(f"StreamBP cannot replay attention dropout ({dropout}) in {type(module).__name__}.")
    block = attention_mask.block(query.shape[2], key.shape[2], query.device)
    if block is not None:
        return sdpa_attention_forward(module, query, key, value, block, scaling=scaling, is_causal=False)
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=causal_lower_right(query.shape[2], key.shape[2]),
        scale=scaling,
        enable_gqa=groups > 1,
    )
    return out.transpose(1, 2).contiguous(), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, stream_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, stream_mask)
        _registered = True
