"""Reward models: the engine's sequence-classification forward against plain autograd (float64), and
StreamRewardTrainer against TRL's RewardTrainer on the same inputs (updates and metrics), its memory shapes, its
activation offloading, the ``reward`` command and what is refused."""

from __future__ import annotations

import contextlib
import copy
import math
import subprocess
import sys

import pytest
import torch
import transformers
from datasets import Dataset
from helpers import (
    CHUNK,
    EXACT,
    MODEL,
    ROOT,
    ShapeRecorder,
    ShapesEveryStep,
    args,
    assert_each_close,
    assert_same_training,
    load_tokenizer,
    max_rel_grad_error,
    tiny_dataset,
    train,
)
from models import batch, tiny_model
from transformers import AutoModelForSequenceClassification
from trl import RewardConfig, RewardTrainer
from trl.trainer import reward_trainer as trl_reward_trainer
from trl.trainer.utils import pad

from streambp_trl import StreamRewardConfig, StreamRewardTrainer, disable_streambp, enable_streambp
from streambp_trl.engine import is_streaming

# -- the engine: sequence classifiers ------------------------------------------------------------------------------


def _classifier(family: str = "qwen3", num_labels: int = 1, dtype=torch.float64, **config):
    """A tiny ``family`` decoder as ``*ForSequenceClassification`` (pad id 0), training mode, fixed weights."""
    model_config = tiny_model(family, **config).config
    model_config.num_labels = num_labels
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(model_config).to(dtype).train()


