"""Checkpoint offload: each streamed layer's saved input (and kept keys/values) waits in pinned host memory.

With ``enable_streambp(..., offload_checkpoints=True)`` a layer's forward hands its saved tensors to
:meth:`CheckpointOffload.save`, which copies them to pinned host memory on a side stream (after the layer's work on
the current stream, without blocking the host) and lets their device memory go once the copy is done
(``record_stream``). A layer's backward takes them back with :meth:`CheckpointOffload.load`, which waits (on the
device, through an event: no host synchronisation) for a copy that is normally already under way: each load starts
the host-to-device copy of the tensors saved just before (the previous layer's input), so it overlaps the current
layer's backward. Device memory then holds at most two layers' inputs instead of all of them.

Tensors on the CPU are saved as they are (an exact no-op). Where the device's backend cannot create a second stream,
the copies are queued on the current stream (the same order and the same memory, without the overlap). The values
are copied, never changed: gradients are bit-identical with and without offload.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


class _HostCopy:
    """One layer's saved tensors, in pinned host memory until :meth:`fetch`."""

    def __init__(
        self, tensors: tuple[torch.Tensor, ...], side: torch.Stream | None, previous: _HostCopy | None, pin: bool
    ):
        self.device = tensors[0].device
        # saved just before this one, so the next one backward needs (held weakly: its layer's context owns it)
        self.previous = weakref.ref(previous) if previous is not None else None
        if side is not None:
            side.wait_stream(torch.accelerator.current_stream(self.device))  # the tensors are complete
        with side if side is not None else contextlib.nullcontext():
            self.host = []
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                host.copy_(t, non_blocking=True)
                self.host.append(host)
        if side is not None:
            for t in tensors:
                t.record_stream(side)  # their memory is not reused before the copy has read it
        self.back: list[torch.Tensor] | None = None
        self.event: torch.Event | None = None

    def prefetch(self, side: torch.Stream | None) -> None:
        """Start copying back to the device (allocated on the current stream; copied on ``side``)."""
        if self.back is not None or self.host is None:
            return
        self.back = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in self.host]
        if side is not None:  # earlier users of the blocks just allocated (on the current stream) are done
            side.wait_stream(torch.accelerator.current_stream(self.device))
        with side if side is not None else contextlib.nullcontext():
            for back, host in zip(self.back, self.host, strict=True):
                back.copy_(host, non_blocking=True)
        if side is not None:
            self.event = torch.Event(device=self.device)
            self.event.record(side)

    def fetch(self, side: torch.Stream | None) -> tuple[torch.Tensor, ...]:
        """The tensors back on the device, once (a second backward is refused before it asks again: see
        :func:`~streambp_trl.layers.call.guards.check_backward`)."""
        self.prefetch(side)
        if self.event is not None:
            torch.accelerator.current_stream(self.device).wait_event(self.event)
        back = tuple(self.back)
        self.back = self.host = self.event = None
        return back


class CheckpointOffload:
    """Moves the saved tensors of streamed layers to pinned host memory and back, one layer ahead; kept on the model
    (in its stream settings), one per model."""

    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory
        self._sides: dict[torch.device, torch.Stream | None] = {}
        self._last: weakref.ref | None = None

    def __deepcopy__(self, memo) -> CheckpointOffload:
        return type(self)(self.pin_memory)  # streams and copies in flight belong to the original

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is moved to the host: tensors on an accelerator are, CPU tensors are kept as they are."""
        return t.device.type != "cpu"

    def _side(self, device: torch.device) -> torch.Stream | None:
        if device not in self._sides and device.type == "cpu":
            self._sides[device] = None  # no streams on the CPU: copies run in order
        if device not in self._sides:
            try:
                self._sides[device] = torch.Stream(device=device)
            except RuntimeError:  # a backend without a second stream: copies go on the current one
                self._sides[device] = None
        return self._sides[device]

    def save(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | _HostCopy:
        """What the layer's autograd context keeps: the tensors themselves on the CPU, else a host copy."""
        if not tensors or not self.offloads(tensors[0]):
            return tensors
        previous = self._last() if self._last is not None else None
        kept = _HostCopy(tensors, self._side(tensors[0].device), previous, self.pin_memory)
        self._last = weakref.ref(kept)
        return kept

    def load(self, kept: tuple[torch.Tensor, ...] | _HostCopy) -> tuple[torch.Tensor, ...]:
        """The saved tensors back on their device; starts bringing back the ones saved just before."""
        if not isinstance(kept, _HostCopy):
            return kept
        side = self._side(kept.device)
        tensors = kept.fetch(side)
        previous = kept.previous() if kept.previous is not None else None
        if previous is not None:
            previous.prefetch(side)
        return tensors
