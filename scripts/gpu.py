#!/usr/bin/env python
"""Measurements on a GPU (each also runs on a CPU, for a quick check): the GPU kit's three measuring commands.

bench: peak memory and time per token of one training step for HF gradient checkpointing, TRL's default
(checkpointing + fused LM head), stream and stream + offload at several lengths (16k, 32k, 64k), then a bisection
of stream's longest length, within a wall-clock budget (under 10 minutes on an 80 GB card); --planned runs stream
as the trainers plan it. Writes benchmarks/gpu_<device>.json, .md and plots:
    python scripts/gpu.py bench
    python scripts/gpu.py bench --device cpu --model qwen3-tiny --seq-len 256 512 --chunk 128 --step 256 \\
        --budget 24MiB --out-dir /tmp/gpu_bench --time-budget 120

profile: where a step's GPU time goes, per configuration (MODE[:CHUNK[:KV_MODE]]): its wall time split by engine
phase and, profiled, the kernels' time by kind and by phase, the GPU's busy share, the host's launches and syncs:
    python scripts/gpu.py profile --configs trl stream:4096 --profile stream:4096

long-context: long sequences that just fit, on a real card with the allocator capped as an 80 GB card's: TRL's
default and stream_chunk_size="auto" around the physical limit, then a StreamSFTTrainer LoRA run (--quantize:
QLoRA; --trl-trainer: TRL's SFTTrainer); JSON lines and a table:
    python scripts/gpu.py long-context --out-dir benchmarks

`bash scripts/gpu_session.sh [OUT] [long-context|speed|qlora|calibrate]` runs them for one short lease.
"""

from subcommands.common import dispatch

COMMANDS = {
    "bench": ("gpu_bench", "peak memory and time per token of the four training modes, then stream's longest length"),
    "profile": ("gpu_profile", "where a step's GPU time goes: phases, kernels by kind and phase, launches, syncs"),
    "long-context": ("gpu_long_context", "TRL's default, 'auto' and a LoRA trainer run near the longest length"),
}

if __name__ == "__main__":
    dispatch(__doc__, COMMANDS)
