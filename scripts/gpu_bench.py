#!/usr/bin/env python
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

    python scripts/gpu_bench.py

On a CPU (a quick check of the script itself, as its test runs it)::

    python scripts/gpu_bench.py --device cpu --model qwen3-tiny --seq-len 256 512 --chunk 128 --step 256 \\
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
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_bp  # noqa: E402  (memory per extra token, the output directory)
import bench_report  # noqa: E402  (the modes' labels, the plot axes)

from streambp_trl.bench.measure import bisect_max_len, measure  # noqa: E402
from streambp_trl.bench.metadata import environment  # noqa: E402
from streambp_trl.bench.spec import DTYPES, MeasureSpec, Mode  # noqa: E402
from streambp_trl.layers import KV_MODES  # noqa: E402
from streambp_trl.sizing import memory_model as mm  # noqa: E402
from streambp_trl.sizing.auto import AUTO  # noqa: E402
from streambp_trl.sizing.lengths import max_len  # noqa: E402
from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name  # noqa: E402

DEFAULT_MODES = (Mode.CHECKPOINT, Mode.CHECKPOINT_CHUNKED_LOSS, Mode.STREAM, Mode.STREAM_OFFLOAD)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
OFFLOAD_TARGET = 1.15  # stream + offload time <= 1.15 x stream's (reported, never enforced)
DEFAULT_TIME_EXPONENT = 2.0  # step time ~ length**2 (attention) until two lengths of a mode give the exponent
# summary key -> (numerator mode, denominator mode, target): time ratios at each length measured in both modes
TIME_RATIOS: dict[str, tuple[Mode, Mode, float | None]] = {
    "stream_vs_checkpoint_time": (Mode.STREAM, Mode.CHECKPOINT, None),
    "stream_vs_trl_default_time": (Mode.STREAM, Mode.CHECKPOINT_CHUNKED_LOSS, None),
    "offload_vs_stream_time": (Mode.STREAM_OFFLOAD, Mode.STREAM, OFFLOAD_TARGET),
}


# --------------------------------------------------------------------------------------------------------------
# Pure pieces: names, estimates, the time budget, the summary
# --------------------------------------------------------------------------------------------------------------


