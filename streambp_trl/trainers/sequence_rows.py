"""How a stream trainer's batches reach the ranks of a sequence split, by what its loss reads. The split is set as
TRL's users set it, in accelerate's ``parallelism_config``: DeepSpeed's sequence parallelism (``sp_backend=
"deepspeed"``, ``sp_size`` > 1), or context parallelism under FSDP2 (``cp_size`` > 1).

* ``"shares"`` (SFT, whose loss is a sum over tokens): each rank gets its share of every row, with global
  ``position_ids`` and ``shift_labels``; transformers' Trainer reduces the ranks' losses (their tokens counted before
  the cut); the engine streams each share (``enable_streambp(sequence_group=...)``). Under DeepSpeed its
  ``UlyssesSPDataLoaderAdapter`` cuts them (TRL's own path); under context parallelism, whose ranks accelerate hands
  the same batches, :func:`context_parallel_inputs` does, where transformers would enter torch's ring attention.
* ``"whole"`` (DPO, whose loss reads whole sequences' log-probabilities): every rank of the group gets the same batch
  (under DeepSpeed :class:`WholeRowsLoader` in place of its adapter, one rank's batch at a time; under context
  parallelism accelerate's loader as it is), and the engine cuts each rank's share itself and gathers the per-token
  outputs back (``whole_rows=True``, :mod:`streambp_trl.engine.whole_rows`), so TRL's loss code runs unchanged on every
  rank.

Under DeepSpeed a step trains one rank's batch on the whole group ("sequence parallelism over data parallelism"): the
loader yields ``sp_size`` batches for each of the wrapped loader's, as transformers' Trainer counts them. Under
context parallelism a step trains the batch the group's ranks share.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROWS = ("shares", "whole")  # what a trainer's ``sequence_rows`` may say


def deepspeed_sequence_group():
    """DeepSpeed's sequence-parallel process group, which accelerate builds when it prepares the model (in
    ``Trainer.train``, after the engine is installed): asked for at each streamed training call."""
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def context_parallel_group(accelerator) -> Callable[[], dist.ProcessGroup]:
    """The process group of ``accelerator``'s context-parallel ranks (the device mesh's ``"cp"`` dimension)."""
    return lambda: accelerator.torch_device_mesh["cp"].get_group()


def keep_attention_masks(accelerator) -> None:
    """``accelerator``'s preparation under context parallelism without what it adds for torch's ring attention: a
    hook on every attention module that drops its mask (torch's ring attention keeps causal masks alone, so accelerate
    refuses sliding windows there), and the ``context_parallel`` context the Trainer would enter. The engine attends
    with the model's own masks (padding, sliding windows) over its own key/value exchange, and
    :func:`context_parallel_inputs` cuts the rows."""
    accelerator._prepare_cp = lambda *prepared: prepared


def context_parallel_inputs(inputs: dict, group: dist.ProcessGroup) -> dict:
    """This rank's share of a batch that every rank of the context-parallel ``group`` holds, as DeepSpeed's data path
    cuts a sequence split's rows: with R ranks and rows of T tokens, rank q keeps positions [qL, (q + 1)L) of every
    (batch, T) field, L = ceil(T / R), and gets ``shift_labels`` (the labels shifted over the whole rows: position t
    scores token t + 1) and the whole rows' ``position_ids`` (0.. where the batch has none). Rows with a padding mask
    are right-padded to R L with masked, unscored positions first (no earlier position attends to them); rows without
    one (padding-free) must hold a multiple of R tokens (``pad_to_multiple_of``)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = inputs["input_ids"]
    batch, length = ids.shape[:2]
    share = -(-length // ranks)
    pad = share * ranks - length
    rows = dict(inputs)
    if rows.get("shift_labels") is None and rows.get("labels") is not None:
        rows["shift_labels"] = F.pad(rows["labels"][:, 1:], (0, 1), value=-100)
    if rows.get("position_ids") is None:
        rows["position_ids"] = torch.arange(length, device=ids.device).expand(batch, -1)
    if pad and rows.get("attention_mask") is None:
        raise ValueError(
            f"StreamBP: rows of {length} tokens without an attention mask (padding-free) cannot be split into equal "
            f"shares across the {ranks} context-parallel ranks: set pad_to_multiple_of to a multiple of cp_size."
        )
    fill = {"labels": -100, "shift_labels": -100}
    for key, value in rows.items():
        if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (batch, length)):
            continue
        if pad and key == "position_ids":
            value = torch.cat([value, value[:, -1:] + torch.arange(1, pad + 1, device=value.device)], dim=1)
        elif pad:
            value = F.pad(value, (0, 0) * (value.dim() - 2) + (0, pad), value=fill.get(key, 0))
        rows[key] = value[:, rank * share : (rank + 1) * share]
    return rows


def first_ranks(obj: object, group: dist.ProcessGroup) -> object:
    """``obj`` as the group's first rank has it (``broadcast_object_list``): an online trainer's generated
    completions, which every rank of a whole-rows split must train alike (each rank samples its own)."""
    held = [obj]
    dist.broadcast_object_list(held, src=dist.get_global_rank(group, 0), group=group)
    return held[0]


def first_ranks_random_state(group: dist.ProcessGroup) -> None:
    """Take the group's first rank's random state (the CPU generator's and the current CUDA device's): what an online
    trainer draws after generating (TRL shuffles the generation batch) is then drawn alike on every rank, whose
    generators TRL seeds apart (``device_specific``)."""
    states = [(torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    cpu, cuda = states[0]
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def check_online_split(trainer) -> None:
    """Refuse, at construction, an online trainer's settings that a whole-rows split would change: every rank
    scores one rank's generation batch, so that batch must hold whole groups of ``num_generations`` completions (the
    advantages are normalised per group over what the ranks gather, every rank's copy alike), and a reward scaling
    over the whole gathered batch (``scale_rewards="batch"``) would count each completion once per rank."""
    args, name = trainer.args, type(trainer).__name__
    held = args.per_device_train_batch_size * (getattr(args, "steps_per_generation", None) or 1)
    if held % trainer.num_generations:
        raise ValueError(
            f"{name}: with the sequence split across ranks every rank trains one rank's generation batch, "
            f"per_device_train_batch_size x steps_per_generation = {held} completions, which must hold whole groups "
            f"of num_generations={trainer.num_generations}: make it a multiple of num_generations."
        )
    if getattr(args, "scale_rewards", None) == "batch":
        raise ValueError(
            f"{name}: scale_rewards='batch' normalises over the batch every rank gathers, which holds each "
            "completion once per rank with the sequence split across ranks; use scale_rewards='group' (or 'none')."
        )


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

    def _gathered(self, batch: object) -> list:
        """One batch of every rank (a dict of tensors, or an online trainer's list of examples), rank 0's first."""
        device = next(_tensors(batch), torch.empty(0)).device
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, _moved(batch, torch.device("cpu")), group=self.group)
        return [_moved(b, device) for b in every]


def _tensors(obj: object):
    """The tensors in a batch (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _moved(obj: object, device: torch.device) -> object:
    """A batch with its tensors on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(v, device) for v in obj)
    return obj
