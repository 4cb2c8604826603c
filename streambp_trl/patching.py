"""Instance patches recorded on the module they change: how the engine installs itself and leaves no trace.

:func:`patch` sets an instance attribute and remembers what the instance had before (in the module's
``_streambp_patches``); :func:`unpatch` puts that back. The records live on the module, so ``copy.deepcopy`` copies a
patched model with its records (bound methods rebound to the copy), and no registry outside the model exists.
:func:`guarded_set_gradient_checkpointing` lets transformers' checkpointing switches act on every other module while
the streamed layers keep their hook.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterable, Iterator

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

_PATCHES = "_streambp_patches"


@contextlib.contextmanager
def temporarily(objects: Iterable, name: str, value) -> Iterator[None]:
    """Set ``obj.<name> = value`` on each object for the duration of a ``with`` block, then restore each one's own."""
    objects = list(objects)
    previous = [getattr(obj, name) for obj in objects]
    for obj in objects:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, old in zip(objects, previous, strict=True):
            setattr(obj, name, old)


@contextlib.contextmanager
def bypassed(module: nn.Module) -> Iterator[None]:
    """``module`` returns its first input unchanged for the duration of a ``with`` block (its instance dictionary is
    restored exactly afterwards)."""
    had, previous = "forward" in vars(module), vars(module).get("forward")
    module.forward = _first_input
    try:
        yield
    finally:
        if had:
            module.forward = previous
        else:
            del module.forward


def _first_input(hidden_states, *args, **kwargs):
    return hidden_states


def patch(module: nn.Module, name: str, value) -> None:
    """Set ``module.<name> = value`` as an instance attribute, remembering what the instance had before."""
    patches = vars(module).setdefault(_PATCHES, {"saved": {}, "applied": {}})
    if name not in patches["saved"]:
        patches["saved"][name] = (name in vars(module), vars(module).get(name))
    patches["applied"][name] = value
    setattr(module, name, value)


def bind(function, module: nn.Module, wraps=None) -> types.MethodType:
    """``function`` as a method of ``module`` (with the signature and docs of ``wraps``, if given)."""
    return types.MethodType(functools.wraps(wraps)(function) if wraps else function, module)


def unpatch(module: nn.Module) -> None:
    if _PATCHES in vars(module):
        _put_back(module)
        del vars(module)[_PATCHES]


def original(module: nn.Module, name: str):
    """``module.<name>`` as it was before the engine patched it (bound to ``module``)."""
    had, previous = vars(module)[_PATCHES]["saved"][name]
    return previous if had else getattr(type(module), name).__get__(module)


def _streamed_layers(root: nn.Module) -> list[nn.Module]:
    return [m for m in root.modules() if isinstance(m, GradientCheckpointingLayer) and _PATCHES in vars(m)]


def _put_back(module: nn.Module) -> None:
    """Give ``module`` the attributes it had before the engine's patches, keeping the records."""
    for name, (had, previous) in vars(module)[_PATCHES]["saved"].items():
        if had:
            setattr(module, name, previous)
        else:
            vars(module).pop(name, None)


def _reapply(module: nn.Module) -> None:
    """Remember ``module``'s current attributes as those to restore, then set the engine's again."""
    patches = vars(module)[_PATCHES]
    for name, value in patches["applied"].items():
        patches["saved"][name] = (name in vars(module), vars(module).get(name))
        setattr(module, name, value)


def guarded_set_gradient_checkpointing(self, *args, **kwargs):
    """transformers' ``_set_gradient_checkpointing``, after which the streamed decoder layers keep their hook.

    It runs on the layers as they were before the engine, so what it sets is what ``disable_streambp`` restores.
    """
    layers = _streamed_layers(self)
    for layer in layers:
        _put_back(layer)
    try:
        original(self, "_set_gradient_checkpointing")(*args, **kwargs)
    finally:
        for layer in layers:
            _reapply(layer)
