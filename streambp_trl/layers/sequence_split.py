"""One sequence split across the ranks of a process group, streamed on each: the key/value exchange of a layer call.

Rank q of a group of R holds positions [q L, (q + 1) L) of every row (``length`` L tokens each, the same on every
rank), as DeepSpeed's Ulysses data path hands them out, and runs every layer on them chunk by chunk as on one
process, in global positions: its chunks start at ``offset`` = q L, and its key/value store covers [0, (q + 1) L).
Attention sees every earlier position of the whole sequence through that store:

* Forward. Each rank first runs its chunks up to their cache update (the collecting pass: keys/values only, no
  query, no attention), then the ranks all-gather those keys/values (:meth:`SequenceSplit.gather_prefix`): rank q
  writes ranks 0..q-1's into positions [0, q L) of its store. Its chunks then run as on one process against that
  prefix. The backward's collecting pass does the same (unless the forward captured the store).
* Backward. Rank q's chunks run last to first as on one process; the key/value gradient sums of positions before
  ``offset`` (what its queries took from earlier ranks) are sent to the ranks holding them (one ``all_to_all`` per
  key and value, :meth:`SequenceSplit.returned_grads`), which receive dK_ret, dV_ret for their own positions, summed
  over every later rank. Each rank then backpropagates those through its chunks' key/value projections alone (a
  collecting pass with grad, :meth:`~.call.backward.ChunkBackward`), adding to its input and parameter gradients:

      dx[:, c] += d(K_c, V_c)/dx_c^T (dK_ret[:, :, c], dV_ret[:, :, c]),  dθ likewise.

  By linearity of the chain rule that completes each gradient: the chunk backward covered every path from x_c but
  the one through later ranks' queries, and this pass covers that one. So every rank's layer backward runs at once,
  no rank waits on another's chunks.

Randomness: each chunk's random state is drawn independently (:meth:`~.rng.RngState.drawn`, salted by the rank), so
the collecting pass, the chunk's forward and every recompute of it draw the same numbers.

Memory beyond one process's plan on L tokens: the store's prefix ((batch, kv_dim) per earlier position per layer,
so the last rank holds the whole sequence's keys/values of the layer in progress), the gathered keys/values
(R L positions, transient) and the returned gradients' buffers (R L positions, transient).

Served: layers of one softmax attention (dense, grouped-query, sliding window), with padding anywhere in the rows
(each rank's queries are masked against the whole rows' padding mask, gathered once per call); positions come from
``position_ids`` (global: given, or the rank's offset on). Packed rows, a user-given 4D mask and a layer with a family
adapter (a recurrent mixer, whose state would cross ranks; shared or compressed keys/values) are refused by name.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .carry.store import KV, CarryStore


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of a sequence split across ``group``: rank ``rank`` of ``size``, ``length`` tokens each;
    ``padding``: the (batch, size x length) padding mask of the whole rows (``True``: a token), gathered from every
    rank's share, or ``None`` where no rank has padding."""

    group: dist.ProcessGroup
    rank: int
    size: int
    length: int
    padding: torch.Tensor | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, length: int, padding: torch.Tensor | None = None) -> SequenceSplit:
        """The split of a call whose rows hold ``length`` tokens on this rank, checked to be the same on every rank of
        ``group`` (one three-element ``all_reduce``); ``padding``: this rank's (batch, length) 2D attention mask, if
        any, gathered from every rank where one has padding (an ``all_gather``), so that each rank's queries are
        masked against the whole rows' padding, wherever it is."""
        padded = padding is not None and not bool(padding.all())
        facts = torch.tensor([length, -length, int(padded)], dtype=torch.int64, device=_device(group))
        dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=group)
        if int(facts[0]) != length or int(-facts[1]) != length:
            raise ValueError(
                f"StreamBP: the sequence split across {dist.get_world_size(group)} ranks gives them different lengths "
                f"({int(-facts[1])} to {int(facts[0])} tokens): split every row into equal shares (pad the "
                "sequence to a multiple of the split, e.g. pad_to_multiple_of)."
            )
        size, whole = dist.get_world_size(group), None
        if int(facts[2]):
            mine = (padding if padding is not None else torch.ones(1, length)).bool()
            parts = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(parts, mine.contiguous(), group=group)
            whole = torch.cat(parts, dim=1)
        return cls(group, dist.get_rank(group), size, length, whole)

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
        the earlier ranks' keys/values: one ``all_gather`` per key and value."""
        L = self.length
        for slot in sorted(store.kv):
            for full in store.kv[slot]:
                mine = full[:, :, self.offset : self.end].contiguous()
                parts = [torch.empty_like(mine) for _ in range(self.size)]
                dist.all_gather(parts, mine, group=self.group)
                for q in range(self.rank):
                    full[:, :, q * L : (q + 1) * L] = parts[q]

    def returned_grads(self, grads: KV) -> KV:
        """What the later ranks' queries hand back for this rank's keys/values: per slot, the sums over every later
        rank of their key and value gradient sums at positions [offset, end), (batch, kv_heads, L, head_dim) each;
        ``grads`` are this rank's sums over [0, end). One ``all_to_all`` per key and value (rank q sends each earlier
        rank its positions' part, zeros to itself and the later ones)."""
        L = self.length
        returned = {}
        for slot in sorted(grads):
            pair = []
            for g in grads[slot]:
                send = g.new_zeros((self.size, *g.shape[:2], L, *g.shape[3:]))
                for q in range(self.rank):
                    send[q] = g[:, :, q * L : (q + 1) * L]
                received = torch.empty_like(send)
                dist.all_to_all_single(received, send, group=self.group)
                pair.append(received[self.rank + 1 :].sum(0) if self.rank + 1 < self.size else None)
            returned[slot] = tuple(pair)
        return returned

    @property
    def returns_grads(self) -> bool:
        """Whether later ranks attend to this rank's keys/values (every rank but the last)."""
        return self.rank + 1 < self.size


def _device(group: dist.ProcessGroup) -> torch.device:
    """The device the group's collectives take tensors on: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
