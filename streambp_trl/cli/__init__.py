"""The ``streambp-trl`` command: one subcommand per objective, each parsed by TRL's ``TrlParser``.

``streambp-trl {sft,dpo,kto,grpo,rloo,distillation,reward} --config FILE.yaml [--any_config_field value ...]`` reads
TRL's script, model and dataset arguments and the objective's ``Stream*Config``, as ``trl sft`` / ``trl dpo`` /
... do, and trains with the objective's ``Stream*Trainer``. The inputs a config names (model, data files, reward or
teacher model) are looked up next to the config file first, so a config runs from any directory. A mistake in the
command or its config (an unknown field, a missing file, a model that is neither a directory nor reachable on the
Hub, a launch that would not train the processes it started) ends the command with one line naming it and the fix,
before any model or data is loaded; so does a config whose longest batch fits no way of running within its memory
(naming the longest length each way allows), when the trainer is built, and any other step that fits none, before
it runs.
``streambp-trl max-len --model NAME [...]`` (plain argparse) gives the longest sequence a step fits, per mode.
``streambp-trl --version`` prints the versions of the package, torch, transformers and TRL.

* :mod:`.arguments`: parsing (``TrlParser``, the YAML config, rewards, launch checks) and :class:`UsageError`;
* :mod:`.run`: loading the model and data and training.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..sizing.auto import NoPlanFits
from ..trainers.objectives import OBJECTIVES
from .arguments import RewardScriptArguments, UsageError, parse_args, read_config, reward_functions
from .run import train

__all__ = [
    "COMMANDS",
    "RewardScriptArguments",
    "UsageError",
    "main",
    "parse_args",
    "read_config",
    "reward_functions",
    "train",
    "versions",
]


def _command(name: str) -> Callable[[list[str]], None]:
    def run(argv: list[str]) -> None:
        train(name, *parse_args(name, argv))

    return run


def _max_len(argv: list[str]) -> None:
    from ..bench.max_len import main

    main(argv)


# name -> (one-line help, entry point taking the remaining arguments): one command per objective, and max-len
COMMANDS: dict[str, tuple[str, Callable[[list[str]], None]]] = {
    **{name: (objective.help, _command(name)) for name, objective in OBJECTIVES.items()},
    "max-len": (
        "The longest sequence a training step fits, per mode: measured on a GPU, or estimated (--gpu-memory).",
        _max_len,
    ),
}


def versions() -> str:
    """``streambp-trl X (torch X, transformers X, trl X)``."""
    import torch
    import transformers
    import trl

    from .. import __version__

    return (
        f"streambp-trl {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__})"
    )


def _cpu_for_deepspeed() -> None:
    """On a machine without an accelerator, tell DeepSpeed (when installed: the ``dev`` extra brings it, and
    transformers imports it) that the CPU is meant, through its own switch ``DS_ACCELERATOR=cpu``: it would choose
    the CPU anyway, with a warning on every run that it found no GPU. A value the user set is kept."""
    import torch

    # (a CUDA build names an accelerator type without any device of it: is_available, not current_accelerator)
    if "DS_ACCELERATOR" not in os.environ and not torch.accelerator.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _cpu_for_deepspeed()
    parser = argparse.ArgumentParser(
        prog="streambp-trl",
        description="Fine-tune with TRL trainers whose backpropagation streams along the sequence (StreamBP). "
        "Each command takes --config FILE.yaml and any config field as --field value; --help lists them.",
    )
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv or ["--help"])  # --help, --version: prints and exits
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    try:
        COMMANDS[argv[0]][1](argv[1:])
    except (UsageError, NoPlanFits) as error:  # a mistake, or a step that fits no way of running: one line
        sys.exit(f"streambp-trl {argv[0]}: error: {error}")
