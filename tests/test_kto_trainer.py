"""StreamKTOTrainer against TRL's KTOTrainer on the same inputs: parameter updates, metrics and loss curves for both
loss types (with the KL term where TRL computes it) and every reference setup."""

from __future__ import annotations

import pytest
from helpers import assert_same_training, tiny_dataset
from trl import KTOConfig, KTOTrainer

from streambp_trl import StreamKTOConfig, StreamKTOTrainer


def _same(tmp_path, **options):
    """:func:`helpers.assert_same_training` against KTOTrainer on 8 rows, desirable and undesirable, not
    alternating."""
    dataset = tiny_dataset("unpaired_preference").select([0, 1, 2, 5, 6, 9, 10, 11])
    return assert_same_training(
        (KTOTrainer, KTOConfig), (StreamKTOTrainer, StreamKTOConfig), tmp_path, dataset, **options
    )


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_one_step_equals_kto_trainer_for_every_loss_type(tmp_path, loss_type):
    _same(tmp_path, loss_type=loss_type)


@pytest.mark.parametrize(
    "overrides",
    [
        {"desirable_weight": 1.5, "undesirable_weight": 0.5, "beta": 0.3},
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"precompute_ref_log_probs": True},
    ],
    ids=["weights_and_beta", "accum2", "precompute"],
)
def test_one_step_equals_kto_trainer_with_options(tmp_path, overrides):
    _same(tmp_path, **overrides)


def test_given_ref_model(tmp_path):
    _same(tmp_path, ref_model=True)


def test_lora_reference_is_the_adapter_disabled_policy(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    _, ours = _same(tmp_path, peft_config=lora, learning_rate=0.5, max_steps=2)
    assert ours.ref_model is None


@pytest.mark.slow
def test_loss_curve_equals_kto_trainer(tmp_path):
    _, ours = _same(tmp_path, max_steps=4, learning_rate=0.05)
    assert len([h for h in ours.state.log_history if "loss" in h]) == 4
