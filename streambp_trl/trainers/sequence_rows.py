"""How a stream trainer's batches reach the ranks of a sequence split (DeepSpeed's sequence parallelism: accelerate's
``parallelism_config`` with ``sp_backend="deepspeed"`` and ``sp_size`` > 1), by what its loss reads.

* ``"shares"`` (SFT, whose loss is a sum over tokens): TRL's own path. DeepSpeed's ``UlyssesSPDataLoaderAdapter``
  hands each rank its share of every row, with global ``position_ids`` and ``shift_labels``; transformers' Trainer
  reduces the ranks' losses; the engine streams each share (``enable_streambp(sequence_group=...)``).
* ``"whole"`` (DPO, whose loss reads whole sequences' log-probabilities): :class:`WholeRowsLoader` in place of
  DeepSpeed's adapter hands every rank of the group the same batch, one rank's at a time, and the engine cuts each
  rank's share itself and gathers the per-token outputs back (``whole_rows=True``,
  :mod:`streambp_trl.engine.whole_rows`), so TRL's loss code runs unchanged on every rank.

Either way a step trains one rank's batch on the whole group (DeepSpeed's "sequence parallelism over data
parallelism"): the loader yields ``sp_size`` batches for each of the wrapped loader's, as transformers' Trainer counts
them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ROWS = ("shares", "whole")  # what a trainer's ``sequence_rows`` may say


def deepspeed_sequence_group():
    """DeepSpeed's sequence-parallel process group, which accelerate builds when it prepares the model (in
    ``Trainer.train``, after the engine is installed): asked for at each streamed training call."""
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def own_attention() -> dict:
    """transformers' attention functions as registered now (before DeepSpeed's preparation replaces its core one
    with the Ulysses exchange: ``UlyssesSPAttentionHF.register_with_transformers``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS.valid_keys()}


def restore_attention(functions: dict) -> None:
    """Register ``functions`` (from :func:`own_attention`) again where the registry now holds another."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, function in functions.items():
        if ALL_ATTENTION_FUNCTIONS[name] is not function:
            ALL_ATTENTION_FUNCTIONS[name] = function


class WholeRowsLoader:
    """Wraps a data loader for a sequence split whose ranks all train the same whole rows: each time it runs dry, one
    batch of every rank's wrapped loader is gathered (``all_gather_object``, on the CPU), and it yields them, rank 0's
    first, to every rank alike."""

    def __init__(self, loader, group: dist.ProcessGroup):
        self.loader, self.group = loader, group
        self.pending: list = []
        self.batches = iter(loader)

    def __len__(self) -> int:
        return len(self.loader) * dist.get_world_size(self.group)

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            try:
                batch = next(self.batches)
            except StopIteration:
                self.batches = iter(self.loader)  # (the next epoch starts afresh, as DeepSpeed's adapter does)
                raise
            self.pending = self._gathered(batch)
        return self.pending.pop(0)

    def _gathered(self, batch: dict) -> list[dict]:
        device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        mine = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in every]
