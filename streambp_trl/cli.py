"""The ``streambp-trl`` command: one subcommand per objective, each parsed by TRL's ``TrlParser``.

``streambp-trl {sft,dpo,kto} --config FILE.yaml [--any_config_field value ...]`` reads TRL's script, model and
dataset arguments and the objective's ``Stream*Config``, as ``trl sft`` / ``trl dpo`` / ``trl kto`` do, and trains
with the objective's ``Stream*Trainer``. Unknown fields in the YAML file or on the command line are errors.
``streambp-trl max-len --model NAME [...]`` (plain argparse) gives the longest sequence a step fits, per mode.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from trl import ScriptArguments

# objectives whose trainers score generated completions with reward functions
_RL = ("grpo", "rloo")


@dataclass
class RewardScriptArguments(ScriptArguments):
    """TRL's script arguments plus the rewards of ``grpo`` / ``rloo`` runs, as TRL's own scripts take them."""

    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model (Hub name or local directory), scored with the functions."}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: names from streambp_trl.rewards (length_reward, sentence_format_reward) or "
            "trl.rewards (accuracy_reward, think_format_reward, reasoning_accuracy_reward), or dotted import paths."
        },
    )


def reward_functions(script_args: RewardScriptArguments) -> list:
    """The reward models and functions a config names; unknown names fail before any model is loaded."""
    import trl.rewards

    from .rewards import REWARDS

    rewards: list = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in REWARDS:
            rewards.append(REWARDS[name])
        elif "." not in name and callable(getattr(trl.rewards, name, None)):
            rewards.append(getattr(trl.rewards, name))
        elif "." in name:
            module, attribute = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            rewards.append(getattr(importlib.import_module(module), attribute))
        else:
            raise ValueError(
                f"Unknown reward function {name!r}: give one of {sorted(REWARDS)}, a function of trl.rewards, or a "
                "dotted import path (my_lib.rewards.my_reward)."
            )
    if not rewards:
        raise ValueError("Give the rewards to train on: `reward_funcs` (names or import paths) and/or a reward model.")
    return rewards


def _objective(name: str) -> tuple[type, type]:
    """The (config, trainer) classes of an objective."""
    from . import trainers

    upper = name.upper()
    return getattr(trainers, f"Stream{upper}Config"), getattr(trainers, f"Stream{upper}Trainer")


def _command(name: str) -> Callable[[list[str]], None]:
    def run(argv: list[str]) -> None:
        from trl import DatasetMixtureConfig, ModelConfig, TrlParser

        config_cls, _ = _objective(name)
        script_cls = RewardScriptArguments if name in _RL else ScriptArguments
        parser = TrlParser((script_cls, config_cls, ModelConfig, DatasetMixtureConfig), prog=f"streambp-trl {name}")
        train(name, *parser.parse_args_and_config(argv))

    return run


def _load_dataset(script_args, dataset_args):
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    raise ValueError("Give a dataset: `datasets:` (a list of {path, data_files, ...}) or `dataset_name`.")


def train(objective: str, script_args, training_args, model_args, dataset_args) -> str:
    """Train as ``trl <objective>`` does, with the objective's ``Stream*Trainer``; returns the output directory."""
    from trl import get_peft_config, get_quantization_config

    _, trainer_cls = _objective(objective)
    rewards = {"reward_funcs": reward_functions(script_args)} if objective in _RL else {}

    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    if not model_args.model_name_or_path:
        raise ValueError("Give the model to train: `model_name_or_path` (a Hub name or a local directory).")
    dataset = _load_dataset(script_args, dataset_args)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        split, strategy = script_args.dataset_test_split, str(training_args.eval_strategy.value)
        if split not in dataset:
            raise ValueError(
                f"eval_strategy={strategy!r} needs an evaluation split, but the dataset has no "
                f"split {split!r} (it has {sorted(dataset)}). Set `dataset_test_split` to one of them, add a "
                "test split to the dataset, or set `eval_strategy: 'no'`."
            )
        eval_dataset = dataset[split]
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **rewards,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return training_args.output_dir


def _max_len(argv: list[str]) -> None:
    from .sizing.max_len import main

    main(argv)


# name -> (one-line help, entry point taking the remaining arguments)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], None]]] = {
    "sft": (
        "Supervised fine-tuning with StreamSFTTrainer (TRL's `trl sft` arguments plus the stream options).",
        _command("sft"),
    ),
    "dpo": (
        "Preference training with StreamDPOTrainer (TRL's `trl dpo` arguments plus the stream options).",
        _command("dpo"),
    ),
    "kto": (
        "Unpaired preference training with StreamKTOTrainer (TRL's `trl kto` arguments plus the stream options).",
        _command("kto"),
    ),
    "grpo": (
        "Online RL with StreamGRPOTrainer (TRL's `trl grpo` arguments, `reward_funcs`, the stream options).",
        _command("grpo"),
    ),
    "rloo": (
        "Online RL with StreamRLOOTrainer (TRL's `trl rloo` arguments, `reward_funcs`, the stream options).",
        _command("rloo"),
    ),
    "max-len": (
        "The longest sequence a training step fits, per mode: measured on a GPU, or estimated (--gpu-memory).",
        _max_len,
    ),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="streambp-trl",
        description="Fine-tune with TRL trainers whose backpropagation streams along the sequence (StreamBP). "
        "Each command takes --config FILE.yaml and any config field as --field value; --help lists them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    COMMANDS[argv[0]][1](argv[1:])


if __name__ == "__main__":
    main()
