"""Plans per call shape: ``stream_chunk_size="auto"``, and ``keep_every`` / ``offload_checkpoints`` left at ``None``.

For a call on ``rows`` sequences of ``seq_len`` tokens, :class:`AutoChunks` asks the planner (:mod:`.plan`) for the
fastest plan (chunk, kept layer inputs, offload; the user's fixed choices kept) whose estimated activations
(:func:`memory_model.estimate_activation_bytes`) fit the room less a fragmentation margin:

* a given ``memory_budget`` (bytes of the whole device the step may use): weights and parameter gradients, as the
  model holds them, plus the activations must fit in it;
* otherwise, on a CUDA device, the memory still free when the call starts (free on the device plus what PyTorch's
  allocator holds unused, within the process's share);
* otherwise, on the CPU, the host memory available (``psutil``) (no offload there: it would keep the tensors where
  they are).

Where no trained parameter holds a gradient when the call starts (the trainers free them after each optimizer step,
so every micro-step with ``gradient_accumulation_steps=1``, and the first of more), the estimate counts each gradient
from the moment the backward forms it (``pending_grads``: the top layer's backward, the usual peak, holds the head's
and its own, not every layer's); where some do, the missing ones are counted as held through the step. The two are
planned apart (a micro-step after the first may take another plan). On a CUDA device what is allocated when the
call starts counts too (with a budget, where it is more than the weights and gradients: optimizer state, a reference
model's buffers), and a call that finds another whole number of GiB allocated is planned again. Whatever that
granularity, a plan kept for a shape is checked against the room of each call before it is reused, and planned again
where its predicted activations no longer fit (a small budget's margin is far below a GiB).
* without any memory figure (another device type, or a model whose config lacks the usual size fields): the user's
  choices, else an eighth of the sequence clamped to [512, 4096] (:func:`rule_of_thumb`), every input kept.

The optimizer's state is counted from the first step: a trainer names its optimizer
(:meth:`AutoChunks.count_optimizer`, ``TrainingArguments.optim``), and until the optimizer has allocated the state
(at its first ``step()``, after the first backward) each plan reserves what it will allocate
(:func:`.optimizers.state_bytes`, the rule the memory model and ``max-len`` count it by: trained parameters x bytes
per element of their dtype); once allocated, the state is counted at its tensors' bytes, which a CUDA device's
allocation already holds (``held`` is the larger of the two counts, never their sum). So the first step runs the plan
every later step runs, and a length that fits only before the state exists is refused before the first step rather
than running out of memory at the second.

The room of a call is :func:`.room.room`, and offload's pinned host memory must fit :func:`.room.host_room`. Where
nothing fits, a call with grad raises before its step (naming the longest length each way of running allows) when the
figure is a budget or a CUDA device's free memory; otherwise (no grad, or the CPU without a budget) the smallest chunk
is taken with a warning. A decision is kept per shape, so every step of the same shape streams the same way, and
logged once. The LM head's form is chosen by the same room (:func:`.room.head_form`).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn
from transformers.utils import logging

from .. import families
from . import memory_model as mm
from . import optimizers
from .choices import NO_MASKS, KVMode, MaskBlocks, PlanChoices, StepPlan, Trained
from .layout import Layout
from .plan import Planner, margin
from .room import Room, allocated_bytes, fits, grads_pending, host_room, offload_saves, room
from .setup import whole_numel
from .units import GiB, size_text

logger = logging.get_logger(__name__)

AUTO = "auto"
# a call that finds another multiple of this allocated on its CUDA device than the call its plan was made for is
# planned again (the optimizer's state appears at the first optimizer step)
REPLAN_STEP = GiB


class NoPlanFits(ValueError):
    """A call with grad that fits no way of running within its memory (a budget, or a CUDA device's free memory):
    one line naming the shape, the memory and the longest length each way of running allows. Raised before the
    call's step; the CLI prints it as its one-line error."""


def _gone() -> None:
    return None


class AutoChunks:
    """The plan policy of one model (kept in its stream settings): a :class:`~.plan.StepPlan` per call shape.

    ``choices``: the user's (:class:`~.choices.PlanChoices`), kept as they are; each ``None`` is chosen per call
    (a ``budget`` of ``None``: what is free when a call starts)."""

    def __init__(self, model: nn.Module, choices: PlanChoices):
        self._model = weakref.ref(model)
        self.choices = choices
        self.optim: str | None = None  # the optimizer whose state the plans count (count_optimizer)
        self._owner = _gone
        self._chosen: dict[tuple, StepPlan] = {}
        self._latest: dict[tuple[int, int], StepPlan] = {}
        self.last: int | None = None  # the latest chunk chosen (what the trainers log)
        self.last_plan: StepPlan | None = None
        self.last_shape: tuple[int, int] | None = None  # (rows, seq_len) of the latest plan's call
        self.last_peak: int | None = None  # its predicted device peak (held + activations), where a figure is known
        # with a fixed chunk only the kept layer inputs and offload are planned: what the memory model cannot size is
        # said at info level (every input is then kept, nothing offloaded, as without a plan); with every choice fixed
        # the plan only checks the user's memory_budget, and what it cannot check is said at warning level
        chunk = choices.chunk
        checked_only = chunk is not None and choices.keep_every is not None and choices.offload is not None
        say = logger.info if chunk is not None and not checked_only else logger.warning
        name = type(model).__name__
        try:
            self.shape: mm.ModelShape | None = mm.ModelShape.from_model(model)
            Planner(self.shape).estimate(1024, StepPlan(512))  # a shape the memory model can size
        except (AttributeError, TypeError, ArithmeticError) as error:  # a config without the usual size fields
            self.shape = None
            if chunk is None:
                say(
                    f'"auto" chunk sizes cannot size {name} from its config ({error}), so a stream chunk takes an '
                    "eighth of each sequence within [512, 4096] whatever the memory: pass stream_chunk_size (tokens) "
                    "to choose it yourself."
                )
            elif checked_only:
                say(
                    f"StreamBP cannot size {name} from its config ({error}), so memory_budget is not checked: each "
                    "call runs as configured whatever memory it takes."
                )
            else:
                say(
                    f"StreamBP's per-call plan cannot size {name} from its config ({error}), so every layer input is "
                    "kept on the device unless stream_keep_every or offload_checkpoints is set."
                )
            return
        config = model.config.get_text_config() if hasattr(model, "config") else None
        uncounted = families.uncounted(config)
        if uncounted is None:
            return
        if chunk is None:
            say(
                f'"auto" chunk sizes size {name} without {uncounted}, which the memory model does not count, so its '
                "chunks may take more memory than there is: pass stream_chunk_size and logits_chunk_size (tokens) to "
                "choose them yourself."
            )
        elif checked_only:
            say(
                f"StreamBP checks memory_budget for {name} without {uncounted}, which the memory model does not "
                "count, so a call may take more memory than the budget: leave room for them in memory_budget."
            )
        else:
            say(
                f"StreamBP's per-call plan sizes {name} without {uncounted}, which the memory model does not count: "
                "set stream_keep_every and offload_checkpoints to choose them yourself."
            )

    def __deepcopy__(self, memo) -> AutoChunks:
        copy = AutoChunks.__new__(AutoChunks)
        # (the copy's plans count no trainer's optimizer: it is not that optimizer's model)
        copy.__dict__.update(
            self.__dict__, _chosen=dict(self._chosen), _latest=dict(self._latest), optim=None, _owner=_gone
        )
        model = self._model()
        copy._model = weakref.ref(memo.get(id(model), model)) if model is not None else self._model
        return copy

    def __getstate__(self) -> dict:
        """Pickled (``torch.save`` of a streaming model) with the model itself, which pickle stores once; without the
        optimizer's owner (a trainer: :meth:`count_optimizer`), whose state a loaded copy no longer sees."""
        return {**self.__dict__, "_model": self._model(), "_owner": None}

    def __setstate__(self, state: dict) -> None:
        model = state.pop("_model")
        state.pop("_owner", None)
        self.__dict__.update(state, _model=weakref.ref(model) if model is not None else _gone, _owner=_gone)

    def count_optimizer(self, optim: object, owner: object | None = None) -> None:
        """Count the state of the optimizer ``optim`` (``TrainingArguments.optim``, :data:`.optimizers.OPTIMIZERS`)
        in every plan from the first: ``owner`` (kept by weak reference) is what holds the optimizer once built as
        its ``optimizer`` attribute (a trainer), whose allocated state is counted as it is."""
        self.optim = optimizers.canonical(optim)
        self._owner = weakref.ref(owner) if owner is not None else _gone

    def optimizer_state(self) -> tuple[int, int]:
        """``(all, pending)``: device bytes of the counted optimizer's state, and of those the bytes it has not
        allocated yet (:func:`.optimizers.state_bytes`); ``(0, 0)`` when no optimizer is counted."""
        model = self._model()
        if self.optim is None or model is None:
            return 0, 0
        return optimizers.state_bytes(model.parameters(), self.optim, getattr(self._owner(), "optimizer", None))

    def choose(self, rows: int, seq_len: int, device: torch.device) -> int:
        """The chunk of the latest plan for (``rows``, ``seq_len``), planning one (with every layout open) if none."""
        plan = self._latest.get((rows, seq_len)) or self.plan(rows, seq_len, device)
        self.last = plan.chunk
        return plan.chunk

    def plan(
        self,
        rows: int,
        seq_len: int,
        device: torch.device,
        rebuildable: bool = True,
        ranks: int = 1,
        masks: MaskBlocks = NO_MASKS,
    ) -> StepPlan:
        """The plan of a call on ``rows`` sequences of ``seq_len`` tokens (``rebuildable``: its layer inputs may be
        rebuilt in backward; ``ranks``: they are one rank's share of rows split across that many, sized for the rank
        whose key/value store spans the whole rows; ``masks``: the attention mask blocks its layers build), chosen
        once per shape (and mask kind) and logged once (at warning level where it
        rebuilds or offloads inputs the user did not ask to, else at info level), and chosen again where its predicted
        activations no longer fit the room this call has (:func:`fits`). Raises where a call with grad fits nowhere
        within a known device figure (a budget, or a CUDA device's free memory)."""
        grad = torch.is_grad_enabled()
        model = self._model()
        pending = model is not None and grads_pending(list(model.parameters()))
        allocated = allocated_bytes(device)
        state = self.optimizer_state() if grad else (0, 0)  # (a call without grad: no optimizer step follows)
        key = (
            rows,
            seq_len,
            rebuildable,
            grad,
            device.type,
            pending,
            None if allocated is None else allocated // REPLAN_STEP,
            state[0] // REPLAN_STEP,
            state[1] > 0,
            ranks,
            masks,
        )
        figure = room(model, device, self.choices.budget, pending, allocated, state)
        plan = self._chosen.get(key)
        if plan is None or not fits(plan, figure):
            if len(self._chosen) > 256:
                self._chosen.clear()
                self._latest.clear()
            plan = self._chosen[key] = self._decide(
                rows, seq_len, device, rebuildable, grad, pending, figure, ranks, masks
            )
        self._latest[(rows, seq_len)] = self.last_plan = plan
        self.last, self.last_shape = plan.chunk, (rows, seq_len)
        self.last_peak = None if figure is None else figure[1] + plan.activations
        return plan

    def check(
        self,
        rows: int,
        seq_len: int,
        device: torch.device,
        rebuildable: bool = True,
        masks: MaskBlocks = NO_MASKS,
    ) -> None:
        """Raise :class:`NoPlanFits` where a training call (with grad, before the first optimizer step) on ``rows``
        sequences of ``seq_len`` tokens (its layers building the attention mask blocks ``masks``) would fit no way of
        running within the memory :meth:`plan` would give it; a check before training (a trainer's longest batch),
        which neither logs nor keeps a plan."""
        model = self._model()
        if model is None or self.shape is None:
            return
        pending = grads_pending(list(model.parameters()))
        figure = room(model, device, self.choices.budget, pending, allocated_bytes(device), self.optimizer_state())
        if figure is not None:
            self._decide(rows, seq_len, device, rebuildable, True, pending, figure, masks=masks, announce=False)

    def _decide(
        self,
        rows: int,
        seq_len: int,
        device: torch.device,
        rebuildable: bool,
        grad: bool,
        pending: bool,
        figure: Room | None,
        ranks: int = 1,
        masks: MaskBlocks = NO_MASKS,
        announce: bool = True,
    ) -> StepPlan:
        """The plan of a call within ``figure`` (:func:`room`; ``None``: no memory figure, the user's choices),
        logged where ``announce``."""
        model = self._model()
        if figure is None or self.shape is None or model is None:
            return self.choices.fixed(seq_len)
        room, held, total = figure
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_trained = head is not None and any(p.requires_grad for p in head.parameters())
        db = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 2)
        # adapters (LoRA: some parameters trained beside frozen ones), whose float32 products the forward holds; a
        # layer's trained parameters, on average (the memory model's lora_layer_params; ZeRO-3: whole elements)
        trained = [p.requires_grad for p in model.parameters()]
        adapters = any(trained) and not all(trained)
        elements = sum(whole_numel(p) for p in model.parameters() if p.requires_grad)
        layer_trained = elements // max(self.shape.layers, 1) if adapters else None
        n, layers, can_offload = rows * seq_len, self.shape.layers, offload_saves(device)
        # offload asked for on the CPU keeps the checkpoints where they are: sized as none, the plan keeps it as asked
        on_cpu = bool(self.choices.offload) and not can_offload
        choices = dataclasses.replace(self.choices, offload=False) if on_cpu else self.choices
        if not grad and choices.kv_mode is None:  # (a call without grad has no backward: nothing to keep for it)
            choices = dataclasses.replace(choices, kv_mode=KVMode.RECOMPUTE)
        trained = Trained(db, head_trained, adapters, layer_trained, pending)
        planner = Planner(self.shape, trained, choices, ranks, masks)
        rebuildable = rebuildable and grad
        limit = room - margin(total)
        host = host_room() if can_offload and self.choices.offload is not False else None
        plan = planner.best(rows, seq_len, limit, host, rebuildable, can_offload)
        if plan is not None:
            plan = dataclasses.replace(plan, offload=True) if on_cpu else plan
            if announce:
                rebuilt = plan.layout.rebuilt(layers) and self.choices.keep_every is None
                say = logger.warning if rebuilt or (plan.offload and not self.choices.offload) else logger.info
                share = f"this rank's share (of {ranks}) of the rows, " if ranks > 1 else ""
                say(
                    f"StreamBP plan for {share}{plan.describe(n, layers, held, room)} (less "
                    f"{size_text(margin(total))} kept for the allocator's fragmentation)."
                )
            return plan
        chunks, layout_choices, offloads = planner.choices_open(seq_len, rebuildable, can_offload)
        kv_mode = planner.kv_modes(False, Layout())[0]  # (the user's, else recomputed)
        kept, attention = self.choices.keep_activations or 0, bool(self.choices.keep_attention)
        smallest = StepPlan(
            chunks[0], layout_choices[0], offloads[0] or on_cpu, kv_mode=kv_mode, keep_activations=kept,
            keep_attention=attention,
        )  # fmt: skip
        if not grad or (self.choices.budget is None and device.type == "cpu"):
            logger.warning(
                f"StreamBP: no plan is predicted to fit {n:,} tokens in {size_text(room)}; running "
                f"{smallest.describe(n, layers)}, which may run out of memory."
            )
            return smallest
        longest = planner.longest(rows, limit, host, rebuildable, can_offload)
        where, more = ("memory_budget", "a larger memory_budget")
        if self.choices.budget is None:
            where, more = "the free device memory", "more free device memory"
        single = max(planner.longest(1, limit, host, rebuildable, can_offload).values(), default=0) if rows > 1 else 0
        fewer = (
            f" (one sequence per step, a per-device batch size of 1, fits up to {single:,} tokens)" if single else ""
        )
        fix = (
            "Longest lengths per sequence that would fit: "
            + "; ".join(f"{way}: {tokens:,}" for way, tokens in longest.items())
            + f". Shorten max_length, or set the option named, or give {more}{fewer}."
            if longest
            else f"No length per sequence fits in any way of running: give {more}{fewer}."
        )
        raise NoPlanFits(
            f"StreamBP: {rows} x {seq_len:,} tokens fit in no way of running within {where} ({size_text(room)} "
            f"for activations beside {size_text(held)} of weights, gradients and optimizer state, less a "
            f"{size_text(margin(total))} margin). {fix}"
        )
