"""The room a call has in memory, by one rule for the planner (when a call starts) and for the LM head's form (at the
head): within a given budget, what the weights, gradients and optimizer state leave; otherwise what the device has
free (a CUDA device's free memory plus what PyTorch's allocator holds unused, within the process's share; the CPU's
available host memory). Offload's pinned host memory has a rule of its own (:func:`host_room`).

:func:`head_form` chooses the form of the logit kernel's gradient for each call from the room at the head, by the
planner's one rule (:func:`room`, so a budget reaches the head on any device): the one that computes the logits
fewest times whose buffers fit, the least memory where no figure is known.
"""

from __future__ import annotations

from typing import NamedTuple

import psutil
import torch
from torch import nn

from ..logits.forms import HEAD_FORMS, HeadForm
from . import memory_model as mm
from .choices import StepPlan
from .plan import margin


class Room(NamedTuple):
    """The memory figure of a call: ``room``, bytes its activations may take; ``held``, what is held beside them (the
    weights, gradients and optimizer state, or what the device has allocated, when more); ``total``, the device's whole
    figure the fragmentation margin is taken of."""

    room: int
    held: int
    total: int


def room(
    model: nn.Module | None,
    device: torch.device,
    budget: int | None,
    pending: bool,
    allocated: int | None,
    state: tuple[int, int] = (0, 0),
) -> Room | None:
    """How much room a call on ``device`` has, the one rule of the planner (when a call starts) and the LM head's form
    (at the head): within ``budget`` (bytes of the whole device the step may use), what the weights, the gradients and
    the optimizer ``state`` (:meth:`AutoChunks.optimizer_state`: all, and not yet allocated) leave, or what the device
    has ``allocated`` and the state yet to be allocated, when more; without a budget, the memory free on the device
    (:func:`free_bytes`) less the gradients and state not yet allocated. ``pending``: the gradients are counted with
    the activations, as the backward forms them. ``None`` when no memory figure is known (no model, or no budget on a
    device type without a free-memory figure)."""
    if model is None:
        return None
    params = list(model.parameters())
    everything, unallocated = state
    held = sum(p.numel() * p.element_size() for p in params) + everything
    if not pending:
        held += sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    missing = (0 if pending else _missing_grad_bytes(params)) + unallocated
    held = max(held, (allocated or 0) + missing)
    if budget is not None:
        return Room(budget - held, held, budget)
    free = free_bytes(device)
    if free is None:
        return None
    return Room(free - missing, held, free + held - missing)


def fits(plan: StepPlan, figure: Room | None) -> bool:
    """Whether ``plan``'s predicted activations fit the room of ``figure`` (:func:`room`) less its fragmentation
    margin, as a plan chosen within it must; any plan fits where no figure is known, and one taken where nothing was
    predicted to fit (no grad: said at warning level) predicts nothing."""
    return figure is None or plan.activations <= figure[0] - margin(figure[2])


def offload_saves(device: torch.device) -> bool:
    """Whether checkpoint offload takes memory off ``device``: not on the CPU, where it keeps tensors as they are."""
    return device.type != "cpu"


def host_room() -> int:
    """Pinned host bytes a plan may take: three quarters of the host memory available (pinned pages cannot be
    swapped out; the rest is left to the data loader, the optimizer's host side and the system)."""
    return psutil.virtual_memory().available * 3 // 4


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes PyTorch has allocated on a CUDA ``device`` now (``None`` elsewhere, or without a CUDA runtime)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_allocated(device)
    return None


def free_bytes(device: torch.device) -> int | None:
    """Bytes new tensors may take on ``device`` now, or ``None`` where no figure is known (a device type other than
    CUDA and the CPU, or a CUDA device type without a CUDA runtime). On a CUDA device: the memory free on the device
    plus what PyTorch's allocator holds unused, within the process's share (``set_per_process_memory_fraction``); on
    the CPU the host memory available (``psutil``)."""
    if device.type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        room = free + torch.cuda.memory_reserved(device) - allocated
        return min(room, int(total * torch.cuda.get_per_process_memory_fraction(device)) - allocated)
    if device.type == "cpu":
        return psutil.virtual_memory().available
    return None


def grads_pending(params: list[nn.Parameter]) -> bool:
    """Whether the backward forms every parameter gradient: some parameter is trained and none holds a gradient."""
    trained = [p for p in params if p.requires_grad]
    return bool(trained) and all(p.grad is None for p in trained)


def _missing_grad_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the parameter gradients not allocated yet (the first backward of a run allocates them)."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)


def head_form(
    model: nn.Module,
    head: nn.Linear,
    n: int,
    logits_chunk: int,
    budget: int | None,
    device: torch.device,
    forms: tuple[HeadForm, ...] = HEAD_FORMS,
    state: tuple[int, int] = (0, 0),
    planned: tuple[HeadForm, ...] | None = None,
) -> HeadForm:
    """The form of the logit kernel's gradient for a call scoring ``n`` rows, among ``forms``: the one that
    recomputes least (eager, then fused, then two-node) whose buffers (:func:`memory_model.head_backward_bytes`) fit
    the call's room at the head less its fragmentation margin, by the planner's rule (:func:`room`, within
    ``budget`` where one is given, the optimizer ``state`` counted as the plan counts it).

    * On a CUDA device the forward's activations are allocated by then, so counted.
    * On the CPU with a budget, what the forward holds at the head is not measured (no allocation figure): the call's
      plan says which forms fit its room (``planned``: :attr:`~.choices.StepPlan.head_forms`, its predicted peak
      with each form). Without a budget, the host memory available counts what the forward holds.
    * On another device without an allocation figure: two-node.

    Two-node takes the least memory (no float32 (V, H) accumulator, the weight's gradient formed vocabulary tile by
    vocabulary tile); it is also taken where no form fits or no memory figure is known."""
    params = list(model.parameters())
    allocated = allocated_bytes(device)
    if device.type == "cpu" and budget is not None and planned is not None:
        return next((form for form in reversed(HEAD_FORMS) if form in forms and form in planned), HeadForm.TWO_NODE)
    figure = room(model, device, budget, grads_pending(params), allocated, state)
    if figure is None or (allocated is None and device.type != "cpu"):  # (what the forward holds is not known)
        return HeadForm.TWO_NODE
    vocab, hidden = head.out_features, head.in_features  # not the weight's shape: ZeRO-3 partitions it
    trained = any(p.requires_grad for p in head.parameters())
    db = head.weight.element_size()
    space = figure.room - margin(figure.total)
    for form in (form for form in reversed(HEAD_FORMS) if form in forms):
        if mm.head_backward_bytes(vocab, hidden, n, logits_chunk, db, head_trained=trained, form=form) <= space:
            return form
    return HeadForm.TWO_NODE
