"""One streamed forward/backward of a tiny model across processes, for tests/test_distributed.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_step.py --wrap ddp|fsdp2 --chunk 4 --out F

Each rank takes its rows of a fixed batch (the same batch ``tests/test_distributed.py`` runs in one process), the
loss is summed over tokens and divided by the token count of the whole batch (times the world size, since DDP and
FSDP2 average gradients), so the gradients equal those of one process on the whole batch. Rank 0 writes the full
gradients and the number of each collective the backward issued to ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import batch, tiny_model  # noqa: E402

from streambp_trl import enable_streambp  # noqa: E402

COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


def count_collectives(counter: Counter) -> None:
    """Count every call of the collectives DDP and FSDP2 use (they look them up on ``torch.distributed``)."""
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, **kwargs):
            counter[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def main() -> None:
    faulthandler.dump_traceback_later(60, exit=True)  # a hung collective shows where, instead of hanging the suite
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), required=True)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = enable_streambp(
        tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=args.layers), stream_chunk_size=args.chunk
    )
    ids, mask, labels = batch(batch_size=4, padding="right")
    tokens = int((labels[:, 1:] != -100).sum())
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    counter: Counter = Counter()
    if args.wrap == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        names = {p: n for n, p in model.named_parameters()}

        def counting_allreduce(state, bucket):  # DDP reduces in C++; its comm hook sees every bucket
            counter["ddp_bucket_allreduce"] += 1
            for p in bucket.parameters():
                counter[f"reduced {names[p]}"] += 1
            return allreduce_hook(state, bucket)

        wrapped.register_comm_hook(None, counting_allreduce)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    loss = wrapped(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows], num_items_in_batch=tokens).loss
    count_collectives(counter)
    (loss * world).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    if rank == 0:
        torch.save({"grads": grads, "collectives": dict(counter)}, args.out)
    dist.barrier()
    os._exit(0)  # gloo's process-group teardown can hang on this machine; everything is written


if __name__ == "__main__":
    main()
