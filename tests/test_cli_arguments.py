"""The ``streambp-trl`` parser in process (no training): TRL's own command lines parse unchanged, the stream options'
help, and the one-line errors of a config for another objective."""

import importlib.util
import re
import shlex

import pytest
import torch
from helpers import ROOT

from streambp_trl.cli import UsageError, parse_args
from streambp_trl.cli.arguments import _Parser
from streambp_trl.trainers.objectives import OBJECTIVES
from streambp_trl.trainers.stream_config import STREAM_FIELDS


def _script_examples(objective: str) -> list[list[str]]:
    """The command lines in the docstring of TRL's own ``trl/scripts/<objective>.py`` (its ``python trl/scripts/...``
    examples), split as a shell would."""
    source = open(importlib.util.find_spec(f"trl.scripts.{objective}").origin).read()
    blocks = re.findall(r"python trl/scripts/\w+\.py \\\n((?:[ \t]+.*\\\n)*[ \t]+.*)", source)
    return [shlex.split(block.replace("\\\n", " ")) for block in blocks]


# TRL's documented command lines (its trainer pages and scripts), with the boolean forms TRL's parser takes:
# a bare `--flag`, `--flag True`, `--no_flag`.
DOCUMENTED = {
    "sft": "--model_name_or_path Qwen/Qwen2-0.5B --dataset_name trl-lib/Capybara --learning_rate 2.0e-5 "
    "--num_train_epochs 1 --packing --per_device_train_batch_size 2 --gradient_accumulation_steps 8 "
    "--gradient_checkpointing --eos_token '<|im_end|>' --eval_strategy steps --eval_steps 100 --output_dir out "
    "--no_gradient_checkpointing",
    "dpo": "--dataset_name trl-lib/ultrafeedback_binarized --model_name_or_path Qwen/Qwen2-0.5B-Instruct "
    "--learning_rate 5.0e-7 --per_device_train_batch_size 2 --gradient_checkpointing --bf16 --output_dir out "
    "--no_remove_unused_columns --use_peft --lora_r 32 --lora_alpha 16",
    "kto": "--dataset_name trl-lib/kto-mix-14k --model_name_or_path=trl-lib/qwen1.5-1.8b-sft "
    "--lr_scheduler_type=cosine --warmup_steps 0.1 --logging_first_step --gradient_checkpointing True "
    "--output_dir=out",
    "grpo": "--model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K --reward_funcs "
    "accuracy_reward --output_dir out --bf16 --gradient_checkpointing --log_completions --num_generations 4",
    "rloo": "--model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K --reward_funcs "
    "accuracy_reward --output_dir out --bf16 True --gradient_checkpointing --log_completions",
    "reward": "--model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized "
    "--output_dir out --per_device_train_batch_size 8 --num_train_epochs 1 --gradient_checkpointing True "
    "--learning_rate 1.0e-5 --eval_strategy steps --eval_steps 50 --max_length 2048 --bf16",
    "distillation": "--model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path "
    "Qwen/Qwen2.5-1.5B-Instruct --dataset_name trl-lib/ultrafeedback-prompt --learning_rate 2.0e-5 "
    "--num_train_epochs 1 --output_dir out --gradient_checkpointing --no_bf16",
}


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_trl_command_lines_parse_unchanged(objective):
    """Each line parses as TRL's parser reads it (`--use_cpu`: TRL's default bf16 needs a GPU or the CPU asked
    for); TRL's own script examples too, where the installed script has them."""
    lines = [shlex.split(DOCUMENTED[objective]), *_script_examples(objective)]
    for argv in lines:
        script, training, model, _ = parse_args(objective, [*argv, "--use_cpu"])
        assert script.dataset_name and model.model_name_or_path and training.output_dir
    assert _script_examples("sft") and _script_examples("dpo")  # the extraction finds TRL's examples


