"""One GPU run of the headline benchmark: peak memory and time per token of one training step for Hugging Face
gradient checkpointing, TRL's default (checkpointing + its fused LM head), stream and stream + checkpoint offload,
at several lengths, then a bisection of stream's longest length; within a wall-clock budget.

What: Qwen3-8B shapes with random weights (fixed seed), bfloat16, one SFT forward+backward on random token ids
(batch 1, every token labelled), stream chunk = logit tile = ``--chunk`` (4096) tokens, keys/values recomputed
(``--kv-mode``); or, with ``--planned``, stream as the trainers run it: chunk, logit tile, kept inputs and kept
keys/values chosen per call by the plan within ``--memory-cap`` (which also caps PyTorch's allocator, e.g. 78GiB: an
80 GB card's limits on a larger one). TRL's default keeps its own token tile. Lengths 16k, 32k and 64k by default;
stream's longest length against ``--budget`` (default: ``--memory-cap``, else the GPU's total memory), in multiples
of ``--step``.

How (the harness of :mod:`streambp_trl.bench.measure`): every (mode, length) runs in a fresh process (no allocator
cache, peak counter or patched model leaks between measurements). Each process runs one warm-up step at
``--warmup-seq-len`` tokens (2048; kernels and lazy initialisation, in less time than a full-length step), then
``--repeats`` measured steps (2), the fastest reported: the first at a length also allocates what a training run
allocates once (pinned host buffers for offload, cuDNN's plans for new attention shapes). Peak:
``torch.cuda.max_memory_allocated`` of the steps, model and parameter gradients included (``total_peak_mb``;
``peak_mb`` is the part above the loaded model); on the CPU the model's bytes plus peak RSS above it. Time:
wall-clock seconds of the fastest measured step (synchronised), reported as ms per 1k tokens. Every record carries
the memory model's estimate (:func:`streambp_trl.sizing.memory_model.estimate_peak_bytes`).

Order and the time budget: lengths in increasing order, the modes interleaved at each length, so a cut keeps the
short lengths complete. A mode that ran out of memory is not run at longer lengths. No measurement starts once
``--time-budget`` seconds (540) have passed, nor one that would likely pass it (estimated from the measured wall
times); each runs with a timeout of the time left. What was not run is listed under ``skipped`` with the reason.
The bisection (:func:`streambp_trl.bench.measure.bisect_max_len`) starts at the memory model's longest length for
the budget and stops the same way, keeping its bracket (longest fit, shortest failure).

On one 80 GB GPU (the defaults). Expect about 9 minutes: the grid of 12 measurements first, then bisection trials
until the 540 s time budget (a measurement still running then is stopped), plus a few seconds for the outputs; so
the whole run stays under 10 minutes::

    python scripts/gpu.py bench

On a CPU (a quick check of the script itself, as its test runs it)::

    python scripts/gpu.py bench --device cpu --model qwen3-tiny --seq-len 256 512 --chunk 128 --step 256 \\
        --budget 24MiB --out-dir /tmp/gpu_bench --time-budget 120

Outputs, in ``--out-dir`` (``benchmarks/``) under ``--name`` (``gpu_<device>``, e.g. ``gpu_nvidia_h100_80gb_hbm3``;
``cpu_fallback`` on a CPU): ``NAME.json`` (the command, environment, settings, records, summary, max_len and
skipped; rewritten after every measurement, so a killed run keeps what it measured), ``NAME.md`` (the tables,
printed at the end) and, with matplotlib, ``NAME_memory.png`` (peak GiB vs length per mode, the memory model's
estimate dotted) and ``NAME_time.png`` (ms per 1k tokens vs length per mode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from streambp_trl.bench.max_len_args import positive_int
from streambp_trl.bench.measure import bisect_max_len, measure
from streambp_trl.bench.metadata import environment
from streambp_trl.bench.spec import DTYPES, MeasureSpec, Mode
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.auto import AUTO
from streambp_trl.sizing.choices import KV_MODES
from streambp_trl.sizing.lengths import max_len
from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name

from .common import BENCH_DIR, command_line
from .gpu_bench_budget import DTYPE_BYTES, bracket, device_slug, estimated_peak_mb, fits, predict_wall_s, skip_reason
from .gpu_bench_output import plot, render_markdown, summarize

DEFAULT_MODES = (Mode.CHECKPOINT, Mode.CHECKPOINT_CHUNKED_LOSS, Mode.STREAM, Mode.STREAM_OFFLOAD)


class _Stop(Exception):
    """The bisection stops (its message says why)."""


class Run:
    """One run: the settings, the clock of the time budget, the result (written after every measurement)."""

    clock = staticmethod(time.monotonic)  # seconds, for the time budget

    def __init__(self, args: argparse.Namespace, device: str, command: str) -> None:
        self.args, self.device, self.start = args, device, self.clock()
        self.out_dir = Path(args.out_dir)
        self.result: dict[str, Any] = {
            "command": command,
            "env": environment(device),
            "settings": {
                "name": args.name,
                "model": args.model,
                "dtype": args.dtype,
                "modes": [m.value for m in args.mode],
                "seq_lens": sorted(set(args.seq_len)),
                "chunk": "auto" if args.planned else args.chunk,
                "planned": args.planned,
                "kv_mode": args.kv_mode or ("planned" if args.planned else "recompute"),
                "memory_cap": args.memory_cap,
                "torch_compile": args.compile,
                "warmup_seq_len": args.warmup_seq_len,
                "repeats": args.repeats,
                "step": args.step,
                "budget_bytes": args.budget,
                "time_budget_s": args.time_budget,
                "elapsed_s": 0.0,
            },
            "records": [],
            "summary": summarize([]),
            "max_len": {"mode": Mode.STREAM.value, "budget_bytes": None, "status": "not run yet"},
            "skipped": [],
        }

    def elapsed(self) -> float:
        return self.clock() - self.start

    def write(self) -> None:
        """Rewrite ``NAME.json`` and ``NAME.md``."""
        self.result["settings"]["elapsed_s"] = self.elapsed()
        self.result["summary"] = summarize(self.result["records"])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / self.args.name
        path.with_suffix(".json").write_text(json.dumps(self.result, indent=1) + "\n")
        path.with_suffix(".md").write_text(render_markdown(self.result))

    def warmup_for(self, seq_len: int) -> int | None:
        """The warm-up length at ``seq_len`` (None: the full length, when the short one is not shorter)."""
        return self.args.warmup_seq_len if self.args.warmup_seq_len < seq_len else None

    def skip(self, mode: Mode, seq_len: int, reason: str) -> None:
        print(f"[gpu_bench] skip {mode} at {seq_len}: {reason}", file=sys.stderr, flush=True)
        self.result["skipped"].append({"mode": mode.value, "seq_len": seq_len, "reason": reason})

    def time_check(self, mode: Mode, seq_len: int, history: list[dict[str, Any]]) -> str | None:
        predicted = predict_wall_s(history, mode, seq_len, self.warmup_for(seq_len))
        return skip_reason(self.elapsed(), self.args.time_budget, predicted)

    def measure(self, mode: Mode, seq_len: int) -> dict[str, Any]:
        """One measurement in a fresh process, timed out when the time budget runs out; the record gets its
        wall time, ms per 1k tokens and the memory model's estimate."""
        a = self.args
        spec = MeasureSpec(
            mode=mode,
            seq_len=seq_len,
            model=a.model,
            device=self.device,
            dtype=a.dtype,
            stream_chunk_size=AUTO if a.planned else a.chunk,
            logits_chunk_size=AUTO if a.planned else a.chunk,
            kv_mode=a.kv_mode,
            warmup_seq_len=self.warmup_for(seq_len),
            repeats=a.repeats,
            planned=a.planned,
            memory_budget=a.memory_cap if a.planned else None,
            memory_cap=a.memory_cap,
            compile=a.compile,
        )
        start = self.clock()
        record = measure(spec, timeout=max(a.time_budget - self.elapsed(), 1.0))
        record["wall_s"] = self.clock() - start
        record["repeats"] = a.repeats
        if record["status"] == "ok":
            # the fastest measured step: the first at a length also allocates (pinned host buffers for offload,
            # cuDNN's plans for new attention shapes), which later steps of a training run reuse
            record["first_step_s"] = record.get("times_s", [record["time_s"]])[0]
            record["time_s"] = record.get("time_min_s", record["time_s"])
            record["ms_per_1k_tokens"] = 1e6 * record["time_s"] / (record["batch_size"] * seq_len)
        form, chunk = record.get("head_form"), record.get("stream_chunk_size", a.chunk)
        tile, capture = record.get("logits_chunk_size"), record.get("captured", a.kv_mode == "capture")
        # (a planned step that failed never chose its chunk; the estimate keeps every input on the device)
        sized = isinstance(chunk, int) and not record.get("inputs_rebuilt")
        if sized and not (record.get("offloaded") and mode is Mode.STREAM):
            tile = tile if isinstance(tile, int) else None
            record["estimated_peak_mb"] = estimated_peak_mb(
                a.model, mode, seq_len, a.dtype, chunk, form, capture, tile
            )
        return record

    def grid(self) -> None:
        """Every mode at every length, lengths increasing, modes interleaved; a mode stops at its first oom."""
        records, oom_at = self.result["records"], {}
        for seq_len in self.result["settings"]["seq_lens"]:
            for mode in self.args.mode:
                why = (
                    f"oom at a shorter length ({oom_at[mode]})"
                    if mode in oom_at
                    else self.time_check(mode, seq_len, records)
                )
                if why:
                    self.skip(mode, seq_len, why)
                    continue
                record = self.measure(mode, seq_len)
                records.append(record)
                if record["status"] == "oom":
                    oom_at[mode] = seq_len
                self.write()

    def bisect(self) -> None:
        """Stream's longest length within the budget, from the memory model's estimate; stops at the time budget
        (or at a failed trial) with the bracket so far."""
        a = self.args
        chunk = AUTO if a.planned else a.chunk
        section: dict[str, Any] = {"mode": Mode.STREAM.value, "stream_chunk_size": chunk, "step": a.step}
        self.result["max_len"] = section
        if not a.max_len:
            section.update(budget_bytes=None, status="not run (--no-max-len)")
            return
        start = None
        if canonical_model_name(a.model) in NAMED_MODELS:
            shape = mm.ModelShape.from_name(a.model)
            setup = mm.StepSetup(mode="stream", dtype_bytes=DTYPE_BYTES[a.dtype], chunk=a.chunk, logits_chunk=a.chunk)
            start = max_len(shape, setup, a.budget, step=a.step) or None
        trials: list[dict[str, Any]] = []
        section.update(budget_bytes=a.budget, start=start, trials=trials, status="running")
        # the grid's stream records are trials of the same spec, reused at their lengths
        known = {r["seq_len"]: r for r in self.result["records"] if r["mode"] == Mode.STREAM}

        def settle() -> None:  # the bracket so far, the grid's stream records included
            pool = [*known.values(), *trials]
            section["longest_fit"], section["shortest_failure"] = bracket(pool, a.budget)
            at = [r for r in pool if r["seq_len"] == section["longest_fit"] and r.get("status") == "ok"]
            section["total_peak_mb_at_longest_fit"] = at[0]["total_peak_mb"] if at else None

        def trial(n: int) -> float | None:
            record = known.get(n)
            if record is None:
                history = [*self.result["records"], *trials]
                why = self.time_check(Mode.STREAM, n, history)
                if why:
                    raise _Stop(f"stopped by time budget before {n}: {why}")
                record = self.measure(Mode.STREAM, n)
            trials.append({**record, "fits": fits(record, a.budget), "from_grid": n in known})
            settle()
            self.write()
            if record["status"] == "error":
                if self.elapsed() >= a.time_budget:
                    raise _Stop(f"stopped by time budget: {n} timed out")
                raise _Stop(f"stopped: {n} failed: {str(record.get('error', '?')).strip().splitlines()[-1]}")
            return record["total_peak_mb"] * 2**20 if record["status"] == "ok" else None

        try:
            bisect_max_len(trial, step=a.step, budget=a.budget, target=a.budget, start=start)
            section["status"] = "done"
        except _Stop as stop:
            section["status"] = str(stop)
            print(f"[gpu_bench] max-len bisection {stop}", file=sys.stderr, flush=True)
            self.result["skipped"].append(
                {"mode": Mode.STREAM.value, "what": "max-len bisection", "reason": str(stop)}
            )
        settle()
        self.write()


