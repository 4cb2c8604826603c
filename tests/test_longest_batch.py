"""A trainer refuses at construction a config whose longest batch (per_device_train_batch_size x max_length, in the
rows TRL's collator builds) fits no way of running within its memory_budget: one :class:`NoPlanFits` line naming the
settings and the shape, before any step. A config whose longest batch fits constructs and trains. No network."""

from __future__ import annotations

import pytest
from helpers import args, load_model, load_tokenizer, tiny_dataset

from streambp_trl import StreamDPOConfig, StreamDPOTrainer, StreamSFTConfig, StreamSFTTrainer
from streambp_trl.sizing.auto import NoPlanFits

BUDGET = "24MiB"  # the tiny model, its gradients and AdamW's moments, and some thousands of tokens' activations


def _sft(tmp_path, **overrides):
    config = args(StreamSFTConfig, tmp_path, optim="adamw_torch", stream_chunk_size="auto", memory_budget=BUDGET)
    for name, value in overrides.items():
        setattr(config, name, value)
    return StreamSFTTrainer(
        model=load_model(), args=config, train_dataset=tiny_dataset("text", 8), processing_class=load_tokenizer()
    )


def test_a_max_length_no_plan_fits_is_refused_at_construction(tmp_path):
    with pytest.raises(NoPlanFits) as error:
        _sft(tmp_path, max_length=1 << 20)
    text = str(error.value)
    assert text.startswith(
        "StreamSFTTrainer, the longest batch of this config (per_device_train_batch_size=4, max_length=1048576): "
        "StreamBP: 4 x 1,048,576 tokens fit in no way of running within memory_budget"
    ), text
    assert "Longest lengths per sequence that would fit: " in text and "\n" not in text


def test_a_max_length_that_fits_constructs_and_trains(tmp_path):
    trainer = _sft(tmp_path, max_length=256)
    trainer.train()
    assert trainer.model._streambp.auto.last_shape[0] == 4


def test_packed_padding_free_batches_are_checked_as_one_row(tmp_path):
    """``packing=True`` ("bfd", padding-free): the examples of a batch are one row."""
    with pytest.raises(NoPlanFits, match=r"padding-free: one row\): StreamBP: 1 x 4,194,304 tokens "):
        _sft(tmp_path, max_length=1 << 20, packing=True)


def test_preference_batches_are_checked_with_chosen_and_rejected_stacked(tmp_path):
    config = args(
        StreamDPOConfig, tmp_path, optim="adamw_torch", stream_chunk_size="auto", memory_budget=BUDGET,
        max_length=1 << 20, per_device_train_batch_size=3,
    )  # fmt: skip
    with pytest.raises(NoPlanFits, match=r"2 rows per example \(chosen and rejected\)\): StreamBP: 6 x 1,048,576 "):
        StreamDPOTrainer(
            model=load_model(),
            args=config,
            train_dataset=tiny_dataset("preference", 6),
            processing_class=load_tokenizer(),
        )


def test_without_a_memory_figure_nothing_is_checked(tmp_path):
    """On the CPU without a memory_budget no figure is known: the longest batch is not refused."""
    config = args(StreamSFTConfig, tmp_path, stream_chunk_size="auto", max_length=1 << 20)
    trainer = StreamSFTTrainer(
        model=load_model(), args=config, train_dataset=tiny_dataset("text", 8), processing_class=load_tokenizer()
    )
    assert trainer.model._streambp.auto is not None
