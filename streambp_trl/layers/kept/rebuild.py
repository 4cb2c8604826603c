"""The first stream layer's input rebuilt from the token ids in backward, instead of kept from the forward.

The first decoder layer's input is usually the input embedding's output: a lookup of the token ids, which costs (batch,
T, hidden) values to keep and almost nothing to recompute. While a streamed decoder call runs,
:meth:`EmbeddingOutputs.watch` records each output of the input embedding with an :class:`EmbeddingSource` (the module,
the ids, the weight and its version), provided recomputing it gives the same tensor: a plain ``nn.Embedding`` (any
subclass without submodules, no ``max_norm``), no forward hook or pre-hook on it (NEFTune's noise is one) and none
global, parameters neither ZeRO-3 partitions nor FSDP shards, and the output not changed in place before the layer gets
it (its version is checked). A stream layer whose input is such an output (the very tensor) keeps the ids instead of
the input, and its backward calls the embedding's forward on them again (its autocast state restored); the weight must
be the same tensor, unchanged, or a ``RuntimeError`` says so. The decoder passes the embedding's output straight to the
first layer in Llama-style models; where it transforms it first (a scale, a dropout, added positions), the layer's
input is another tensor, not recorded, and is kept as before.

Memory: the saved inputs of an L-layer model are L - 1 (batch, T, hidden) tensors and the ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ..sharding import partitioned, sharded_module


@dataclasses.dataclass(frozen=True)
class EmbeddingSource:
    """An input embedding's output, as its inputs: ``module.forward(ids)`` with ``weight`` at ``version``; the output
    was at ``output_version``. ``ids`` is a copy, so a later in-place change to the caller's ids is harmless."""

    module: nn.Embedding
    ids: torch.Tensor
    weight: torch.Tensor
    version: int
    output_version: int

    def rebuild(self, autocast: dict) -> torch.Tensor:
        """The embedding's output again (no grad)."""
        if self.module.weight is not self.weight or self.weight._version != self.version:
            raise RuntimeError(
                f"StreamBP rebuilds the first decoder layer's input from the token ids in backward, but the input "
                f"embedding's weight ({type(self.module).__name__}) was replaced or modified in place between the "
                "forward and the backward. Run the backward before changing the embedding."
            )
        with torch.no_grad(), torch.autocast(**autocast):
            return self.module.forward(self.ids)


def _rebuildable(module: nn.Module) -> bool:
    if not isinstance(module, nn.Embedding) or any(True for _ in module.children()) or module.max_norm is not None:
        return False  # (max_norm renormalises the weight in place on every call)
    if module._forward_pre_hooks or nn.modules.module._global_forward_hooks:
        return False
    if nn.modules.module._global_forward_pre_hooks:
        return False
    from torch.distributed.tensor import DTensor

    weight = module.weight
    return not partitioned(weight) and not isinstance(weight, DTensor)


def _record(
    outputs: EmbeddingOutputs, module: nn.Embedding, args: tuple, output: torch.Tensor
) -> None:  # an embedding's forward hook
    # only for a call with grad (nothing rebuilds what a no-grad or inference-mode call makes; inference tensors have
    # no version), and when no other forward hook could change the output (or draw random noise); transformers' own
    # `enable_input_require_grads` hook (PEFT's k-bit preparation) only flags the output as requiring grad
    if not torch.is_grad_enabled():
        return
    others = [h for h in module._forward_hooks.values() if not _is_record(h)]
    harmless = all(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in others)
    if harmless and _rebuildable(module) and args and isinstance(args[0], torch.Tensor):
        if isinstance(output, torch.Tensor) and not args[0].is_floating_point():
            weight = module.weight
            source = EmbeddingSource(module, args[0].clone(), weight, weight._version, output._version)
            outputs.seen.append((weakref.ref(output), source))


def _is_record(hook: object) -> bool:
    return isinstance(hook, functools.partial) and hook.func is _record


@dataclasses.dataclass
class EmbeddingOutputs:
    """The outputs of a decoder's input embedding during one streamed call that can be rebuilt from the token ids
    (held weakly, with their sources)."""

    seen: list[tuple[weakref.ref, EmbeddingSource]] = dataclasses.field(default_factory=list)

    def source_of(self, x: torch.Tensor) -> EmbeddingSource | None:
        """The source of ``x`` if ``x`` is one of these outputs, unchanged in place since the embedding made it."""
        for output, source in self.seen:
            if output() is x:
                return source if x._version == source.output_version else None
        return None

    @contextlib.contextmanager
    def watch(self, decoder: nn.Module) -> Iterator[None]:
        """Record the outputs of ``decoder``'s input embedding while the block runs, where they can be rebuilt."""
        try:
            embedding = decoder.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embedding = None
        if not isinstance(embedding, nn.Embedding) or sharded_module(decoder) is not None:
            yield
            return
        handle = embedding.register_forward_hook(functools.partial(_record, self))
        try:
            yield
        finally:
            handle.remove()