def device_slug(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def estimated_peak_mb(
    model: str,
    mode: Mode,
    seq_len: int,
    dtype: str,
    chunk: int,
    head_form: str | None = None,
    capture: bool = False,
    logits_chunk: int | None = None,
) -> float | None:
    """The memory model's peak (MiB, weights and gradients included) of ``mode`` at ``seq_len``, stream modes with
    the logit gradient form the step took (``head_form``; None: the two-node form); None for a model that is not a
    named shape (no config is read) and for ``plain`` (which the memory model has no name for). The model holds every
    parameter's gradient through the step (gradients accumulated from an earlier micro-batch). ``capture``: the
    stream step keeps its keys/values from the forward (sized without offload: ``None`` for ``stream+offload``).
    ``logits_chunk``: the logit tile (None: the chunk)."""
    name = canonical_model_name(model)
    if name not in NAMED_MODELS or mode is Mode.PLAIN or (capture and mode is Mode.STREAM_OFFLOAD):
        return None
    setup = mm.StepSetup(
        mode=mode.memory_model_mode,
        dtype_bytes=DTYPE_BYTES[dtype],
        chunk=chunk if mode.streams else None,
        logits_chunk=(logits_chunk or chunk) if mode.streams else None,
        head_form=head_form or "two-node",
        capture=capture and mode is Mode.STREAM,
    )
    return mm.estimate_peak_bytes(mm.ModelShape.from_name(name), setup, seq_len) / 2**20


def _full_length_steps(warmup_seq_len: int | None, repeats: int = 1) -> int:
    """Steps at the measured length in one process: the measured ones, and the warm-up unless it is shorter."""
    return repeats + (0 if warmup_seq_len is not None else 1)


def _time_exponent(pool: list[dict[str, Any]]) -> float:
    """How the step time grows with the length, ``t ~ n**e``, from the two longest lengths in ``pool`` (clamped to
    [1, 2]: linear layers to attention); :data:`DEFAULT_TIME_EXPONENT` with fewer than two lengths."""
    slowest: dict[int, float] = {}
    for r in pool:
        slowest[r["seq_len"]] = max(slowest.get(r["seq_len"], 0.0), r["time_s"])
    if len(slowest) < 2:
        return DEFAULT_TIME_EXPONENT
    (n0, t0), (n1, t1) = sorted(slowest.items())[-2:]
    if t0 <= 0 or t1 <= 0:
        return DEFAULT_TIME_EXPONENT
    return min(max(math.log(t1 / t0) / math.log(n1 / n0), 1.0), 2.0)


def predict_wall_s(
    records: list[dict[str, Any]], mode: Mode, seq_len: int, warmup_seq_len: int | None
) -> float | None:
    """Likely wall-clock seconds of measuring ``mode`` at ``seq_len`` (the whole process), from earlier records'
    ``wall_s``: the one of the same mode (else of any mode) that ran ok at the longest length up to ``seq_len`` (else
    the shortest above), its fixed part (start, model, short warm-up) kept and its full-length steps scaled by
    ``(seq_len / n0) ** e`` (:func:`_time_exponent`). Without an ok record, the longest wall time so far; None
    before the first measurement."""
    timed = [r for r in records if r.get("wall_s") is not None]
    ok = [r for r in timed if r.get("status") == "ok"]
    pool = [r for r in ok if r["mode"] == mode] or ok
    if not pool:
        return max((r["wall_s"] for r in timed), default=None)
    lengths = sorted({r["seq_len"] for r in pool})
    below = [n for n in lengths if n <= seq_len]
    n0 = below[-1] if below else lengths[0]
    ref = max((r for r in pool if r["seq_len"] == n0), key=lambda r: r["wall_s"])
    steps0 = _full_length_steps(ref.get("warmup_seq_len"), ref.get("repeats", 1))
    fixed = max(ref["wall_s"] - steps0 * ref["time_s"], 0.0)
    scale = (seq_len / n0) ** _time_exponent(pool)
    return fixed + _full_length_steps(warmup_seq_len, ref.get("repeats", 1)) * ref["time_s"] * scale


def skip_reason(elapsed_s: float, time_budget_s: float, predicted_s: float | None) -> str | None:
    """Why a measurement is not started (None: start it): the time budget is spent, or the measurement would
    likely end past it."""
    if elapsed_s >= time_budget_s:
        return f"time budget spent ({elapsed_s:.0f} s of {time_budget_s:.0f} s)"
    if predicted_s is not None and elapsed_s + predicted_s > time_budget_s:
        left = time_budget_s - elapsed_s
        return f"would likely pass the time budget (about {predicted_s:.0f} s needed, {left:.0f} s left)"
    return None


def fits(record: dict[str, Any], budget_bytes: float) -> bool:
    """The trial ran and its total peak is within the budget."""
    return record.get("status") == "ok" and record["total_peak_mb"] * 2**20 <= budget_bytes


def bracket(trials: list[dict[str, Any]], budget_bytes: float) -> tuple[int, int | None]:
    """``(longest fit, shortest failure above it)`` of the trials so far (0: none fits; None: none failed). A
    failure ran out of memory or peaked above the budget; a trial that failed otherwise (e.g. timed out) is
    neither."""
    longest = max((t["seq_len"] for t in trials if fits(t, budget_bytes)), default=0)
    failures = [
        t["seq_len"]
        for t in trials
        if t["seq_len"] > longest
        and (t.get("status") == "oom" or t.get("status") == "ok" and not fits(t, budget_bytes))
    ]
    return longest, min(failures, default=None)


def time_ratios(records: list[dict[str, Any]], num: Mode, den: Mode, target: float | None) -> dict[str, Any]:
    """Step time of ``num`` over ``den`` at each length both ran ok (keys: the length as a string)."""
    times: dict[tuple[str, int], float] = {
        (r["mode"], r["seq_len"]): r["time_s"] for r in records if r.get("status") == "ok"
    }
    out: dict[str, Any] = {}
    for (mode, seq_len), t in sorted(times.items(), key=lambda kv: kv[0][1]):
        if mode == num and (den, seq_len) in times:
            ratio = t / times[(den, seq_len)]
            out[str(seq_len)] = {"ratio": ratio} | ({"target": target, "met": ratio <= target} if target else {})
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory per extra token per mode (shortest vs longest length measured ok: ``bench_bp.summarize``) and the
    time ratios of :data:`TIME_RATIOS`."""
    ok = [r for r in records if r.get("status") == "ok"]
    summary: dict[str, Any] = {"memory_per_extra_token": bench_bp.summarize(ok)["memory_per_extra_token"]}
    for key, (num, den, target) in TIME_RATIOS.items():
        summary[key] = time_ratios(ok, num, den, target)
    return summary


# --------------------------------------------------------------------------------------------------------------
# Markdown and plots
# --------------------------------------------------------------------------------------------------------------


def _unit(result: dict[str, Any]) -> tuple[str, float]:
    """GiB when a peak reaches 1 GiB, else MiB: the name and MiB per unit."""
    peaks = [r.get("total_peak_mb") or 0 for r in result["records"]]
    return ("GiB", 1024.0) if max(peaks, default=0) >= 1024 else ("MiB", 1.0)


def _cell(record: dict[str, Any] | None, skipped: dict[str, Any] | None, unit_mb: float) -> tuple[str, str]:
    """(peak, ms per 1k tokens) cells of one mode at one length."""
    if record is None:
        return ("skipped", "skipped") if skipped else ("–", "–")
    if record["status"] != "ok":
        return record["status"], record["status"]
    peak = f"{record['total_peak_mb'] / unit_mb:.2f}"
    if record.get("estimated_peak_mb") is not None:
        peak += f" ({record['estimated_peak_mb'] / unit_mb:.2f})"
    return peak, f"{record['ms_per_1k_tokens']:.1f}"


def render_markdown(result: dict[str, Any]) -> str:
    env, s = result["env"], result["settings"]
    unit, unit_mb = _unit(result)
    peak_how = (
        "torch.cuda.max_memory_allocated of the step"
        if env["device"] == "cuda"
        else "the model's bytes plus peak RSS above it"
    )
    lines = [
        f"# {s['name']}: {s['model']}, {s['dtype']}, one forward+backward, {env['device_name']}",
        "",
        f"- command: `{result['command']}`",
        f"- device: {env['device_name']} ({env['device']}, {env['cpu_cores']} CPU cores); "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
        + f"; git {env['git']}, engine sha256 {env['engine_sha256']}; {env['date']}",
        f"- each (mode, length): {s.get('repeats', 1)} measured step(s) in a fresh process after a warm-up step at "
        f"{s['warmup_seq_len']} tokens (at the length itself when not longer); peak = {peak_how} (model and gradients "
        "included); time = the fastest measured step's wall clock (the first at a length also allocates pinned host "
        "buffers and cuDNN plans: `first_step_s` in the JSON)",
        _stream_line(s),
        f"- run: {s['elapsed_s']:.0f} s of the {s['time_budget_s']:.0f} s time budget",
        "",
        f"Peak {unit} and ms per 1k tokens. In parentheses the memory model's estimate, which holds every parameter's "
        "gradient through the step (as when gradients accumulate over micro-batches); each step here starts without "
        "them (as after the Trainer's `zero_grad`), so a full fine-tuning step peaks below it "
        "(`tests/test_cuda.py` measures with the gradients held):",
        "",
    ]
    lengths = s["seq_lens"]
    by_key = {(r["mode"], r["seq_len"]): r for r in result["records"]}
    skipped = {(k["mode"], k["seq_len"]): k for k in result["skipped"] if k.get("seq_len") in lengths}
    lines.append("| mode | " + " | ".join(f"{n} peak {unit} | {n} ms/1k" for n in lengths) + " |")
    lines.append("|---|" + "---:|---:|" * len(lengths))
    for mode in s["modes"]:
        cells = [c for n in lengths for c in _cell(by_key.get((mode, n)), skipped.get((mode, n)), unit_mb)]
        lines.append(f"| {bench_report.LABELS[Mode(mode)]} | " + " | ".join(cells) + " |")
    summary = result["summary"]
    if summary["memory_per_extra_token"]:
        lines += ["", "Memory per extra token (peak above the model, longest length minus shortest):", ""]
        lines += ["| mode | from → to | KiB/token |", "|---|---|---:|"]
        for mode, v in summary["memory_per_extra_token"].items():
            lines.append(f"| {mode} | {v['from_seq_len']} → {v['to_seq_len']} | {v['kib_per_token']:.2f} |")
    ratio_lengths = sorted({int(n) for key in TIME_RATIOS for n in summary[key]})
    if ratio_lengths:
        heads = {
            "stream_vs_checkpoint_time": "stream / checkpoint",
            "stream_vs_trl_default_time": "stream / TRL default",
            "offload_vs_stream_time": f"stream+offload / stream (≤ {OFFLOAD_TARGET})",
        }
        lines += ["", "Step time ratios:", "", "| length | " + " | ".join(heads.values()) + " |"]
        lines.append("|---:|" + "---:|" * len(heads))
        for n in ratio_lengths:
            cells = []
            for key in heads:
                v = summary[key].get(str(n))
                cell = "–" if v is None else f"{v['ratio']:.3f}"
                if v is not None and "met" in v:
                    cell += " (met)" if v["met"] else " (**not met**)"
                cells.append(cell)
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", *_max_len_lines(result["max_len"], unit, unit_mb)]
    if result["skipped"]:
        lines += ["", "Skipped:", ""]
        for k in result["skipped"]:
            what = f"at {k['seq_len']}" if "seq_len" in k else k["what"]
            lines.append(f"- {k['mode']} {what}: {k['reason']}")
    return "\n".join(lines) + "\n"


def _max_len_lines(section: dict[str, Any], unit: str, unit_mb: float) -> list[str]:
    head = "Stream's longest length"
    if section.get("budget_bytes") is None:
        return [f"{head}: {section['status']}."]
    budget = section["budget_bytes"] / 2**20 / unit_mb
    head += f" (budget {budget:.2f} {unit}, multiples of {section['step']}, first trial {section['start'] or '-'})"
    if "longest_fit" not in section:
        return [f"{head}: {section['status']}."]
    longest, failure, at = section["longest_fit"], section["shortest_failure"], section["total_peak_mb_at_longest_fit"]
    peak = f" (peak {at / unit_mb:.2f} {unit})" if at is not None else ""
    tried = ", ".join(
        f"{t['seq_len']} "
        + ("fits" if t["fits"] else "above the budget" if t["status"] == "ok" else t["status"])
        + (" (the grid's record)" if t["from_grid"] else "")
        for t in section["trials"]
    )
    return [
        f"{head}: **{longest:,}** tokens{peak}, shortest failure {f'{failure:,}' if failure else '-'}; "
        f"{section['status']}.",
        f"Trials: {tried or 'none'}.",
    ]


def plot(result: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    """``NAME_memory.png`` (peak GiB vs length per mode, the memory model's estimate dotted) and ``NAME_time.png``
    (ms per 1k tokens vs length); none, with a message, without matplotlib."""
    try:
        bench_report.pyplot()
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    s, env = result["settings"], result["env"]
    title = f"{s['model']}, {s['dtype']}, one forward+backward, {env['device_name']}"
    paths = []
    for what, ylabel in (("memory", "peak memory (GiB, model included)"), ("time", "ms per 1k tokens")):
        fig, ax = bench_report.new_axes(title, ylabel)
        for i, mode in enumerate(Mode):
            ok = [r for r in result["records"] if r["mode"] == mode and r["status"] == "ok"]
            ok.sort(key=lambda r: r["seq_len"])
            if not ok:
                continue
            xs, label, color = [r["seq_len"] for r in ok], bench_report.LABELS[mode], f"C{i}"
            if what == "time":
                ax.plot(xs, [r["ms_per_1k_tokens"] for r in ok], marker="o", color=color, label=label)
                continue
            ax.plot(xs, [r["total_peak_mb"] / 1024 for r in ok], marker="o", color=color, label=label)
            estimated = [r for r in ok if r.get("estimated_peak_mb") is not None]
            if estimated:
                xs = [r["seq_len"] for r in estimated]
                ys = [r["estimated_peak_mb"] / 1024 for r in estimated]
                ax.plot(xs, ys, linestyle=":", color=color, label=f"{label} (memory model)")
        longest = result["max_len"].get("longest_fit")
        at = result["max_len"].get("total_peak_mb_at_longest_fit")
        if what == "memory" and longest and at is not None:
            color = f"C{list(Mode).index(Mode.STREAM)}"
            ax.plot([longest], [at / 1024], marker="*", markersize=12, color=color, label="stream's longest fit")
        top = ax.get_ylim()[1]
        if what == "memory" and s["budget_bytes"] and s["budget_bytes"] / 2**30 < 2 * top:  # else it flattens the rest
            ax.axhline(s["budget_bytes"] / 2**30, color="gray", linestyle="--", linewidth=1, label="budget")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        paths.append(bench_report.save_figure(fig, out_dir / f"{name}_{what}.png"))
    return paths


# --------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------


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


def _stream_line(s: dict[str, Any]) -> str:
    """How the stream modes ran, for the report's header."""
    kv = {"planned": "kept or recomputed as planned", "capture": "kept from the forward"}.get(
        s.get("kv_mode", "recompute"), "recomputed in backward"
    )
    cap = f", the allocator capped at {s['memory_cap']}" if s.get("memory_cap") else ""
    if s.get("planned"):
        return (
            f"- stream as the trainers plan it (chunk, logit tile, kept inputs per call within the budget{cap}; "
            f"each record's plan in the JSON), keys/values {kv}; TRL's default keeps its own token tile"
        )
    return (
        f"- stream chunk = logit tile = {s['chunk']} tokens, keys/values {kv}{cap}; TRL's default keeps its own "
        "token tile"
    )


def _size_text(text: str) -> str:
    """A size with its unit (``78GiB``), checked and kept as written (the worker parses it again)."""
    _budget_arg(text)
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Peak memory and time per token of HF checkpointing, TRL's default, stream and stream + offload "
        "at several lengths, and stream's longest length, within a time budget (one GPU run; a CPU works too).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--model", help="a named shape or a Hub name / local dir (default: qwen3-8b; qwen3-tiny on cpu)")
    p.add_argument("--seq-len", nargs="+", type=_positive, default=[16384, 32768, 65536])
    p.add_argument("--mode", nargs="+", choices=[m.value for m in Mode], default=[m.value for m in DEFAULT_MODES])
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--chunk", type=_positive, default=4096, help="stream chunk and logit tile (tokens)")
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
    p.add_argument("--warmup-seq-len", type=_positive, default=2048, help="length of each process's warm-up step")
    p.add_argument(
        "--repeats",
        type=_positive,
        default=2,
        help="measured steps per process after the warm-up (the fastest counts)",
    )
    p.add_argument("--step", type=_positive, default=4096, help="the bisection's lengths are multiples of this")
    p.add_argument(
        "--max-len", action=argparse.BooleanOptionalAction, default=True, help="bisect stream's longest length"
    )
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds: no measurement starts past it")
    p.add_argument(
        "--budget",
        type=_budget_arg,
        help="the bisection's memory budget, e.g. 78GiB (cuda default: the GPU's total memory; cpu: required)",
    )
    p.add_argument("--out-dir", type=Path, default=bench_bp.BENCH_DIR)
    p.add_argument("--name", help="output file stem (default: gpu_<device>, or cpu_fallback on a CPU)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = shlex.join(["python", *(sys.argv if argv is None else [str(Path(__file__)), *argv])])
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


if __name__ == "__main__":
    main()
