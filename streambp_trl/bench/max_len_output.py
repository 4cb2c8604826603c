"""The output of ``streambp-trl max-len``: its table, the plans of an estimate and the notes under them."""

from __future__ import annotations

import argparse
from typing import Any

from streambp_trl.sizing import memory_model as mm

from .max_len_rows import CUDA_RESERVE_GIB, DEFAULT_GPU, DEFAULT_GPU_MEMORY, GPUS, OFFLOAD_ROW, human, training
from .plans import render_plans


def _size(value: float | None, unit: str = "GiB") -> str:
    return "-" if value is None else f"{value / mm.UNITS[unit.lower()]:.2f}"


def _notes(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Lines under the table: why a row is 0, what ``--offload`` does in an estimate, that offload reaches no further
    than the stream row within an estimate's host memory (where it does not), and why ``keep_every`` with offload
    fits less than offload alone (where it does, in an estimate)."""
    rows, notes = result["rows"], []
    zero: dict[str, list[str]] = {}
    for row in rows:
        if row.get("why"):
            zero.setdefault(row["why"], []).append(row["label"])
    if "instead" in result:  # no row fits: why, per reason where they differ, then once what fits instead
        whys = [why if len(zero) == 1 else f"{'; '.join(labels)}, {why}" for why, labels in zero.items()]
        notes.append(f"Fits at no length: {'; '.join(whys)}. {_instead(result)}")
    for why, labels in zero.items() if "instead" not in result else ():
        who = "every mode" if len(labels) == len(rows) > 1 else "; ".join(labels)
        notes.append(f"0 for {who}: {why}.")
    if args.offload and result["kind"] == "estimated":
        notes.append("--offload changes nothing here: an estimate always has the stream + offload row.")
    lengths = {row["mode"]: row["max_len"] for row in rows}
    if result["kind"] == "estimated" and 0 < lengths.get(OFFLOAD_ROW, 0) <= lengths.get("stream", 0):
        notes.append(
            f"Offload reaches no further than the stream row within {human(result['host_bytes'])} of host memory "
            "(--host-memory for a machine with more)."
        )
    k = args.keep_every or 1
    offload = next((row for row in rows if row["mode"] == OFFLOAD_ROW), None)
    alone = result.get("offload_alone")  # an estimate's: every input kept may need more host memory than allowed
    if k > 1 and offload is not None and (alone is None or alone > offload["max_len"]):
        notes.append(
            f"With offload, keep_every={k} fits less than offload alone: a segment's backward holds its {k} layer "
            f"inputs (the kept one and {k - 1} rebuilt) and the prefetched input of the segment below, {k + 1} on "
            f"the GPU against 2; what it saves is host memory (about 1/{k})."
        )
    return notes


def _stream_rows(result: dict[str, Any], args: argparse.Namespace) -> str:
    """What an estimate's stream rows are: the planner's longest length within its room, the gradients as counted
    and the host memory offload may pin."""
    host = f"{human(result['host_bytes'])} of host memory"
    if result["host_given"]:
        host += " (--host-memory)"
    else:
        host += (
            ": three quarters of this machine's available memory, as the engine allows itself (--host-memory for "
            "another machine's)"
        )
    grads = (
        "the parameter gradients formed by the backward, as a trainer's steps with gradient_accumulation_steps=1 run "
        "(--gradient-accumulation-steps 2: a micro-step that holds them)"
        if args.gradient_accumulation_steps == 1
        else "the parameter gradients held through the step, as a micro-step after the first holds them"
    )
    if args.gpus > 1:
        host += " per GPU"
        grads = (
            f"each sequence split across {args.gpus} GPUs (sequence parallelism; the length is the whole sequence's, "
            "the memory the last GPU's, whose keys/values span the whole sequence), the weights, gradients and "
            f"optimizer state sharded across them by ZeRO-3 (1/{args.gpus} of each per GPU, and two decoder layers' "
            "weights gathered); HF gradient checkpointing and TRL's default are not sized across GPUs"
        )
    return (
        'Stream rows: the longest length stream_chunk_size="auto" runs (the engine\'s planner, within the budget less '
        f"{human(result['margin_bytes'])} kept for fragmentation; the label says which layer inputs its plan there "
        f"rebuilds in backward), {grads}; offload pins at most {host}."
    )


def _instead(result: dict[str, Any]) -> str:
    """What would fit instead, with its lengths (streamed; TRL's default), in one sentence."""
    each = [f"{i['recipe']}: {i['stream']:,} ({i['trl-default']:,})" for i in result["instead"] if i["stream"]]
    each += [f"{i['recipe']}: none either" for i in result["instead"] if not i["stream"]]
    return f"Instead (the longest length streamed, with TRL's default in brackets): {'; '.join(each)}." if each else ""


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    what = f"{args.model}, {args.objective.upper()} ({training(args)}), one forward+backward, batch 1"
    if args.optimizer == "none":
        what += ", no optimizer state (--optimizer none: the forward+backward alone)"
    elif getattr(args, "offload_optimizer", False):
        what += f", {args.optimizer} state in host memory (none on the GPU)"
    else:
        what += f", {args.optimizer} state held (what its first step allocates)"
    sizes = [r[k] or 0 for r in result["rows"] for k in ("peak_bytes", "host_bytes")] + [result["budget_bytes"] or 0]
    unit = "GiB" if max(sizes) >= 2**30 else "MiB"
    if result["kind"] == "estimated":
        how = (
            f"Estimated from the memory model (streambp_trl.sizing.memory_model), not measured: budget "
            f"{human(result['budget_bytes'])} of GPU memory (torch.cuda.max_memory_allocated)."
        )
        if args.gpu:
            how += f" ({args.gpu}: {GPUS[args.gpu]} GiB less {CUDA_RESERVE_GIB} GiB for the CUDA context.)"
        elif args.gpu_memory is None:
            how += (
                f" (No GPU here: {DEFAULT_GPU_MEMORY}, an 80 GB card ({DEFAULT_GPU}) less the CUDA context; see --gpu "
                "and --gpu-memory.)"
            )
    else:
        env = result["env"]
        bound = f", budget {human(result['budget_bytes'])}" if result["budget_bytes"] else ""
        peak = "model + peak RSS above it" if env["device"] == "cpu" else "torch.cuda.max_memory_allocated"
        kept = (
            "" if args.keep_every else " Stream rows: every layer input kept (an estimate, --gpu, plans some rebuilt)."
        )
        how = (
            f"Measured on {env['device_name']} ({env['device']}){bound}: each length one real forward+backward "
            f"in a fresh process, {result['dtype']}, lengths in multiples of {args.step}; peak = {peak}.{kept}"
        )
    head = f"| mode | max length | peak {unit} at that length | host {unit} |"
    lines = [
        what,
        how,
        *([_stream_rows(result, args)] if result["kind"] == "estimated" else []),
        "",
        head,
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        length = f"{row['max_len']:,}" if row["max_len"] is not None else "-"
        if row.get("error"):
            length = f"failed: {row['error'][:60]}"
        elif row["max_len"] and result["kind"] == "measured" and row.get("first_failure") is None:
            length += " (the --limit)"
        peak, host = _size(row["peak_bytes"], unit), _size(row["host_bytes"], unit)
        lines.append(f"| {row['label']} | {length} | {peak} | {host} |")
    if "plans" in result:
        lines += ["", render_plans(result["plans"])]
    notes = _notes(result, args)
    return "\n".join([*lines, *([""] + notes if notes else [])])
