"""The plan's vocabulary: what the user fixed, what one call runs with, and what a step trains.

Two frozen objects and nothing between them:

* :class:`PlanChoices`, the user's choices of every call's plan, each ``None`` where the plan chooses; built once from
  the options (:attr:`streambp_trl.engine.options.StreamOptions.choices`), where every value is converted to its
  type (``"auto"`` to ``None``, ``"78GiB"`` to bytes, ``"capture"`` to :class:`KVMode`);
* :class:`StepPlan`, the resolved plan of one call: the chunk, which layer inputs are kept or rebuilt
  (:class:`~.layout.Layout`), whether the kept ones wait in host memory, and how each layer's backward gets its
  keys/values, with what the memory model predicts for it. The planner (:class:`~.auto.AutoChunks`) returns one for
  every call, also where the user fixed everything (:meth:`PlanChoices.fixed`); the layers read only it, carried with
  the decoder call (:class:`~streambp_trl.layers.DecoderCall`).

:class:`Trained` says what the memory model counts as trained and held beside a plan.
"""

from __future__ import annotations

import dataclasses
import enum

from ..logits.forms import HeadForm
from .layout import Layout
from .units import size_text

_FALLBACK = (512, 4096)
CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)  # the stream chunk sizes a plan chooses among


class KVMode(enum.StrEnum):
    """How a layer's backward gets the keys/values (and the carried states) of earlier positions: ``RECOMPUTE``d from
    its kept input by a no-grad chunked pass, or ``CAPTURE``d in its forward and kept until its backward
    (2 x kv_dim values per token per attention layer, the carries of every chunk boundary)."""

    RECOMPUTE = "recompute"
    CAPTURE = "capture"


KV_MODES = tuple(mode.value for mode in KVMode)  # as a user writes them