def _budget_arg(text: str) -> int:
    try:
        return mm.parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_text(text: str) -> str:
    """A size with its unit (``78GiB``), checked and kept as written (the worker parses it again)."""
    _budget_arg(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Peak memory and time per token of HF checkpointing, TRL's default, stream and stream + offload "
        "at several lengths, and stream's longest length, within a time budget (one GPU run; a CPU works too).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--model", help="a named shape or a Hub name / local dir (default: qwen3-8b; qwen3-tiny on cpu)")
    p.add_argument("--seq-len", nargs="+", type=positive_int, default=[16384, 32768, 65536])
    p.add_argument("--mode", nargs="+", choices=[m.value for m in Mode], default=[m.value for m in DEFAULT_MODES])
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--chunk", type=positive_int, default=4096, help="stream chunk and logit tile (tokens)")
    p.add_argument(
        "--kv-mode",
        choices=KV_MODES,
        help="stream modes: keys/values recomputed in backward, or captured in the forward (no key/value pass); "
        "default: recompute, or the plan's choice with --planned",
    )
    p.add_argument(
        "--planned",
        action="store_true",
        help="stream modes as the trainers run them: chunk, logit tile, kept inputs and kept keys/values chosen by "
        "the plan (stream_chunk_size='auto') within --memory-cap, or the free memory; stream+offload fixes offload on",
    )
    p.add_argument(
        "--memory-cap",
        type=_size_text,
        help="CUDA: PyTorch's allocator capped at this size (e.g. 78GiB: an 80 GB card's limits on a larger one), "
        "the plan's memory_budget with --planned, and the bisection's budget unless --budget is given",
    )
    p.add_argument("--warmup-seq-len", type=positive_int, default=2048, help="length of each process's warm-up step")
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=2,
        help="measured steps per process after the warm-up (the fastest counts)",
    )
    p.add_argument("--step", type=positive_int, default=4096, help="the bisection's lengths are multiples of this")
    p.add_argument(
        "--max-len", action=argparse.BooleanOptionalAction, default=True, help="bisect stream's longest length"
    )
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds: no measurement starts past it")
    p.add_argument(
        "--budget",
        type=_budget_arg,
        help="the bisection's memory budget, e.g. 78GiB (cuda default: the GPU's total memory; cpu: required)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch_compile=True: the whole model compiled (checkpoint modes), the layers' per-chunk bodies (stream)",
    )
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR)
    p.add_argument("--name", help="output file stem (default: gpu_<device>, or cpu_fallback on a CPU)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    parser = build_parser()
    parser.prog = prog or parser.prog  # "cpu.py bp" / "gpu.py bench" in its usage
    args = parser.parse_args(argv)
    command = command_line("gpu", "bench", sys.argv[1:] if argv is None else argv)
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if any(n < 2 for n in args.seq_len) or args.warmup_seq_len < 2:
        parser.error("--seq-len and --warmup-seq-len must be at least 2")
    if args.time_budget <= 0:
        parser.error("--time-budget must be positive")
    if device == "cpu" and args.max_len and args.budget is None:
        parser.error("--device cpu needs --budget for the bisection (e.g. 24MiB), or --no-max-len")
    cuda = device == "cuda"
    args.model = args.model or ("qwen3-8b" if cuda else "qwen3-tiny")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.mode = [Mode(m) for m in dict.fromkeys(args.mode)]
    if args.budget is None and args.memory_cap is not None:
        args.budget = mm.parse_budget(args.memory_cap)  # the bisection within the allocator's cap
    if cuda and args.budget is None:
        args.budget = torch.cuda.get_device_properties(0).total_memory
    args.name = args.name or (f"gpu_{device_slug(torch.cuda.get_device_name(0))}" if cuda else "cpu_fallback")
    run = Run(args, device, command)
    run.write()
    run.grid()
    run.bisect()
    run.write()
    for path in plot(run.result, run.out_dir, args.name):
        print(f"[gpu_bench] wrote {path}", file=sys.stderr)
    print(render_markdown(run.result))
    return run.result
