"""Long context that just fits, on a real card: TRL's default and ``stream_chunk_size="auto"`` (its per-call plan)
at lengths around the physical limit, and a ``StreamSFTTrainer`` LoRA run, each in a fresh process with PyTorch's
allocator capped as an 80 GB card's (``--cap``, on a card with more memory). Records the peak, the time and the plan
"auto" chose, as JSON lines and a markdown table.

    python scripts/gpu.py long-context --out-dir benchmarks                               # the kit's check
    python scripts/gpu.py long-context --device cpu --model qwen3-tiny --lengths 512 1024 --trainer-length 256 \\
        --cap none --budget 2GiB --out-dir /tmp/lc                                         # a CPU smoke run

Steps, in order, each under its own time limit (the whole fits one device call of under 9 minutes on an H200):

1. TRL 1.16's default (checkpointing + its fused LM head) at the first length (163,840);
2. stream, "auto" with ``memory_budget`` (the cap) at each length (163,840: every input kept does not fit; 262,144:
   the plan must rebuild or offload layer inputs);
3. ``StreamSFTTrainer`` with LoRA (rank 16, every linear layer), ``--trainer-steps`` (2) optimizer steps at
   ``--trainer-length`` (131,072; ``--trl-trainer``: TRL's ``SFTTrainer`` with gradient checkpointing), its peak as
   ``torch.cuda.max_memory_allocated``; with ``--quantize``, QLoRA: the decoder layers' base weights in
   bitsandbytes' NF4, computing in bfloat16 (:func:`~streambp_trl.bench.models.quantize_4bit`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from streambp_trl.bench.measure import measure
from streambp_trl.bench.metadata import environment
from streambp_trl.bench.spec import MeasureSpec, Mode

from .common import REPO_ROOT, command_line, entry, prefixed_record

TRAINER_PREFIX = "LONG_CONTEXT_TRAINER="


def _specs(args: argparse.Namespace) -> list[MeasureSpec]:
    common = dict(
        model=args.model, device=args.device, dtype=args.dtype, warmup_seq_len=args.warmup, memory_cap=args.cap
    )
    specs = (
        [] if args.no_baseline else [MeasureSpec(mode=Mode.CHECKPOINT_CHUNKED_LOSS, seq_len=args.lengths[0], **common)]
    )
    for n in args.lengths:
        specs.append(MeasureSpec(mode=Mode.STREAM, seq_len=n, memory_budget=args.budget, planned=True, **common))
    return specs


def trainer_run(args: argparse.Namespace) -> dict:
    """``StreamSFTTrainer`` with LoRA (``--trl-trainer``: TRL's ``SFTTrainer`` with gradient checkpointing, its
    default for long rows), ``--trainer-steps`` optimizer steps on one random row of ``--trainer-length`` tokens each
    (in this process); the peak of each step and the run's time."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from streambp_trl import StreamSFTConfig, StreamSFTTrainer
    from streambp_trl.bench.models import build_model, quantize_4bit
    from streambp_trl.engine import last_plan
    from streambp_trl.sizing.units import parse_size

    device = torch.device(args.device)
    if args.cap is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.cap) / total), device.index or 0)
    model = build_model(args.model, args.dtype, device, 0)
    if args.quantize:
        model = quantize_4bit(model)
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (args.trainer_length,)).tolist()
    data = Dataset.from_dict({"input_ids": [ids] * args.trainer_steps})
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "configs" / "tiny_model")
    peaks: list[float] = []

    class Peaks(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        def on_step_end(self, *_, **__):
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)

    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out, max_length=args.trainer_length, per_device_train_batch_size=1,
            max_steps=args.trainer_steps, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
            bf16=args.dtype == "bfloat16", use_cpu=device.type == "cpu", dataloader_num_workers=0,
        )  # fmt: skip
        if args.trl_trainer:
            trainer_cls, config = SFTTrainer, SFTConfig(**common, gradient_checkpointing=True)
        else:
            trainer_cls, config = StreamSFTTrainer, StreamSFTConfig(**common, memory_budget=args.budget)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        trainer = trainer_cls(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[Peaks()],
        )
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        plan = None if args.trl_trainer else last_plan(trainer.model)
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        quantized = sum(type(m).__module__.startswith("bitsandbytes") for m in trainer.model.modules())
    return {"mode": _trainer_mode(args), "seq_len": args.trainer_length, "steps": args.trainer_steps,
            "time_s": elapsed, "peak_gib_per_step": peaks, "losses": losses, "4bit_layers": quantized,
            "plan": None if plan is None else plan.describe(
                args.trainer_length, len(trainer.model.base_model.model.model.layers))}  # fmt: skip


