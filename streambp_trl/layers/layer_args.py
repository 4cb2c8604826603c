"""The arguments of a decoder-layer call, as a streamed layer splits them per chunk.

A layer is called as transformers calls it (``partial(layer.forward, **kwargs)`` and the hidden states); its
positional arguments are bound to their parameter names. Per-token arguments are sliced per chunk along their
sequence dimension: ``position_ids`` (and the like) on the last dimension, ``position_embeddings`` (a (cos, sin)
pair or one tensor) on the second to last, any other tensor on its one dimension after the batch whose length is the
sequence length. Only per-token tensors (besides the hidden states and the layer's parameters) may carry gradient.

A chunk [s, e) gets positions [s, e) of each, except where the decoder hands its layers a *position history*
(:func:`.traits.keeps_position_history`): its layers then get the rotary embeddings of every position they attend
to, [p, e) from the chunk's first key position p, and take the chunk's own as the last e - s.

A packed row's sequence descriptors (:data:`PACKING_KWARGS`, TRL's padding-free batches) are read once per call:
where a layer's recurrent mixers keep documents apart (:func:`.traits.keeps_documents_apart`), the chunks are cut at
each document start (:func:`document_starts`) and run without them. What a layer's code does (its traits) is read in
:mod:`.traits`.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

# Keyword arguments a layer call may carry that are not per-token tensors to slice: flash-attention's packed
# sequence descriptors, ignored by stream attention, which reads packing from the mask.
PASS_THROUGH = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
# The sequence descriptors of packed rows (TRL's padding-free collator): a row's document boundaries as cumulative
# lengths, and each token's document index (read by the convolution kernels of linear-attention layers)
PACKING_KWARGS = (*sorted(PASS_THROUGH), "seq_idx")
# The layer arguments a position history spans (see :func:`.traits.keeps_position_history`)
HISTORY_ARGUMENTS = ("position_embeddings",)
# Per-token keyword arguments with the sequence on their last dimension (batch, T), sliced per chunk.
PER_TOKEN_LAST = {"position_ids", "seq_idx", "cache_position"}
# The names a call passes its cache under: ``cache`` since transformers 5.24 (decoder layers and every mixer), the
# older names before it (``cache_params``: the recurrent and convolution mixers of transformers < 5.24)
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")
# the argument a decoder layer takes its recurrent state in, and returns its last state beside its output, where it
# has no cache (xLSTM's blocks: ``forward(x, state) -> (y, state)``)
STATE_ARGUMENT = "state"


def cache_argument(kwargs: dict):
    """The cache a call passes (under any of :data:`CACHE_KWARGS`), or ``None``."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


def builds_cache(decoder: nn.Module, kwargs: dict) -> bool:
    """Whether a decoder call with ``kwargs`` builds or extends a key/value cache: one is passed, or ``use_cache`` is
    on (the argument, else ``config.use_cache``, on by default), which Hugging Face gradient checkpointing turns off
    in training. transformers' mask reads packed rows from restarting position ids only in a call without one."""
    if cache_argument(kwargs) is not None:
        return True
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(decoder.config, "use_cache", False)
    if getattr(decoder, "gradient_checkpointing", False) and decoder.training:
        return False
    return bool(use_cache)


def document_starts(cu_seq_lens: torch.Tensor, seq_len: int) -> tuple[int, ...]:
    """The positions where a document of a packed row starts, but the first: the inner cumulative lengths (one host
    read per layer call)."""
    return tuple(int(t) for t in cu_seq_lens.tolist() if 0 < int(t) < seq_len)


def sequence_dim(name: str, t: torch.Tensor, batch: int, seq_len: int) -> int | None:
    """The dimension of a per-token layer argument that runs along the sequence, or None if it has none."""
    if name in PER_TOKEN_LAST:
        return t.dim() - 1 if t.dim() and t.shape[-1] == seq_len else None
    if name == "position_embeddings":
        return t.dim() - 2 if t.dim() >= 2 and t.shape[-2] == seq_len else None
    first = 1 if t.dim() > 1 and t.shape[0] in (batch, 1) else 0
    dims = [d for d in range(first, t.dim()) if t.shape[d] == seq_len]
    if len(dims) > 1:
        raise ValueError(
            f"StreamBP cannot tell which dimension of the layer argument `{name}` (shape {tuple(t.shape)}) runs along "
            f"the {seq_len}-token sequence."
        )
    return dims[0] if dims else None


def slice_arg(value, dim_map, s: int, e: int):
    """``value`` (a tensor, or a tuple/list/dict of them and other objects) with each tensor narrowed to [s, e) along
    its sequence dimension in ``dim_map`` (same structure; ``None``: not per-token)."""
    if isinstance(value, dict):
        return {k: slice_arg(v, dim_map.get(k), s, e) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(slice_arg(v, d, s, e) for v, d in zip(value, dim_map, strict=True))
    return value.narrow(dim_map, s, e - s) if isinstance(value, torch.Tensor) and dim_map is not None else value


def per_token(layer: nn.Module, kwargs: dict, batch: int, seq_len: int) -> tuple[dict, tuple[str, ...]]:
    """Which arguments to slice per chunk, and along which dimension, and which of them carry gradient (only a
    per-token tensor argument may)."""
    per_token, grad_inputs = {}, []
    for name, value in kwargs.items():
        if name in CACHE_KWARGS or name in PASS_THROUGH:
            continue  # (a StreamMask is no tensor: each chunk gets its own view; a (batch, T) padding mask is sliced)
        if isinstance(value, dict):  # a mapping of masks (the causal StreamMask beside a convolution's (batch, T)), of
            # rotary embeddings by layer type ((cos, sin) each: DeepSeek-V4)
            entries = {k: v if isinstance(v, (tuple, list)) else (v,) for k, v in value.items()}
            if any(t.requires_grad for v in entries.values() for t in v if _tensor(t)):
                raise ValueError(f"StreamBP: {type(layer).__name__} receives `{name}` with gradient inside a mapping.")
            dims = {
                k: tuple(sequence_dim(name, t, batch, seq_len) if _tensor(t) else None for t in v)
                for k, v in entries.items()
            }
            if any(d is not None for v in dims.values() for d in v):
                per_token[name] = {k: d if isinstance(value[k], (tuple, list)) else d[0] for k, d in dims.items()}
            continue
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        dims = []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                dims.append(None)
                continue
            dims.append(sequence_dim(name, t, batch, seq_len))
            if t.requires_grad and not (isinstance(value, torch.Tensor) and dims[-1] is not None):
                raise ValueError(
                    f"StreamBP: {type(layer).__name__} receives `{name}` with gradient; only the hidden states, "
                    "per-token tensor arguments and the layer's parameters can carry gradient through a stream layer."
                )
        if any(d is not None for d in dims):
            per_token[name] = dims[0] if isinstance(value, torch.Tensor) else tuple(dims)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                grad_inputs.append(name)
    return per_token, tuple(grad_inputs)


def _tensor(t: object) -> bool:
    return isinstance(t, torch.Tensor)


def parameter_names(layer: nn.Module) -> list[str]:
    return list(inspect.signature(type(layer).forward).parameters)[1:]  # without self
