"""One sequence split across the ranks of a process group, streamed on each: the key/value exchange of a layer call.

Rank q of a group of R holds positions [q L, (q + 1) L) of every row (``length`` L tokens each, the same on every
rank), as DeepSpeed's Ulysses data path hands them out, and runs every layer on them chunk by chunk as on one
process, in global positions: its chunks start at ``offset`` = q L, and its key/value store covers [0, (q + 1) L).
Attention sees every earlier position of the whole sequence through that store:

* Forward. Each rank first runs its chunks up to their cache update (the collecting pass: keys/values only, no
  query, no attention), then the ranks exchange those keys/values (:meth:`SequenceSplit.gather_prefix`): rank q
  receives ranks 0..q-1's into positions [0, q L) of its store. Its chunks then run as on one process against that
  prefix. The backward's collecting pass does the same (unless the forward captured the store).
* Backward. Rank q's chunks run last to first as on one process; the key/value gradient sums of positions before
  ``offset`` (what its queries took from earlier ranks) are sent to the ranks holding them
  (:meth:`SequenceSplit.returned_grads`), which receive dK_ret, dV_ret for their own positions, summed over every
  later rank. Each rank then backpropagates those through its chunks' key/value projections alone (a
  collecting pass with grad, :meth:`~.call.backward.ChunkBackward`), adding to its input and parameter gradients:

      dx[:, c] += d(K_c, V_c)/dx_c^T (dK_ret[:, :, c], dV_ret[:, :, c]),  dθ likewise.

  By linearity of the chain rule that completes each gradient: the chunk backward covered every path from x_c but
  the one through later ranks' queries, and this pass covers that one. So every rank's layer backward runs at once,
  no rank waits on another's chunks.

Randomness: each chunk's random state is drawn independently (:meth:`~.rng.RngState.drawn`, salted by the rank), so
the collecting pass, the chunk's forward and every recompute of it draw the same numbers.

Both exchanges are ``R - 1`` rounds of point-to-point sends and receives of one share (L positions) each way, so
their buffers are one share's. Memory beyond one process's plan on L tokens: the store's prefix and its gradient
sums ((batch, kv_dim) each per earlier position, so the last rank holds the whole sequence's keys/values of the layer
in progress), one share's buffers each way, and the returned gradients (L positions).

Served: layers of one softmax attention (dense, grouped-query, sliding window), with padding anywhere in the rows
(each rank's queries are masked against the whole rows' padding mask, gathered once per call); positions come from
``position_ids`` (global: given, or the rank's offset on). Packed rows (TRL's padding-free batches: position ids that
restart where a document starts, no attention mask) keep their documents apart across the ranks as on one process:
the documents' starts are read from the whole rows' position ids (gathered once per call where some rank's restart)
and every layer's mask keeps them apart (:func:`packed_documents`). A user-given 4D mask and a layer with a family
adapter other than flash attention's (a recurrent mixer, whose state would cross ranks; shared or compressed
keys/values) are refused by name.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .carry.store import KV, CarryStore


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of a sequence split across ``group``: rank ``rank`` of ``size``, ``length`` tokens each;
    ``padding``: the (batch, size x length) padding mask of the whole rows (``True``: a token), gathered from every
    rank's share, or ``None`` where no rank has padding; ``documents``: the global positions where the packed rows'
    documents start (but the first), kept apart by every layer (:func:`packed_documents`), ``()`` for unpacked rows."""

    group: dist.ProcessGroup
    rank: int
    size: int
    length: int
    padding: torch.Tensor | None = None
    documents: tuple[int, ...] = ()
    draws: Iterator[int] = dataclasses.field(default_factory=itertools.count, compare=False)  # see :meth:`place`

    def place(self, count: int) -> int:
        """Where a layer call's ``count`` chunk random states start among its engine's (``draws``: the engine's
        count of split layer calls, which a copy of the model carries on from; :meth:`~.rng.RngState.drawn`)."""
        return next(self.draws) * count

    @classmethod
    def of(
        cls,
        group: dist.ProcessGroup,
        length: int,
        mask: torch.Tensor | None,
        draws: Iterator[int],
        positions: torch.Tensor | None,
        kernel_apart: bool,
        rows: int = 1,
    ) -> SequenceSplit:
        """The split of a call whose ``rows`` rows hold ``length`` tokens on this rank, checked to be the same on every
        rank of ``group``, and its ``position_ids`` given on every rank or none (one eight-element ``all_reduce``);
        ``mask``: this rank's (batch, length) 2D attention mask, if the
        call has one, gathered from every rank where one has padding (an ``all_gather``), so that each rank's queries
        are masked against the whole rows' padding, wherever it is; ``positions``: this rank's share of the call's
        ``position_ids``, if given, gathered where some rank's do not run on from its offset (an ``all_gather``) for
        the packed rows' documents (:func:`packed_documents`; ``kernel_apart``: some layer's attention keeps them
        apart whatever the mask)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        padded = mask is not None and not bool(mask.all())
        restarts = positions is not None and _restarts(positions, rank * length)
        given = int(positions is not None)
        facts = [length, -length, rows, -rows, given, -given, int(padded), int(restarts)]
        facts = torch.tensor(facts, dtype=torch.int64, device=_device(group))
        dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=group)
        if int(facts[0]) != length or int(-facts[1]) != length:
            raise ValueError(
                f"StreamBP: the sequence split across {size} ranks gives them different lengths "
                f"({int(-facts[1])} to {int(facts[0])} tokens): split every row into equal shares (pad the "
                "sequence to a multiple of the split, e.g. pad_to_multiple_of)."
            )
        if int(facts[2]) != rows or int(-facts[3]) != rows:
            raise ValueError(
                f"StreamBP: the sequence split across {size} ranks gives them different numbers of rows "
                f"({int(-facts[3])} to {int(facts[2])}): every rank holds its share of the same rows (the same "
                "per_device_train_batch_size on every rank of the group)."
            )
        if int(facts[4]) != int(-facts[5]):
            raise ValueError(
                f"StreamBP: position_ids are given on some of the {size} ranks of the sequence split and not on "
                "others: pass each rank's share of the global position ids on every rank, or on none."
            )
        whole = None
        if int(facts[6]):
            whole = _joined((mask if mask is not None else torch.ones(rows, length)).bool(), group)
        documents = ()
        if int(facts[7]):
            documents = packed_documents(_joined(positions, group), mask is not None, whole is not None, kernel_apart)
        return cls(group, rank, size, length, whole, documents, draws)

    @property
    def offset(self) -> int:
        """The global position of this rank's first token."""
        return self.rank * self.length

    @property
    def end(self) -> int:
        """The global position after this rank's last token: the length of its key/value store."""
        return self.offset + self.length

    def gather_prefix(self, store: CarryStore) -> None:
        """Fill positions [0, offset) of every slot of ``store`` (whose own positions [offset, end) are written) with
        the earlier ranks' keys/values, in ``size - 1`` rounds of point-to-point exchanges per key and value: in round
        k, this rank sends its own to rank + k and receives rank - k's (one share's buffer each way at a time)."""
        for slot in sorted(store.kv):
            for full in store.kv[slot]:
                mine = full[:, :, self.offset : self.end].contiguous()
                for k in range(1, self.size):
                    source = self.rank - k
                    got = torch.empty_like(mine) if source >= 0 else None
                    self._exchange(mine if self.rank + k < self.size else None, self.rank + k, got, source)
                    if got is not None:
                        full[:, :, self._positions(source)] = got

    def returned_grads(self, grads: KV) -> KV:
        """What the later ranks' queries hand back for this rank's keys/values: per slot, the sums over every later
        rank of their key and value gradient sums at positions [offset, end), (batch, kv_heads, L, head_dim) each
        (``None`` on the last rank); ``grads`` are this rank's sums over [0, end). In ``size - 1`` rounds per key and
        value: in round k, this rank sends rank - k its positions' part and adds what rank + k sends (in that order,
        so the sum is the same on every run)."""
        returned = {}
        for slot in sorted(grads):
            pair = []
            for g in grads[slot]:
                total = None
                for k in range(1, self.size):
                    target, source = self.rank - k, self.rank + k
                    sent = g[:, :, self._positions(target)].contiguous() if target >= 0 else None
                    got = g.new_empty((*g.shape[:2], self.length, *g.shape[3:])) if source < self.size else None
                    self._exchange(sent, target, got, source)
                    if got is not None:
                        total = got if total is None else total.add_(got)
                pair.append(total)
            returned[slot] = tuple(pair)
        return returned

    def _positions(self, rank: int) -> slice:
        """The global positions rank ``rank`` holds."""
        return slice(rank * self.length, (rank + 1) * self.length)

    def _exchange(self, sent: torch.Tensor | None, target: int, got: torch.Tensor | None, source: int) -> None:
        """Send ``sent`` to group rank ``target`` and receive ``got`` from group rank ``source`` at once (each where
        not ``None``)."""
        ops = []
        if sent is not None:
            ops.append(dist.P2POp(dist.isend, sent, group=self.group, group_peer=target))
        if got is not None:
            ops.append(dist.P2POp(dist.irecv, got, group=self.group, group_peer=source))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    @property
    def returns_grads(self) -> bool:
        """Whether later ranks attend to this rank's keys/values (every rank but the last)."""
        return self.rank + 1 < self.size


