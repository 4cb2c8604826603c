"""Benchmark the memory and time of ONE forward+backward of a causal LM under different backprop strategies.

Modes (``--mode``, one or more): ``plain`` (no checkpointing, full logits), ``checkpoint`` (HF gradient
checkpointing), ``checkpoint+chunked-loss`` (TRL 1.16's default: checkpointing + ``add_fused_lm_head``),
``stream`` (``enable_streambp(model, stream_chunk_size=..., logits_chunk_size=..., kv_mode=...)`` and the same
``fused_lm_head=True`` call) and ``stream+offload`` (the same with ``offload_checkpoints=True``).

The measuring lives in ``streambp_trl.bench.measure`` (shared with ``streambp-trl max-len``; its docstrings and
those of ``bench.worker`` / ``bench.memory_meter`` describe it exactly): every (mode, seq_len) runs in a fresh
subprocess, one warm-up step, then ``--repeats`` measured forward+backward steps; ``peak_mb`` is the peak above the
loaded model in MiB (CPU: peak RSS with ``MALLOC_MMAP_THRESHOLD_=131072`` and ``/proc/self/clear_refs``; CUDA:
``max_memory_allocated``), parameter gradients included; the time is the median wall-clock seconds (synchronised on
CUDA); ``cpu_s`` is the process CPU time of the step (all threads): on a shared machine a wall time far above
``cpu_s / threads`` means the step was waiting for a CPU.

``--phases`` also splits the measured step at the decoder layers' gradient boundaries (forward; loss + LM head +
final norm backward; each layer's backward; the rest) and records each phase's peak and time; the summary then
gives each phase's memory per extra token. The steepest phase slope is what the per-token memory tends to at long
sequences: at moderate lengths a phase with a large fixed cost (the logit tiles) can hold the peak and hide it.
Compare phase slopes between lengths that are both at least the logit tile sizes.

Inputs are random token ids (fixed seed), ``labels = input_ids`` (every token labelled), ``--batch-size`` rows,
no padding. Dropout probabilities in the config are set to 0 for every mode (StreamBP refuses dropout, and it
would change the other modes' saved tensors).

Results go to ``benchmarks/NAME.json`` and ``benchmarks/NAME.md`` (``--out NAME``), rewritten after every
measurement. With two or more sequence lengths the summary gives, per mode, the memory per extra token between
the shortest and the longest length, and for ``stream`` the ratios to ``checkpoint+chunked-loss`` (per-token
memory) and to ``checkpoint`` (time at each length). ``--baseline FILE`` takes records of modes not measured in
this run from an earlier JSON output (e.g. to compare ``--kv-mode capture`` against an earlier full run).

The longest sequence that fits, per training mode, is ``streambp-trl max-len`` (the same measuring, one trial per
length in a fresh process, e.g. ``streambp-trl max-len --model qwen3-8b --json h100_qwen3_8b_max_len.json``).

Example::

    python scripts/cpu.py bp --model qwen3-cpu-bench --dtype float32 --seq-len 8192 16384 \\
        --mode plain checkpoint checkpoint+chunked-loss stream --out cpu_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from streambp_trl.bench.measure import measure
from streambp_trl.bench.metadata import environment
from streambp_trl.bench.models import trl_token_chunk
from streambp_trl.bench.spec import DTYPES, MeasureSpec, Mode
from streambp_trl.sizing.choices import KV_MODES
from streambp_trl.sizing.shapes import NAMED_MODELS

from .common import BENCH_DIR

# Acceptance targets of the CPU benchmark (reported, never enforced).
TARGET_MEM_RATIO = 0.35  # stream KiB per extra token <= 0.35 x checkpoint+chunked-loss's
TARGET_TIME_RATIO = 1.3  # stream time <= 1.3 x checkpoint's


# --------------------------------------------------------------------------------------------------------------
# Metadata, summary, output files (the measuring itself: streambp_trl.bench.measure).
# --------------------------------------------------------------------------------------------------------------


def metadata(args: argparse.Namespace, device: str) -> dict[str, Any]:
    return {
        **environment(device),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "model": args.model,
        "model_config": NAMED_MODELS.get(args.model),
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "stream_chunk_size": args.stream_chunk_size,
        "logits_chunk_size": args.logits_chunk_size,
        "trl_token_chunk_size": args.logits_chunk_size if args.same_logits_tile else trl_token_chunk(),
        "kv_mode": args.kv_mode,
        "torch_compile": args.compile,
        "repeats": args.repeats,
        "memory": "peak RSS above the loaded model (VmHWM - VmRSS baseline)"
        if device == "cpu"
        else "torch.cuda.max_memory_allocated() - memory_allocated() baseline",
    }


def _ok_by_mode(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == "ok":
            out.setdefault(r["mode"], {})[r["seq_len"]] = r
    return out


def _phase_slopes(by_mode: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode with phase records at two or more lengths: each phase's KiB per extra token, and the steepest.

    The steepest phase slope is the per-token memory the step tends to at long sequences, where that phase holds
    the peak; at shorter lengths a phase with a large fixed cost (e.g. logit tiles) can hold it instead.
    """
    out: dict[str, dict[str, Any]] = {}
    for mode, recs in by_mode.items():
        lengths = sorted(n for n, r in recs.items() if r.get("phases"))
        if len(lengths) < 2:
            continue
        lo, hi = recs[lengths[0]], recs[lengths[-1]]
        extra_tokens = hi["batch_size"] * hi["seq_len"] - lo["batch_size"] * lo["seq_len"]
        lo_peaks = {p["phase"]: p["peak_mb"] for p in lo["phases"]}
        slopes = {
            p["phase"]: (p["peak_mb"] - lo_peaks[p["phase"]]) * 1024 / extra_tokens
            for p in hi["phases"]
            if p["phase"] in lo_peaks
        }
        if not slopes:
            continue
        steepest = max(slopes, key=slopes.__getitem__)
        out[mode] = {
            "from_seq_len": lo["seq_len"],
            "to_seq_len": hi["seq_len"],
            "kib_per_token": slopes,
            "steepest_phase": steepest,
            "max_kib_per_token": slopes[steepest],
            "peak_phase": {str(n): max(recs[n]["phases"], key=lambda p: p["peak_mb"])["phase"] for n in lengths},
        }
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory per extra token per mode (shortest vs longest length) and stream's ratios to the baselines."""
    by_mode = _ok_by_mode(records)
    per_token: dict[str, dict[str, Any]] = {}
    for mode, recs in by_mode.items():
        lengths = sorted(recs)
        if len(lengths) < 2:
            continue
        lo, hi = recs[lengths[0]], recs[lengths[-1]]
        extra_tokens = hi["batch_size"] * hi["seq_len"] - lo["batch_size"] * lo["seq_len"]
        per_token[mode] = {
            "from_seq_len": lo["seq_len"],
            "to_seq_len": hi["seq_len"],
            "kib_per_token": (hi["peak_mb"] - lo["peak_mb"]) * 1024 / extra_tokens,
        }
    summary: dict[str, Any] = {"memory_per_extra_token": per_token}
    phase_slopes = _phase_slopes(by_mode)
    if phase_slopes:
        summary["phase_memory_per_extra_token"] = phase_slopes
        if Mode.STREAM in phase_slopes and Mode.CHECKPOINT_CHUNKED_LOSS in phase_slopes:
            ratio = (
                phase_slopes[Mode.STREAM]["max_kib_per_token"]
                / phase_slopes[Mode.CHECKPOINT_CHUNKED_LOSS]["max_kib_per_token"]
            )
            summary["stream_vs_chunked_loss_steepest_phase"] = {
                "ratio": ratio,
                "target": TARGET_MEM_RATIO,
                "met": ratio <= TARGET_MEM_RATIO,
            }
    hashes = sorted(
        {r.get("engine_sha256") or "?" for r in records if r.get("status") == "ok" and r["mode"] == Mode.STREAM}
    )
    if len(hashes) > 1:
        summary["warning"] = f"records come from different streambp_trl sources (engine_sha256 {', '.join(hashes)})"
    stream = by_mode.get(Mode.STREAM, {})
    if Mode.STREAM in per_token and Mode.CHECKPOINT_CHUNKED_LOSS in per_token:
        ratio = per_token[Mode.STREAM]["kib_per_token"] / per_token[Mode.CHECKPOINT_CHUNKED_LOSS]["kib_per_token"]
        summary["stream_vs_chunked_loss_memory_per_token"] = {
            "ratio": ratio,
            "target": TARGET_MEM_RATIO,
            "met": ratio <= TARGET_MEM_RATIO,
        }
    time_ratios = {}
    for seq_len, rec in sorted(stream.items()):
        base = by_mode.get(Mode.CHECKPOINT, {}).get(seq_len)
        if base is not None:
            ratio = rec["time_s"] / base["time_s"]
            time_ratios[str(seq_len)] = {
                "ratio": ratio,
                "target": TARGET_TIME_RATIO,
                "met": ratio <= TARGET_TIME_RATIO,
            }
    if time_ratios:
        summary["stream_vs_checkpoint_time"] = time_ratios
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _phase_markdown(records: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    with_phases = [r for r in records if r.get("status") == "ok" and r.get("phases")]
    if not with_phases:
        return []
    names = list(dict.fromkeys(p["phase"] for r in with_phases for p in r["phases"]))
    lines = ["", "Peak MiB above the model per phase (time s in parentheses):", ""]
    lines += ["| mode | seq_len | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in with_phases:
        cells = {p["phase"]: f"{p['peak_mb']:.1f} ({p['time_s']:.1f})" for p in r["phases"]}
        mode = r["mode"] + (f" ({r['kv_mode']})" if r["mode"] == Mode.STREAM else "")
        lines.append(f"| {mode} | {r['seq_len']} | " + " | ".join(cells.get(n, "–") for n in names) + " |")
    slopes = summary.get("phase_memory_per_extra_token", {})
    if slopes:
        lines += ["", "KiB per extra token per phase (steepest in bold):", ""]
        lines += ["| mode | from → to | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
        for mode, v in slopes.items():
            cells = [
                "–"
                if n not in v["kib_per_token"]
                else (
                    f"**{v['kib_per_token'][n]:.2f}**" if n == v["steepest_phase"] else f"{v['kib_per_token'][n]:.2f}"
                )
                for n in names
            ]
            lines.append(f"| {mode} | {v['from_seq_len']} → {v['to_seq_len']} | " + " | ".join(cells) + " |")
        steep = summary.get("stream_vs_chunked_loss_steepest_phase")
        if steep:
            lines += [
                "",
                f"- stream / checkpoint+chunked-loss steepest-phase memory per extra token: **{steep['ratio']:.3f}** "
                f"(target ≤ {steep['target']}: {'met' if steep['met'] else 'NOT met'})",
            ]
        for mode, v in slopes.items():
            where = ", ".join(f"{n}: {ph}" for n, ph in v["peak_phase"].items())
            lines.append(f"- {mode}: the step's peak is in phase ({where})")
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    meta = result["metadata"]
    lines = [
        f"# bench_bp: {meta['model']}, {meta['dtype']}, batch {meta['batch_size']}, {meta['device']}",
        "",
        f"- device: {meta['device_name']} ({meta['cpu_cores']} cores, {meta['torch_threads']} torch threads)",
        "- versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f", git {meta['git']}, engine sha256 {meta['engine_sha256']}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- memory: {meta['memory']}, MiB; time: wall-clock s of one forward+backward (median of {meta['repeats']})",
        f"- stream: stream_chunk_size {meta['stream_chunk_size']}, logits_chunk_size {meta['logits_chunk_size']}, "
        f"kv_mode {meta['kv_mode']}; TRL fused head token tile {meta['trl_token_chunk_size']}",
    ]
    if result.get("summary", {}).get("warning"):
        lines.append(f"- **warning: {result['summary']['warning']}**")
    if result.get("baseline"):
        lines.append(f"- records marked * come from the baseline file `{result['baseline']}`")
    lines += [
        "",
        "| mode | seq_len | peak MiB | time s | CPU s | tokens/s | loss | grad norm | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["records"]:
        mode = (
            r["mode"] + (f" ({r['kv_mode']})" if r["mode"] == Mode.STREAM else "") + ("*" if r.get("source") else "")
        )
        lines.append(
            f"| {mode} | {r['seq_len']} | {_fmt(r.get('peak_mb'), '.1f')} | {_fmt(r.get('time_s'), '.2f')} | "
            f"{_fmt(r.get('cpu_s'), '.1f')} | "
            f"{_fmt(r.get('tokens_per_s'), '.0f')} | {_fmt(r.get('loss'), '.6f')} | "
            f"{_fmt(r.get('grad_norm'), '.6g')} | {r['status']} |"
        )
    summary = result.get("summary", {})
    per_token = summary.get("memory_per_extra_token", {})
    if per_token:
        lines += ["", "Memory per extra token (peak at the longer length minus the shorter, per token):", ""]
        lines += ["| mode | from → to | KiB/token |", "|---|---|---:|"]
        for mode, v in per_token.items():
            lines.append(f"| {mode} | {v['from_seq_len']} → {v['to_seq_len']} | {v['kib_per_token']:.2f} |")
    mem = summary.get("stream_vs_chunked_loss_memory_per_token")
    if mem:
        lines += [
            "",
            f"- stream / checkpoint+chunked-loss memory per extra token: **{mem['ratio']:.3f}** "
            f"(target ≤ {mem['target']}: {'met' if mem['met'] else 'NOT met'})",
        ]
    for seq_len, v in summary.get("stream_vs_checkpoint_time", {}).items():
        lines.append(
            f"- stream / checkpoint time at {seq_len}: **{v['ratio']:.3f}** "
            f"(target ≤ {v['target']}: {'met' if v['met'] else 'NOT met'})"
        )
    lines += _phase_markdown(result["records"], summary)
    return "\n".join(lines) + "\n"


def write_outputs(name: str | None, result: dict[str, Any]) -> None:
    if not name:
        return
    BENCH_DIR.mkdir(exist_ok=True)
    (BENCH_DIR / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (BENCH_DIR / f"{name}.md").write_text(render_markdown(result))


def load_baseline(path: str, meta: dict[str, Any], modes: list[Mode]) -> list[dict[str, Any]]:
    """Records of modes not measured in this run, from an earlier output with the same model, dtype and batch."""
    earlier = json.loads(Path(path).read_text())
    em = earlier["metadata"]
    for key in ("model", "dtype", "batch_size", "device"):
        if em.get(key) != meta[key]:
            raise SystemExit(f"--baseline {path}: {key} is {em.get(key)!r}, this run's is {meta[key]!r}.")
    return [{**r, "source": path} for r in earlier["records"] if r["mode"] not in modes]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Peak memory and time of one forward+backward: plain, HF checkpointing, TRL's chunked loss, "
        "StreamBP. The longest sequence that fits, per mode: streambp-trl max-len.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="qwen3-cpu-bench",
        help=f"a named size ({', '.join(NAMED_MODELS)}) or a Hub name / local dir (config only; random weights)",
    )
    parser.add_argument("--mode", nargs="+", choices=[m.value for m in Mode], default=[m.value for m in Mode])
    parser.add_argument("--seq-len", nargs="+", type=int, default=[8192, 16384])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--stream-chunk-size", type=int, default=1024, help="stream mode: tokens per layer chunk")
    parser.add_argument(
        "--logits-chunk-size", type=int, default=4096, help="stream mode: token tile of the logit kernel (TRL: 4096)"
    )
    parser.add_argument("--kv-mode", choices=KV_MODES, default="recompute", help="stream mode: K/V in backward")
    parser.add_argument(
        "--same-logits-tile",
        action="store_true",
        help="give TRL's fused head (checkpoint+chunked-loss) the same token tile, --logits-chunk-size",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed iterations after one warm-up")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also record each phase's peak and time (forward, head backward, each layer's backward) and the "
        "per-phase memory slopes; the step's peak is then the largest phase peak",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch_compile=True: the whole model compiled (checkpoint modes), the layers' per-chunk bodies (stream)",
    )
    parser.add_argument("--out", metavar="NAME", help="write benchmarks/NAME.json and benchmarks/NAME.md")
    parser.add_argument("--baseline", metavar="FILE", help="earlier JSON output supplying the modes not run here")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per measurement subprocess")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = build_parser()
    parser.prog = prog or parser.prog  # "cpu.py bp" / "gpu.py bench" in its usage
    args = parser.parse_args(argv)
    for name in ("batch_size", "stream_chunk_size", "logits_chunk_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if any(n < 2 for n in args.seq_len):
        parser.error("--seq-len values must be at least 2")
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    modes = [Mode(m) for m in dict.fromkeys(args.mode)]
    meta = metadata(args, device)
    result: dict[str, Any] = {"metadata": meta, "records": []}
    baseline_records = load_baseline(args.baseline, meta, modes) if args.baseline else []
    if args.baseline:
        result["baseline"] = args.baseline

    def spec_for(mode: Mode, seq_len: int) -> MeasureSpec:
        return MeasureSpec(
            mode=mode,
            seq_len=seq_len,
            batch_size=args.batch_size,
            dtype=args.dtype,
            model=args.model,
            device=device,
            seed=args.seed,
            repeats=args.repeats,
            stream_chunk_size=args.stream_chunk_size,
            logits_chunk_size=args.logits_chunk_size,
            kv_mode=args.kv_mode,
            phases=args.phases,
            same_logits_tile=args.same_logits_tile,
            compile=args.compile,
        )

    measured: list[dict[str, Any]] = []
    for seq_len in sorted(dict.fromkeys(args.seq_len)):
        for mode in modes:
            measured.append(measure(spec_for(mode, seq_len), args.timeout))
            result["records"] = baseline_records + measured
            result["summary"] = summarize(result["records"])
            write_outputs(args.out, result)
    order = list(Mode)
    result["records"] = sorted(baseline_records + measured, key=lambda r: (order.index(r["mode"]), r["seq_len"]))
    result["summary"] = summarize(result["records"])
    write_outputs(args.out, result)
    print(render_markdown(result))
