"""Count one training step instead of timing it: FLOPs, kernel operations and host syncs per mode.

What: one SFT forward+backward (every token labelled, random ids, random weights, float32 on the CPU) of Hugging Face
gradient checkpointing over full logits (``checkpoint``, the reference), TRL's default (checkpointing + its fused LM
head, ``checkpoint+chunked-loss``) and stream (chunk = logit tile = ``--chunk``; every input kept and keys/values
recomputed, or with ``--planned`` as the trainers plan it: on the CPU without a budget, keys/values kept from the
forward), counted by
:class:`streambp_trl.bench.counting.StepCounter` after one uncounted warm-up step: FLOPs (causal attention as the
pairs it allows), by weight (LM head, attention projections, MLP) and attention; aten operations (views left out);
host syncs with their file and line.

Per layer-chunk: stream is counted a second time with twice the chunk and the same logit tile; the difference in
operations, over the layer-chunks it removes (layers x (T/chunk - T/(2 chunk))), is what one layer-chunk costs in
launches, and the difference in host syncs is the syncs inside the layer loop (0: the syncs are once per call).
``tests/test_counting.py`` checks the logit kernel's tile loop the same way.

Counts are exact and repeatable (they do not depend on the machine's load); a step on 2 CPU cores at the issue's
size (``--model qwen3-1k-bench --seq-len 8192 --chunk 2048``) takes a few minutes per mode::

    python scripts/cpu.py count --model qwen3-1k-bench --seq-len 8192 --chunk 2048

Outputs ``--out-dir``/``count_<model>_<seq_len>.{json,md}`` (``benchmarks/``): the command, environment, records and
a table relative to ``checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from streambp_trl.bench.counting import count_step
from streambp_trl.bench.metadata import environment
from streambp_trl.bench.models import build_config
from streambp_trl.bench.spec import MeasureSpec
from streambp_trl.sizing.memory_model import OBJECTIVES
from streambp_trl.sizing.shapes import canonical_model_name

from .common import command_line

MODES = ("checkpoint", "checkpoint+chunked-loss", "stream")
CHOICES = (*MODES, "plain")  # plain: no checkpointing (the FLOPs of a step that recomputes nothing)


def _spec(args: argparse.Namespace, mode: str, chunk: int) -> MeasureSpec:
    return MeasureSpec(
        mode=mode,
        seq_len=args.seq_len,
        model=args.model,
        device="cpu",
        dtype="float32",
        stream_chunk_size=chunk,
        logits_chunk_size=args.chunk,
        same_logits_tile=True,
        planned=args.planned and mode == "stream",
        memory_budget=args.memory_budget if mode == "stream" else None,
        objective=args.objective,
    )


def per_layer_chunk(single: dict[str, Any], double: dict[str, Any], layers: int) -> dict[str, float]:
    """Operations and host syncs one layer-chunk costs, from two stream counts at chunk c and 2c (same logit tile)."""
    chunks = [r["seq_len"] // r["stream_chunk_size"] for r in (single, double)]
    removed = layers * (chunks[0] - chunks[1])
    return {key: (single[key] - double[key]) / removed for key in ("ops", "syncs")}


def table(records: dict[str, dict[str, Any]], layer_chunk: dict[str, float] | None) -> str:
    base = records["checkpoint"]
    groups = sorted({g for r in records.values() for g in r["flops_by"]})
    head = "| mode | FLOPs / checkpoint | " + " | ".join(f"{g} / checkpoint" for g in groups)
    head += " | ops | ops / checkpoint | host syncs | LM head's gradient | layers kept |"
    lines = [head, "|" + "---|" * (7 + len(groups))]
    for mode, r in records.items():
        by = " | ".join(f"{r['flops_by'].get(g, 0) / base['flops']:.4f}" for g in groups)
        lines.append(
            f"| {mode} | {r['flops'] / base['flops']:.4f} | {by} | {r['ops']} | {r['ops'] / base['ops']:.1f} | "
            f"{r['syncs']} | {r.get('head_form') or ''} | {r.get('layers_kept', '')} |"
        )
    if layer_chunk is not None:
        ops, syncs = layer_chunk["ops"], layer_chunk["syncs"]
        lines.append(f"\nStream per layer-chunk: {ops:.0f} operations, {syncs:g} host syncs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1k-bench")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=CHOICES)
    parser.add_argument(
        "--planned",
        action="store_true",
        help="stream as the trainers do: each call's plan decides the kept inputs, offload, whether keys/values "
        "are kept from the forward and how many layers keep their activations (default: every input kept, "
        "keys/values and every layer recomputed)",
    )
    parser.add_argument(
        "--objective",
        default="sft",
        choices=OBJECTIVES,
        help="the step's loss: SFT's token mean (default), DPO's or GRPO's, as the memory and time workers run them",
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="stream: enable_streambp's memory_budget ('40GiB'), which each call's plan and the LM head's form read "
        "(default: none, the host memory available)",
    )
    parser.add_argument("--out-dir", default="benchmarks")
    parser.add_argument("--name", default=None, help="output name (default count_<model>_<seq_len>)")
    args = parser.parse_args(argv)
    if "checkpoint" not in args.modes:
        parser.error("--modes must include checkpoint (the reference)")
    records = {}
    for mode in args.modes:
        records[mode] = count_step(_spec(args, mode, args.chunk))
        print(f"{mode}: {json.dumps({k: records[mode][k] for k in ('flops', 'ops', 'syncs')})}", flush=True)
    layer_chunk = None
    if "stream" in args.modes and 2 * args.chunk <= args.seq_len:
        double = count_step(_spec(args, "stream", 2 * args.chunk))
        layer_chunk = per_layer_chunk(records["stream"], double, build_config(args.model).num_hidden_layers)
    name = args.name or f"count_{canonical_model_name(args.model)}_{args.seq_len}"
    out = {
        "command": command_line("cpu", "count", sys.argv[1:] if argv is None else argv),
        "environment": environment("cpu"),
        "records": records,
        "stream_per_layer_chunk": layer_chunk,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    Path(args.out_dir, f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    objective = "" if args.objective == "sft" else f" ({args.objective})"
    text = f"# Counted step{objective}: {args.model}, {args.seq_len} tokens, chunk {args.chunk}\n\n"
    text += f"`{out['command']}`\n\n"
    text += table(records, layer_chunk) + "\n"
    Path(args.out_dir, f"{name}.md").write_text(text)
    print(text)
    return out