@pytest.mark.parametrize(
    "flags, checkpointing, bf16",
    [
        ([], True, True),
        (["--gradient_checkpointing"], True, True),
        (["--no_gradient_checkpointing"], False, True),
        (["--no-gradient-checkpointing", "--bf16"], False, True),
        (["--activation_checkpointing", "false", "--no_bf16"], False, False),
        (["--no_activation_checkpointing", "--bf16", "False"], False, False),
        (["--gradient_checkpointing", "--no_gradient_checkpointing"], False, True),
    ],
)
def test_boolean_flags_take_no_value_and_a_no_form(flags, checkpointing, bf16):
    _, training, _, _ = parse_args("sft", ["--model_name_or_path", "m", "--use_cpu", *flags])
    assert training.activation_checkpointing is checkpointing and training.gradient_checkpointing is checkpointing
    assert training.bf16 is bf16


def test_a_config_value_is_overridden_by_a_bare_or_valued_flag():
    config = str(ROOT / "configs" / "sft_tiny.yaml")
    _, training, _, _ = parse_args("sft", ["--config", config, "--assistant_only_loss", "false", "--bf16"])
    assert training.assistant_only_loss is False and training.bf16 is True


def _help(objective: str) -> str:
    config_cls = OBJECTIVES[objective].config
    return _Parser((config_cls,), prog=f"streambp-trl {objective}").format_help()


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_stream_options_are_one_titled_group_each_default_once(objective):
    text = _help(objective)
    title = "stream options (streambp-trl):"
    assert text.count(title) == 1
    group = text[text.index(title) :]
    group = group[: group.find("\n\n", group.index("\n  --"))]
    options = re.findall(r"^  (--\w+)", group, flags=re.MULTILINE)
    # a boolean whose default is decided later (offload_checkpoints, stream_keep_attention: None, planned per call)
    # has its --no_ form too
    negated = {"offload_checkpoints", "stream_keep_attention"}
    assert options == [f"--{p}{name}" for name in STREAM_FIELDS for p in ("", "no_")[: 1 + (name in negated)]]
    entries = re.split(r"\n  (?=--)", group)[1:]
    for entry in entries:
        assert " ".join(entry.split()).count("(default") == 1, entry
    assert "(default: each batch shape's plan captures them where they fit)" in " ".join(group.split())


