"""Attention outputs kept from the forward, so a backward recompute skips the attention kernels (the plan's
``keep_attention``).

A chunk's attention in the forward computes its output O and the row log-sum-exps L; its recompute in backward
computes them again, only for the fused backward, which reads Q, K, V, O and L. Where a layer keeps them
(:attr:`~streambp_trl.layers.call.LayerCall.keeps_attention`), the forward records, per chunk, every
:class:`~.causal_chunk.CausalChunkAttention` call's O, L and kernel state in call order (:func:`recording`), and the
chunk's recompute takes them back in the same order (:func:`replaying`) instead of running the kernels: the backward
reads the values the recompute would have computed (the same kernels on the same inputs), so the gradients are the
recomputing ones, bit for bit. Each kept call is checked against the recompute's: the same query shape and number
of keys, else a ``RuntimeError`` (the forward and its recompute took different attention paths).

Memory, from the layer's forward to its backward: per token, the attention output (query heads x head_dim in the
model dtype) and one float32 log-sum-exp per query head; freed chunk by chunk as the backward goes. Only plainly
causal chunks without dropout take this form (on the CPU its flash kernel, on CUDA cuDNN's): a chunk under a mask
block, with dropout, sinks or softcapping records nothing, and its recompute runs its kernels as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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

    def take(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The next kept call's output, log-sum-exp and kernel state, for a call on ``query`` against ``key``."""
        if self.next >= len(self.entries):
            raise RuntimeError(
                "StreamBP: a chunk's recompute ran more attention calls than its forward kept; set "
                "stream_keep_attention=False and report the model."
            )
        shape, keys, out, lse, state = self.entries[self.next]
        if shape != tuple(query.shape) or keys != key.shape[2]:
            raise RuntimeError(
                f"StreamBP: a chunk's recompute attends {tuple(query.shape)} queries to {key.shape[2]} keys where its "
                f"forward kept {shape} against {keys}; set stream_keep_attention=False and report the model."
            )
        self.next += 1
        return out, lse, state

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
