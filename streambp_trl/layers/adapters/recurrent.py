"""Recurrent and convolution mixers (Gated DeltaNet, Mamba, short convolutions: :func:`~..traits.carries_state`):
chunks of at least two tokens, and a packed row's documents each started from a zero state where the mixers keep
them apart (:func:`~..traits.keeps_documents_apart`)."""

from __future__ import annotations

import dataclasses

from torch import nn

from ..layer_args import PACKING_KWARGS, document_starts
from ..shared_kv import SharedKV
from ..traits import carries_state, keeps_documents_apart
from .base import CallArguments, LayerAdapter
from .varlen import VarlenAttention


@dataclasses.dataclass(frozen=True)
class RecurrentMixers(LayerAdapter):
    """A layer holding a recurrent or convolution mixer. On one token such a mixer takes its decoding path, which
    updates the state it is given in place, and a state that later chunks differentiate through cannot be changed in
    place: chunks have at least two tokens. ``apart``: whether its mixers start each document of a packed row from a
    zero state (they hand the row's sequence descriptors to their kernels), ``False`` where they run across
    documents, ``None`` where they do so in part."""

    apart: bool | None
    min_chunk = 2
    after = (VarlenAttention,)  # flash's documents are read from the sequence descriptors before the cut takes them

    @classmethod
    def detect(cls, layer: nn.Module, decoder: type) -> RecurrentMixers | None:
        mixers = {type(m) for m in layer.modules() if carries_state(type(m))}
        if not mixers:
            return None
        kinds = {keeps_documents_apart(m) for m in mixers}
        return cls(kinds.pop() if len(kinds) == 1 else None)  # (None also where a mixer resets its convolution alone)

    def bind(self, layer: nn.Module, args: CallArguments, shared: SharedKV) -> CallArguments:
        """Where the call's packed row starts a new document, where the mixers keep documents apart. A packed row
        comes with sequence descriptors (``cu_seq_lens_q``: TRL's padding-free collator, ``packing=True``); the chunks
        are then cut at every document start and each starts from a zero state there, as a new sequence does, so a
        chunk holds one document and the mixers get no descriptors (which describe the whole row). Attention keeps
        documents apart by its mask; a mixer that ignores the descriptors runs across documents, in the plain model
        and here alike."""
        cu_seq_lens = args.kwargs.get("cu_seq_lens_q")
        if self.apart is False:
            return args
        if cu_seq_lens is None:
            if args.kwargs.get("seq_idx") is not None:
                raise ValueError(
                    f"StreamBP: {type(layer).__name__} got `seq_idx` without `cu_seq_lens_q`: a packed row needs both "
                    "(TRL's padding-free collator gives both)."
                )
            return args
        refusal = self.packing_refusal(layer)
        if refusal is not None:
            raise ValueError(refusal)
        if args.batch != 1:
            raise ValueError(
                f"StreamBP: packed rows (cu_seq_lens) describe one flattened row, got a batch of {args.batch} rows "
                f"for {type(layer).__name__}."
            )
        kwargs = {k: v for k, v in args.kwargs.items() if k not in PACKING_KWARGS}
        starts = document_starts(cu_seq_lens, args.seq_len)
        return dataclasses.replace(args, kwargs=kwargs, resets=tuple(sorted({*args.resets, *starts})))

    def packing_refusal(self, layer: nn.Module) -> str | None:
        """Why the layer cannot take packed rows: its recurrent mixers keep the documents apart in part."""
        if self.apart is not None:
            return None
        return (
            f"StreamBP cannot stream packed rows (cu_seq_lens) through {type(layer).__name__}: its recurrent mixers "
            "keep the documents apart in part (some mixers and not others, or the convolution and not the scan). "
            "Train without packing / padding_free (padded rows)."
        )