def test_every_option_of_trl_is_an_option_of_ours():
    """Every option string `trl sft` takes (TRL's TrlParser over its SFTConfig) is one of ours too."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    theirs = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))._option_string_actions
    config_cls = OBJECTIVES["sft"].config
    ours = _Parser((ScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig))._option_string_actions
    assert set(theirs) <= set(ours)


def test_a_bare_flag_without_its_objective_is_still_an_error():
    with pytest.raises(UsageError, match="unknown option: --beta"):
        parse_args("sft", ["--model_name_or_path", "m", "--use_cpu", "--beta", "0.1"])


# --- the one-line errors of a command that cannot train ---------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a bf16 GPU")
def test_trl_default_bf16_on_a_cpu_names_the_flag():
    """transformers said "Your setup doesn't support bf16/gpu", naming no flag."""
    with pytest.raises(UsageError) as error:
        parse_args("sft", ["--model_name_or_path", "m", "--dataset_name", "d"])
    assert str(error.value) == (
        "bf16 (TRL's default) needs a GPU that supports it, and this machine has none: set `--bf16 false` "
        "(`bf16: false` in a config) to train in float32 (and `--use_cpu true` to say the CPU is meant)"
    )
    assert parse_args("sft", ["--model_name_or_path", "m", "--bf16", "false"])[1].bf16 is False


@pytest.mark.parametrize(
    "objective, config, says",
    [
        # (every field of the tiny DPO file is a KTO field too)
        (
            "sft",
            "dpo_tiny.yaml",
            "beta; the file looks like a DPO or KTO config: run `streambp-trl dpo` or `streambp-trl kto`",
        ),
        ("dpo", "sft_tiny.yaml", "assistant_only_loss; the file looks like an SFT config: run `streambp-trl sft`"),
        ("sft", "grpo_tiny.yaml", "; the file looks like a GRPO config: run `streambp-trl grpo`"),
    ],
)
def test_a_config_of_another_objective_names_its_command(objective, config, says):
    path = str(ROOT / "configs" / config)
    with pytest.raises(UsageError) as error:
        parse_args(objective, ["--config", path])
    assert str(error.value).startswith(f"unknown field in {path}: ") and str(error.value).endswith(says)
    # a field several objectives take names each of them (it named DPO alone)
    with pytest.raises(UsageError) as error:
        parse_args("sft", ["--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--beta", "0.2"])
    assert str(error.value) == (
        "unknown option: --beta; DPO, KTO, GRPO, RLOO or distillation options: run `streambp-trl dpo` or "
        "`streambp-trl kto` or `streambp-trl grpo` or `streambp-trl rloo` or `streambp-trl distillation`"
    )


def test_a_misspelt_option_suggests_the_closest_of_its_family():
    """``--lora_rank`` suggested ``--local_rank`` (closer as a string); the closest ``lora_*`` field comes first."""
    with pytest.raises(UsageError, match=r"unknown option: --lora_rank \(did you mean --lora_r\?\)"):
        parse_args("sft", ["--config", str(ROOT / "configs" / "sft_tiny.yaml"), "--lora_rank", "8"])


def test_a_data_file_as_dataset_name_loads_by_its_extension(tmp_path):
    """``--dataset_name configs/data/tiny_chat.jsonl`` said the existing file could not be found."""
    from trl import DatasetMixtureConfig, ScriptArguments

    from streambp_trl.cli.run import _load_dataset

    file = ROOT / "configs" / "data" / "tiny_chat.jsonl"
    dataset = _load_dataset(ScriptArguments(dataset_name=str(file)), DatasetMixtureConfig())
    assert len(dataset["train"]) == len(file.read_text().splitlines()) and "messages" in dataset["train"].features
    other = tmp_path / "rows.dat"
    other.write_text(file.read_text())
    with pytest.raises(UsageError, match=r"is a file whose format its extension does not say .*data_files: FILE"):
        _load_dataset(ScriptArguments(dataset_name=str(other)), DatasetMixtureConfig())


def test_a_training_set_emptied_by_preparing_is_one_line():
    """``--max_length 16`` with ``assistant_only_loss`` dropped every row and ended in a sampler's traceback."""
    from types import SimpleNamespace

    from streambp_trl.cli.run import _check_rows

    script = SimpleNamespace(dataset_train_split="train")
    args = SimpleNamespace(max_length=16, assistant_only_loss=True, completion_only_loss=None)
    with pytest.raises(UsageError) as error:
        _check_rows(SimpleNamespace(train_dataset=[], args=args), script)
    assert str(error.value) == (
        "no training rows left: preparing split 'train' dropped every row (truncated to max_length=16, no token left "
        "to train with assistant_only_loss); raise max_length, or check the dataset's columns"
    )
    _check_rows(SimpleNamespace(train_dataset=[{"input_ids": [1]}], args=args), script)


@pytest.mark.parametrize(
    ("argv", "expected"), [([], None), (["--offload_checkpoints"], True), (["--no_offload_checkpoints"], False)]
)
def test_offload_checkpoints_is_planned_unless_given(argv, expected):
    """offload_checkpoints left out is None (each call's plan decides); a bare flag or its --no_ form fixes it."""
    _, training, _, _ = parse_args("sft", ["--model_name_or_path", "m", "--use_cpu", "--bf16", "false", *argv])
    assert training.offload_checkpoints is expected and training.to_options().offload_checkpoints is expected


def test_stream_kv_mode_none_on_a_command_line_says_to_omit_the_flag():
    """``--stream_kv_mode None`` reaches the config as the string 'None' (TRL's parser types it as str): refused,
    naming the way to get the plan; the flag left out gives the plan (None)."""
    argv = ["--model_name_or_path", "m", "--use_cpu", "--bf16", "false"]
    assert parse_args("sft", argv)[1].stream_kv_mode is None
    with pytest.raises((ValueError, UsageError), match="omit the flag"):
        parse_args("sft", [*argv, "--stream_kv_mode", "None"])