def packed_documents(positions: torch.Tensor, masked: bool, padded: bool, kernel_apart: bool) -> tuple[int, ...]:
    """Where the documents of packed rows start (but the first), as a split call keeps them apart: ``positions`` are
    the whole rows' position ids (batch, T), which restart where a document starts (a step other than 1:
    transformers' packed-sequence detection; per-axis positions, (axes, batch, T), hold no packed rows). One process
    keeps the documents apart in a call without an attention mask that builds no key/value cache (``masked`` False:
    transformers' mask does), and otherwise attends across them, unless some layer's kernel keeps them apart whatever
    the mask (``kernel_apart``: flash attention's variable-length kernel, on rows without padding), a case refused
    here: the split's layers see only the shares' masks. Rows whose documents start at different positions are
    refused too (TRL's padding-free batches are one row)."""
    if positions.dim() != 2:
        return ()
    steps = positions.diff(dim=1) != 1
    if not bool(steps.any()):
        return ()
    if masked:
        if not kernel_apart or padded:
            return ()
        raise ValueError(
            "StreamBP cannot split packed rows (position_ids that restart) given with an attention mask across ranks "
            "for a flash attention model: pass them without attention_mask (as TRL's padding-free batches come), or "
            "train without the sequence split."
        )
    if not bool((steps == steps[:1]).all()):
        raise ValueError(
            "StreamBP cannot split packed rows whose documents start at different positions across ranks: pack the "
            "batch into one row (TRL's padding_free=True does), or train without the sequence split."
        )
    return tuple(int(i) + 1 for i in steps[0].nonzero().flatten().tolist())


def _restarts(positions: torch.Tensor, offset: int) -> bool:
    """Whether a rank's share of position ids (batch, L) may hold a document's start: they restart within the share,
    or do not begin at its offset (per-axis positions: never, :func:`packed_documents`)."""
    if positions.dim() != 2:
        return False
    return bool((positions.diff(dim=1) != 1).any() or (positions[:, 0] != offset).any())


def _joined(mine: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's share of a (batch, length) tensor, joined along the positions (one ``all_gather``)."""
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _device(group: dist.ProcessGroup) -> torch.device:
    """The device the group's collectives take tensors on: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
