"""The command line's arguments: TRL's ``TrlParser`` over the objective's configs, the YAML config (its inputs looked
up next to it), the reward functions of RL objectives and the launch checks; every mistake a one-line
:class:`UsageError` naming the fix."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from trl import ScriptArguments, TrlParser

from ..trainers.objectives import OBJECTIVES, Objective

# config fields that name inputs, and those of each `datasets:` entry: looked up next to the config file first
_INPUT_FIELDS = (
    "model_name_or_path",
    "reward_model_name_or_path",
    "teacher_model_name_or_path",
    "dataset_name",
    "chat_template_path",
    "deepspeed",
)
_DATASET_INPUT_FIELDS = ("path", "data_dir", "data_files")
# what launchers set for the number of processes of a run (torchrun, MPI)
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


class UsageError(ValueError):
    """A mistake in the command or its config; ``main`` prints it as one line, ``streambp-trl CMD: error: ...``."""


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


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

    from ..rewards import REWARDS

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
            raise UsageError(
                f"Unknown reward function {name!r}: give one of {sorted(REWARDS)}, a function of trl.rewards, or a "
                "dotted import path (my_lib.rewards.my_reward)."
            )
    if not rewards:
        raise UsageError("Give the rewards to train on: `reward_funcs` (names or import paths) and/or a reward model.")
    return rewards


def script_arguments(objective: Objective) -> type:
    """TRL's script arguments of ``objective``'s command, with its rewards where its trainer scores generations."""
    return RewardScriptArguments if objective.rewards else ScriptArguments


def _next_to(value, base: Path):
    """``value`` (a path, or a list or mapping of paths) with each relative path that exists under ``base`` made
    absolute there; anything else (a Hub name, ``json``, a path found only from the current directory) as it is."""
    if isinstance(value, str):
        return str(base / value) if not os.path.isabs(value) and (base / value).exists() else value
    if isinstance(value, list):
        return [_next_to(v, base) for v in value]
    if isinstance(value, dict):
        return {k: _next_to(v, base) for k, v in value.items()}
    return value


def read_config(path: str) -> dict:
    """The fields of a YAML config file, with the inputs it names (model, data files, reward model, chat template,
    DeepSpeed config) that exist relative to the file's directory made absolute: the config runs from any directory.
    Other paths, ``output_dir`` among them, stay relative to the current directory."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(
            f"config file {path!r} not found (relative to {os.getcwd()}): give the path of a YAML file, e.g. "
            "--config configs/sft_tiny.yaml"
        )
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"config file {path} is not valid YAML: {_one_line(error)}") from error
    if not isinstance(config, dict):
        raise UsageError(f"config file {path} must hold a YAML mapping of fields (`max_steps: 10`, ...).")
    base = file.resolve().parent
    for key in _INPUT_FIELDS:
        if isinstance(config.get(key), str):  # (`deepspeed` may be the DeepSpeed config itself)
            config[key] = _next_to(config[key], base)
    for entry in config.get("datasets") or []:
        for key in _DATASET_INPUT_FIELDS if isinstance(entry, dict) else ():
            if key in entry:
                entry[key] = _next_to(entry[key], base)
    return config


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: ...)`` after each option's help, unless the help already says its default."""

    def _get_help_string(self, action):
        return action.help if "(default" in (action.help or "") else super()._get_help_string(action)