def _labels(num_labels: int, problem_type: str | None, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    if problem_type == "single_label_classification":
        return torch.randint(0, num_labels, (rows,), generator=g)
    if problem_type == "multi_label_classification":
        return torch.randint(0, 2, (rows, num_labels), generator=g).double()
    return torch.randn(rows, num_labels, generator=g, dtype=torch.float64).squeeze(-1)


def _loss_and_grads(model, **call):
    model.zero_grad(set_to_none=True)
    out = model(**call)
    out.loss.backward()
    return out


@pytest.mark.parametrize(
    "family", ["qwen3", pytest.param("llama", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("padding", ["right", "left", "none"])
def test_streamed_classifier_equals_plain_autograd(family, padding):
    """Loss, pooled logits and every gradient within 1e-10 of the model's own forward, with each row's score read at
    its last non-pad token, for chunks of 1, 6 (dividing the 24 tokens), 7 (not dividing them) and 24."""
    reference = _classifier(family)
    ids, mask, _ = batch(batch_size=4, seq_len=24, padding=padding)
    labels = _labels(1, None, 4)
    ref = _loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    for chunk in (1, 6, 7, 24):
        streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
        out = _loss_and_grads(streamed, input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits.shape == ref.logits.shape == (4, 1)
        assert abs(out.loss.item() - ref.loss.item()) <= EXACT * abs(ref.loss.item())
        assert ((out.logits - ref.logits).norm() / ref.logits.norm()).item() < EXACT
        err, where = max_rel_grad_error(reference, streamed)
        assert err < EXACT, f"chunk {chunk}: relative gradient error {err:.3e} at {where}"
        assert streamed._streambp.final_norm() is not None  # the final norm ran on the read rows only


@pytest.mark.parametrize(
    ("num_labels", "problem_type"),
    [(1, None), (3, "single_label_classification"), (3, "multi_label_classification")],
    ids=["regression", "single_label", "multi_label"],
)
def test_every_problem_type_is_the_models_own_loss(num_labels, problem_type):
    reference = _classifier(num_labels=num_labels, problem_type=problem_type)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=6)
    ids, mask, _ = batch(batch_size=4, seq_len=23, padding="left")
    labels = _labels(num_labels, problem_type, 4)
    ref = _loss_and_grads(reference, input_ids=ids, attention_mask=mask, labels=labels)
    out = _loss_and_grads(streamed, input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (4, num_labels)
    assert abs(out.loss.item() - ref.loss.item()) <= EXACT * abs(ref.loss.item())
    assert max_rel_grad_error(reference, streamed)[0] < EXACT


def test_call_forms_are_the_models_own():
    """return_dict=False, output_hidden_states, inputs_embeds (read at the last position), no pad id (batch 1, and
    transformers' own error for more rows), eval mode (the model's own forward; streamed with stream_eval) and
    disable_streambp."""
    reference = _classifier()
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, _ = batch(batch_size=3, seq_len=13, padding="right")

    def same(a, b):
        return ((a - b).norm() / b.norm()).item() < EXACT

    as_tuple = streamed(input_ids=ids, attention_mask=mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and same(as_tuple[0], reference(input_ids=ids, attention_mask=mask).logits)
    ref = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    out = streamed(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) and same(out.hidden_states[-1], ref.hidden_states[-1])
    assert same(out.logits, ref.logits)
    embeds = reference.get_input_embeddings()(ids[:1]).detach()
    assert same(streamed(inputs_embeds=embeds).logits, reference(inputs_embeds=embeds).logits)
    for model in (reference, streamed):
        model.config.pad_token_id = None
    assert same(streamed(input_ids=ids[:1]).logits, reference(input_ids=ids[:1]).logits)
    with pytest.raises(ValueError, match="Cannot handle batch sizes > 1 if no padding token is defined"):
        streamed(input_ids=ids)
    for model in (reference, streamed):
        model.config.pad_token_id = 0
        model.eval()
    assert same(
        streamed(input_ids=ids, attention_mask=mask).logits, reference(input_ids=ids, attention_mask=mask).logits
    )
    eval_streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, stream_eval=True)
    with torch.no_grad():
        assert same(
            eval_streamed(input_ids=ids, attention_mask=mask).logits,
            reference(input_ids=ids, attention_mask=mask).logits,
        )
    disable_streambp(streamed)
    assert "forward" not in vars(streamed) and not is_streaming(streamed)


def _violations(shapes, long: int, num_labels: int, rows: int) -> list:
    """(T x T) tensors (masks, attention scores): two dimensions of at least ``long``; (tokens x num_labels) ones
    (scores at every position of the ``rows`` sequences): (rows, T, num_labels) or (rows x T, num_labels) with T at
    least ``long``. (The rotary embedding's (1, T, 1) positions are neither.)"""
    bad = []
    for op, shape in shapes:
        if sum(d >= long for d in shape) >= 2:
            bad.append(("T x T", op, shape))
        if len(shape) >= 2 and shape[-1] == num_labels and shape[0] >= rows and math.prod(shape[:-1]) >= rows * long:
            bad.append(("tokens x labels", op, shape))
    return bad


def test_streamed_classifier_builds_no_full_mask_or_logits():
    """96 tokens in chunks of 8, 3 labels: no (T x T) and no (tokens x num_labels) tensor; the stock model (the
    check can fail) builds both."""
    model = _classifier(num_labels=3, dtype=torch.float32)
    ids, mask, _ = batch(batch_size=2, seq_len=96, padding="left")
    with ShapeRecorder() as stock:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert {kind for kind, *_ in _violations(stock.shapes, 95, 3, rows=2)} == {"T x T", "tokens x labels"}
    enable_streambp(model, stream_chunk_size=8)
    with ShapeRecorder() as rec:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert _violations(rec.shapes, 95, 3, rows=2) == []


def test_other_sequence_classifiers_are_refused():
    """A *ForSequenceClassification whose forward is its own (pooling the engine does not reproduce) is refused by
    name, at enable_streambp and at the trainer's construction."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=101, num_labels=1, pad_token_id=0)
    gpt2 = transformers.GPT2ForSequenceClassification(config)
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification exactly: its sequence-classification forward"):
        enable_streambp(gpt2, stream_chunk_size=4)

    class OwnForward(transformers.Qwen3ForSequenceClassification):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    own = OwnForward(_classifier().config)
    with pytest.raises(ValueError, match="OwnForward exactly: its sequence-classification forward is its own code"):
        StreamRewardTrainer(
            model=own,
            args=args(StreamRewardConfig, "unused"),
            train_dataset=tiny_dataset("preference", 4),
            processing_class=load_tokenizer(),
        )


# -- the trainer against TRL's RewardTrainer ----------------------------------------------------------------------


def _reward_model():
    """configs/tiny_model as a sequence classifier with one label, its new score head drawn from seed 0 (the same
    for both trainers)."""
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=1, dtype=torch.float32)


def _same(tmp_path, dataset=None, **options):
    """:func:`helpers.assert_same_training` against RewardTrainer on 8 preference pairs (explicit prompts)."""
    dataset = tiny_dataset("preference", 8) if dataset is None else dataset
    return assert_same_training(
        (RewardTrainer, RewardConfig),
        (StreamRewardTrainer, StreamRewardConfig),
        tmp_path,
        dataset,
        model=_reward_model,
        **options,
    )


def test_one_step_equals_reward_trainer(tmp_path):
    """The update and the metrics TRL logs; then evaluation (streamed in eval mode) gives TRL's eval metrics."""
    ref, ours = _same(tmp_path)
    logged = [h for h in ours.state.log_history if "loss" in h][0]
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"} <= set(logged)
    assert logged["stream_chunk_size"] == CHUNK and "logits_chunk_size" not in logged  # no logit kernel runs
    assert isinstance(ours.maybe_activation_offload_context, contextlib.nullcontext)
    held_out = tiny_dataset("preference").select(range(8, 14))
    expected, metrics = ref.evaluate(held_out), ours.evaluate(held_out)
    for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward", "eval_min_reward"):
        assert abs(metrics[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), key


def test_margin_column(tmp_path):
    dataset = tiny_dataset("preference", 8).map(lambda row, i: {"margin": 0.5 * (i % 3) - 0.25}, with_indices=True)
    _same(tmp_path, dataset)


@pytest.mark.parametrize(
    "options",
    [{"center_rewards_coefficient": 0.3}, {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}],
    ids=["centering", "accum2"],
)
def test_one_step_equals_reward_trainer_with_options(tmp_path, options):
    _same(tmp_path, **options)


def test_lora_trains_the_score_head_in_full(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    _, ours = _same(tmp_path, peft_config=lora)
    trained = {n for n, p in ours.model.named_parameters() if p.requires_grad}
    assert any("score.modules_to_save" in n for n in trained) and any("lora_A" in n for n in trained)


class _LeftPadding(trl_reward_trainer.DataCollatorForPreference):
    """TRL's preference collator, padding on the left."""

    def torch_call(self, examples):
        ids = [torch.tensor(e[key]) for key in ("chosen_ids", "rejected_ids") for e in examples]
        out = {
            "input_ids": pad(ids, padding_value=self.pad_token_id, padding_side="left"),
            "attention_mask": pad([torch.ones_like(i) for i in ids], padding_value=0, padding_side="left"),
        }
        if "margin" in examples[0]:
            out["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float)
        return out


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_left_and_right_padding(tmp_path, monkeypatch, padding_side):
    """TRL's collator pads on the right; the same pairs padded on the left (both trainers' default collator swapped)
    read each score at the same last token and train the same."""
    if padding_side == "left":
        monkeypatch.setattr(trl_reward_trainer, "DataCollatorForPreference", _LeftPadding)
    _, ours = _same(tmp_path)
    collated = ours.data_collator([ours.train_dataset[i] for i in range(4)])
    padded = collated["attention_mask"] == 0
    assert padded.any() and padded[:, 0 if padding_side == "left" else -1].any()
    assert not padded[:, -1 if padding_side == "left" else 0].any()


@pytest.mark.parametrize("config_cls", [RewardConfig, StreamRewardConfig])
def test_activation_offloading_is_the_engines_checkpoint_offload(tmp_path, config_cls):
    """activation_offloading=True turns the engine's offload_checkpoints on and TRL's own offloading off (never
    both), in a copy of the config; the update is TRL's without offloading (the engine's offload is a no-op on the
    CPU, where TRL's own fails at construction: it needs an accelerator)."""
    config = args(config_cls, tmp_path, activation_offloading=True)
    trainer = StreamRewardTrainer(
        model=_reward_model(),
        args=config,
        train_dataset=tiny_dataset("preference", 8),
        processing_class=load_tokenizer(),
    )
    assert trainer.stream_options.offload_checkpoints and not trainer.args.activation_offloading
    assert isinstance(trainer.maybe_activation_offload_context, contextlib.nullcontext)
    assert config.activation_offloading and not getattr(config, "offload_checkpoints", False)
    if config_cls is StreamRewardConfig:
        dataset = tiny_dataset("preference", 8)
        _, expected = train(RewardTrainer, RewardConfig, tmp_path, dataset, model=_reward_model)
        _, update = train(
            StreamRewardTrainer, config_cls, tmp_path, dataset, model=_reward_model, activation_offloading=True
        )
        assert_each_close(expected, update, 1e-5)


@pytest.mark.slow
def test_reward_step_builds_no_full_mask_or_token_scores(tmp_path):
    """Pairs of ~220 tokens in chunks of 16, two steps: no tensor with two dimensions of at least 150 (no (T x T)
    mask or score; every dimension of the tiny model's weights is below 150) and no score or norm statistic at every
    position ((2, T, 1)); TRL's own step (the check can fail) builds both."""
    sentence = " The first letter of the word is the one it starts with, and we count from there."
    rows = [
        {"prompt": f"Question: {i}{sentence * 2}\nAnswer:", "chosen": sentence * 9, "rejected": f" {i}{sentence * 8}"}
        for i in range(3)
    ]
    records = {}
    for trainer_cls, config_cls, steps in (
        (RewardTrainer, RewardConfig, 1),
        (StreamRewardTrainer, StreamRewardConfig, 2),
    ):
        records[trainer_cls] = record = ShapesEveryStep()
        stream = {"stream_chunk_size": 16} if config_cls is StreamRewardConfig else {}
        config = args(config_cls, tmp_path, max_steps=steps, per_device_train_batch_size=1, max_length=None, **stream)
        trainer = trainer_cls(
            model=_reward_model(),
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=load_tokenizer(),
            callbacks=[record],
        )
        trainer.train()
        lengths = {shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"}
        assert lengths and min(lengths) >= 200
    assert records[StreamRewardTrainer].streaming == [True] * 2
    kinds = {kind for kind, *_ in _violations(records[RewardTrainer].recorder.shapes, 150, 1, rows=2)}
    assert kinds == {"T x T", "tokens x labels"}
    assert _violations(records[StreamRewardTrainer].recorder.shapes, 150, 1, rows=2) == []


# -- the command line -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_config_trains_and_saves_a_sequence_classifier(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", "reward", "--config", "configs/reward_tiny.yaml",
         "--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Model saved to {tmp_path}" in out.stdout + out.stderr
    assert "'accuracy'" in out.stdout + out.stderr and "'stream_chunk_size': 16" in out.stdout + out.stderr
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert type(model).__name__ == "Qwen3ForSequenceClassification" and model.config.num_labels == 1


def test_command_refuses_lora_without_seq_cls_task_type():
    from streambp_trl.cli import UsageError, parse_args, train

    parsed = parse_args("reward", ["--config", str(ROOT / "configs" / "reward_tiny.yaml"), "--use_peft", "true"])
    with pytest.raises(UsageError, match="set `lora_task_type: SEQ_CLS` \\(got 'CAUSAL_LM'\\)"):
        train("reward", *parsed)


def test_hub_example_config_parses():
    from streambp_trl.cli import parse_args

    config = str(ROOT / "configs" / "reward_qwen3_8b.yaml")
    _, training_args, model_args, _ = parse_args(
        "reward", ["--config", config, "--use_cpu", "true", "--bf16", "false"]
    )
    assert model_args.model_name_or_path == "Qwen/Qwen3-8B" and model_args.lora_task_type == "SEQ_CLS"
    assert isinstance(training_args, StreamRewardConfig) and training_args.max_length == 65536
