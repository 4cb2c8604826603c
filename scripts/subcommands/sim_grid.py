"""Simulated CUDA peak memory of one forward+backward (``../shared/cudasim``), appended to a JSON-lines file.

Each (model, mode, length, options) runs the simulator's own ``sim.py`` (Qwen3 shapes) in a fresh process; the
record it prints gets the exact command and the memory model's estimate for the same setup
(``streambp_trl.bench.simulator.estimate_peak_gib``) added. Parameter gradients are allocated before the step
(``--grads-ready``: what every step after the first holds), unless ``--pending`` (a trainer's first micro-step).
Examples::

    python scripts/sim.py grid --model qwen3-8b qwen3-4b --mode streambp --seq-len 16384 32768 65536
    python scripts/sim.py grid --model qwen3-8b --mode streambp --offload --chunk 8192 --seq-len 1048576
    python scripts/sim.py grid --model qwen3-8b --mode streambp --keep-every 6 --seq-len 393216
    python scripts/sim.py grid --model qwen3-8b --mode gc gc+fused --seq-len 16384 32768
    python scripts/sim.py grid --model qwen3-8b --mode streambp --pending --seq-len 16384 \
        --stream-kwargs '{"kv_mode": "recompute", "keep_activations": 8}' --out benchmarks/sim_qwen3_8b_kept.jsonl

The records go to ``benchmarks/sim_qwen3_bf16.jsonl`` (``--out``); ``scripts/cpu.py report`` plots them and
``tests/test_memory_model.py`` holds the memory model to them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from streambp_trl.bench.simulator import SIMULATOR_MODES, estimate_peak_gib

from .common import BENCH_DIR, CUDASIM, REPO_ROOT

SIM = CUDASIM / "sim.py"
OUT = BENCH_DIR / "sim_qwen3_bf16.jsonl"


def run(
    model: str,
    mode: str,
    seq_len: int,
    chunk: int,
    offload: bool,
    timeout: int,
    keep_every: int = 1,
    extra: dict | None = None,
    pending: bool = False,
) -> dict:
    kwargs = {"verify": False, **({"offload_checkpoints": True} if offload else {}), **(extra or {})}
    if keep_every > 1:
        kwargs["keep_every"] = keep_every
    cmd = [sys.executable, str(SIM), "--model", model, "--mode", mode, "--seq-len", str(seq_len)]
    cmd += [] if pending else ["--grads-ready"]
    stream = SIMULATOR_MODES[mode].streams
    if stream:
        cmd += ["--chunk", str(chunk), "--logits-chunk", str(chunk), "--stream-kwargs", json.dumps(kwargs)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{out.stderr[-3000:]}")
    record = json.loads(line)
    shown = [c if c != str(SIM) else "../shared/cudasim/sim.py" for c in cmd[1:]]
    record.update(command="python " + shlex.join(shown))
    if stream:
        record.update(chunk=chunk, logits_chunk=chunk)
    record["model_estimate_gib"] = round(estimate_peak_gib(record), 3)
    return record


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen3-8b"])
    p.add_argument("--mode", nargs="+", default=["streambp"], choices=sorted(SIMULATOR_MODES))
    p.add_argument("--seq-len", nargs="+", type=int, required=True)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--offload", action="store_true", help="enable_streambp(offload_checkpoints=True)")
    p.add_argument("--keep-every", type=int, default=1, help="enable_streambp(keep_every=K)")
    p.add_argument(
        "--stream-kwargs", type=json.loads, default=None, help="more enable_streambp arguments (JSON), stream modes"
    )
    p.add_argument(
        "--pending", action="store_true", help="no parameter gradient before the step (the backward forms them)"
    )
    p.add_argument("--timeout", type=int, default=4 * 3600)
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    for model in a.model:
        for mode in a.mode:
            for seq_len in a.seq_len:
                offload = a.offload and SIMULATOR_MODES[mode].streams
                record = run(
                    model, mode, seq_len, a.chunk, offload, a.timeout, a.keep_every, a.stream_kwargs, a.pending
                )
                with open(a.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
                print(json.dumps(record), flush=True)
