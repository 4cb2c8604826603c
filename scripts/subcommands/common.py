"""What the subcommands share: the repository's paths, the dispatch from an entry point (``scripts/cpu.py``,
``scripts/gpu.py``, ``scripts/sim.py``) to a subcommand's module, the command line a record keeps, and the reading of
a measurement made in a fresh process (its record printed as one line ``PREFIX{json}``).

Nothing here imports torch: ``scripts/sim.py step`` must import the simulator's ``fakecuda`` before it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1]
REPO_ROOT = SCRIPTS.parent
BENCH_DIR = REPO_ROOT / "benchmarks"
CUDASIM = REPO_ROOT.parent / "shared" / "cudasim"  # the CUDA memory simulator, beside the checkout


def entry(name: str) -> Path:
    """The entry point ``scripts/NAME.py`` (a subcommand's fresh processes run through it)."""
    return SCRIPTS / f"{name}.py"


def command_line(entry_name: str, subcommand: str, argv: list[str]) -> str:
    """A run as its records show it: ``python scripts/ENTRY.py SUBCOMMAND ARGS``."""
    return shlex.join(["python", f"scripts/{entry_name}.py", subcommand, *argv])


def prefixed_record(
    cmd: list[str], prefix: str, env: dict[str, str] | None = None, timeout: float | None = None
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess]:
    """Runs ``cmd`` (a measurement in a fresh process): the last record it printed as ``PREFIX{json}`` (None if
    none) and the finished process. A timeout raises ``subprocess.TimeoutExpired``."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    return (json.loads(lines[-1][len(prefix) :]) if lines else None), proc


def dispatch(doc: str, commands: dict[str, tuple[str, str]], argv: list[str] | None = None) -> Any:
    """``ENTRY.py COMMAND ARGS``: runs ``main(ARGS, prog)`` of the command's module in this package.

    ``commands``: name -> (module, one line of help). ``ENTRY.py --help`` shows ``doc``'s first paragraph, the
    commands with their lines, the rest of ``doc`` and how to get a command's options (``ENTRY.py COMMAND --help``).
    Only the chosen module is imported (one needs the simulator, another matplotlib or the tests' model zoo).
    """
    prog = Path(sys.argv[0]).name
    summary, _, details = doc.strip().partition("\n\n")
    details += (
        f"\n\n`python scripts/{prog} COMMAND --help` gives a command's options; its module in\n"
        "scripts/subcommands/ says exactly what it measures."
    )
    parser = argparse.ArgumentParser(
        prog=prog, description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, line) in commands.items():
        subparsers.add_parser(name, help=line, add_help=False)  # its own parser reads the rest, --help included
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(f"{__package__}.{commands[args.command][0]}")
    return module.main(rest, prog=f"{prog} {args.command}")
