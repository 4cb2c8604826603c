"""Flash attention's variable-length kernel: a layer whose own attention implementation is a flash attention keeps a
packed row's documents apart whatever the mask, so the stream attention's mask keeps them apart too."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn
from transformers.utils.generic import is_flash_attention_requested

from ...attention import StreamMask, stream_configs
from ..layer_args import PASS_THROUGH, document_starts
from ..shared_kv import SharedKV
from .base import CallArguments, LayerAdapter


@dataclasses.dataclass(frozen=True)
class VarlenAttention(LayerAdapter):
    """A layer whose attention implementation (when the engine is installed) is a flash attention."""

    kernel_apart: ClassVar[bool] = True
    splits: ClassVar[bool] = True  # (under a split, every layer keeps the whole rows' documents apart instead)

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> VarlenAttention | None:
        return cls() if any(is_flash_attention_requested(c) for c in stream_configs(layer)) else None

    def bind(self, layer: nn.Module, args: CallArguments, shared: SharedKV) -> CallArguments:
        starts = self.documents(args.kwargs, args.seq_len)
        if not starts:
            return args
        kwargs = dict(args.kwargs)
        kwargs["attention_mask"] = kwargs["attention_mask"].apart(starts)
        return dataclasses.replace(args, kwargs=kwargs)

    @staticmethod
    def documents(kwargs: Mapping, seq_len: int) -> tuple[int, ...]:
        """Where a packed row's documents start (but the first), for a call given the row's sequence descriptors and a
        :class:`StreamMask` without padding; ``()`` otherwise. The model's own flash attention then runs its
        variable-length kernel over the documents (``cu_seq_lens``, or a single row's position ids where they
        restart: transformers' ``prepare_fa_kwargs_from_position_ids``), keeping them apart whatever the mask says (a
        model whose mask ignores packing, as Granite 4 hybrid's, built without the position ids, does; with SDPA or
        eager the model's attention follows that mask, and so does the stream's)."""
        mask = kwargs.get("attention_mask")
        if not isinstance(mask, StreamMask) or mask.padding is not None:
            return ()
        if all(kwargs.get(k) is not None for k in PASS_THROUGH):
            return document_starts(kwargs["cu_seq_lens_q"], seq_len)
        positions = kwargs.get("position_ids")  # flash's other packed form: position ids that restart, one row
        if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape == (1, seq_len):
            return tuple(int(i) for i in (positions[0] == positions.min()).nonzero().flatten().tolist() if i > 0)
        return ()
