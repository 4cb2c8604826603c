"""The state of one streamed decoder call, as its layers' hooks read it.

transformers, not the engine, calls each layer's checkpoint hook (``GradientCheckpointingLayer.__call__``), so what
the decoder's forward decides for a call reaches the hooks through :func:`decoder_call`: a context variable set for
the duration of that call (as ``torch.autocast`` keeps its state), never through attributes on modules or tensors.
A nested decoder call (another model run by a hook) has its own; a layer called outside any streamed decoder call
is a call of its own, with the defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch

from .call import StreamSettings
from .kept import EmbeddingOutputs, Segment
from .shared_kv import SharedKV


@dataclasses.dataclass
class DecoderCall:
    """One streamed decoder call.

    ``chunk_size``: tokens per chunk for every layer of the call (the fixed option, or what ``"auto"`` chose), the
    one place a layer reads it; ``None`` (``"auto"`` without a recognisable input, or a layer called outside a
    streamed decoder call): each layer takes the rule of thumb for its length.
    ``inputs_rebuildable``: the decoder collects no hidden states, so a layer's input may be rebuilt in backward
    (from the token ids, or by its segment) instead of kept, when no hook watches the layer either.
    ``embeddings``: the outputs of the input embedding during the call that can be rebuilt from the token ids.
    ``segment``: with ``keep_every > 1``, the segment of the last stream layer that ran (its output may be the next
    layer's input in the same segment). ``shared_kv``: the keys/values layers share with later layers
    (:mod:`.shared_kv`), which the layer calls keep until their backwards.
    ``segment_sizes``: where the call's plan keeps other layer inputs than the settings' ``keep_every``, the size of
    a segment started by each stream layer of the call, by its place among them
    (:class:`~streambp_trl.sizing.layout.Layout`); ``settings``: where the plan offloads otherwise than the model's
    settings, the call's own.
    """

    chunk_size: int | None = None
    inputs_rebuildable: bool = False
    embeddings: EmbeddingOutputs = dataclasses.field(default_factory=EmbeddingOutputs)
    segment: Segment | None = None
    shared_kv: SharedKV = dataclasses.field(default_factory=SharedKV)
    segment_sizes: tuple[int, ...] | None = None
    settings: StreamSettings | None = None
    layers_called: int = 0  # stream layers called so far in this call

    def segment_size(self, index: int, keep_every: int) -> int:
        """The size of a segment the call's ``index``-th stream layer starts: the plan's, else ``keep_every``."""
        sizes = self.segment_sizes
        return sizes[index] if sizes is not None and index < len(sizes) else (keep_every if sizes is None else 1)

    def segment_to_join(self, x: torch.Tensor) -> Segment | None:
        """The segment whose last layer produced ``x``, if ``x`` can continue it (see :meth:`Segment.continued_by`)."""
        return self.segment if self.segment is not None and self.segment.continued_by(x) else None


_ACTIVE: contextvars.ContextVar[DecoderCall | None] = contextvars.ContextVar("streambp_decoder_call", default=None)


@contextlib.contextmanager
def decoder_call(call: DecoderCall) -> Iterator[DecoderCall]:
    """Make ``call`` the one the layer hooks see for the duration of a ``with`` block."""
    token = _ACTIVE.set(call)
    try:
        yield call
    finally:
        _ACTIVE.reset(token)


def active_call() -> DecoderCall:
    """The streamed decoder call in progress, or a call of its own with the defaults (a layer called directly)."""
    call = _ACTIVE.get()
    return DecoderCall() if call is None else call
