"""StreamDistillationTrainer against TRL's DistillationTrainer on the same inputs and seed: the same parameter update
and logged metrics on given completions (off-policy data) and on the student's own samples (on-policy), for each
divergence, temperature, sampling filter, LoRA, gradient accumulation and teacher width; no (tokens x vocab) tensor
in a step, teacher included; the refusals; the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import MODEL, ROOT, ShapesEveryStep, args, assert_same_training, load_model, load_tokenizer, tiny_dataset
from transformers import AutoModelForCausalLM, Qwen3Config
from trl import DistillationConfig, DistillationTrainer

from streambp_trl import StreamDistillationConfig, StreamDistillationTrainer
from streambp_trl.engine import is_streaming

TEACHER = ROOT / "configs" / "tiny_teacher"  # wider than the student (hidden 96 against 64), the same vocabulary
ON_POLICY = dict(max_completion_length=8, temperature=0.9)


def wide_teacher():
    """The shipped tiny teacher, its logits sharpened (the tied embedding, hence the LM head, times 8) so that the
    divergence is far from zero."""
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)
    return teacher


def same_width_teacher():
    """A teacher of the student's shape with other random weights."""
    config = Qwen3Config.from_pretrained(MODEL)
    torch.manual_seed(7)
    teacher = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)
    return teacher


