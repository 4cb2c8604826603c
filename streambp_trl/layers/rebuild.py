"""The first stream layer's input rebuilt from the token ids in backward, instead of kept from the forward.

The first decoder layer's input is usually the input embedding's output: a lookup of the token ids, which costs
(batch, T, hidden) values to keep and almost nothing to recompute. While a streamed decoder call runs,
:func:`embedding_sources` marks each output of the input embedding with an :class:`EmbeddingSource` (the module, the
ids, the weight and its version), provided recomputing it gives the same tensor: a plain ``nn.Embedding`` (any
subclass without submodules, no ``max_norm``), no forward hook or pre-hook on it (NEFTune's noise is one) and none
global, parameters neither ZeRO-3 partitions nor FSDP shards, and the output not changed in place before the layer
gets it (its version is checked). A stream layer whose input carries the mark keeps the ids instead of the
input, and its backward calls the embedding's forward on them again (its autocast state restored); the weight must be
the same tensor, unchanged, or a ``RuntimeError`` says so. The decoder passes the embedding's output straight to the
first layer in Llama-style models; where it transforms it first (a scale, a dropout, added positions), the layer's
input is another tensor, without the mark, and is kept as before.

Memory: the saved inputs of an L-layer model are L - 1 (batch, T, hidden) tensors and the ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from .segments import sharded_module

_MARK = "_streambp_embedding_source"


@dataclasses.dataclass(frozen=True)
class EmbeddingSource:
    """An input embedding's output, as its inputs: ``module.forward(ids)`` with ``weight`` at ``version``; the output
    was at ``output_version``. ``ids`` is a copy, so a later in-place change to the caller's ids is harmless."""

    module: nn.Embedding
    ids: torch.Tensor
    weight: torch.Tensor
    version: int
    output_version: int

    @staticmethod
    def of(x: torch.Tensor) -> EmbeddingSource | None:
        """The source of ``x``, unless ``x`` was changed in place since the embedding made it."""
        source = getattr(x, _MARK, None)
        return source if source is not None and x._version == source.output_version else None

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
    return not hasattr(weight, "ds_id") and not isinstance(weight, DTensor)


def _mark(module: nn.Embedding, args: tuple, output: torch.Tensor) -> None:
    # only for a call with grad (nothing rebuilds what a no-grad or inference-mode call makes; inference tensors have
    # no version), and when no other forward hook could change the output (or draw random noise); transformers' own
    # `enable_input_require_grads` hook (PEFT's k-bit preparation) only flags the output as requiring grad
    if not torch.is_grad_enabled():
        return
    others = [h for h in module._forward_hooks.values() if h is not _mark]
    harmless = all(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in others)
    if harmless and _rebuildable(module) and args and isinstance(args[0], torch.Tensor):
        if isinstance(output, torch.Tensor) and not args[0].is_floating_point():
            weight = module.weight
            source = EmbeddingSource(module, args[0].clone(), weight, weight._version, output._version)
            setattr(output, _MARK, source)


@contextlib.contextmanager
def embedding_sources(decoder: nn.Module) -> Iterator[None]:
    """Mark the outputs of ``decoder``'s input embedding while the block runs, where they can be rebuilt."""
    try:
        embedding = decoder.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    if not isinstance(embedding, nn.Embedding) or sharded_module(decoder) is not None:
        yield
        return
    handle = embedding.register_forward_hook(_mark)
    try:
        yield
    finally:
        handle.remove()
