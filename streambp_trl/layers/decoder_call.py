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

from ..sizing.choices import StepPlan
from .kept import CheckpointOffload, EmbeddingOutputs, Segment
from .sequence_split import SequenceSplit
from .shared_kv import SharedKV


@dataclasses.dataclass
class DecoderCall:
    """One streamed decoder call.

    ``plan``: the call's resolved plan (:class:`~streambp_trl.sizing.choices.StepPlan`: its chunk, the layer inputs
    kept, offload, the key/value mode), the one place a layer reads them; ``None`` where the call had no length to plan
    for (no recognisable input), or for a layer called outside a streamed decoder call: each layer then takes the
    user's choices at the rule of thumb for its length (:meth:`~.hook.LayerFacts.unplanned`).
    ``offloader``: the model's checkpoint offloader, used where the plan offloads. ``layers``: the stream layers of the
    decoder, by whose count a plan's layout places its segments.
    ``inputs_rebuildable``: the decoder collects no hidden states, so a layer's input may be rebuilt in backward
    (from the token ids, or by its segment) instead of kept, when no hook watches the layer either.
    ``embeddings``: the outputs of the input embedding during the call that can be rebuilt from the token ids.
    ``segment``: the segment of the last stream layer that ran, where the plan rebuilds layer inputs (its output may
    be the next layer's input in the same segment). ``shared_kv``: the keys/values layers share with later layers
    (:mod:`.shared_kv`), which the layer calls keep until their backwards. ``split``: the call's rows are this
    rank's share of sequences split across ranks (:mod:`.sequence_split`), or ``None``.
    """

    plan: StepPlan | None = None
    offloader: CheckpointOffload | None = None
    layers: int = 0
    inputs_rebuildable: bool = False
    embeddings: EmbeddingOutputs = dataclasses.field(default_factory=EmbeddingOutputs)
    segment: Segment | None = None
    shared_kv: SharedKV = dataclasses.field(default_factory=SharedKV)
    layers_called: int = 0  # stream layers called so far in this call
    split: SequenceSplit | None = None

    def segment_size(self, index: int, plan: StepPlan) -> int:
        """The size of a segment the call's ``index``-th stream layer starts under ``plan``: ``keep_every`` for
        every layer, or where the layout rebuilds some inputs below the top layer, that layer's (1 past the decoder's
        stream layers: a layer called once more)."""
        layout = plan.layout
        if layout.every > 1:
            return layout.every
        return layout.sizes(self.layers)[index] if index < self.layers else 1

    def offload(self, plan: StepPlan) -> CheckpointOffload | None:
        """Where kept layer inputs wait between forward and backward under ``plan``: the model's offloader where it
        offloads (one is made for a layer called outside a streamed decoder call), else ``None`` (on the device)."""
        if not plan.offload:
            return None
        if self.offloader is None:
            self.offloader = CheckpointOffload()
        return self.offloader

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
