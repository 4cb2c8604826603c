"""Memory and time of one step of a preference or RL objective with TRL's defaults and with the stream engine,
each measurement in a fresh process (``streambp_trl.bench.measure``, the measuring code of ``cpu.py bp`` and
``streambp-trl max-len``, which runs these objectives too).

* ``--objective dpo``: a DPO step as TRL's ``DPOTrainer`` runs it: the batch is [chosen; rejected], two sequences of
  ``--seq-len`` tokens (the first eighth a shared prompt); the frozen reference model (eval mode, no grad) and the
  policy both compute per-token log-probs through ``model(..., labels=..., fused_lm_head=True)``; the sigmoid loss
  is backpropagated through the policy.
* ``--objective grpo``: the policy-update part of a GRPO step as TRL's ``GRPOTrainer`` runs it (generation and
  rewards excluded, beta 0): two sequences of ``--seq-len`` tokens, the first eighth the prompt, per-token
  log-probs of the completions at the sampling temperature through the fused head, the token-level clipped
  surrogate with advantages +1 and -1, backpropagated through the policy.

Modes (:data:`streambp_trl.bench.spec.OBJECTIVE_MODES`):

* ``trl``: DPOTrainer's defaults: Hugging Face gradient checkpointing on the policy, TRL's fused LM head on both
  models (its token tile set to ``--logits-chunk-size``, so both modes hold the same logit tile).
* ``stream``: ``enable_streambp`` on the policy and, with ``stream_eval=True``, on the reference.

Memory is the peak above both loaded models (CPU: peak RSS with ``MALLOC_MMAP_THRESHOLD_=131072``; CUDA: peak
allocated); the figure of merit is its growth per extra token (KiB/token) between the two lengths.

The summary and the table of two modes (TRL's defaults and stream) per length are also those of ``cpu.py reward``
and ``cpu.py distillation`` (:func:`summarize`, :func:`render_table`, :func:`write_results`), and so is the measuring
of their own fresh processes (:func:`measured_steps`).

    python scripts/cpu.py objectives --objective dpo --seq-len 2048 4096 --out cpu_dpo_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from streambp_trl.bench.measure import measure
from streambp_trl.bench.memory_meter import MemoryMeter
from streambp_trl.bench.spec import DTYPES, OBJECTIVE_MODES, MeasureSpec
from streambp_trl.sizing import memory_model as mm

from . import cpu_bp
from .common import BENCH_DIR

MODES = tuple(OBJECTIVE_MODES)  # the names of the two modes: "trl", "stream"
OBJECTIVES = tuple(o for o in mm.OBJECTIVES if o != "sft")  # the preference / RL objectives
TITLE = {"dpo": "One DPO step (reference + policy)", "grpo": "The policy update of a GRPO step (temperature 0.7)"}
TARGET_MEM_RATIO = 0.4  # stream KiB per extra token <= 0.4 x TRL's (reported, never enforced)
HEADING = (  # the report's title and settings line (render_table)
    "# {title}, {model}, {dtype}, {device_name}",
    "Stream chunk {stream_chunk_size}, logit tile {logits_chunk_size} (TRL's fused head: the same); memory: {memory}",
)


def summarize(records: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """Each mode's memory per extra token between the shortest and the longest length (two sequences a step), and
    stream's ratios to TRL's."""
    by = {(r["mode"], r["seq_len"]): r for r in records if r.get("status") == "ok"}
    lo, hi = min(lengths), max(lengths)
    slopes = {}
    for mode in MODES:
        if (mode, lo) in by and (mode, hi) in by:
            tokens = 2 * (hi - lo)  # two sequences per step
            slopes[mode] = (by[(mode, hi)]["peak_mb"] - by[(mode, lo)]["peak_mb"]) * 1024 / tokens
    summary: dict[str, Any] = {"kib_per_token": slopes}
    if len(slopes) == 2:
        summary["memory_ratio"] = slopes["stream"] / slopes["trl"]
        summary["target_memory_ratio"] = TARGET_MEM_RATIO
        summary["time_ratio_at_longest"] = by[("stream", hi)]["time_s"] / by[("trl", hi)]["time_s"]
    return summary


def render_table(
    heading: tuple[str, str], meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any], **fields
) -> str:
    """The Markdown of a two-mode run: ``heading`` (a title and a line of settings, formatted with ``meta`` and
    ``fields``), the command and versions, then each mode's peak and time per length and its memory per extra
    token."""
    title, settings = (line.format_map({**meta, **fields}) for line in heading)
    lengths = sorted({r["seq_len"] for r in records})
    by = {(r["mode"], r["seq_len"]): r for r in records if r.get("status") == "ok"}
    head = "| mode | " + " | ".join(f"peak MiB at 2x{n}" for n in lengths) + " | KiB per extra token | "
    head += " | ".join(f"time s at 2x{n}" for n in lengths) + " |"
    lines = [
        title,
        "",
        f"Command: `{meta['command']}`  ",
        f"Versions: {json.dumps(meta['versions'])}; git {meta['git']}; engine {meta['engine_sha256']}  ",
        settings,
        "",
        head,
        "|---|" + "---:|" * (2 * len(lengths) + 1),
    ]
    for mode in MODES:
        peaks = " | ".join(fmt(by.get((mode, n), {}).get("peak_mb")) for n in lengths)
        times = " | ".join(fmt(by.get((mode, n), {}).get("time_s"), ".2f") for n in lengths)
        lines.append(f"| {mode} | {peaks} | {fmt(summary['kib_per_token'].get(mode))} | {times} |")
    if "memory_ratio" in summary:
        lines += [
            "",
            f"Memory per extra token, stream / TRL: **{summary['memory_ratio']:.2f}x** (target <= "
            f"{TARGET_MEM_RATIO}); time at the longest length: {summary['time_ratio_at_longest']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def measured_steps(step: Callable[[], float], model, device, repeats: int) -> tuple[list, list, list]:
    """The measuring of the ``--worker`` processes of ``cpu.py reward`` and ``cpu.py distillation``: one warm-up
    ``step()``, then ``repeats`` measured ones, the gradients cleared after each: their wall times (s), peaks above
    the baseline (bytes, :class:`~streambp_trl.bench.memory_meter.MemoryMeter`) and losses."""
    step()  # first-touch pages, lazy initialisation
    model.zero_grad(set_to_none=True)
    meter = MemoryMeter(device)
    times, peaks, losses = [], [], []
    for _ in range(repeats):
        meter.reset()
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
        peaks.append(meter.peak_above_baseline())
        model.zero_grad(set_to_none=True)
    return times, peaks, losses


def write_results(
    name: str | None, meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any], markdown: str
) -> None:
    """``benchmarks/NAME.json`` (meta, records, summary) and ``benchmarks/NAME.md`` (``markdown``); nothing without
    a name."""
    if not name:
        return
    BENCH_DIR.mkdir(exist_ok=True)
    result = {"meta": meta, "records": records, "summary": summary}
    (BENCH_DIR / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (BENCH_DIR / f"{name}.md").write_text(markdown)


def render(meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    return render_table(HEADING, meta, records, summary, title=TITLE[meta["objective"]])


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", choices=OBJECTIVES, default="dpo")
    parser.add_argument("--model", default="qwen3-cpu-bench", help="named size of cpu.py bp, Hub name or dir")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seq-len", nargs="+", type=int, default=[2048, 4096], help="tokens per sequence")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--stream-chunk-size", type=int, default=1024)
    parser.add_argument("--logits-chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", metavar="NAME", help="write benchmarks/NAME.json and benchmarks/NAME.md")
    args = parser.parse_args(argv)
    records = []
    for seq_len in args.seq_len:
        for mode in args.mode:
            spec = MeasureSpec(
                objective=args.objective,
                mode=OBJECTIVE_MODES[mode],
                same_logits_tile=True,
                seq_len=seq_len,
                batch_size=2,
                model=args.model,
                dtype=args.dtype,
                device=args.device,
                seed=args.seed,
                repeats=args.repeats,
                stream_chunk_size=args.stream_chunk_size,
                logits_chunk_size=args.logits_chunk_size,
            )
            records.append({**measure(spec, args.timeout), "mode": mode})
    meta_args = argparse.Namespace(**vars(args), batch_size=2, kv_mode="recompute", same_logits_tile=True)
    meta = {**cpu_bp.metadata(meta_args, args.device), "objective": args.objective}
    summary = summarize(records, args.seq_len)
    print(render(meta, records, summary))
    write_results(args.out, meta, records, summary, render(meta, records, summary))
