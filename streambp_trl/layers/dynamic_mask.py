"""A dynamic mask attention's top-k window, ranked over whole rows (Doge's ``prepare_dynamic_mask``).

Doge's attention adds a per-key bias to its mask, ``b_j = exp(A * softplus(dt_proj(v_j)))`` from each key's values,
and keeps in each query row only the ``keep_window_size`` keys of largest bias (a ``torch.topk`` over the row).
In the first layer a key's value depends on its token alone, so a repeated token gives exactly equal biases, and which
of those the top-k keeps is the sort's order over the row as it is given. The full forward ranks rows over every
position [0, T), with the positions a row may not attend to at the dtype's lowest value. A chunk's keys are [p, e),
so :func:`full_rows` has the module's own method rank the full-width row: the chunk's biases at [p, e) and zeros
elsewhere, under the chunk's mask block (queries [s, e) against keys [p, T), the later positions masked) with the
positions [0, p) masked as well (no query of the chunk attends to them, as in the full mask). Each ranked row is then
the full forward's row, bit for bit where the biases are, and the same keys are kept; the result is cut back to the
keys [p, e). Holds the (batch, heads, chunk, T) bias of the full-width rows, the full forward's rows for the chunk.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

METHOD = "prepare_dynamic_mask"


def dynamic_mask_modules(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The modules of ``layer`` that build a dynamic mask with their own ``prepare_dynamic_mask``."""
    return tuple(m for m in layer.modules() if callable(getattr(type(m), METHOD, None)))


@contextlib.contextmanager
def full_rows(modules: tuple[nn.Module, ...], kv_start: int, seq_len: int) -> Iterator[None]:
    """Within the block, each module's ``prepare_dynamic_mask`` ranks full-width rows (see the module docstring):
    the chunk's keys start at absolute position ``kv_start`` of a ``seq_len``-token sequence, and the mask it is given
    is the chunk's block from ``kv_start`` to ``seq_len``. An instance attribute for the block only."""
    for module in modules:
        module.__dict__[METHOD] = _FullRows(getattr(type(module), METHOD).__get__(module), kv_start, seq_len)
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop(METHOD, None)


class _FullRows:
    """``prepare_dynamic_mask`` of one module, called with the chunk's biases and mask block and run on the
    full-width rows."""

    def __init__(self, method, kv_start: int, seq_len: int):
        self.method, self.kv_start, self.seq_len = method, kv_start, seq_len
        self.signature = inspect.signature(method)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        dt, mask = bound.arguments["dt_states"], bound.arguments["attention_mask"]
        p, kv = self.kv_start, dt.shape[-1]
        if not isinstance(mask, torch.Tensor) or mask.shape[-1] != self.seq_len - p:
            raise RuntimeError(
                f"StreamBP: {self.method.__qualname__} got a mask that is not the chunk's block of keys [{p}, "
                f"{self.seq_len}) ({type(mask).__name__}{tuple(getattr(mask, 'shape', ()))}), so it cannot rank the "
                "full forward's rows."
            )
        lowest = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        bound.arguments["dt_states"] = F.pad(dt, (p, self.seq_len - p - kv))
        bound.arguments["attention_mask"] = F.pad(mask, (p, 0), value=lowest) if p else mask
        return self.method(*bound.args, **bound.kwargs)[..., p : p + kv]
