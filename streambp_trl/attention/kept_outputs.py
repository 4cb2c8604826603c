"""Attention outputs kept from the forward, so a backward recompute skips the attention kernels (the plan's
``keep_attention``).

A chunk's attention in the forward computes its output O and the row log-sum-exps L; its recompute in backward
computes them again, only for the fused backward, which reads Q, K, V, O and L. Where a layer keeps them
(:attr:`~streambp_trl.layers.call.LayerCall.keeps_attention`), the forward records, per chunk, every
:class:`~.causal_chunk.CausalChunkAttention` call's O, L and kernel state in call order (:func:`recording`), and the
chunk's recompute takes them back in the same order (:func:`replaying`) instead of running the kernels: the backward
reads the values the recompute would have computed (the same kernels on the same inputs), so the gradients are the
recomputing ones, bit for bit. Each kept call is checked against the recompute's (the same query shape and number of
keys): where they differ (the forward and its recompute took different attention paths), the recompute computes its
attention as before, exactly, and a warning says so once.

Memory, from the layer's forward to its backward: per token, the attention output (query heads x head_dim in the
model dtype) and one float32 log-sum-exp per query head; freed chunk by chunk as the backward goes. Only plainly
causal chunks without dropout take this form (on the CPU its flash kernel, on CUDA cuDNN's): a chunk under a mask
block, with dropout, sinks or softcapping records nothing, and its recompute runs its kernels as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Iterator

import torch


@dataclasses.dataclass
class KeptOutputs:
    """One chunk's kept attention calls, in call order: (query shape, key length, output, log-sum-exp, kernel
    state). ``replay``: taken back, in order (``next`` is the next to take), rather than recorded."""

    entries: list[tuple] = dataclasses.field(default_factory=list)
    replay: bool = False
    next: int = 0

    def keep(self, query: torch.Tensor, key: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, state: list) -> None:
        self.entries.append((tuple(query.shape), key.shape[2], out, lse, state))

    def take(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list] | None:
        """The next kept call's output, log-sum-exp and kernel state, for a call on ``query`` against ``key``; ``None``
        (the call computes its attention, which is exact) where the forward kept no such call: what is left of the
        chunk then computes too, and the first such chunk says so in a warning."""
        entry = self.entries[self.next] if self.next < len(self.entries) else None
        if entry is None or entry[0] != tuple(query.shape) or entry[1] != key.shape[2]:
            if self.next <= len(self.entries):  # (the chunk's first call without a kept one)
                _warn_once(tuple(query.shape), key.shape[2], None if entry is None else entry[:2])
            self.next = len(self.entries) + 1  # (the rest of the chunk computes)
            return None
        self.next += 1
        return entry[2], entry[3], entry[4]

    def release(self) -> None:
        """Drop what was kept (a chunk's backward is done)."""
        self.entries.clear()


_ACTIVE: contextvars.ContextVar[KeptOutputs | None] = contextvars.ContextVar("streambp_kept_outputs", default=None)


def active() -> KeptOutputs | None:
    """The chunk's kept attention outputs being recorded or replayed, if any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(kept: KeptOutputs | None) -> Iterator[None]:
    """Record a chunk's attention calls into ``kept`` for the duration of a ``with`` block (nothing with ``None``)."""
    token = _ACTIVE.set(kept)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def replaying(kept: KeptOutputs | None) -> Iterator[None]:
    """Take a chunk's attention calls back from ``kept``, from its first, in a ``with`` block (none with ``None``)."""
    if kept is None:
        yield
        return
    replay = KeptOutputs(kept.entries, replay=True)
    token = _ACTIVE.set(replay)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@functools.cache
def _warn_once(shape: tuple, keys: int, entry: tuple[tuple, int] | None) -> None:
    kept = "nothing" if entry is None else f"{entry[0]} queries against {entry[1]} keys"
    warnings.warn(
        f"StreamBP: a chunk's recompute attends {shape} queries to {keys} keys where its forward kept {kept}: its "
        "attention is recomputed (exact, without the saving of stream_keep_attention). Please report the model.",
        stacklevel=4,
    )
