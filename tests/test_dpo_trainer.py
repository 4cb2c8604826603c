"""StreamDPOTrainer against TRL's DPOTrainer on the same inputs: parameter updates, metrics and loss curves for every
loss type and reference setup TRL 1.16 offers."""

from __future__ import annotations

import pytest
from datasets import Dataset
from helpers import ShapesEveryStep, args, assert_same_training, load_model, load_tokenizer, tiny_dataset
from trl import DPOConfig, DPOTrainer

from streambp_trl import StreamDPOConfig, StreamDPOTrainer
from streambp_trl.engine import is_streaming

LOSS_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


def _same(tmp_path, **options):
    """:func:`helpers.assert_same_training` against DPOTrainer on 8 preference pairs."""
    dataset = tiny_dataset("preference", 8)
    return assert_same_training(
        (DPOTrainer, DPOConfig), (StreamDPOTrainer, StreamDPOConfig), tmp_path, dataset, **options
    )


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_step_equals_dpo_trainer_for_every_loss_type(tmp_path, loss_type):
    extra = {"label_smoothing": 1e-3} if loss_type == "exo_pair" else {}  # TRL requires it for EXO
    _same(tmp_path, loss_type=[loss_type], **extra)


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},  # MPO-style combination
        {"use_weighting": True},  # WPO
        {"ld_alpha": 0.5},
        {"label_smoothing": 0.1, "loss_type": ["robust"]},
        {"f_divergence_type": "js_divergence"},
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"precompute_ref_log_probs": True},
        {"stream_keep_every": 2},  # the policy's layer inputs rebuilt in segments of two
    ],
    ids=[
        "weighted_combination",
        "use_weighting",
        "ld_alpha",
        "label_smoothing",
        "js_divergence",
        "accum2",
        "precompute",
        "keep_every2",
    ],
)
def test_one_step_equals_dpo_trainer_with_options(tmp_path, overrides):
    _same(tmp_path, **overrides)


def test_given_ref_model(tmp_path):
    _same(tmp_path, ref_model=True, beta=0.5)


def test_lora_reference_is_the_adapter_disabled_policy(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    _, ours = _same(tmp_path, peft_config=lora, learning_rate=0.5, max_steps=2)
    assert ours.ref_model is None


@pytest.mark.slow
def test_loss_curve_equals_dpo_trainer(tmp_path):
    _, ours = _same(tmp_path, max_steps=4, learning_rate=0.05, sync_ref_model=True, ref_model_sync_steps=2)
    assert len([h for h in ours.state.log_history if "loss" in h]) == 4


@pytest.mark.slow
def test_three_steps_build_no_full_mask_or_logits_reference_passes_included(tmp_path):
    """Pairs of ~210 tokens in chunks of 16: no tensor with two dimensions of at least 150 in any of three steps
    (policy and reference passes), so no (T x T) mask or score and no (tokens x vocab) logits (vocab 512, widest other
    weight dimension 128)."""
    sentence = " The first letter of the word is the one it starts with, and we count from there."
    rows = [
        {"prompt": f"Question: {i}{sentence * 2}\nAnswer:", "chosen": sentence * 9, "rejected": f" {i}{sentence * 8}"}
        for i in range(3)
    ]
    record = ShapesEveryStep()
    trainer = StreamDPOTrainer(
        model=load_model(),
        args=args(
            StreamDPOConfig,
            tmp_path,
            max_steps=3,
            per_device_train_batch_size=1,
            max_length=None,
            stream_chunk_size=16,
            logits_chunk_size=16,
        ),  # fmt: skip
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer(),
        callbacks=[record],
    )
    trainer.train()
    assert record.streaming == [True] * 3 and is_streaming(trainer.accelerator.unwrap_model(trainer.ref_model))
    lengths = {shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"}
    assert lengths and min(lengths) >= 200  # the rows really are long, for the policy and the reference
    assert [(op, s) for op, s in record.recorder.shapes if sum(d >= 150 for d in s) >= 2] == []