class _Parser(TrlParser):
    """``TrlParser`` whose mistakes raise :class:`UsageError` (argparse would print the usage of all ~400 options),
    that takes TRL's command lines as ``trl CMD`` does and a little more, and lists the stream options apart:

    * every boolean field takes a bare ``--flag`` (True) and ``--no_flag`` (False) besides ``--flag true|false``: TRL's
      parser gives ``--no_X`` only to fields whose default is True, and neither form to ``bool | None`` fields whose
      default is decided later (``bf16``; ``gradient_checkpointing``, which a ``Stream*Config`` leaves unset so that
      its default is the current name, ``activation_checkpointing``);
    * an ``int | str`` field (``stream_chunk_size``) is read as given, for the config to check: TRL's parser would
      convert every value to int, ``'auto'`` included;
    * the options a ``Stream*Config`` adds to TRL's are one titled group of ``--help``, and a help text that says its
      default is not given a second ``(default: ...)``."""

    def __init__(self, dataclass_types, **kwargs):
        super().__init__(dataclass_types, formatter_class=_HelpFormatter, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message}; `{self.prog} --help` lists the options")

    @staticmethod
    def _parse_dataclass_field(parser, dataclass_field):
        hint = dataclass_field.type
        if hint == int | str:
            dataclass_field = copy.copy(dataclass_field)
            dataclass_field.type = str
        unset_flag = hint in (bool, bool | None) and dataclass_field.default is None  # its default decided later
        if unset_flag and "nargs" not in dataclass_field.metadata:
            dataclass_field = copy.copy(dataclass_field)
            dataclass_field.metadata = {**dataclass_field.metadata, "nargs": "?", "const": True}
        TrlParser._parse_dataclass_field(parser, dataclass_field)
        negative = f"--no_{dataclass_field.name}"
        if unset_flag and negative not in parser._option_string_actions:  # (TRL's gives it where the default is True)
            help_text = f"Sets {dataclass_field.name} to False."
            parser.add_argument(
                negative,
                negative.replace("_", "-"),
                action="store_false",
                dest=dataclass_field.name,
                default=dataclass_field.default,
                help=help_text,
            )

    def _add_dataclass_arguments(self, dtype):
        from ..trainers.stream_config import STREAM_FIELDS, StreamArguments

        if not issubclass(dtype, StreamArguments):
            return super()._add_dataclass_arguments(dtype)
        group = self.add_argument_group(
            "stream options (streambp-trl)",
            "How the stream engine chunks each decoder layer and the LM head; the other options are TRL's.",
        )
        hints = typing.get_type_hints(dtype)
        for dataclass_field in dataclasses.fields(dtype):
            if dataclass_field.init:
                dataclass_field.type = hints[dataclass_field.name]
                parser = group if dataclass_field.name in STREAM_FIELDS else self
                self._parse_dataclass_field(parser, dataclass_field)
        return None

    def unknown(self, names: list[str], where: str, hint: str = "") -> UsageError:
        """The error for ``names`` (config fields or ``--options``) that no argument takes, with the closest ones
        (and ``hint``, where they belong to another command)."""
        fields = sorted({action.dest for action in self._actions})
        hints = []
        for name in names:
            prefix = "--" if name.startswith("-") else ""
            field = name.lstrip("-")
            # the closest among the fields of the same family first (``lora_rank``: ``lora_r``, not ``local_rank``)
            family = [f for f in fields if f.split("_")[0] == field.split("_")[0]]
            close = difflib.get_close_matches(field, family, n=1) or difflib.get_close_matches(field, fields, n=1)
            hints.append(f"{name} (did you mean {prefix}{close[0]}?)" if close else name)
        return UsageError(f"unknown {where}: {', '.join(hints)}; {hint or f'`{self.prog} --help` lists the options'}")


def _other_objectives(name: str, fields: list[str], context: list[str] = ()) -> list[str]:
    """The other commands whose config has every one of ``fields``; of those, the ones whose config knows most of
    ``context`` (every key of the file ``fields`` came from). ``dpo`` alone for a DPO config given to ``sft``;
    ``dpo``, ``kto``, ``grpo``, ... for ``beta`` alone, which each of them takes."""
    known = {}
    for other, objective in OBJECTIVES.items():
        names = {f.name for cls in (objective.config, script_arguments(objective)) for f in dataclasses.fields(cls)}
        if other != name and fields and set(fields) <= names:
            known[other] = len(names & set(context))
    return [other for other, n in known.items() if n == max(known.values())]


def _belongs(others: list[str], what: str) -> str:
    """``what`` naming ``others``, and the command(s) to run: ``the file looks like a DPO config: run `streambp-trl
    dpo``` for ``what`` = ``the file looks like {a} {label} config``; ``""`` without another command."""
    if not others:
        return ""
    labels = [other.upper() if len(other) <= 4 else other for other in others]
    label = labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} or {labels[-1]}"
    article = "an" if label[0] in "AEFHILMNORSX" else "a"
    commands = " or ".join(f"`streambp-trl {other}`" for other in others)
    return f"{what.format(a=article, label=label)}: run {commands}"


