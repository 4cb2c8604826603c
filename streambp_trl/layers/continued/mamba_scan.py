"""Mamba v1's selective scan continued from the state a chunk receives.

transformers' Mamba v1 mixers (Mamba, FalconMamba, Jamba, Zamba) run the selective scan of any call longer than one
token from a zero state; a cached state is read only by the one-token decoding path, which updates it in place. The
scan is linear in its state, so a chunk's scan from its incoming state ``h_0`` is the zero-started scan plus a term
in ``h_0`` alone. Per channel ``d`` and state entry ``n``, with the step ``Δ_t = softplus(dt_t + bias)`` (as the
mixer asks), ``h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t`` gives

    h_t = h⁰_t + P_t ⊙ h_0,   P_t = exp(A · Σ_{τ ≤ t} Δ_τ),
    y_t = (C_t · h_t + D x_t) ⊙ silu(z_t) = y⁰_t + (C_t · (P_t ⊙ h_0)) ⊙ silu(z_t),

where ``h⁰`` and ``y⁰`` are the scan from zero. :func:`scans_continued` rebinds a modeling module's
``mamba_selective_scan`` for one chunk call to :func:`_continued`, which runs the model's own scan (its kernel where
one is installed) for ``y⁰`` and the last ``h⁰`` and adds both terms, so the mixer returns the chunk's true output and
records its true outgoing state through the cache. The chunk cache keeps the incoming state from the mixer (which
would take its decoding path on a one-token chunk) and hands it to the scan instead (``ChunkCache.scan_starts``).
Autograd reaches ``h_0`` through the added terms: its gradient is the carry gradient the chunk hands back.

Under grad (a chunk's backward recompute) the zero-started last state is recomputed from the scan's inputs, since
mamba-ssm's kernel gives its last state no gradient (see :func:`_continued`).

Memory: ``P`` and its product with ``h_0``, (batch x channels x chunk x state) each in float32 (float64 for a
float64 scan), kept by autograd for the backward, as the model's torch scan keeps its discretised ``A``; with
mamba-ssm's kernel, under grad, also the decay to the chunk's end and its product with the inputs, two more such. The
step sums ``Σ Δ`` are taken in float64, so their rounding over a long chunk stays below the float32 of ``P``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ...patching import temporarily
from ..traits import names_called

SCAN = "mamba_selective_scan"  # the modeling modules' selective scan, which starts from a zero state


def scan_modules(layer: nn.Module) -> tuple[ModuleType, ...]:
    """The modeling modules whose :data:`SCAN` the modules of ``layer`` call (none for a layer without a Mamba v1
    mixer)."""
    found = {_module_of(type(m)) for m in layer.modules() if SCAN in names_called(type(m))}
    return tuple(sorted((m for m in found if m is not None), key=lambda m: m.__name__))


def _module_of(cls: type) -> ModuleType | None:
    module = sys.modules.get(inspect.unwrap(cls.forward).__module__)
    return module if callable(getattr(module, SCAN, None)) else None


@contextlib.contextmanager
def scans_continued(modules: tuple[ModuleType, ...], starts: list[list]) -> Iterator[None]:
    """Within the block, each module's :data:`SCAN` continues from the state the last entry of ``starts`` holds
    (``[state, calls]``, appended by the chunk cache each time a mixer asks for its recurrent state; ``None`` for the
    first chunk). A state with a head dimension, (batch, heads, channels, state) (Zamba's mixer scans head by head),
    gives its ``calls``-th head to each successive scan. The rebinding is the module's, so a call from another thread
    (another model running meanwhile) gets the model's own scan."""
    thread = threading.get_ident()
    with contextlib.ExitStack() as stack:
        for module in modules:
            continued = functools.partial(_continued, getattr(module, SCAN), starts, thread)
            stack.enter_context(temporarily([module], SCAN, continued))
        yield


def _continued(
    scan: Callable,
    starts: list[list],
    thread: int,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (the model's names)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor | None = None,  # noqa: N803
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The model's ``scan`` on (batch, channels, L) inputs, continued from the state ``starts`` gives (see the module
    docstring): ``y⁰ + (C · (P ⊙ h_0)) ⊙ silu(z)``, and with ``return_last_state`` also ``h⁰_L + P_L ⊙ h_0``.

    Where the scan's ``h⁰_L`` carries no gradient under grad (mamba-ssm's kernel returns its last state without
    one; transformers' torch scan's has one), it is recomputed here as ``Σ_t exp(A · Σ_{τ > t} Δ_τ) ⊙ Δ_t B_t x_t``:
    the chunk's outgoing state must pass the gradient the next chunk hands back to the chunk's inputs. The terms are
    computed outside autocast, in float32 (float64 for a float64 scan)."""
    y, last = scan(
        hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
        return_last_state=True, **kwargs,
    )  # fmt: skip
    if threading.get_ident() != thread:  # another model's call, in another thread
        return (y, last) if return_last_state else y
    h0 = _start(starts)
    recompute_last = return_last_state and torch.is_grad_enabled() and not last.requires_grad
    if h0 is None and not recompute_last:
        return (y, last) if return_last_state else y
    with torch.autocast(hidden_states.device.type, enabled=False):
        return _with_start(y, last, h0, hidden_states, dt, A, B, C, z, delta_bias, delta_softplus, recompute_last)


def _with_start(
    y: torch.Tensor,
    last: torch.Tensor,
    h0: torch.Tensor | None,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (the model's names)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
    recompute_last: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms of :func:`_continued` added to ``y`` and ``last`` (``h0`` None: only the recomputed last state)."""
    dtype = torch.promote_types(A.dtype, torch.float32)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    steps = dt.to(torch.float64).cumsum(-1)  # (batch, channels, L): Σ_{τ ≤ t} Δ_τ
    a = A.to(dtype)[None, :, None, :]
    if recompute_last:
        to_end = torch.exp(a * (steps[..., -1:] - steps).to(dtype)[..., None])  # (batch, channels, L, state)
        inputs = (dt * hidden_states).to(dtype)
        last = torch.einsum("bdln,bdl,bnl->bdn", to_end, inputs, B.to(dtype)).to(last.dtype)
    if h0 is not None:
        decay = torch.exp(a * steps.to(dtype)[..., None])  # P, (batch, channels, L, state)
        h0 = h0.to(dtype)
        extra = torch.einsum("bdln,bdn,bnl->bdl", decay, h0, C.to(dtype))
        if z is not None:
            extra = extra * F.silu(z.to(dtype))
        y = y + extra.to(y.dtype)
        last = last + (decay[:, :, -1] * h0).to(last.dtype)
    return y, last


def _start(starts: list[list]) -> torch.Tensor | None:
    """The state entering the next scan: the last mixer's (its ``calls``-th head for a per-head state), counted."""
    if not starts:
        return None
    entry = starts[-1]
    state, calls = entry
    entry[1] = calls + 1
    if state is not None and state.dim() == 4:
        state = state[:, calls]
    return state
