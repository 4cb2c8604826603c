"""The random state of a chunk, kept from the forward and restored for each recompute of it (as
``torch.utils.checkpoint`` keeps a checkpointed region's), so dropout, sampled routing and jitter draw the same numbers
every time the chunk runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils import checkpoint


class RngState:
    """The CPU generator's state and that of the devices of ``x`` (as ``torch.utils.checkpoint`` captures them),
    taken before a chunk runs."""

    def __init__(self, x: torch.Tensor):
        self.device_type = checkpoint._infer_device_type(x)
        self.cpu = torch.get_rng_state()
        self.devices, self.states = checkpoint.get_device_states(x)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        checkpoint.set_device_states(self.devices, self.states, device_type=self.device_type)


@contextlib.contextmanager
def rng_fork(x: torch.Tensor) -> Iterator[None]:
    """Leave the global random state as it was, whatever the recompute draws (like ``torch.utils.checkpoint``)."""
    devices, _ = checkpoint.get_device_states(x)
    with torch.random.fork_rng(devices=devices, device_type=checkpoint._infer_device_type(x)):
        yield
