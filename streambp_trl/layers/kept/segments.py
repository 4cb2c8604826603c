"""Segments of stream layers: only the first of every ``k`` consecutive layers keeps its input (``keep_every=k``).

A streamed decoder call groups its stream layers into segments of up to ``k`` consecutive layers, each layer's input
being the previous one's output (a layer whose input is anything else, or is watched by a hook or kept as a hidden
state, starts a new segment). The segment's first layer keeps its input as any stream layer does: on the device, in
pinned host memory with ``offload_checkpoints``, or as the token ids when it is the input embedding's output
(:mod:`.rebuild`). The other layers keep nothing. In backward the segment's last layer, whose backward runs first,
gets the first layer's input back and runs the segment's layers but the last forward again, under no grad and chunk
by chunk, each chunk with the random state its forward drew (:mod:`..rng`): every layer's input comes back
bit-identical to the forward's, so the gradient is exactly the one of ``keep_every=1``. Each layer's backward then
takes its own input and writes its input gradient over it.

Memory: an L-layer model keeps ceil(L / k) inputs (the host memory of ``offload_checkpoints`` divided by ~k), and a
segment's backward holds its k inputs on the device. Time: one more chunked forward of k - 1 layers out of every k.
The layers of a segment run in another layer's backward, so their parameters must be whole there: ZeRO-3 partitions
and FSDP shards are refused (:func:`~.sharding.check_segmentable`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..rng import rng_fork


class Segment:
    """Up to ``size`` consecutive stream layer calls with their forwards' records (held weakly: their autograd nodes
    own them), the first one's
    input (what :meth:`keep_first_input` was given) and, in backward, every call's rebuilt input. The decoder call
    in progress holds the segment its last stream layer joined (:class:`~.decoder_call.DecoderCall`)."""

    def __init__(self, size: int):
        self.size = size
        self.calls: list[weakref.ref] = []
        self.first_input: object = None  # the first call's kept input: a tuple (x,) or an offload host copy
        self.inputs: list[torch.Tensor | None] | None = None
        self.output_version: int | None = None  # the last call's output, as it left the layer; None once consumed
        self._output: Callable[[], torch.Tensor | None] = _dead

    def continued_by(self, x: torch.Tensor) -> bool:
        """Whether a layer with input ``x`` may join: ``x`` is the last call's output, unchanged since (its version:
        nothing wrote into it in place, e.g. a forward hook), the segment has room and no other layer joined from
        it already."""
        if len(self.calls) >= self.size or self.output_version != x._version:
            return False
        return self.calls[-1]() is not None and x is self._output()

    @property
    def joined(self) -> int:
        """How many calls have joined: the position of the next one."""
        return len(self.calls)

    def join(self, recorded: object, position: int) -> int:
        """Add ``recorded`` (a layer call and its forward's record) at ``position``, the :attr:`joined` the call was
        built with; returns that position."""
        if position != len(self.calls):
            raise RuntimeError(f"StreamBP: a segment layer joined at {position}, not at {len(self.calls)}.")
        self.calls.append(weakref.ref(recorded))
        self.output_version, self._output = None, _dead
        return position

    def left(self, y: torch.Tensor) -> None:
        """The last call left ``y``, which may be the next layer's input in this segment."""
        self.output_version, self._output = y._version, weakref.ref(y)

    def keep_first_input(self, kept: object) -> None:
        self.first_input = kept

    def input(self, position: int, load_first: Callable[[object], torch.Tensor]) -> torch.Tensor:
        """Call ``position``'s input, rebuilding every call's on the first request (``load_first(first_input)``
        gives the first one's); each is handed out once (a second backward is refused before it asks again: see
        :func:`~streambp_trl.layers.call.guards.check_backward`). The replayed layers' parameters and arguments and the
        kept input must be as their forwards left them (each call's ``versions``)."""
        if self.inputs is None:
            calls = [_alive(ref) for ref in self.calls]
            for recorded in calls:
                recorded.record.versions.check()
            x = load_first(self.first_input)
            self.first_input = None
            inputs = [x]
            with rng_fork(x):
                for recorded in calls[:-1]:
                    inputs.append(recorded.replay(inputs[-1]))
            self.inputs = inputs
        x, self.inputs[position] = self.inputs[position], None
        return x


def _dead() -> None:
    return None


def _alive(ref: weakref.ref) -> object:
    call = ref()
    if call is None:
        raise RuntimeError("StreamBP: a segment layer's graph was freed before the segment's backward.")
    return call
