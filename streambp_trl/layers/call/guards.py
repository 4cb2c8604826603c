"""What a streamed layer's backward checks about tensors that user code can hold or change.

* :func:`sole_holder`: whether a tensor's memory is held by nothing but the tensor itself, so the layer's backward may
  write its input gradient into it. A layer keeps its input as a tensor of its own over the input's memory
  (``x.detach()``), never as the tensor the caller, a hook or another autograd node may hold; then anything still
  holding that memory at backward time (the previous layer's output kept by a forward hook, a pre-hook's argument,
  a hidden state, a view or ``detach()`` of it, an autograd node that saved it, a NumPy array over it, the storage
  object itself) is one more reference to the memory (``torch._C._storage_Use_Count``), and the memory is left alone.
* :class:`Versions`: tensors a backward reads again without autograd's saved-tensor check (a layer's parameters,
  trainable or frozen, and its tensor arguments, which it recomputes from; a segment's kept input), with their
  versions at the forward; :meth:`Versions.check` raises if one was changed in place since (an optimizer step before
  ``backward()``), where the recompute would otherwise use the new values silently. Only in-place changes count, as
  for autograd's own check: DeepSpeed ZeRO-3 and FSDP swap ``param.data`` or resize storage, which keeps the version.
* :func:`check_backward`: a layer's backward runs once per forward (it consumes its kept input) and is not itself
  differentiable; a second backward through the same graph or ``create_graph=True`` is refused before anything runs.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Iterable

import torch


def sole_holder(x: torch.Tensor) -> bool:
    """Whether ``x`` is the only tensor over its memory and nothing else holds the memory.

    Measured as for a fresh tensor of the same kind (``x.new_empty(0)``: the same tensor type and device), so the
    count of the storage's C++ references and of the Python references to its one storage object (a caller holding
    ``x.untyped_storage()``) are compared like for like. A tensor without a storage of its own is never reused.
    """
    try:
        return _references(x) == _references(x.new_empty(0))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _references(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``): their pack hook may keep
    what ``save_for_backward`` is given, beyond :func:`sole_holder`'s sight."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


@dataclasses.dataclass
class Versions:
    """Named tensors (held weakly: a tensor nobody holds any more is not read again) and their versions when recorded;
    ``owner`` names what they belong to, for the error. Inference tensors have no version and are left out."""

    owner: str
    entries: list[tuple[str, weakref.ref, int]]

    @staticmethod
    def record(owner: str, named: Iterable[tuple[str, torch.Tensor]]) -> Versions:
        return Versions(owner, [(name, weakref.ref(t), t._version) for name, t in named if not t.is_inference()])

    def check(self) -> None:
        for name, ref, version in self.entries:
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"StreamBP: {name} of {self.owner} was modified in place between the forward and the backward "
                    f"(version {t._version}, {version} at the forward), e.g. by an optimizer step before backward(). "
                    "The streamed backward recomputes from it and would use the new values (plain autograd raises "
                    "its in-place error here too). Run the backward before changing it, or run the forward again."
                )


def check_backward(ctx: object, what: str) -> None:
    """Refuse a second backward through ``ctx``'s node, and a differentiable backward (``create_graph=True``)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"StreamBP: {what} has no differentiable backward, so create_graph=True (double backward, gradient "
            "penalties) cannot be honoured. Call disable_streambp(model) for steps that need higher-order gradients."
        )
    if getattr(ctx, "_streambp_ran", False):
        raise RuntimeError(
            f"StreamBP: the backward of {what} was asked for twice for one forward (a second backward through the "
            "same graph, as with retain_graph=True): each streamed layer's backward uses up what its forward kept. "
            "Run the forward again before each backward, or call disable_streambp(model) for such steps."
        )
    ctx._streambp_ran = True
