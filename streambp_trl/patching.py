"""Instance patches recorded on the module they change: how the engine installs itself and leaves no trace.

:func:`patch` sets an instance attribute and remembers what the instance had before (in the module's
``_streambp_patches``); :func:`unpatch` puts that back, and :func:`unpatched` does so for a ``with`` block. The
records live on the module, and the methods the engine installs are :class:`Method` objects (a module-level function
and the module), so ``copy.deepcopy`` and pickling (``torch.save(model)``) copy a patched model with its records and
methods bound to the copy; no registry outside the model exists.
:func:`guarded_set_gradient_checkpointing` lets transformers' checkpointing switches act on every other module while
the streamed layers keep their hook. :func:`opaque` and :func:`opaque_methods` mark the engine's code a compiled
layer calls (:mod:`streambp_trl.layers.compiled`) as run eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

_PATCHES = "_streambp_patches"
# the item access a cache-like object serves a layer's code by, run eagerly beside its public methods
_SERVED = ("__getitem__", "__setitem__", "__contains__", "__len__", "__iter__")


def opaque(func: Callable) -> Callable:
    """``func``, run eagerly where a compiled layer calls it: a graph break (``torch.compiler.disable``), so what it
    reads and changes (the chunk cache's store, a prefix that grows chunk by chunk) never enters a graph; outside a
    compiled frame, ``func`` as it is."""
    return torch.compiler.disable(func, recursive=True)


def opaque_methods(cls: type) -> type:
    """``cls`` with each of its own methods a layer's code may call made :func:`opaque`: its public methods, its
    properties' getters and its item access (``__getitem__``, ``__len__``, ...)."""
    for name, value in list(vars(cls).items()):
        if isinstance(value, property) and value.fget is not None:
            setattr(cls, name, property(opaque(value.fget), value.fset, value.fdel, value.__doc__))
        elif inspect.isfunction(value) and (not name.startswith("_") or name in _SERVED):
            setattr(cls, name, opaque(value))
    return cls


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
def forwards_replaced(replacements: dict[nn.Module, Callable]) -> Iterator[None]:
    """Each module's ``forward`` is its callable in ``replacements`` (an instance attribute) for the duration of a
    ``with`` block; each instance dictionary is restored exactly afterwards."""
    saved = {m: ("forward" in vars(m), vars(m).get("forward")) for m in replacements}
    for module, forward in replacements.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, (had, previous) in saved.items():
            if had:
                module.forward = previous
            else:
                del module.forward


def bypassed(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """``module`` returns its first input unchanged for the duration of a ``with`` block."""
    return forwards_replaced({module: _first_input})


def _first_input(hidden_states, *args, **kwargs):
    return hidden_states


def hooked_without_grad(layers: Iterable[nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Each of ``layers`` (transformers ``GradientCheckpointingLayer``s in training mode, with their checkpoint hook)
    calls that hook also while grad is disabled, for the duration of a ``with`` block.

    transformers < 5.24 calls ``_gradient_checkpointing_func`` whenever a layer has checkpointing on and is in training
    mode; 5.24 also requires grad to be enabled, so a streamed no-grad call (``stream_eval``, the probe) would run
    each layer whole. An instance ``forward`` hands the hook the class's own forward with the call's keyword
    arguments, as transformers' checkpointing wrapper does."""
    return forwards_replaced({layer: functools.partial(_through_hook, layer) for layer in layers})


def _through_hook(layer: nn.Module, *args, **kwargs):
    forward = own_forward(type(layer))
    return layer._gradient_checkpointing_func(functools.partial(forward, layer, **kwargs), *args)


def own_forward(cls: type) -> Callable:
    """The class's own ``forward``, under transformers' checkpointing wrapper where it has one."""
    return getattr(cls.forward, "__wrapped__", cls.forward)


def patch(module: nn.Module, name: str, value) -> None:
    """Set ``module.<name> = value`` as an instance attribute, remembering what the instance had before."""
    patches = vars(module).setdefault(_PATCHES, {"saved": {}, "applied": {}})
    if name not in patches["saved"]:
        patches["saved"][name] = (name in vars(module), vars(module).get(name))
    patches["applied"][name] = value
    setattr(module, name, value)


class Method:
    """``function`` as a method of ``module``: ``Method(f, m, *bound)(*a, **kw)`` is ``f(m, *bound, *a, **kw)``.

    Unlike a bound method (which pickles as ``getattr(module, function.__name__)``), it pickles and deep-copies as
    its parts: ``function``, a module-level function, by its name, and ``module`` (and ``bound``) with the model it
    belongs to.
    ``inspect.signature`` gives that of ``module``'s own method ``wraps`` when named (what transformers' ``generate``
    and the Trainer's column filter read), and so does that of ``__func__`` (with ``__self__``, what accelerate's
    mixed-precision wrapper rebinds).
    """

    def __init__(self, function, module: nn.Module, *bound, wraps: str | None = None):
        self.function, self.__self__, self.bound, self.wraps = function, module, bound, wraps

    def __call__(self, *args, **kwargs):
        return self.function(self.__self__, *self.bound, *args, **kwargs)

    @property
    def __func__(self):
        """``function`` as a plain function of the module and the call's arguments. It carries the signature and no
        ``__wrapped__``, so accelerate, unwrapping its mixed-precision wrapper, stops at it."""
        function, bound = self.function, self.bound
        own = getattr(type(self.__self__), self.wraps) if self.wraps else function

        def method(module, *args, **kwargs):
            return function(module, *bound, *args, **kwargs)

        method.__name__, method.__qualname__, method.__doc__ = own.__name__, own.__qualname__, own.__doc__
        method.__signature__ = inspect.signature(own)
        return method

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self) -> str:
        return f"<streambp method {self.function.__qualname__} of {type(self.__self__).__name__}>"


def unpatch(module: nn.Module) -> None:
    if _PATCHES in vars(module):
        _put_back(module)
        del vars(module)[_PATCHES]


@contextlib.contextmanager
def unpatched(modules: Iterable[nn.Module]) -> Iterator[None]:
    """``modules`` as they were before the engine for the duration of a ``with`` block (what is set on them meanwhile
    becomes what :func:`unpatch` restores), then patched again."""
    modules = [m for m in modules if _PATCHES in vars(m)]
    for module in modules:
        _put_back(module)
    try:
        yield
    finally:
        for module in modules:
            _reapply(module)


def original(module: nn.Module, name: str):
    """``module.<name>`` as it was before the engine patched it (bound to ``module``)."""
    had, previous = vars(module)[_PATCHES]["saved"][name]
    return previous if had else getattr(type(module), name).__get__(module)


def _streamed_layers(root: nn.Module) -> list[nn.Module]:
    return [m for m in root.modules() if isinstance(m, GradientCheckpointingLayer) and _PATCHES in vars(m)]


# The patches are plain instance attributes (no parameters, buffers or submodules), so putting them back and
# reapplying them write the instance dictionary directly: generation does so on every decoder call.
def _put_back(module: nn.Module) -> None:
    """Give ``module`` the attributes it had before the engine's patches, keeping the records."""
    attributes = vars(module)
    for name, (had, previous) in attributes[_PATCHES]["saved"].items():
        if had:
            attributes[name] = previous
        else:
            attributes.pop(name, None)


def _reapply(module: nn.Module) -> None:
    """Remember ``module``'s current attributes as those to restore, then set the engine's again."""
    attributes = vars(module)
    patches = attributes[_PATCHES]
    for name, value in patches["applied"].items():
        patches["saved"][name] = (name in attributes, attributes.get(name))
        attributes[name] = value


def guarded_set_gradient_checkpointing(self, *args, **kwargs):
    """transformers' ``_set_gradient_checkpointing``, after which the streamed decoder layers keep their hook.

    It runs on the layers as they were before the engine, so what it sets is what ``disable_streambp`` restores.
    """
    with unpatched(_streamed_layers(self)):
        original(self, "_set_gradient_checkpointing")(*args, **kwargs)
