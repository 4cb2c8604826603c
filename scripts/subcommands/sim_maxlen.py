"""The longest simulated sequence of one training step within a memory budget, by bisection over
``sim.py step`` runs (``../shared/cudasim``, any named shape, LoRA); one JSON line per run, then the result.

Each trial is a fresh ``sim.py step`` process (its command is in its JSON line). ``--lo`` must fit and ``--hi``
must not (both are measured first, unless ``--trust-brackets``); the bisection then halves the bracket down to
``--step`` tokens. Take the brackets from the memory model's estimate (``streambp_trl.sizing.lengths.max_len``):
a step of a Gated DeltaNet hybrid takes minutes under the simulator (transformers' torch kernels). Usage::

    python scripts/sim.py max-len --model qwen3.5-9b --lora --grads-ready --mode gc --budget-gib 78 \\
        --lo 16384 --hi 32768 --step 2048
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from .common import command_line, entry


def trial(base: list[str], seq_len: int) -> dict:
    step = [*base, "--seq-len", str(seq_len)]
    out = subprocess.run(
        [sys.executable, str(entry("sim")), "step", *step], capture_output=True, text=True, check=False
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"sim.py step failed at {seq_len} tokens:\n{out.stderr[-3000:]}")
    record = json.loads(line)
    record["command"] = command_line("sim", "step", step)
    print(json.dumps(record), flush=True)
    return record


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-gib", type=float, default=78.0)
    p.add_argument("--lo", type=int, required=True, help="a length that fits")
    p.add_argument("--hi", type=int, required=True, help="a length that does not")
    p.add_argument("--step", type=int, default=1024, help="stop when the bracket is this narrow")
    p.add_argument("--trust-brackets", action="store_true", help="do not measure --lo and --hi first")
    a, rest = p.parse_known_args(argv)  # the rest goes to sim.py step (--model, --mode, --lora, ...)
    fits = {}

    def fit(n: int) -> bool:
        if n not in fits:
            fits[n] = trial(rest, n)["peak_gib"] <= a.budget_gib
        return fits[n]

    lo, hi = a.lo, a.hi
    if not a.trust_brackets and (not fit(lo) or fit(hi)):
        print(json.dumps({"result": "brackets do not hold", "lo": lo, "hi": hi, "fits": fits}), flush=True)
        return
    while hi - lo > a.step:
        mid = (lo + hi) // 2 // a.step * a.step
        lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    print(json.dumps({"result": "bisected", "longest_fitting": lo, "shortest_over": hi, "budget_gib": a.budget_gib}))
