"""The random state of a chunk, kept from the forward and restored for each recompute of it (as
``torch.utils.checkpoint`` keeps a checkpointed region's), so dropout, sampled routing and jitter draw the same numbers
every time the chunk runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils import checkpoint

_SPREAD = 0x9E3779B97F4A7C15  # (seeds of successive chunks far apart)


class RngState:
    """The CPU generator's state and that of the devices of ``x`` (as ``torch.utils.checkpoint`` captures them),
    taken before a chunk runs."""

    def __init__(self, x: torch.Tensor):
        self.device_type = checkpoint._infer_device_type(x)
        self.cpu = torch.get_rng_state()
        self.devices, self.states = checkpoint.get_device_states(x)

    @classmethod
    def drawn(cls, x: torch.Tensor, count: int, salt: int, place: int) -> list[RngState]:
        """``count`` independent states for chunks whose state must be known before any of them runs (a sequence
        split's collecting pass comes first): each is the generators (CPU and ``x``'s devices) seeded by a number
        read from the current CPU generator, the call's ``place`` (its engine's count of split layer calls, times
        ``count``: :class:`~.sequence_split.SequenceSplit`) and ``salt`` (the rank, so ranks seeded alike draw
        apart). The global state is left as it was: a split call draws from it what the same call on one process
        draws, so one process and a split group sample alike where nothing else draws (an online trainer's
        generation)."""
        with rng_fork(x):
            base = int(torch.randint(0, 2**62, ()))
            states = []
            for i in range(count):
                torch.manual_seed((base + salt + (place + i) * _SPREAD) % 2**63)
                states.append(cls(x))
        return states

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        checkpoint.set_device_states(self.devices, self.states, device_type=self.device_type)


@contextlib.contextmanager
def rng_fork(x: torch.Tensor) -> Iterator[None]:
    """Leave the global random state as it was, whatever the recompute draws (like ``torch.utils.checkpoint``)."""
    devices, _ = checkpoint.get_device_states(x)
    with torch.random.fork_rng(devices=devices, device_type=checkpoint._infer_device_type(x)):
        yield
