"""Data-parallel training over two CPU processes (gloo): DDP and FSDP2 give the gradients of one process on the whole
batch, with one gradient reduction (and, for FSDP2, one parameter gather) per layer and backward, however many chunks
each layer streams."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_each_close, torchrun
from models import batch, tiny_model

from streambp_trl import enable_streambp

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYERS = 3


def _run(tmp_path, wrap: str, chunk: int) -> dict:
    out = tmp_path / f"{wrap}_{chunk}.pt"
    args = ("--wrap", wrap, "--chunk", str(chunk), "--layers", str(LAYERS), "--out", str(out))
    torchrun("distributed_step.py", *args, log=tmp_path / f"{wrap}_{chunk}.log")
    return torch.load(out)


def _one_process_grads() -> dict:
    model = enable_streambp(tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=LAYERS), stream_chunk_size=4)
    ids, mask, labels = batch(batch_size=4, padding="right")
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path, wrap):
    grads, expected = _run(tmp_path, wrap, chunk=4)["grads"], _one_process_grads()
    assert_each_close(expected, grads, 1e-5, "gradient")


def test_fsdp2_gathers_and_reduces_once_per_layer_whatever_the_chunks(tmp_path):
    for chunk in (2, 7):
        collectives = _run(tmp_path, "fsdp2", chunk)["collectives"]
        # backward: each layer's parameters gathered again once, and every unit (layers + root) reduce-scattered once
        gathers = collectives.get("all_gather_single", 0) + collectives.get("all_gather_into_tensor", 0)
        reductions = collectives.get("reduce_scatter_single", 0) + collectives.get("reduce_scatter_tensor", 0)
        assert (gathers, reductions) == (LAYERS, LAYERS + 1), (chunk, collectives)


def test_ddp_reduces_every_parameter_once_whatever_the_chunks(tmp_path):
    for chunk in (2, 7):
        collectives = _run(tmp_path, "ddp", chunk)["collectives"]
        reduced = {k: v for k, v in collectives.items() if k.startswith("reduced ")}
        assert len(reduced) == len(_one_process_grads()) and set(reduced.values()) == {1}, (chunk, collectives)