def _option(arg: str) -> str:
    """The field an ``--option`` or ``--option=value`` argument sets (``--max-steps`` and ``--max_steps`` alike)."""
    return arg.split("=")[0].lstrip("-").replace("-", "_") if arg.startswith("--") else ""


def parse_args(name: str, argv: list[str]) -> tuple:
    """(script, training, model, dataset) arguments of ``streambp-trl <name> ARGV``: TRL's dataclasses, with the
    values of the ``--config`` file (:func:`read_config`) as defaults and the command line over them."""
    from trl import DatasetMixtureConfig, ModelConfig

    objective = OBJECTIVES[name]
    parser = _Parser(
        (script_arguments(objective), objective.config, ModelConfig, DatasetMixtureConfig), prog=f"streambp-trl {name}"
    )
    argv = list(argv)
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 == len(argv):
            raise UsageError("--config needs a file: --config FILE.yaml")
        path = argv[at + 1]
        del argv[at : at + 2]
        config = read_config(path)
        for key, value in (config.pop("env", None) or {}).items():  # as TrlParser does
            os.environ[key] = str(value)
        unknown = parser.set_defaults_with_config(**config)[::2]
        if unknown:
            names = [key.removeprefix("--") for key in unknown]
            hint = _belongs(_other_objectives(name, names, list(config)), "the file looks like {a} {label} config")
            raise parser.unknown(names, f"field in {path}", hint)
    elif not {"-h", "--help"} & set(argv) and "model_name_or_path" not in {_option(a) for a in argv}:
        raise UsageError(
            f"no config: give one, `streambp-trl {name} --config FILE.yaml` (configs/{name}_tiny.yaml trains a tiny "
            f"model on a CPU), or --model_name_or_path and a dataset; `streambp-trl {name} --help` lists the options"
        )
    try:
        *parsed, remaining = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except UsageError:
        raise
    except ValueError as error:  # a value the config classes refuse (their __post_init__)
        if "support bf16" in str(error):  # transformers' "Your setup doesn't support bf16/gpu", naming no flag
            raise UsageError(
                "bf16 (TRL's default) needs a GPU that supports it, and this machine has none: set `--bf16 false` "
                "(`bf16: false` in a config) to train in float32 (and `--use_cpu true` to say the CPU is meant)"
            ) from error
        raise UsageError(_one_line(error)) from error
    if remaining:
        options = [a for a in remaining if a.startswith("-")] or remaining
        hint = _belongs(_other_objectives(name, [_option(a) for a in options]), "{label} options")
        raise parser.unknown(options, "option", hint)
    model_args = parsed[2]
    if (model_args.load_in_4bit or model_args.load_in_8bit) and not model_args.use_peft:
        bits = "4" if model_args.load_in_4bit else "8"
        raise UsageError(
            f"--load_in_{bits}bit quantizes the base weights, which then train no more: add adapters to train, "
            "--use_peft true (QLoRA), or drop the flag to train every weight"
        )
    return tuple(parsed)


def _check_launch(training_args) -> None:
    """Refuse a launch whose processes would not train together, each alone (on the CPU)."""
    launched = max(int(os.environ.get(name, "1")) for name in _WORLD_SIZE_VARIABLES)
    accelerate_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if accelerate_cpu and "MASTER_ADDR" in os.environ and launched == 1 and "LOCAL_RANK" not in os.environ:
        raise UsageError(
            "`accelerate launch --cpu` starts one process whatever --num_processes says: drop --cpu, and launch "
            "`accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes N -m streambp_trl.cli ...` "
            "with `use_cpu: true` in the training config (the tiny configs have it), or `torchrun --nproc_per_node N "
            "-m streambp_trl.cli ...`"
        )
    if launched > 1 and training_args.world_size == 1:
        raise UsageError(
            f"{launched} processes were launched, but each would train alone: without GPUs set `use_cpu: true` "
            "(--use_cpu true) so that they train as one data-parallel group on the CPU (gloo)"
        )
