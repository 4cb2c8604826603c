#!/usr/bin/env python
"""Measurements on the CPU (most also take --device cuda), and the report of every benchmark record.

bp: peak memory and time of ONE forward+backward per backprop mode (plain, HF checkpointing, TRL's default =
checkpointing + fused LM head, stream, stream + offload) and length, each in a fresh process; --phases splits the
peak by phase. Writes benchmarks/NAME.json and .md:
    python scripts/cpu.py bp --model qwen3-cpu-bench --dtype float32 --seq-len 8192 16384 --out cpu_qwen3_4l_fp32

objectives: one DPO step (reference + policy) or the policy update of a GRPO step, TRL's defaults against stream:
    python scripts/cpu.py objectives --objective dpo --seq-len 2048 4096 --out cpu_dpo_qwen3_4l_fp32

distillation: one step of TRL's DistillationTrainer (its defaults) against StreamDistillationTrainer:
    python scripts/cpu.py distillation --seq-len 4096 8192 --out cpu_distillation_qwen3_4l_fp32

reward: one reward-model step, RewardTrainer's defaults against stream:
    python scripts/cpu.py reward --seq-len 2048 4096 --out cpu_reward_qwen3_4l_fp32

count: one step's FLOPs, kernel operations and host syncs per mode, counted rather than timed (exact, whatever the
machine's load); writes benchmarks/count_<model>_<seq_len>.json and .md:
    python scripts/cpu.py count --model qwen3-1k-bench --seq-len 8192 --chunk 2048

bf16-spread: how far one parameter's bf16 gradient lies from a float64 reference, streamed beside plain steps that
differ only in rounding; a table on stdout:
    python scripts/cpu.py bf16-spread --family qwen3_5_text --param model.layers.0.linear_attn.dt_bias

report: plots and benchmarks/REPORT.md from the records in benchmarks/ (CPU, GPU and simulated; needs matplotlib):
    python scripts/cpu.py report
"""

from subcommands.common import dispatch

COMMANDS = {
    "bp": ("cpu_bp", "peak memory and time of one forward+backward per backprop mode and length"),
    "objectives": ("cpu_objectives", "one DPO step or GRPO policy update: TRL's defaults against stream"),
    "distillation": ("cpu_distillation", "one distillation step: TRL's DistillationTrainer against stream"),
    "reward": ("cpu_reward", "one reward-model step: TRL's RewardTrainer defaults against stream"),
    "count": ("cpu_count", "FLOPs, kernel operations and host syncs of one step per mode"),
    "bf16-spread": ("cpu_bf16_spread", "a parameter's bf16 gradient error: streamed against plain steps' spread"),
    "report": ("cpu_report", "plots and benchmarks/REPORT.md from the records in benchmarks/"),
}

if __name__ == "__main__":
    dispatch(__doc__, COMMANDS)
