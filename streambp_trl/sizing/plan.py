"""One plan per streamed call shape: the chunk, which layer inputs are kept, whether they wait in host memory, and
whether the layers keep their keys/values from the forward.

For a call on ``n`` tokens the planner weighs every combination the options leave open (a fixed chunk, ``keep_every``
or ``offload_checkpoints`` set by the user is kept as it is) and takes the one with the least predicted time among
those whose predicted peak (:func:`.memory_model.estimate_activation_bytes`) fits the device room less a margin for
the allocator's fragmentation, and whose pinned host memory fits the host. Where none fits it says so with the
longest length each way of running would allow (:func:`longest_lengths`).

The time model, per token of a step, relative to one that keeps every layer input on the device in one chunk:

* a chunk of ``c`` tokens costs ``1 + CHUNK_OVERHEAD_TOKENS / c``: each chunk's backward adds the layer's parameter
  gradients into their sums, a pass over the layer's weights bound by memory bandwidth, which on an H100/H200 (about
  200 FLOPs per byte) costs as much as the matmuls of a couple of hundred tokens, plus the chunk's kernel launches;
* a rebuilt layer input costs one more layer forward, ``REBUILD_COST`` of a layer's step (a streamed layer step is
  a forward, a recompute and a backward of twice the FLOPs: 2 + 2 + 4, of which the forward is a quarter);
* offload multiplies the step by ``OFFLOAD_COST``, the ratio measured on an H200 at 16,384 tokens in chunks of 4096
  (``benchmarks/gpu_nvidia_h200.md``: 1.049), where the copies hide least behind compute (at 65,536 tokens in chunks
  of 16384 it was 1.001: ``benchmarks/gpu_nvidia_h200_speed.md``);
* keys/values captured in the forward (``kv_mode="capture"``) save the backward's key/value collection pass,
  ``COLLECT_COST`` of the step: 0.160 s of 3.20 s on an H200 at 16,384 tokens (Qwen3-8B shapes,
  ``benchmarks/gpu_nvidia_h200_profile.md``); timed against recompute at the same chunk of 16384 it saved 4.1%, 3.5%
  and 2.5% of the step at 16k, 32k and 64k tokens (``benchmarks/gpu_nvidia_h200_speed.md``). A hybrid's
  state-carrying layers collect their chunk carries by a whole no-grad chunked forward, which capture saves too: the
  model counts them at the attention's saving, the least. The plan opens capture without offload (whose copies it
  has not timed with capture), or keeps the user's ``kv_mode``; the memory model counts what capture keeps for every
  kind of layer (:func:`.memory_model.captured_bytes`), with offload too;
* a layer that keeps its activations from the forward (the top ``keep_activations``, :mod:`streambp_trl.layers.call.
  kept`) runs no recompute, ``REBUILD_COST`` of a layer's step, and no key/value pass: the plan keeps the most layers
  whose predicted peak fits, where every layer input is kept (:meth:`Planner.most_kept`), so room a length does not
  need goes to recomputing less.
"""

from __future__ import annotations

import dataclasses

from ..logits.forms import HEAD_FORMS, HeadForm
from . import memory_model as mm
from .choices import NO_MASKS, KVMode, MaskBlocks, PlanChoices, StepPlan, Trained
from .layout import Layout
from .lengths import longest_fitting
from .model_shape import ModelShape
from .units import GiB

CHUNK_OVERHEAD_TOKENS = 256
REBUILD_COST = 0.25
OFFLOAD_COST = 1.05
COLLECT_COST = 0.05
# kept free below a device's room for the allocator's fragmentation: a real H200 capped at 78 GiB failed to allocate
# with 77.58 GiB allocated (0.42 GiB lost); at most 1/64 of the room (a small budget keeps a small margin)
MARGIN = GiB
CONFIGURED = "as configured"  # Planner.longest's name of the way the user's fixed choices run


