"""Whether a module's parameters are whole in this process: the one test for DeepSpeed ZeRO-3 partitions and FSDP
shards, which the stream layers, the first-layer rebuild, the segments and the engine's ZeRO-3 support ask."""

from __future__ import annotations

import torch
from torch import nn


def partitioned(obj: torch.Tensor | nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the parameter ``obj``, or registered its hooks on the module ``obj``: both
    then carry a ``ds_id``."""
    return hasattr(obj, "ds_id")


def sharded(module: nn.Module) -> bool:
    """Whether FSDP shards ``module`` or ZeRO-3 partitions its own parameters."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule) or any(partitioned(p) for p in module.parameters(recurse=False))


def sharded_module(model: nn.Module) -> nn.Module | None:
    """The first submodule of ``model`` that FSDP shards or whose own parameters ZeRO-3 partitions, if any."""
    return next((module for module in model.modules() if sharded(module)), None)


def check_segmentable(model: nn.Module, keep_every: int) -> None:
    """Refuse ``keep_every > 1`` for a model whose parameters are ZeRO-3 partitions or FSDP shards: a segment's layers
    run forward inside another layer's backward, where they are not gathered."""
    if keep_every == 1:
        return
    module = sharded_module(model)
    if module is not None:
        raise ValueError(
            f"keep_every={keep_every} needs each decoder layer's parameters whole in this process, but "
            f"{type(module).__name__} is sharded (FSDP) or partitioned (DeepSpeed ZeRO-3). Use keep_every=1 "
            "(with offload_checkpoints to save device memory), or DDP / ZeRO-2."
        )
