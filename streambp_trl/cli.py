"""The ``streambp-trl`` command: one subcommand per objective, each parsed by TRL's ``TrlParser``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# name -> (one-line help, entry point taking the remaining arguments)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], None]]] = {}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="streambp-trl",
        description="Fine-tune with TRL trainers whose backpropagation streams along the sequence (StreamBP).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, (help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help()
        sys.exit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    COMMANDS[argv[0]][1](argv[1:])


if __name__ == "__main__":
    main()
