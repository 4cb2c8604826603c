#!/usr/bin/env python
"""Simulated CUDA peak memory (the simulator of ../shared/cudasim: FakeTensors on a CPU, not a GPU run).

step: one simulated training step of any named shape (the Qwen3.5 hybrids included; a local config directory
too), with or without rank-16 LoRA; one JSON line with the peak:
    python scripts/sim.py step --model qwen3.5-9b --lora --mode streambp --seq-len 65536 --chunk 2048 --grads-ready

max-len: the longest simulated length within a memory budget, by bisection over `sim.py step` runs (the options
it does not know go to each step):
    python scripts/sim.py max-len --model qwen3.5-9b --lora --grads-ready --mode gc --budget-gib 78 \\
        --lo 16384 --hi 32768 --step 2048

grid: the simulator's own sim.py (Qwen3 shapes) over models x modes x lengths, each record appended to
benchmarks/sim_qwen3_bf16.jsonl with its command and the memory model's estimate:
    python scripts/sim.py grid --model qwen3-8b qwen3-4b --mode streambp --seq-len 16384 32768 65536
"""

from subcommands.common import dispatch

COMMANDS = {
    "step": ("sim_step", "one simulated training step of any named shape, with or without LoRA"),
    "max-len": ("sim_maxlen", "the longest simulated length within a memory budget, by bisection"),
    "grid": ("sim_grid", "the simulator's own Qwen3 runs over models x modes x lengths, appended to JSON lines"),
}

if __name__ == "__main__":
    dispatch(__doc__, COMMANDS)