class GivenCompletions:
    """Generation replaced by the dataset's completions (off-policy data: not sampled from the student)."""

    completions: dict[tuple[int, ...], list[int]] = {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        return [list(self.completions[tuple(ids)]) for ids in prompt_ids]


class RecordedCompletions:
    """The student's own samples, recorded."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, has_tool_images=False):
        completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields, has_tool_images)
        self.__dict__.setdefault("sampled", []).extend(map(tuple, completion_ids))
        return completion_ids


def _given(dataset: Dataset) -> dict[tuple[int, ...], list[int]]:
    tokenizer = load_tokenizer()
    eos = [tokenizer.eos_token_id]
    return {
        tuple(tokenizer(row["prompt"])["input_ids"]): tokenizer(row["completion"])["input_ids"] + eos
        for row in dataset
    }


def _trainer(cls, teacher, generation):
    """``cls`` given its teacher (built by ``teacher`` for each trainer), with ``generation`` mixed in."""

    def __init__(self, *pos, **kwargs):
        cls.__init__(self, *pos, teacher_model=teacher(), **kwargs)

    return type(cls.__name__, (generation, cls), {"__init__": __init__})


def _same(tmp_path, *, on_policy=False, teacher=wide_teacher, **options):
    """:func:`helpers.assert_same_training` of the two trainers on 8 prompts, with the same teacher; the loss within
    relative 1e-5 too, and (on-policy) the same completions sampled, not all equal."""
    dataset = tiny_dataset("prompt_completion", 8)
    generation = RecordedCompletions if on_policy else GivenCompletions
    GivenCompletions.completions = _given(dataset)
    trl_pair = (_trainer(DistillationTrainer, teacher, generation), DistillationConfig)
    stream_pair = (_trainer(StreamDistillationTrainer, teacher, generation), StreamDistillationConfig)
    ref_trainer, ours = assert_same_training(
        trl_pair, stream_pair, tmp_path, dataset, **{**(ON_POLICY if on_policy else {}), **options}
    )
    assert is_streaming(ours.accelerator.unwrap_model(ours.teacher_model))
    for ref, log in zip(ref_trainer.state.log_history, ours.state.log_history, strict=True):
        if "loss" in ref:
            assert abs(log["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]) and ref["loss"] > 1e-2
    if on_policy:
        assert ours.sampled == ref_trainer.sampled and len(set(ours.sampled)) > 1
    return ref_trainer, ours


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_given_completions_one_step_equals_trl_for_each_divergence(tmp_path, beta):
    _same(tmp_path, beta=beta)


@pytest.mark.parametrize(
    "overrides",
    [
        {"beta": 0.5, "temperature": 0.6},
        {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
        {"teacher": same_width_teacher, "beta": 0.0},
    ],
    ids=["temperature", "accum2", "same_width_teacher"],
)
def test_given_completions_one_step_equals_trl_with_options(tmp_path, overrides):
    _same(tmp_path, **overrides)


@pytest.mark.parametrize(
    "overrides",
    [{"beta": 0.5}, {"beta": 1.0, "top_k": 20, "top_p": 0.9, "temperature": 0.7}],
    ids=["jsd", "reverse_kl_top_k_top_p"],
)
def test_on_policy_samples_and_step_equal_trl(tmp_path, overrides):
    _same(tmp_path, on_policy=True, **overrides)


def test_lora_student_equals_trl(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    _, ours = _same(tmp_path, peft_config=lora, beta=0.5, learning_rate=0.5)
    assert {n for n, p in ours.model.named_parameters() if p.requires_grad} == {
        n for n, _ in ours.model.named_parameters() if "lora_" in n
    }


@pytest.mark.slow
def test_on_policy_loss_curve_equals_trl(tmp_path):
    _same(tmp_path, on_policy=True, beta=0.5, max_steps=3, learning_rate=0.05)


def test_evaluation_loss_equals_trl(tmp_path):
    dataset = tiny_dataset("prompt_completion", 8)
    GivenCompletions.completions = _given(dataset)
    losses = []
    pairs = ((DistillationTrainer, DistillationConfig), (StreamDistillationTrainer, StreamDistillationConfig))
    for cls, config in pairs:
        trainer = _trainer(cls, wide_teacher, GivenCompletions)(
            model=load_model(),
            args=args(config, tmp_path / cls.__name__, beta=0.5, per_device_eval_batch_size=4),
            train_dataset=dataset,
            eval_dataset=dataset,
            processing_class=load_tokenizer(),
        )
        metrics = trainer.evaluate()
        losses.append((metrics["eval_loss"], metrics["eval_entropy"]))
    (ref_loss, ref_entropy), (loss, entropy) = losses
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss and abs(entropy - ref_entropy) <= 1e-5 * ref_entropy


def test_a_step_builds_no_full_mask_or_logits_teacher_included(tmp_path):
    """Prompts of ~60 tokens and completions of 200 (prompt + completion ~260) in chunks of 16: no tensor with two
    dimensions of at least 150 in the step (generation included), so no (T x T) mask or score and no
    (tokens x vocab) logits of either model."""
    sentence = " The first letter of the word is the one it starts with, and we count from there."
    record = ShapesEveryStep()
    trainer = _trainer(StreamDistillationTrainer, wide_teacher, RecordedCompletions)(
        model=load_model(),
        args=args(
            StreamDistillationConfig,
            tmp_path,
            per_device_train_batch_size=2,
            max_completion_length=200,
            generation_kwargs={"min_new_tokens": 200},
            stream_chunk_size=16,
            logits_chunk_size=16,
            stream_keep_activations=0,  # (every layer recomputed: the student's first input is rebuilt)
        ),
        train_dataset=Dataset.from_list([{"prompt": f"Question {i}:{sentence * 3}\nAnswer:"} for i in range(2)]),
        processing_class=load_tokenizer(),
        callbacks=[record],
    )
    trainer.train()
    assert record.streaming == [True] and is_streaming(trainer.accelerator.unwrap_model(trainer.teacher_model))
    lengths = [shape[1] for op, shape in record.recorder.shapes if op == "aten.embedding.default"]
    # long rows: the student's forward (its first layer's input rebuilt from the ids in backward) and the teacher's
    assert sum(n >= 250 for n in lengths) == 3
    assert [(op, s) for op, s in record.recorder.shapes if sum(d >= 150 for d in s) >= 2] == []


def test_refuses_no_teacher(tmp_path):
    with pytest.raises(ValueError, match="needs a teacher: pass `teacher_model`"):
        StreamDistillationTrainer(
            model=load_model(),
            args=args(StreamDistillationConfig, tmp_path),
            train_dataset=tiny_dataset("prompt_completion", 4),
            processing_class=load_tokenizer(),
        )


@pytest.mark.parametrize("hooked", ["student", "teacher"])
def test_a_hook_on_an_lm_head_is_refused_by_name(tmp_path, hooked):
    """The divergence kernel applies each model's LM head to its hidden states tile by tile and never calls the head:
    a hook on the student's or the teacher's lm_head would not run, so the step says so."""
    trainer = _trainer(StreamDistillationTrainer, wide_teacher, GivenCompletions)(
        model=load_model(),
        args=args(StreamDistillationConfig, tmp_path, max_steps=1),
        train_dataset=tiny_dataset("prompt_completion", 4),
        processing_class=load_tokenizer(),
    )
    GivenCompletions.completions = _given(tiny_dataset("prompt_completion", 4))
    model = trainer.model if hooked == "student" else trainer.teacher_model
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: None)
    with pytest.raises(ValueError, match="lm_head has a forward or backward hook.*disable_streambp"):
        trainer.train()


def test_refuses_a_teacher_the_engine_cannot_stream(tmp_path):
    teacher = wide_teacher()
    teacher.config.is_causal = False
    with pytest.raises(ValueError, match="Qwen3ForCausalLM exactly: its attention is bidirectional"):
        StreamDistillationTrainer(
            model=load_model(),
            teacher_model=teacher,
            args=args(StreamDistillationConfig, tmp_path),
            train_dataset=tiny_dataset("prompt_completion", 4),
            processing_class=load_tokenizer(),
        )


def test_a_plain_distillation_config_streams_with_the_defaults(tmp_path):
    trainer = StreamDistillationTrainer(
        model=load_model(),
        teacher_model=wide_teacher(),
        args=args(DistillationConfig, tmp_path),
        train_dataset=tiny_dataset("prompt_completion", 4),
        processing_class=load_tokenizer(),
    )
    assert trainer.stream_options.stream_chunk_size == "auto" and not trainer.args.activation_checkpointing
    assert is_streaming(trainer.model) and is_streaming(trainer.teacher_model)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, (None, 1.0)),
        ({"logit_scale": 0.5, "logits_scaling": 4.0}, (None, 0.5)),  # the first multiplier set wins
        ({"logits_scaling": 4.0}, (None, 0.25)),  # Granite divides
        ({"model_type": "hyperclovax", "logits_scaling": 4.0}, (None, 4.0)),  # HyperCLOVA X multiplies
        ({"lm_head_multiplier": 3.0, "final_logit_softcapping": 30.0}, (30.0, 3.0)),
    ],
)
def test_logit_transform_reads_the_config_as_trl_does(fields, expected):
    from types import SimpleNamespace

    from streambp_trl.engine.lm_forward import logit_transform

    assert logit_transform(SimpleNamespace(**{"model_type": "qwen3", **fields})) == expected


def test_command_line_without_a_teacher_says_what_to_give(tmp_path):
    from streambp_trl.cli import UsageError, parse_args, train

    parsed = parse_args(
        "distillation", ["--config", str(ROOT / "configs" / "distillation_tiny.yaml"), "--output_dir", str(tmp_path)]
    )
    parsed[1].teacher_model_name_or_path = None
    with pytest.raises(UsageError, match="Give the teacher: `teacher_model_name_or_path`"):
        train("distillation", *parsed)


@pytest.mark.slow
def test_tiny_config_trains_and_saves(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "streambp_trl.cli", "distillation", "--config", "configs/distillation_tiny.yaml",
         "--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Model saved to {tmp_path}" in out.stdout + out.stderr
    assert "'entropy'" in out.stdout + out.stderr and "'stream_chunk_size': 16" in out.stdout + out.stderr
    trained = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not torch.equal(trained.lm_head.weight, AutoModelForCausalLM.from_pretrained(MODEL).lm_head.weight)


def test_hub_example_config_parses():
    from streambp_trl.cli import parse_args

    _, training_args, model_args, _ = parse_args(
        "distillation",
        ["--config", str(ROOT / "configs" / "distillation_qwen3.yaml"), "--use_cpu", "true", "--bf16", "false"],
    )
    assert model_args.model_name_or_path == "Qwen/Qwen3-1.7B"
    assert training_args.teacher_model_name_or_path == "Qwen/Qwen3-8B"
    assert Path(training_args.output_dir).name and training_args.stream_chunk_size == 4096