def _trainer_mode(args: argparse.Namespace) -> str:
    trainer = "SFTTrainer (TRL's default)" if args.trl_trainer else "StreamSFTTrainer"
    return trainer + ("+QLoRA (NF4)" if args.quantize else "+LoRA")


def _trainer_record(args: argparse.Namespace, argv: list[str]) -> dict:
    """:func:`trainer_run` in a fresh process: its record, or one saying how it failed."""
    cmd = [sys.executable, str(entry("gpu")), "long-context", *argv, "--trainer-only"]
    failed = {"mode": _trainer_mode(args), "seq_len": args.trainer_length}
    try:
        record, proc = prefixed_record(cmd, TRAINER_PREFIX, timeout=args.timeout * 2)
    except subprocess.TimeoutExpired:
        return {**failed, "status": "timeout"}
    if record is None:
        return {**failed, "status": "error", "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return record


def _table(records: list[dict], env: dict, args: argparse.Namespace, command: str) -> str:
    lines = [
        f"# Long context on {env['device_name']}: {args.model}, {args.dtype}, allocator capped at {args.cap}",
        "",
        f"- command: `{command}`",
        f"- {json.dumps(env)}",
        "",
        "| run | tokens | status | peak GiB | time s | plan |",
        "|---|---:|---|---:|---:|---|",
    ]
    for r in records:
        peak = r.get("total_peak_mb")
        peak = f"{peak / 1024:.2f}" if peak else ", ".join(f"{p:.2f}" for p in r.get("peak_gib_per_step", [])) or "-"
        t = r.get("time_s")
        lines.append(
            f"| {r['mode']} | {r['seq_len']:,} | {r.get('status', 'ok')} | {peak} | "
            f"{'-' if t is None else f'{t:.1f}'} | {r.get('plan') or r.get('error', '')[:80]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lengths", type=int, nargs="*", default=[163840, 262144], help="(none: no stream runs)")
    p.add_argument("--trainer-length", type=int, default=131072)
    p.add_argument("--warmup", type=int, default=2048, help="each process's warm-up step length")
    p.add_argument("--cap", default="78GiB", help="the allocator's cap on CUDA ('none': the whole card)")
    p.add_argument("--budget", default="78GiB", help="memory_budget of the stream runs")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks"))
    p.add_argument("--name", default=None, help="output stem (default: gpu_<device>_long_context)")
    p.add_argument("--no-baseline", action="store_true", help="skip TRL's default at the first length")
    p.add_argument("--no-trainer", action="store_true", help="skip the StreamSFTTrainer LoRA run")
    p.add_argument(
        "--quantize", action="store_true", help="the trainer run's base weights in bitsandbytes' NF4 (QLoRA)"
    )
    p.add_argument("--trainer-steps", type=int, default=2, help="the trainer run's optimizer steps")
    p.add_argument("--trl-trainer", action="store_true", help="the trainer run with TRL's SFTTrainer instead")
    p.add_argument("--trainer-only", action="store_true", help=argparse.SUPPRESS)  # the trainer run's own process
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    args.cap = None if args.cap == "none" else args.cap
    if args.trainer_only:
        print(TRAINER_PREFIX + json.dumps(trainer_run(args)), flush=True)
        return
    env = environment(args.device)
    name = args.name or f"gpu_{env['device_name'].lower().replace(' ', '_')}_long_context"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for spec in _specs(args):
        record = measure(spec, args.timeout, log=False)
        records.append({**record, "mode": str(spec.mode) + (" auto" if spec.planned else "")})
        print(json.dumps(records[-1])[:600], flush=True)
    if not args.no_trainer:
        records.append(_trainer_record(args, argv))
        print(json.dumps(records[-1])[:600], flush=True)
    with open(args.out_dir / f"{name}.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({**r, "env": env}) + "\n")
    command = command_line("gpu", "long-context", argv)
    (args.out_dir / f"{name}.md").write_text(_table(records, env, args, command))
    print(_table(records, env, args, command))
