"""StreamGRPOTrainer and StreamRLOOTrainer against TRL's GRPOTrainer and RLOOTrainer on the same inputs and seed: the
same completions generated, the same parameter update, the same logged metrics, for every loss type and option."""

from __future__ import annotations

import pytest
from helpers import LengthReward, ShapesEveryStep, args, assert_same_training, load_model, load_tokenizer, tiny_dataset
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from streambp_trl import StreamGRPOConfig, StreamGRPOTrainer, StreamRLOOConfig, StreamRLOOTrainer
from streambp_trl.engine import is_streaming

GRPO_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
RL = dict(
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=8,
    temperature=0.7,
    logging_steps=1,
)


def _same(trl_pair, stream_pair, tmp_path, **options):
    """:func:`helpers.assert_same_training` on 8 prompts, rewarded by completion length: both trainers also
    generated the same completions (and not all equal)."""
    dataset = tiny_dataset("prompt_completion", 8).remove_columns("completion")
    ref_trainer, ours = assert_same_training(
        trl_pair, stream_pair, tmp_path, dataset, rewards=lambda: [LengthReward()], **{**RL, **options}
    )
    completions, ref_completions = ours.reward_funcs[0].seen, ref_trainer.reward_funcs[0].seen
    assert completions == ref_completions and len(set(completions)) > 1  # the same samples, and not all equal
    return ref_trainer, ours


GRPO = ((GRPOTrainer, GRPOConfig), (StreamGRPOTrainer, StreamGRPOConfig))
RLOO = ((RLOOTrainer, RLOOConfig), (StreamRLOOTrainer, StreamRLOOConfig))


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_one_step_equals_for_every_loss_type(tmp_path, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    _same(*GRPO, tmp_path, loss_type=loss_type, **extra)


@pytest.mark.parametrize(
    "overrides",
    [
        {"beta": 0.04},  # a reference model, streamed in eval mode
        {"importance_sampling_level": "sequence", "loss_type": "grpo"},
        {"num_iterations": 2, "max_steps": 2},
        {"gradient_accumulation_steps": 2, "steps_per_generation": 2, "per_device_train_batch_size": 2},
        {"epsilon": 0.1, "epsilon_high": 0.3, "delta": 1.5},
        {"top_entropy_quantile": 0.5},
        {"entropy_coef": 0.01},
        {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 3.0},
        {"cast_lm_head_to_fp32": True},
    ],
    ids=[
        "beta",
        "sequence_is",
        "num_iterations2",
        "accum2_spg2",
        "epsilons_delta",
        "top_entropy",
        "entropy_bonus",
        "adaptive_entropy",
        "lm_head_fp32",
    ],  # fmt: skip
)
def test_grpo_one_step_equals_with_options(tmp_path, overrides):
    _same(*GRPO, tmp_path, **overrides)


def test_grpo_lora_with_reference_from_the_disabled_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    _, ours = _same(*GRPO, tmp_path, peft_config=lora, beta=0.04, learning_rate=0.5)
    assert ours.ref_model is None


@pytest.mark.parametrize(
    "overrides", [{}, {"beta": 0.04}, {"num_iterations": 2, "max_steps": 2}], ids=["plain", "beta", "iter2"]
)
def test_rloo_one_step_equals(tmp_path, overrides):
    _same(*RLOO, tmp_path, **overrides)


@pytest.mark.slow
def test_three_steps_build_no_full_mask_or_logits_old_policy_and_reference_included(tmp_path):
    """Prompts of ~60 tokens and completions of 200 (prompt + completion ~260) in chunks of 16, with an old-policy
    pass (num_iterations 2) and a reference (beta 0.04): no tensor with two dimensions of at least 150 in any of
    three steps (generation included), so no (T x T) mask or score and no (tokens x vocab) logits."""
    from datasets import Dataset

    sentence = " The first letter of the word is the one it starts with, and we count from there."
    record = ShapesEveryStep()
    trainer = StreamGRPOTrainer(
        model=load_model(),
        reward_funcs=[LengthReward()],
        args=args(
            StreamGRPOConfig,
            tmp_path,
            max_steps=3,
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=200,
            generation_kwargs={"min_new_tokens": 200},
            num_iterations=2,
            beta=0.04,
            stream_chunk_size=16,
            logits_chunk_size=16,
            logging_steps=1,
            stream_keep_activations=0,  # (every layer recomputed: the policy's first input is rebuilt)
        ),  # fmt: skip
        train_dataset=Dataset.from_list([{"prompt": f"Question {i}:{sentence * 3}\nAnswer:"} for i in range(4)]),
        processing_class=load_tokenizer(),
        callbacks=[record],
    )
    trainer.train()
    assert record.streaming == [True] * 3 and is_streaming(trainer.accelerator.unwrap_model(trainer.ref_model))
    lengths = [shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"]
    # long rows: three policy passes (each with its first layer's input rebuilt from the ids in backward), and an
    # old-policy and a reference pass at each of the two generations
    assert sum(n >= 250 for n in lengths) == 3 * 2 + 2 * 2
    assert [(op, s) for op, s in record.recorder.shapes if sum(d >= 150 for d in s) >= 2] == []
