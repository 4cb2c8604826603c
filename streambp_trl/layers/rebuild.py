"""The first stream layer's input rebuilt from the token ids in backward, instead of kept from the forward.

The first decoder layer's input is usually the input embedding's output: a lookup of the token ids, which costs
(batch, T, hidden) values to keep and almost nothing to recompute. While a streamed decoder call runs,
:func:`embedding_sources` marks each output of the input embedding with an :class:`EmbeddingSource` (the module, the
ids, the weight and its version), provided recomputing it gives the same tensor: a plain ``nn.Embedding`` (any
subclass without submodules), no forward hook or pre-hook on it (NEFTune's noise is one) and none global, parameters
neither ZeRO-3 partitions nor FSDP shards. A stream layer whose input carries the mark keeps the ids instead of the
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

_MARK = "_streambp_embedding_source"


@dataclasses.dataclass(frozen=True)
class EmbeddingSource:
    """An input embedding's output, as its inputs: ``module.forward(ids)`` with ``weight`` at ``version``."""

    module: nn.Embedding
    ids: torch.Tensor
    weight: torch.Tensor
    version: int

    @staticmethod
    def of(x: torch.Tensor) -> EmbeddingSource | None:
        return getattr(x, _MARK, None)

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
    if not isinstance(module, nn.Embedding) or any(True for _ in module.children()):
        return False
    if module._forward_pre_hooks or nn.modules.module._global_forward_hooks:
        return False
    if nn.modules.module._global_forward_pre_hooks:
        return False
    from torch.distributed.tensor import DTensor

    weight = module.weight
    return not hasattr(weight, "ds_id") and not isinstance(weight, DTensor)


def _mark(module: nn.Embedding, args: tuple, output: torch.Tensor) -> None:
    # only when this is the module's one forward hook (another could change the output, or draw random noise)
    if len(module._forward_hooks) == 1 and _rebuildable(module) and args and isinstance(args[0], torch.Tensor):
        if isinstance(output, torch.Tensor) and not args[0].is_floating_point():
            setattr(output, _MARK, EmbeddingSource(module, args[0], module.weight, module.weight._version))


@contextlib.contextmanager
def embedding_sources(decoder: nn.Module) -> Iterator[None]:
    """Mark the outputs of ``decoder``'s input embedding while the block runs, where they can be rebuilt."""
    from torch.distributed.fsdp import FSDPModule

    try:
        embedding = decoder.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    if not isinstance(embedding, nn.Embedding) or any(isinstance(m, FSDPModule) for m in decoder.modules()):
        yield
        return
    handle = embedding.register_forward_hook(_mark)
    try:
        yield
    finally:
        handle.remove()
