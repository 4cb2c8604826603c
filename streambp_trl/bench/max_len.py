"""``streambp-trl max-len``: the longest sequence one training step fits, per mode.

Two ways, and the output says which one it used:

* **measured**: on a GPU (``torch.cuda.is_available()`` and no ``--gpu-memory``), or on the CPU against a
  ``--budget`` (``--device cpu``), a real search: every trial is one forward+backward at that length in a fresh
  process (:mod:`streambp_trl.bench.measure`); lengths are multiples of ``--step``. On CUDA a length fits when it
  runs without running out of memory (and, with ``--budget``, when ``max_memory_allocated`` stays within it); on
  the CPU when the model's bytes plus the step's peak RSS above the loaded model stay within ``--budget``.
* **estimated**: without a GPU, or with ``--gpu`` / ``--gpu-memory``, from :mod:`streambp_trl.sizing.memory_model`:
  for a card (``--gpu h200``, default ``h100``) its stated memory less 2 GiB for the CUDA context (78 GiB of an 80 GB
  card, 139 of an H200's 141), or for the memory ``--gpu-memory`` says the step may use.

The stream rows' chunk sizes default to ``"auto"``. A measured row runs what a trainer with
``stream_chunk_size="auto"`` runs (the engine's own policy, :mod:`streambp_trl.sizing.auto`) with every layer input
kept (or ``--keep-every``). An estimate's stream row is what ``"auto"`` runs with ``offload_checkpoints`` as the row
says (:func:`.plans.stream_row`): the longest length the engine's planner finds a plan for within the budget less its
fragmentation margin, its layer inputs kept or rebuilt as the plan chooses (the label names a layout that rebuilds
some), offload within ``--host-memory`` or, by default, the host memory the engine allows itself
(:func:`streambp_trl.sizing.room.host_room`); the plans under it and their footer are the same planner's.

One row per mode: Hugging Face gradient checkpointing, TRL's default (checkpointing + its fused LM head), stream,
and stream + checkpoint offload (always in an estimate; measured only with ``--offload``, as it trials up to a
million tokens and needs host memory). A row of 0 says why under the table.

What the step holds beside its activations is what a trainer's step holds (:mod:`streambp_trl.sizing.setup`): the
optimizer state of ``--optimizer`` (TrainingArguments' ``optim`` names, default TRL's ``adamw_torch_fused``; ``none``:
the forward+backward alone; ``--offload-optimizer``: in host memory), LoRA adapters, and with ``--load-in-4bit`` /
``--load-in-8bit`` (QLoRA, estimates only) the base weights at their bitsandbytes size. Where no mode fits at any
length, one line says so and gives the lengths of what would fit instead (8-bit AdamW, the optimizer state in host
memory, LoRA, QLoRA).

``--model``: a named shape of :data:`~streambp_trl.sizing.shapes.NAMED_MODELS` (or the Hub name of one in any case,
e.g. ``Qwen/Qwen3-8B`` or ``Qwen/Qwen3.5-9B``: no network), a local config directory, or a Hub id ``org/name`` (its
config only). Any other name is refused in one line listing the named shapes, without asking the Hub.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Any, NoReturn

from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.auto import AUTO
from streambp_trl.sizing.lengths import max_len
from streambp_trl.sizing.plan import margin
from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name

from .max_len_args import build_parser
from .max_len_output import render
from .max_len_rows import (
    DEFAULT_GPU_MEMORY,
    OFFLOAD_ROW,
    ROWS,
    gpu_budget,
    human,
    instead,
    quantized,
    row_label,
    row_setup,
)
from .measure import bisect_max_len, measure
from .metadata import environment
from .plans import describe_layout, host_bytes, least_peak_bytes, plan_rows, stream_row
from .spec import MeasureSpec, Mode

# ------------------------------------------------------------------------------------------------------------
# Estimated from the memory model
# ------------------------------------------------------------------------------------------------------------


PROG = "streambp-trl max-len"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hub spells a repository


def _fail(message: str) -> NoReturn:
    """Exit with status 1 and one line, ``streambp-trl max-len: error: ...`` (as the CLI's other mistakes)."""
    raise SystemExit(f"{PROG}: error: {message}")


def _shape(name: str) -> mm.ModelShape | None:
    """The memory model's shape of ``--model`` (:meth:`~memory_model.ModelShape.from_name`): a named shape or the
    Hub name of one (no network), a local directory, or a Hub id (``org/name``: its config). Exits with one line
    for a name that is none of these (without asking the Hub) and when a config cannot be read; None when it reads
    but is not a decoder shape the memory model knows."""
    shapes = f"named shapes: {', '.join(NAMED_MODELS)} (or their Hub names, e.g. Qwen/Qwen3-8B)"
    local = os.path.isdir(name) or os.path.isfile(name)
    if canonical_model_name(name) not in NAMED_MODELS and not local and not _HUB_ID.fullmatch(name):
        _fail(f"unknown model {name!r}; {shapes}, a local directory with a config.json, or a Hub id (org/name).")
    try:
        return mm.ModelShape.from_name(name)
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _fail(
            f"cannot read the config of --model {name!r} ({reason}). Give a local directory with its config.json, "
            f"one of the {shapes}, or run with access to the Hub."
        )
    except (AttributeError, TypeError):
        return None


def _why_none_fits(
    shape: mm.ModelShape, setup: mm.StepSetup, budget: int, step: int, kept: int = 0, peak: int | None = None
) -> str:
    """Why not even ``step`` tokens fit in ``budget`` (less ``kept`` bytes for fragmentation: a stream row's, as the
    planner keeps): the weights, gradients and optimizer state alone (the gradients counted whether or not the
    backward forms them: every one is there at its end), or the step's ``peak`` at ``step`` tokens (``None``: the
    memory model's for ``setup``)."""
    static = max(
        mm.static_bytes(shape, dataclasses.replace(setup, pending_grads=False)), mm.optimizer_step_bytes(shape, setup)
    )
    state = setup.optimizer != "none" and not setup.optimizer_offload
    held = f"the weights, gradients and {setup.optimizer} state" if state else "the weights and gradients"
    if static > budget:
        params = f"{shape.params / 1e9:.2f}B parameters"
        return f"{held} alone need {human(static)} ({params}), above the budget of {human(budget)}"
    peak = mm.estimate_peak_bytes(shape, setup, step) if peak is None else peak
    less = f" less {human(kept)} kept for fragmentation" if kept else ""
    return f"{step:,} tokens need {human(peak)} ({held}: {human(static)}), above the budget of {human(budget)}{less}"


def _stream_row(
    args: argparse.Namespace, shape: mm.ModelShape, mode: str, budget: int, host: int
) -> tuple[str, dict[str, Any], str | None]:
    """A stream row of an estimate (:func:`.plans.stream_row`): its label (naming the layer inputs its plan rebuilds,
    where the plan chose them), its figures with the plan in words, and why it is 0 (``None`` where it fits)."""
    setup = row_setup(mode, args)
    row = stream_row(shape, setup, budget, host, setup.offload, args.keep_every, args.step)
    plan, share = row.pop("plan"), row.pop("share")
    planned = "" if args.keep_every else describe_layout(plan, shape.layers)  # (a fixed one: in row_label)
    split = f"split across {setup.gpus} GPUs ({share:,} tokens each)" if setup.gpus > 1 and share else ""
    label = ", ".join(filter(None, [row_label(mode, args), split, planned]))
    if plan is not None:
        return label, {**row, "plan": plan.describe(share, shape.layers)}, None
    least = least_peak_bytes(shape, setup, args.step, setup.offload, args.keep_every)
    return label, {**row, "plan": None}, _why_none_fits(shape, setup, budget, args.step, margin(budget), least)


def estimate(args: argparse.Namespace, shape: mm.ModelShape, modes: list[str], budget: int) -> dict[str, Any]:
    """The estimate's rows: per mode the longest length (a multiple of ``--step``) and the peak there; the stream
    rows what ``stream_chunk_size="auto"`` runs (:func:`_stream_row`: the engine's planner, its room, the host memory
    of ``--host-memory`` or the engine's own), the others the memory model's peak within the whole budget."""
    host = host_bytes(args.host_memory)
    rows = []
    if args.gpus > 1:  # (the memory model sizes a sequence split for the stream modes alone)
        modes = [mode for mode in modes if ROWS[mode][0].streams]
    for mode in modes:
        if ROWS[mode][0].streams:
            label, row, why = _stream_row(args, shape, mode, budget, host)
        else:
            setup = row_setup(mode, args)
            length, label = max_len(shape, setup, budget, step=args.step), row_label(mode, args)
            peak = mm.estimate_peak_bytes(shape, setup, length) if length else None
            row = {"max_len": length, "peak_bytes": peak, "host_bytes": None}
            why = None if length else _why_none_fits(shape, setup, budget, args.step)
        rows.append({"mode": mode, "label": label, **row, "why": why})
    result = {"kind": "estimated", "budget_bytes": budget, "margin_bytes": margin(budget), "host_bytes": host,
              "host_given": args.host_memory is not None, "rows": rows}  # fmt: skip
    if (args.keep_every or 1) > 1 and OFFLOAD_ROW in modes:  # what the offload row fits with every input kept
        alone = stream_row(shape, row_setup(OFFLOAD_ROW, args), budget, host, True, 1, args.step)
        result["offload_alone"] = alone["max_len"]
    if not any(row["max_len"] for row in rows):
        result["instead"] = instead(args, shape, budget)
    return result


# ------------------------------------------------------------------------------------------------------------
# Measured
# ------------------------------------------------------------------------------------------------------------


def _start_hint(args: argparse.Namespace, shape: mm.ModelShape | None, mode: str, device: str) -> int | None:
    """The memory model's length for the GPU's memory: the first trial (None when there is no estimate)."""
    if device != "cuda" or shape is None:
        return None
    return max_len(shape, row_setup(mode, args), args.budget or _gpu_bytes(), step=args.step) or None


def _gpu_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[1]


def _why_measured_none_fits(record: dict[str, Any], budget: int | None) -> str:
    """Why not even the shortest length fits, from its trial's record."""
    n = f"{record['seq_len']:,} tokens"
    if record["status"] == "oom":
        return f"{n} already ran out of memory"
    return f"{n} already peak at {human(record['total_peak_mb'] * 2**20)}, above the --budget of {human(budget)}"


def measured(args: argparse.Namespace, shape: mm.ModelShape | None, modes: list[str], device: str) -> dict[str, Any]:
    from tqdm.auto import tqdm

    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    # the optimizer state, a placeholder of its size held through each trial (in the dtype the trials run)
    as_run = argparse.Namespace(**{**vars(args), "dtype": dtype})
    reserve = mm.optimizer_bytes(shape, row_setup(modes[0], as_run)) if shape is not None else 0
    width = max(len(row_label(mode, args)) for mode in modes)
    rows, all_trials = [], []
    for mode in modes:
        records: dict[int, dict[str, Any]] = {}
        failure: list[str] = []

        def trial(n: int, mode: str = mode, records: dict = records, failure: list = failure) -> float | None:
            spec = MeasureSpec(
                mode=ROWS[mode][0],
                objective=args.objective,
                lora=args.lora,
                seq_len=n,
                dtype=dtype,
                model=args.model,
                device=device,
                stream_chunk_size=args.chunk or AUTO,
                logits_chunk_size=args.logits_chunk or args.chunk or AUTO,
                keep_every=args.keep_every or 1,
                reserve_bytes=reserve,
            )
            record = measure(spec, args.timeout, log=False)
            records[n] = record
            if record["status"] == "error":
                failure.append(record.get("error", "?"))
                raise _ProbeError
            return record["total_peak_mb"] * 2**20 if record["status"] == "ok" else None

        bar = tqdm(desc=f"{row_label(mode, args):<{width}}", unit="trial", file=sys.stderr, dynamic_ncols=True)

        def progress(n: int, fits: bool, bar=bar) -> None:
            bar.update(1)
            bar.set_postfix_str(f"{n} tokens {'fits' if fits else 'does not fit'}")

        try:
            best, first_failure, _ = bisect_max_len(
                trial,
                step=args.step,
                budget=args.budget,
                target=_gpu_bytes() if device == "cuda" and args.budget is None else None,
                start=_start_hint(args, shape, mode, device),
                limit=args.limit,
                progress=progress,
            )
        except _ProbeError:
            best = first_failure = None
        finally:
            bar.close()
        at_best = records.get(best, {}) if best else {}
        host = at_best.get("host_peak_mb")
        rows.append(
            {
                "mode": mode,
                "label": row_label(mode, args),
                "max_len": best,
                "first_failure": first_failure,
                "peak_bytes": at_best["total_peak_mb"] * 2**20 if at_best else None,
                "host_bytes": host * 2**20 if host is not None and ROWS[mode][0] is Mode.STREAM_OFFLOAD else None,
                "time_s": at_best.get("time_s"),
                "error": failure[0].strip().splitlines()[-1] if failure else None,
                "why": _why_measured_none_fits(records[first_failure], args.budget) if best == 0 else None,
            }
        )
        all_trials += [{**r, "row": mode} for _, r in sorted(records.items())]
    env = environment(device)
    return {"kind": "measured", "budget_bytes": args.budget, "dtype": dtype, "env": env, "rows": rows,
            "trials": all_trials}  # fmt: skip


class _ProbeError(Exception):
    """A trial failed for another reason than memory (its error goes in the row)."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpu:
        args.gpu_memory = mm.parse_size(gpu_budget(args.gpu))
    modes = list(dict.fromkeys([*(args.mode or ROWS), *([OFFLOAD_ROW] if args.offload else [])]))
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and args.gpu_memory is None else "estimate"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (without one, max-len estimates)")
    if device != "estimate" and quantized(args):
        parser.error("--load-in-4bit/--load-in-8bit are estimated only (pass --gpu or --gpu-memory): a measured "
                     "trial builds random weights of the model's shape, unquantized")  # fmt: skip
    if args.use_bnb_nested_quant and not args.load_in_4bit:
        parser.error("--use-bnb-nested-quant goes with --load-in-4bit")
    if device != "estimate" and args.gpus > 1:
        parser.error("--gpus is estimated only (pass --gpu or --gpu-memory): a measured trial runs on one device")
    if device == "cpu" and args.budget is None:
        parser.error("--device cpu needs --budget (e.g. 512MiB): the CPU has no out-of-memory error to bisect on")
    shape = _shape(args.model)
    if device == "estimate":
        if shape is None:
            _fail(
                f"the memory model does not know the shape of --model {args.model!r} (a decoder with hidden_size, "
                "intermediate_size, attention heads); measure it on a GPU instead."
            )
        budget = args.gpu_memory or mm.parse_size(DEFAULT_GPU_MEMORY)
        result = estimate(args, shape, modes, budget)
        setup = row_setup(Mode.STREAM.memory_model_mode, args)
        also = tuple(row["max_len"] for row in result["rows"] if ROWS[row["mode"]][0].streams)
        if args.gpus == 1:  # (a split's plans are each row's, at its longest length)
            result["plans"] = plan_rows(
                shape, setup, budget, result["host_bytes"], args.lengths, args.keep_every, also=also, step=args.step
            )
    else:
        if not args.offload and args.mode is None:
            modes = [m for m in modes if m != OFFLOAD_ROW]
        result = measured(args, shape, modes, device)
    print(render(result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return result
