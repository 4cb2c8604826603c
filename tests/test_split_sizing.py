"""The reach of one sequence split across GPUs, as the memory model sizes it (``estimate_activation_bytes``'
``ranks``; ``streambp-trl max-len --gpus N``): estimates, not measurements (no multi-GPU machine here)."""

from __future__ import annotations

import json

import pytest

from streambp_trl import cli
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.choices import StepPlan

ALST_8_GPUS = 3_700_000  # ALST's published reach for Llama-3.1-8B on 8 H100s (DeepSpeed Ulysses, tiled MLP, offload)


def test_the_last_ranks_store_spans_the_whole_rows():
    """A split call on n tokens per rank across R ranks is sized for the last rank, whose key/value store and its
    gradient sums cover all R x n positions (the engine's store: :class:`~streambp_trl.layers.sequence_split.
    SequenceSplit`, ``end`` = the whole rows on the last rank): at least 4 kv db (R - 1) n more than one process on n
    tokens, and more with more ranks."""
    shape = mm.ModelShape.from_name("qwen3-8b")
    n, plan = 65536, StepPlan(2048)
    alone = mm.estimate_activation_bytes(shape, n, plan)
    for ranks in (2, 8):
        split = mm.estimate_activation_bytes(shape, n, plan, ranks=ranks)
        assert split - alone >= 4 * shape.kv_dim * 2 * (ranks - 1) * n
    assert mm.estimate_activation_bytes(shape, n, plan, ranks=8) > mm.estimate_activation_bytes(
        shape, n, plan, ranks=2
    )


def test_static_memory_is_sharded_across_the_gpus():
    shape = mm.ModelShape.from_name("qwen3-8b")
    one = mm.StepSetup(optimizer="adamw_8bit")
    eight = mm.StepSetup(optimizer="adamw_8bit", gpus=8)
    layer = (shape.params - shape.embedding_params) // shape.layers * 2
    assert mm.static_bytes(shape, eight) == -(-mm.static_bytes(shape, one) // 8) + 2 * layer
    with pytest.raises(ValueError, match="stream mode"):
        mm.StepSetup(mode="trl-default", gpus=8)


def _reach(tmp_path, model: str, gpus: int) -> dict:
    out = tmp_path / f"{gpus}.json"
    argv = ["max-len", "--model", model, "--optimizer", "adamw_8bit", "--gpu", "h100", "--host-memory", "125GiB"]
    cli.main([*argv, "--gpus", str(gpus), "--json", str(out)])
    return json.loads(out.read_text())


def test_max_len_gpus_sizes_the_whole_sequence_per_gpu(tmp_path, capsys):
    """Qwen3-8B, full fine-tuning with 8-bit AdamW, 80 GB cards, 125 GiB of host memory per GPU: the stream rows
    alone, each a whole sequence's length split in equal shares (multiples of the step) whose plan fits the card, and
    more GPUs reach further. With offload, 8 GPUs are estimated past ALST's published 3.7M tokens."""
    eight, many = _reach(tmp_path, "qwen3-8b", 8), _reach(tmp_path, "qwen3-8b", 32)
    out = capsys.readouterr().out
    assert "split across 8 GPUs" in out and "sharded across them by ZeRO-3" in out
    for result, gpus in ((eight, 8), (many, 32)):
        assert [row["mode"] for row in result["rows"]] == ["stream", "stream+offload"]
        assert "plans" not in result
        for row in result["rows"]:
            assert row["max_len"] % (gpus * 1024) == 0 and row["peak_bytes"] <= result["budget_bytes"]
            assert f"({row['max_len'] // gpus:,} tokens each)" in row["label"]
    lengths = {gpus: [row["max_len"] for row in r["rows"]] for gpus, r in ((8, eight), (32, many))}
    assert all(a < b for a, b in zip(lengths[8], lengths[32], strict=True))
    assert lengths[8][1] > ALST_8_GPUS


def test_max_len_gpus_is_estimated_only(capsys):
    with pytest.raises(SystemExit):
        cli.main(["max-len", "--model", "qwen3-tiny", "--device", "cpu", "--budget", "1GiB", "--gpus", "2"])
    assert "--gpus is estimated only" in capsys.readouterr().err
