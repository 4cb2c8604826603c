"""Mixers whose multi-token call starts from a zero state, continued from the state a chunk receives.

Some recurrent mixers take a cached state only on their one-token decoding path: Mamba v1's selective scan
(:mod:`.mamba_scan`: Mamba, FalconMamba, Jamba, Zamba) and MiniMax's lightning attention (:mod:`.lightning`). Both
recurrences are linear in their state, so a chunk's result from its incoming state is the model's own result from
zero plus a term in that state alone, which the engine adds around the model's code for the chunk call
(:func:`continued`); the outgoing state the model records through the chunk cache gets its term likewise, and
autograd carries the incoming state's gradient back to the chunk before. The enable-time probe
(:func:`streambp_trl.engine.probe.check_streamed`) catches a mixer whose term is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import ModuleType

from torch import nn

from ..carry import ChunkCache
from .lightning import lightning_continued, lightning_modules
from .mamba_scan import scan_modules, scans_continued


@dataclasses.dataclass(frozen=True)
class Continued:
    """What of a layer starts from zero: the modeling modules whose Mamba v1 scan its mixers call, its lightning
    attention modules."""

    scans: tuple[ModuleType, ...] = ()
    lightning: tuple[nn.Module, ...] = ()

    @classmethod
    def of(cls, layer: nn.Module) -> Continued | None:
        found = cls(scan_modules(layer), lightning_modules(layer))
        return found if found.scans or found.lightning else None


@contextlib.contextmanager
def continued(parts: Continued, cache: ChunkCache) -> Iterator[None]:
    """For one chunk call against ``cache``: each mixer of ``parts`` continues from the chunk's incoming state."""
    starts: list[list] = []
    if parts.scans:
        cache.scan_starts = starts
    with scans_continued(parts.scans, starts), lightning_continued(parts.lightning, cache):
        yield


__all__ = ["Continued", "continued"]
