"""No (T x T) mask or score tensor and no (tokens x vocab) logits tensor is ever built by the engine."""

import math
from pathlib import Path

import pytest
import torch
from datasets import load_dataset
from helpers import ShapeRecorder, ShapesEveryStep
from models import VOCAB, batch, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head
from zoo import tiny_causal_lm

from streambp_trl import StreamSFTConfig, StreamSFTTrainer, enable_streambp

ROOT = Path(__file__).resolve().parents[1]

T, CHUNK, TILE = 96, 8, 8


def _violations(shapes):
    bad = []
    for op, shape in shapes:
        big = [d for d in shape if d >= T - 1]
        if len(big) >= 2:
            bad.append(("T x T", op, shape))
        if VOCAB in shape and any(d >= T // 2 for d in shape if d != VOCAB):
            bad.append(("tokens x vocab", op, shape))
    return bad


def _run(model, **call):
    ids, mask, labels = batch(seq_len=T, padding="left")
    with ShapeRecorder() as rec:
        model(input_ids=ids, attention_mask=mask, labels=labels, **call).loss.backward()
    return _violations(rec.shapes)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
@pytest.mark.parametrize("fused", [False, True])
def test_stream_builds_no_full_mask_or_logits(family, fused):
    model = enable_streambp(tiny_model(family, dtype=torch.float32), stream_chunk_size=CHUNK, logits_chunk_size=TILE)
    assert model.config.hidden_size < T // 2  # so the LM head weight (vocab x hidden) is not flagged
    assert _run(model, **({"fused_lm_head": True} if fused else {})) == []


def _state_size(config) -> int:
    """Elements of one sequence's recurrent state in one layer (Gated DeltaNet or Mamba2)."""
    if hasattr(config, "linear_num_value_heads"):
        return config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_hybrid_stream_builds_no_full_mask_logits_or_state_history(family):
    """A hybrid's streamed step: besides no (T x T) and no (tokens x vocab) tensor, no (T x state) one (a state per
    position); the stock model with padding is flagged (its attention layer's T x T mask)."""
    model = tiny_causal_lm(family, dtype=torch.float32)
    batch_size, state = 2, _state_size(model.config)
    assert model.config.hidden_size < T // 2

    def history(shapes):
        return [s for _, s in shapes if max(s, default=0) >= T - 1 and math.prod(s) >= batch_size * (T - 1) * state]

    ids, mask, labels = batch(seq_len=T, padding="left")
    with ShapeRecorder() as stock:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert "T x T" in {kind for kind, *_ in _violations(stock.shapes)}
    streamed = enable_streambp(model, stream_chunk_size=CHUNK, logits_chunk_size=TILE)
    with ShapeRecorder() as rec:
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert _violations(rec.shapes) == [] and history(rec.shapes) == []


def test_detector_flags_the_stock_model():
    """The check above can fail: stock transformers with padding builds a T x T mask and full logits."""
    kinds = {kind for kind, *_ in _run(tiny_model("qwen3", dtype=torch.float32))}
    assert kinds == {"T x T", "tokens x vocab"}
    model = tiny_model("qwen3", dtype=torch.float32)
    model.activation_checkpointing_enable()
    add_fused_lm_head(model)  # gradient checkpointing still builds the T x T mask
    assert "T x T" in {kind for kind, *_ in _run(model, fused_lm_head=True, use_cache=False)}


def test_second_trainer_step_builds_no_full_mask_or_logits(tmp_path):
    """The detector over a later StreamSFTTrainer step (packed 192-token rows, chunks of 16): no tensor with two
    dimensions of at least 150 (the tiny model's widest weight dimension other than its 512-token vocabulary is 128),
    so no (T x T) mask or score and no (tokens x vocab) logits."""
    model_dir = ROOT / "configs" / "tiny_model"
    record = ShapesEveryStep(step=1)
    trainer = StreamSFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=StreamSFTConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=2,
            packing=True,
            packing_strategy="wrapped",
            max_length=192,
            stream_chunk_size=16,
            logits_chunk_size=16,
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
        ),
        train_dataset=load_dataset("json", data_files=str(ROOT / "configs/data/tiny_text.jsonl"), split="train"),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[record],
    )
    trainer.train()
    assert record.streaming == [True, True]
    assert record.recorder.shapes, "the step was not recorded"
    lengths = {shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"}
    assert lengths and min(lengths) >= 192  # the rows really are long
    assert [(op, s) for op, s in record.recorder.shapes if sum(d >= 150 for d in s) >= 2] == []
