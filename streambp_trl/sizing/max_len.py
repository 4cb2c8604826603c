"""``streambp-trl max-len``: the longest sequence one training step fits, per mode.

Two ways, and the output says which one it used:

* **measured**: on a GPU (``torch.cuda.is_available()`` and no ``--gpu-memory``), or on the CPU against a
  ``--budget`` (``--device cpu``), a real search: every probe is one forward+backward at that length in a fresh
  process (:mod:`streambp_trl.sizing.measure`); lengths are multiples of ``--step``. On CUDA a length fits when it
  runs without running out of memory (and, with ``--budget``, when ``max_memory_allocated`` stays within it); on
  the CPU when the model's bytes plus the step's peak RSS above the loaded model stay within ``--budget``.
* **estimated**: without a GPU, or with ``--gpu-memory``, from :mod:`streambp_trl.sizing.memory_model`.

One row per mode: Hugging Face gradient checkpointing, TRL's default (checkpointing + its fused LM head), stream,
and stream + checkpoint offload (always estimated; measured only with ``--offload``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .measure import bisect_max_len, measure
from .memory_model import UNITS, parse_size
from .metadata import environment
from .models import NAMED_MODELS, OBJECTIVES, build_config, canonical_model_name

# memory-model mode -> (measure mode, row label)
ROWS: dict[str, tuple[str, str]] = {
    "hf-gc": ("checkpoint", "HF gradient checkpointing"),
    "trl-default": ("checkpoint+chunked-loss", "TRL's default (checkpointing + fused LM head)"),
    "stream": ("stream", "stream (streambp-trl)"),
    "stream+offload": ("stream+offload", "stream + checkpoint offload"),
}
OPTIMIZER_BYTES = {"none": 0, "adamw": 8, "adamw-8bit": 2}  # state bytes per trainable parameter
DEFAULT_GPU_MEMORY = "78GiB"  # an 80 GB card less the CUDA context and library workspaces


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streambp-trl max-len",
        description="The longest sequence one training step fits, per mode: measured on a GPU (or on the CPU "
        "against --budget), or estimated from the memory model (no GPU, or --gpu-memory).",
    )
    p.add_argument("--model", required=True, help="a size (qwen3-4b, qwen3-8b, 8b, ...), a Hub name or a local dir")
    p.add_argument("--objective", choices=OBJECTIVES, default="sft")
    p.add_argument("--lora", action="store_true", help="LoRA (r 16, all linear layers) instead of full fine-tuning")
    p.add_argument("--offload", action="store_true", help="also measure stream + offload (always estimated)")
    p.add_argument("--gpu-memory", type=_size_arg, help="estimate for this much GPU memory (e.g. 80GiB, 141GB)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to measure")
    p.add_argument("--budget", type=_size_arg, help="measured runs: the most the peak may reach (cpu: required)")
    p.add_argument("--chunk", type=_positive, help="stream_chunk_size (default: auto, as the trainers)")
    p.add_argument("--logits-chunk", type=_positive, help="logits_chunk_size (default: the chunk)")
    p.add_argument("--keep-every", type=_positive, default=1, help="stream rows: keep only every k-th layer's input")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="default bfloat16 (float32 on the CPU)")
    p.add_argument("--optimizer", choices=OPTIMIZER_BYTES, default="none", help="optimizer state held during the step")
    p.add_argument("--mode", nargs="+", choices=ROWS, help="only these rows")
    p.add_argument("--step", type=_positive, default=1024, help="lengths are multiples of this")
    p.add_argument("--limit", type=_positive, default=1 << 22, help="measured runs: longest length tried")
    p.add_argument("--timeout", type=float, help="measured runs: seconds allowed per probe")
    p.add_argument("--json", metavar="FILE", help="also write the result (rows, probes) as JSON")
    return p


def _auto_chunk(seq_len: int) -> int:
    """``stream_chunk_size="auto"`` of the trainers: an eighth of the length, clamped to [512, 4096]."""
    return min(max(seq_len // 8, 512), 4096)


# ------------------------------------------------------------------------------------------------------------
# Estimated from the memory model
# ------------------------------------------------------------------------------------------------------------


def _shape(name: str):
    from . import memory_model as mm

    try:
        return mm.ModelShape.from_name(name)
    except (KeyError, ValueError, OSError):
        canonical = canonical_model_name(name)
        if canonical not in NAMED_MODELS:
            raise
        return mm.ModelShape.from_config(build_config(canonical))


def _label(mode: str, args: argparse.Namespace) -> str:
    label = ROWS[mode][1]
    if mode.startswith("stream") and args.keep_every > 1:
        label += f", keep_every={args.keep_every}"
    return label


def _setup(mode: str, args: argparse.Namespace):
    from . import memory_model as mm

    stream = mode.startswith("stream")
    return mm.StepSetup(
        mode=mode,
        objective=args.objective,
        lora=args.lora,
        dtype_bytes=4 if args.dtype == "float32" else 2,
        chunk=args.chunk if stream else None,
        logits_chunk=(args.logits_chunk or args.chunk) if stream else None,
        optimizer_bytes_per_param=OPTIMIZER_BYTES[args.optimizer],
        keep_every=args.keep_every if stream else 1,
    )


def estimate(args: argparse.Namespace, modes: list[str], budget: int) -> dict[str, Any]:
    from . import memory_model as mm

    shape = _shape(args.model)
    rows = []
    for mode in modes:
        setup = _setup(mode, args)
        length = mm.max_len(shape, setup, budget, step=args.step)
        rows.append(
            {
                "mode": mode,
                "label": _label(mode, args),
                "max_len": length,
                "peak_bytes": mm.estimate_peak_bytes(shape, setup, length) if length else None,
                "host_bytes": mm.estimate_host_bytes(shape, setup, length) if length and "offload" in mode else None,
            }
        )
    return {"kind": "estimated", "budget_bytes": budget, "rows": rows}


# ------------------------------------------------------------------------------------------------------------
# Measured
# ------------------------------------------------------------------------------------------------------------


def _num_trainable_estimate(args: argparse.Namespace) -> int:
    """Parameters whose optimizer state the measured step holds (a placeholder tensor of that size)."""
    if OPTIMIZER_BYTES[args.optimizer] == 0:
        return 0
    try:
        return _shape(args.model).params if not args.lora else 0
    except Exception:  # noqa: BLE001 - no estimate of the size: no optimizer placeholder
        return 0


def _start_hint(args: argparse.Namespace, mode: str, device: str) -> int | None:
    """The memory model's length for the GPU's memory: the first probe (None when there is no estimate)."""
    if device != "cuda":
        return None
    try:
        from . import memory_model as mm

        budget = args.budget or _gpu_bytes()
        return mm.max_len(_shape(args.model), _setup(mode, args), budget, step=args.step) or None
    except Exception:  # noqa: BLE001 - the hint is optional
        return None


def _gpu_bytes() -> int:
    import torch

    return torch.cuda.mem_get_info()[1]


def measured(args: argparse.Namespace, modes: list[str], device: str) -> dict[str, Any]:
    from tqdm.auto import tqdm

    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    reserve = _num_trainable_estimate(args) * OPTIMIZER_BYTES[args.optimizer]
    rows, all_probes = [], []
    for mode in modes:
        records: dict[int, dict[str, Any]] = {}
        failure: list[str] = []

        def probe(n: int, mode: str = mode, records: dict = records, failure: list = failure) -> float | None:
            spec = {
                "mode": ROWS[mode][0],
                "objective": args.objective,
                "lora": args.lora,
                "seq_len": n,
                "batch_size": 1,
                "dtype": dtype,
                "model": args.model,
                "device": device,
                "seed": 0,
                "repeats": 1,
                "stream_chunk_size": args.chunk or _auto_chunk(n),
                "logits_chunk_size": args.logits_chunk or args.chunk or _auto_chunk(n),
                "keep_every": args.keep_every,
                "reserve_bytes": reserve,
            }
            record = measure(spec, args.timeout, log=False)
            records[n] = record
            if record["status"] == "error":
                failure.append(record.get("error", "?"))
                raise _ProbeError
            return record["total_peak_mb"] * 2**20 if record["status"] == "ok" else None

        bar = tqdm(desc=f"{ROWS[mode][1][:34]:<34}", unit="probe", file=sys.stderr, dynamic_ncols=True)

        def progress(n: int, fits: bool, bar=bar) -> None:
            bar.update(1)
            bar.set_postfix_str(f"{n} tokens {'fits' if fits else 'does not fit'}")

        try:
            best, first_failure, _ = bisect_max_len(
                probe,
                step=args.step,
                budget=args.budget,
                target=_gpu_bytes() if device == "cuda" and args.budget is None else None,
                start=_start_hint(args, mode, device),
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
                "label": _label(mode, args),
                "max_len": best,
                "first_failure": first_failure,
                "peak_bytes": at_best["total_peak_mb"] * 2**20 if at_best else None,
                "host_bytes": host * 2**20 if host is not None and mode == "stream+offload" else None,
                "time_s": at_best.get("time_s"),
                "error": failure[0].strip().splitlines()[-1] if failure else None,
            }
        )
        all_probes += [{**r, "row": mode} for _, r in sorted(records.items())]
    env = environment(device)
    return {"kind": "measured", "budget_bytes": args.budget, "dtype": dtype, "env": env, "rows": rows,
            "probes": all_probes}  # fmt: skip


class _ProbeError(Exception):
    """A probe failed for another reason than memory (its error goes in the row)."""


# ------------------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------------------


def _size(value: float | None, unit: str = "GiB") -> str:
    return "-" if value is None else f"{value / UNITS[unit.lower()]:.2f}"


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    training = "LoRA" if args.lora else "full fine-tuning"
    what = f"{args.model}, {args.objective.upper()} ({training}), one forward+backward, batch 1"
    if args.optimizer != "none":
        what += f", {args.optimizer} states held"
    sizes = [r[k] or 0 for r in result["rows"] for k in ("peak_bytes", "host_bytes")] + [result["budget_bytes"] or 0]
    unit = "GiB" if max(sizes) >= 2**30 else "MiB"
    if result["kind"] == "estimated":
        how = (
            f"Estimated from the memory model (streambp_trl.sizing.memory_model), not measured: budget "
            f"{_size(result['budget_bytes'])} GiB of GPU memory (torch.cuda.max_memory_allocated)."
        )
        if args.gpu_memory is None:
            how += f" (No GPU here: {DEFAULT_GPU_MEMORY}, an 80 GB card less the CUDA context; see --gpu-memory.)"
    else:
        env = result["env"]
        bound = f", budget {_size(result['budget_bytes'], unit)} {unit}" if result["budget_bytes"] else ""
        peak = "model + peak RSS above it" if env["device"] == "cpu" else "torch.cuda.max_memory_allocated"
        how = (
            f"Measured on {env['device_name']} ({env['device']}){bound}: each length one real forward+backward "
            f"in a fresh process, {result['dtype']}, lengths in multiples of {args.step}; peak = {peak}."
        )
    head = f"| mode | max length | peak {unit} at that length | host {unit} |"
    lines = [what, how, "", head, "|---|---:|---:|---:|"]
    for row in result["rows"]:
        length = f"{row['max_len']:,}" if row["max_len"] is not None else "-"
        if row.get("error"):
            length = f"failed: {row['error'][:60]}"
        elif row["max_len"] and result["kind"] == "measured" and row.get("first_failure") is None:
            length += " (the --limit)"
        peak, host = _size(row["peak_bytes"], unit), _size(row["host_bytes"], unit)
        lines.append(f"| {row['label']} | {length} | {peak} | {host} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = list(dict.fromkeys(args.mode or ROWS))
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and args.gpu_memory is None else "estimate"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (without one, max-len estimates)")
    if device == "cpu" and args.budget is None:
        parser.error("--device cpu needs --budget (e.g. 512MiB): the CPU has no out-of-memory error to bisect on")
    if device == "estimate":
        try:
            result = estimate(args, modes, args.gpu_memory or parse_size(DEFAULT_GPU_MEMORY))
        except NotImplementedError:
            raise SystemExit("max-len: the memory model is not available in this version; run it on a GPU.") from None
    else:
        if not args.offload and args.mode is None:
            modes = [m for m in modes if m != "stream+offload"]
        result = measured(args, modes, device)
    print(render(result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)
    return result