def margin(room: int) -> int:
    """Bytes kept free below a device room of ``room`` bytes: :data:`MARGIN`, at most a 64th of the room."""
    return min(MARGIN, max(room, 0) // 64)


def attention_share(shape: ModelShape, seq_len: int) -> float:
    """The share of a softmax-attention layer's streamed step, on sequences of ``seq_len`` tokens, that is its
    recompute's attention forward: per token, the attention's ``2 x 2 x q x seq_len / 2`` FLOPs (scores and weighted
    values over half the sequence on average, causal) against a step of four forwards (forward, recompute, a backward
    of twice the FLOPs), each of the layer's ``2 x params`` matmul FLOPs and the attention's; times the share of the
    layers that are softmax attention."""
    q = shape.heads * shape.head_dim
    attention = 2 * q * seq_len
    layer = 4 * (2 * shape.layer_params + attention)
    return attention / layer * len(shape.plain_attention_layers) / max(shape.layers, 1)


def predicted_time(plan: StepPlan, layers: int, attention: float = 0.0) -> float:
    """The relative time of a step run as ``plan`` says, for ``layers`` layers (see the module docstring);
    ``attention``: the share of the step a recompute's attention forward takes (:func:`attention_share`), which the
    layers that recompute save where they keep their attention outputs."""
    layers = max(layers, 1)
    kept = min(plan.keep_activations, layers)
    rebuilt = plan.layout.rebuilt(layers) / layers
    saved = attention * (layers - kept) / layers if plan.keep_attention else 0.0
    time = (1 + CHUNK_OVERHEAD_TOKENS / plan.chunk) * (1 + REBUILD_COST * (rebuilt - kept / layers) - saved)
    time *= OFFLOAD_COST if plan.offload else 1.0
    uncollected = 1.0 if plan.kv_mode == KVMode.CAPTURE else kept / layers
    return time * (1 - COLLECT_COST * uncollected)


def layouts(layers: int, keep_every: int | None, rebuildable: bool) -> list[Layout]:
    """The layouts a plan may take: the user's ``keep_every`` when set; else every input kept, then (where inputs can
    be rebuilt) each number of dropped inputs below the top layer and each ``keep_every`` from 2 to ``layers``."""
    if keep_every is not None:
        return [Layout(every=keep_every)]
    if not rebuildable:
        return [Layout()]
    drops = [Layout(drop=d) for d in range(1, Layout.drops(layers) + 1)]
    return [Layout(), *drops, *(Layout(every=k) for k in range(2, layers + 1))]


@dataclasses.dataclass(frozen=True)
class Planner:
    """What the plans of one model are chosen from: its ``shape``, what is ``trained`` (the memory model's
    :class:`~.choices.Trained`) and the user's ``choices`` (each ``None``: chosen by the plan); of the calls planned,
    how many ranks split their rows and the attention mask blocks they build (``masks``)."""

    shape: ModelShape
    trained: Trained = Trained()
    choices: PlanChoices = PlanChoices()
    ranks: int = 1  # a call's rows are one rank's share of rows split across this many (its store spans them all)
    masks: MaskBlocks = NO_MASKS

    def estimate(
        self, tokens: int, plan: StepPlan, head_form: HeadForm = HeadForm.TWO_NODE, rows: int = 1
    ) -> tuple[int, int]:
        """``(device activation bytes, pinned host bytes)`` of a step on ``tokens`` tokens (``rows`` x length) run as
        ``plan`` says (the memory model), with what capturing keys/values keeps from the forward
        (:func:`.memory_model.captured_bytes`) on the device and, with offload, on the host; the LM head's gradient
        in ``head_form``."""
        activations = mm.estimate_activation_bytes(
            self.shape, tokens, plan, self.trained, head_form=head_form, ranks=self.ranks, rows=rows, masks=self.masks
        )
        return activations, mm.estimate_host_bytes(self.shape, plan, tokens, self.trained.db, rows)

    def choices_open(self, seq_len: int, rebuildable: bool, can_offload: bool) -> tuple[list, list, list[bool]]:
        """The chunks, layouts and offload settings open to a call of ``seq_len`` tokens per sequence (``rebuildable``:
        its layer inputs may be rebuilt; ``can_offload``: offload saves device memory, i.e. not on the CPU)."""
        chunk, offload = self.choices.chunk, self.choices.offload
        chunks = [chunk] if chunk is not None else [c for c in mm.CHUNKS if c <= max(seq_len, mm.CHUNKS[0])]
        offloads = [offload] if offload is not None else [False, True] if can_offload else [False]
        return chunks, layouts(self.shape.layers, self.choices.keep_every, rebuildable), offloads

    def kv_modes(self, offload: bool, layout: Layout) -> list[KVMode]:
        """How keys/values may be had, for a plan that offloads or not and keeps the layer inputs ``layout`` says:
        the user's ``kv_mode`` where fixed; else recomputed, or captured where there is no offload and every layer
        input is kept as well. A rebuilt input costs a layer forward, as much as the key/value pass capture saves:
        trading one for the other gains nothing and holds more."""
        if self.choices.kv_mode is not None:
            return [self.choices.kv_mode]
        open_ = not offload and not layout.rebuilt(self.shape.layers)
        return [KVMode.RECOMPUTE, KVMode.CAPTURE] if open_ else [KVMode.RECOMPUTE]

    def attention_modes(self, offload: bool, layout: Layout) -> list[bool]:
        """Whether the layers that recompute may keep their attention outputs: the user's ``keep_attention`` where
        fixed; else either, where the model has softmax-attention layers, nothing is offloaded and every layer input
        is kept (as :meth:`kv_modes` opens capture); not otherwise."""
        if self.choices.keep_attention is not None:
            return [self.choices.keep_attention]
        open_ = bool(self.shape.plain_attention_layers) and not offload and not layout.rebuilt(self.shape.layers)
        return [False, True] if open_ else [False]

    def keeps_open(self, layout: Layout, offload: bool, rebuildable: bool) -> list[int]:
        """How many top layers may keep their activations from the forward: the user's ``keep_activations`` where
        fixed; else any number, where every layer input is kept on the device and layers may keep more than their
        input (``rebuildable``: weights whole, a call with grad), none otherwise."""
        if self.choices.keep_activations is not None:
            return [self.choices.keep_activations]
        # (a split sequence's layers recompute: their returned key/value gradients' pass reads the chunks again)
        open_ = rebuildable and layout == Layout() and not offload and self.ranks == 1
        return list(range(self.shape.layers + 1)) if open_ else [0]

    def most_kept(self, rows: int, seq_len: int, plan: StepPlan, limit: int, rebuildable: bool) -> StepPlan:
        """``plan`` with the most top layers keeping their activations open (:meth:`keeps_open`) whose predicted
        activations fit ``limit`` (the fewest open where none does): each kept layer saves its recompute, so the
        most that fit is the fastest. The peak grows with every layer kept, so the count is bisected."""
        open_ = self.keeps_open(plan.layout, plan.offload, rebuildable)
        low, high = 0, len(open_) - 1
        while low < high:
            mid = (low + high + 1) // 2
            kept = dataclasses.replace(plan, keep_activations=open_[mid])
            fits = self.estimate(rows * seq_len, kept, rows=rows)[0] <= limit
            low, high = (mid, high) if fits else (low, mid - 1)
        return dataclasses.replace(plan, keep_activations=open_[low])

    def best(
        self, rows: int, seq_len: int, limit: int, host_room: int | None, rebuildable: bool, can_offload: bool
    ) -> StepPlan | None:
        """The fastest plan for ``rows`` x ``seq_len`` tokens whose device activations fit ``limit`` and whose pinned
        host bytes fit ``host_room`` (``None``: not known, so no offload is taken); ``None`` when none fits. Ties go to
        the smaller peak."""
        chunks, layout_choices, offloads = self.choices_open(seq_len, rebuildable, can_offload)
        best, key = None, None
        share = attention_share(self.shape, seq_len)
        for offload in offloads:
            for layout in layout_choices:
                combinations = [
                    (chunk, kv_mode, attention)
                    for chunk in chunks
                    for kv_mode in self.kv_modes(offload, layout)
                    for attention in self.attention_modes(offload, layout)
                ]
                for chunk, kv_mode, attention in combinations:
                    plan = StepPlan(chunk, layout, offload, kv_mode=kv_mode, keep_attention=attention)
                    plan = self.most_kept(rows, seq_len, plan, limit, rebuildable)
                    activations, host = self.estimate(rows * seq_len, plan, rows=rows)
                    if activations > limit or (offload and (host_room is None or host > host_room)):
                        continue
                    time = predicted_time(plan, self.shape.layers, share)
                    if key is None or (time, activations) < key:
                        best = dataclasses.replace(plan, activations=activations, host=host, time=time)
                        key = (time, activations)
        if best is None:
            return None
        fitting = (f for f in HEAD_FORMS if self.estimate(rows * seq_len, best, f, rows)[0] <= limit)
        return dataclasses.replace(best, head_forms=tuple(fitting))

    def longest(
        self, rows: int, limit: int, host_room: int | None, rebuildable: bool, can_offload: bool, step: int = 1024
    ) -> dict[str, int]:
        """The longest length per sequence that fits ``limit`` (and ``host_room``) at the smallest chunk open (a
        multiple of ``step``, or below ``step`` the longest at all), for each way of running: as configured (every
        input kept, or the user's layout; the user's offload, else none; keys/values captured where the user's
        ``kv_mode`` says so), with the layout that reaches furthest, with offload, and with both; and, where the user
        captures keys/values, with them recomputed. Keyed by what a user would set (a layout no option sets, some
        inputs rebuilt below the top layer, is the plan's with ``stream_keep_every`` unset); a way that is not open,
        fits no length, or reaches no further than one before it is left out (so none, where nothing fits)."""
        chunks, layout_choices, offloads = self.choices_open(1 << 30, rebuildable, can_offload)
        layers, chunk, configured = self.shape.layers, min(chunks), self.choices.kv_mode or KVMode.RECOMPUTE
        # (the plan keeps activations and attention outputs only with room to spare)
        kept, attention = self.choices.keep_activations or 0, bool(self.choices.keep_attention)

        def longest(layout: Layout, offload: bool, kv_mode: KVMode = configured) -> int:
            def fits(tokens: int) -> bool:
                plan = StepPlan(
                    chunk, layout, offload, kv_mode=kv_mode, keep_activations=kept, keep_attention=attention
                )
                activations, host = self.estimate(rows * tokens, plan, rows=rows)
                return activations <= limit and (not offload or (host_room is not None and host <= host_room))

            return longest_fitting(fits, step) or longest_fitting(fits, step=1)

        def name(layout: Layout, offload: bool) -> str:
            kept = f"stream_keep_every={layout.every}"
            if layout.every == 1:
                kept = f"stream_keep_every unset (the plan's {layout.describe(layers)})"
            return " + ".join([kept] * bool(layout.rebuilt(layers)) + ["offload_checkpoints=True"] * offload)

        ways = {CONFIGURED: longest(layout_choices[0], offloads[0])}
        for offload in sorted(set(offloads)):
            reach = {layout: longest(layout, offload) for layout in layout_choices}
            best = max(reach, key=lambda layout: (reach[layout], -layout.rebuilt(layers)))
            if reach[best] > max(ways.values()):
                ways[name(best, offload)] = reach[best]
        if configured == KVMode.CAPTURE:
            recomputed = longest(layout_choices[0], offloads[0], KVMode.RECOMPUTE)
            if recomputed > max(ways.values()):
                ways["stream_kv_mode=recompute"] = recomputed
        return {way: tokens for way, tokens in ways.items() if tokens}