def rule_of_thumb(seq_len: int) -> int:
    """The chunk without a memory figure: an eighth of the sequence, clamped to [512, 4096]."""
    return min(max(seq_len // 8, _FALLBACK[0]), _FALLBACK[1])


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How one streamed call runs: ``chunk`` tokens per chunk (and logit tile), the ``layout`` of kept layer inputs,
    ``offload`` of the kept ones to pinned host memory, ``kv_mode`` of each layer's keys/values, how many top layers
    keep their activations from the forward (``keep_activations``) and whether the others keep their attention outputs
    (``keep_attention``); what the memory model
    predicts for it (``activations``: device bytes beyond weights and gradients, with the LM head's gradient in its
    two-node form; ``host``: pinned host bytes), its predicted relative ``time``, and ``head_forms``: the forms of the
    LM head's gradient (:class:`~streambp_trl.logits.forms.HeadForm`) with which the predicted peak still fits the
    plan's room (the head takes the one that recomputes least among them that its loss allows, where no allocation
    figure is measured at the head; ``()``: not planned)."""

    chunk: int
    layout: Layout = Layout()
    offload: bool = False
    activations: int = 0
    host: int = 0
    time: float = 1.0
    kv_mode: KVMode = KVMode.RECOMPUTE
    head_forms: tuple[HeadForm, ...] = ()
    keep_activations: int = 0
    keep_attention: bool = False

    def keeps(self, index: int, layers: int) -> bool:
        """Whether the ``index``-th of a decoder's ``layers`` stream layers keeps its activations from the forward
        (the top ``keep_activations``: their backwards come first; a layer called outside a decoder: any)."""
        return self.keep_activations > 0 and index >= layers - self.keep_activations

    def describe(self, tokens: int, layers: int, held: int | None = None, room: int | None = None) -> str:
        """The plan in plain words, e.g. ``262,144 tokens: chunk 4096, every layer input kept, checkpoints offloaded
        to host (70.0 GiB pinned), predicted peak 41.2 GiB of 78.0 GiB``; ``held``: the weights and gradients the
        peak adds to the activations, ``room``: what the device allows them (``None``: not known)."""
        words = [f"{tokens:,} tokens: chunk {self.chunk}"]
        if self.keep_activations >= layers:  # (no layer recomputes: what the others keep does not arise)
            words.append("every layer's activations kept from the forward (nothing recomputed)")
        else:
            words.append(self.layout.describe(layers))
            if self.offload:  # (no pinned bytes on the CPU, where offload keeps the checkpoints as they are)
                pinned = f" ({size_text(self.host)} pinned)" if self.host else ""
                words.append(f"checkpoints offloaded to host{pinned}")
            if self.kv_mode == KVMode.CAPTURE:
                words.append("keys/values kept from the forward")
            if self.keep_attention:
                words.append("attention outputs kept from the forward")
            if self.keep_activations:
                words.append(f"the top {self.keep_activations} layers' activations kept from the forward")
        if held is not None:
            peak = f"predicted peak {size_text(held + self.activations)}"
            words.append(peak if room is None else f"{peak} of {size_text(held + room)}")
        return ", ".join(words)


@dataclasses.dataclass(frozen=True)
class PlanChoices:
    """The user's choices of each call's plan; ``None``: the plan chooses. ``chunk``: tokens per chunk;
    ``keep_every``: only the first input of every ``keep_every`` layers kept; ``offload``: kept inputs in pinned host
    memory; ``kv_mode``: how the backward gets keys/values; ``keep_activations``: how many top layers keep their
    activations from the forward (no recompute); ``keep_attention``: the other layers keep their attention outputs
    from the forward (their recompute skips the attention kernels); ``budget``: bytes of the whole device a step may
    use (``None``: the memory free when a call starts)."""

    chunk: int | None = None
    keep_every: int | None = None
    offload: bool | None = None
    kv_mode: KVMode | None = None
    keep_activations: int | None = None
    keep_attention: bool | None = None
    budget: int | None = None

    def __post_init__(self):
        if self.kv_mode is not None:  # (the one place a key/value mode as written becomes a KVMode)
            object.__setattr__(self, "kv_mode", KVMode(self.kv_mode))

    def fixed(self, seq_len: int) -> StepPlan:
        """The plan without a memory figure for sequences of ``seq_len`` tokens: the user's choices, else the rule of
        thumb's chunk (:func:`rule_of_thumb`), every input kept, nothing offloaded, keys/values recomputed, every layer
        recomputed in backward, attention included."""
        chunk = self.chunk if self.chunk is not None else rule_of_thumb(seq_len)
        kept, attention = self.keep_activations or 0, bool(self.keep_attention)
        layout = Layout(every=self.keep_every or 1)
        plan = StepPlan(chunk, layout, bool(self.offload), keep_activations=kept, keep_attention=attention)
        return plan if self.kv_mode is None else dataclasses.replace(plan, kv_mode=self.kv_mode)


@dataclasses.dataclass(frozen=True)
class Trained:
    """What a step trains, as the memory model counts it: ``db`` bytes per element of the weights (and activations);
    ``head``: the LM head is trained; ``adapters``: float32 LoRA adapters on the layers' linear maps, whose products
    the forward holds; ``layer_params``: a layer's trained parameters (``None``: all of them); ``pending_grads``: no
    parameter gradient is allocated when the step starts, so each is counted from the moment the backward forms it."""

    db: int = 2
    head: bool = True
    adapters: bool = False
    layer_params: int | None = None
    pending_grads: bool = False


MASK_ALIGN = 16  # an additive mask block's rows are padded to a multiple of this many keys (the CUDA kernels' rows)


@dataclasses.dataclass(frozen=True)
class MaskBlocks:
    """The attention mask blocks a call's softmax-attention layers build, as the memory model counts them.

    A chunk that is not plainly causal attends under a (rows, 1, chunk, keys) mask block
    (:meth:`~streambp_trl.attention.StreamMask.block`), a bool block turned into one additive mask in the attention's
    dtype (rows aligned to :data:`MASK_ALIGN` keys) that the memory-efficient kernel takes and saves for its
    backward: from the chunk's recompute to its attention backward a layer holds ``rows x chunk x keys x db``, and
    while the block is built the bool block too. ``whole``: the layers that attend over the whole prefix build one
    (padding, packed rows, a 4D mask), ``keys`` the row's length; ``window``: the sliding-window or chunked layers'
    span of earlier keys (their chunk attends to ``window - 1 + chunk`` keys at most), which build one whatever the
    inputs; ``None`` where the model has none."""

    whole: bool = False
    window: int | None = None

    def keys(self, chunk: int, length: int) -> int:
        """Keys of the widest block a chunk of ``chunk`` queries builds in rows of ``length`` positions (0: none)."""
        if self.whole:
            return length
        return min(self.window - 1 + chunk, length) if self.window else 0

    def block_bytes(self, rows: int, chunk: int, length: int, db: int, built: bool = False) -> int:
        """Bytes of the widest additive block of ``rows`` x ``chunk`` queries in rows of ``length`` positions, in
        ``db``-byte elements; ``built``: with the bool block it is built from (one byte an element) beside it."""
        keys = self.keys(chunk, length)
        aligned = -(-keys // MASK_ALIGN) * MASK_ALIGN
        return rows * chunk * (aligned * db + (keys if built else 0))

    def every_block_bytes(self, rows: int, chunk: int, length: int, db: int) -> int:
        """Bytes of every chunk's additive block, in rows of ``length`` positions in chunks of ``chunk``: what a layer
        that keeps its activations from the forward holds of them until its backward. Chunk ``i`` (from 1) attends to
        ``i x chunk`` keys, or a window's ``window - 1 + chunk`` at most; the last to every key it may."""
        if not self.whole and not self.window:
            return 0
        full = -(-length // chunk) - 1  # the chunks before the last
        widest = self.keys(chunk, 1 << 62)  # (a window's span, without the row's end)
        growing = min(full, widest // chunk)  # the chunks whose keys are every earlier position
        keys = chunk * growing * (growing + 1) // 2 + (full - growing) * widest
        aligned = keys + full * (MASK_ALIGN - 1)  # (each block's rows aligned: at most this much more)
        return rows * chunk * (aligned + self.keys(chunk, length) + MASK_ALIGN - 1) * db


NO_MASKS = MaskBlocks()  # every chunk plainly causal: no block
