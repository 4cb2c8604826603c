"""Searches over the memory model (:mod:`.memory_model`): the longest length that fits a budget, the largest chunk
that fits a length."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .memory_model import CHUNKS, ModelShape, StepSetup, estimate_peak_bytes


def max_len(shape: ModelShape, setup: StepSetup, budget_bytes: int, step: int = 1024) -> int:
    """Longest multiple of ``step`` whose estimated peak fits in ``budget_bytes`` (0 if none does)."""
    return longest_fitting(lambda tokens: estimate_peak_bytes(shape, setup, tokens) <= budget_bytes, step)


def longest_fitting(fits: Callable[[int], bool], step: int = 1024) -> int:
    """Longest multiple of ``step`` that ``fits`` (monotone: whatever fits, every shorter length fits), by doubling
    then bisection; 0 if ``step`` does not fit."""
    if not fits(step):
        return 0
    lo, hi = step, 2 * step
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > 1 << 30:
            return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_chunk(seq_len: int, fits: Callable[[int], bool]) -> int:
    """The largest chunk of :data:`CHUNKS` (fewest kernel launches) that ``fits``, never longer than the sequence, or
    the smallest when none does."""
    fitting = [c for c in CHUNKS if c <= max(seq_len, CHUNKS[0]) and fits(c)]
    return fitting[-1] if fitting else CHUNKS[0]


def auto_chunk_sizes(shape: ModelShape, setup: StepSetup, seq_len: int, budget_bytes: int) -> tuple[int, int]:
    """``(stream_chunk_size, logits_chunk_size)`` for ``setup`` at ``seq_len`` within ``budget_bytes`` (weights,
    gradients, optimizer state and activations): :func:`largest_chunk` whose estimated peak fits."""

    def fits(c: int) -> bool:
        return estimate_peak_bytes(shape, dataclasses.replace(setup, chunk=c, logits_chunk=c), seq_len) <= budget_bytes

    chunk = largest_chunk(seq_len, fits)
    return chunk, chunk
