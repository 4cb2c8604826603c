"""Plots and a report from the benchmark records in ``benchmarks/``: ``benchmarks/*.png`` and
``benchmarks/REPORT.md``.

Inputs (each optional; what is missing is said in the report, not an error):

* ``cpu.py bp`` outputs (``{"metadata": ..., "records": [...]}``) measured on a CPU (default: the files
  ``benchmarks/cpu_qwen3_4l_fp32*.json``) or a GPU (every ``benchmarks/*.json`` whose device is ``cuda``): peak
  memory above the model and time per token vs sequence length, one line per mode and setting.
* ``cpu.py objectives`` outputs (``{"meta": ..., "records": [...]}``, ``benchmarks/cpu_dpo_*.json``,
  ``cpu_grpo_*``): peak memory of one DPO / GRPO step, TRL vs stream.
* simulated CUDA records of ``../shared/cudasim/sim.py`` (``benchmarks/sim_*.jsonl``, one JSON object per line:
  ``model``, ``mode``, ``seq_len``, ``peak_gib``, ``host_peak_gib``, ``stream_kwargs``, ``grads_ready``, ``sdpa``;
  a ``command`` key or ``# ...`` comment lines give the commands shown in the report): peak GiB vs length per
  mode, one plot per model, with the budget line (``--budget-gib``, 78) and the host memory of offload runs.

Needs matplotlib (``pip install -e ".[bench]"``)::

    python scripts/cpu.py report
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from streambp_trl.bench.simulator import SIMULATOR_MODES
from streambp_trl.bench.spec import OBJECTIVE_MODES, Mode

from .common import BENCH_DIR
from .plots import LABELS, new_axes, pyplot, save_figure

# a record's mode by any of its names: cpu.py bp's, the simulator's and cpu.py objectives'
MODE_NAMES: dict[str, Mode] = {**{m.value: m for m in Mode}, **SIMULATOR_MODES, **OBJECTIVE_MODES}
SIMULATOR_ONLY = {"streambp-labels": "stream (labels= call)"}  # simulator modes no measured mode matches
ORDER = ["no checkpointing", "HF checkpointing", "TRL default", "stream"]


def _label(name: str) -> str:
    """The label of the mode a record names."""
    return LABELS[MODE_NAMES[name]] if name in MODE_NAMES else SIMULATOR_ONLY.get(name, name)


def _order(label: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(ORDER) if label.startswith(p)), len(ORDER)), label


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------


def read_bench(path: Path) -> dict[str, Any] | None:
    """A ``cpu.py bp`` / ``cpu.py objectives`` output as ``{"path", "meta", "records"}`` (None for other files)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    meta = data.get("metadata") or data.get("meta") if isinstance(data, dict) else None
    if not meta or "records" not in data:
        return None
    return {"path": path, "meta": meta, "records": [r for r in data["records"] if not r.get("source")]}


def _bench_label(record: dict[str, Any], meta: dict[str, Any]) -> str:
    mode = MODE_NAMES.get(record["mode"])
    label = _label(record["mode"])
    details = []
    if mode is not None and mode.streams:
        details.append(f"kv {record.get('kv_mode') or meta.get('kv_mode') or 'recompute'}")
    tile = record.get("logits_chunk_size") or meta.get("logits_chunk_size")
    if mode not in (Mode.PLAIN, Mode.CHECKPOINT) and tile and tile != 4096:
        details.append(f"tile {tile}")
    return label + (f" ({', '.join(details)})" if details else "")


def bench_series(files: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """label -> seq_len -> record (the first file listing a (label, length) wins)."""
    series: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for f in files:
        for r in f["records"]:
            if r.get("status") == "ok":
                series[_bench_label(r, f["meta"])].setdefault(r["seq_len"], r)
    return dict(sorted(series.items(), key=lambda kv: _order(kv[0])))


def read_sim(paths: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Simulated records and the commands/notes of JSON-lines files."""
    records, notes = [], []
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("#"):
                notes.append(line.lstrip("# "))
            elif line:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "command" in rec and rec["command"] not in notes:
                    notes.append(rec["command"])
                if {"mode", "seq_len", "peak_gib"} <= rec.keys():
                    records.append({**rec, "file": path.name})
    return records, notes


def _sim_label(rec: dict[str, Any]) -> str:
    kwargs = dict(rec.get("stream_kwargs") or {})
    kwargs.pop("verify", None)
    label = _label(rec["mode"])
    if kwargs.pop("offload_checkpoints", False):
        label += " + offload"
    keep_every = kwargs.pop("keep_every", 1)
    if keep_every > 1:
        label += f", keep_every={keep_every}"
    return label + (f" {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")


# --------------------------------------------------------------------------------------------------------------
# Plotting
# --------------------------------------------------------------------------------------------------------------


def plot_bench(series, meta, out: Path, what: str) -> Path | None:
    """``what``: "memory" (peak MiB above the model) or "time" (ms per token)."""
    if not series:
        return None
    device = "CPU" if meta["device"] == "cpu" else meta.get("device_name", meta["device"])
    title = f"{meta['model']}, {meta['dtype']}, one forward+backward, measured on {device}"
    ylabel = "peak memory above the model (MiB)" if what == "memory" else "time per token (ms)"
    fig, ax = new_axes(title, ylabel)
    styles: dict[int, list[str]] = defaultdict(lambda: ["-", "--", ":", "-."])
    for label, points in series.items():
        xs = sorted(points)
        if what == "memory":
            ys = [points[n]["peak_mb"] for n in xs]
        else:
            ys = [1e3 * points[n]["time_s"] / (points[n].get("batch_size", 1) * n) for n in xs]
        family = _order(label)[0]  # one colour per mode, one line style per setting
        ax.plot(xs, ys, marker="o", label=label, color=f"C{family}", linestyle=styles[family].pop(0))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def plot_objectives(files: list[dict[str, Any]], out: Path) -> Path | None:
    if not files:
        return None
    title = "One step per objective (2 sequences per step), measured on CPU"
    fig, ax = new_axes(title, "peak memory above models (MiB)")
    for f in files:
        by_mode = defaultdict(dict)
        for r in f["records"]:
            if r.get("status") == "ok":
                by_mode[r["mode"]][r["seq_len"]] = r["peak_mb"]
        for mode, points in sorted(by_mode.items()):
            xs = sorted(points)
            label = f"{f['meta'].get('objective', '?').upper()}: {_label(mode)}"
            ax.plot(
                xs, [points[n] for n in xs], marker="o", label=label, linestyle="-" if mode == Mode.STREAM else "--"
            )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def plot_sim(model: str, records: list[dict[str, Any]], budget_gib: float, out: Path) -> Path:
    dtype = records[0].get("dtype", "")
    grads = ", parameter gradients allocated" if any(r.get("grads_ready") for r in records) else ""
    title = f"{model}, {dtype}, one forward+backward\nsimulated CUDA peak (cudasim){grads}"
    fig, ax = new_axes(title, "peak GPU memory (GiB)")
    series: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        series[_sim_label(r)][r["seq_len"]] = r
    hosts = []
    for label, points in sorted(series.items(), key=lambda kv: _order(kv[0])):
        xs = sorted(points)
        (line,) = ax.plot(xs, [points[n]["peak_gib"] for n in xs], marker="o", label=label)
        host = [(n, points[n].get("host_peak_gib")) for n in xs if (points[n].get("host_peak_gib") or 0) > 0.01]
        if host:
            hosts.append((label, line.get_color(), host))
    ax.axhline(budget_gib, color="black", linestyle=":", linewidth=1, label=f"{budget_gib:g} GiB budget")
    top = max(1.05 * budget_gib, 1.05 * max(r["peak_gib"] for r in records))
    ax.set_ylim(0, min(1.6 * budget_gib, top))  # the budget line always shown; runs far above it: off the top
    if hosts:
        host_ax = ax.twinx()
        host_ax.set_ylabel("host memory, dashed (GiB)")
        for label, color, points in hosts:
            host_ax.plot(*zip(*points, strict=True), linestyle="--", color=color, marker="x", label=f"{label}: host")
        host_ax.set_ylim(bottom=0)
        host_ax.legend(fontsize=8, loc="lower right")
    ax.xaxis.set_major_formatter(pyplot().FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, out)


# --------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------


def _describe(files: list[dict[str, Any]]) -> list[str]:
    lines = []
    first = files[0]["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in first.get("versions", {}).items())
    cores = f", {first['cpu_cores']} cores, {first.get('torch_threads')} torch threads" if "cpu_cores" in first else ""
    names = sorted({f["meta"].get("device_name", f["meta"]["device"]) for f in files})
    lines.append(f"- device: {', '.join(names)} ({first['device']}{cores})")
    lines.append(f"- versions: {versions}")
    lines.append(f"- memory: {first.get('memory', 'peak above the loaded model')}")
    lines.append("- commands (from the records' metadata; git commit and date of each run):")
    for f in files:
        m = f["meta"]
        lines.append(f"  - `{m['command']}` (git {m.get('git')}, {m.get('date', '?')}; `{f['path'].name}`)")
    return lines


def _rel(path: Path, report: Path) -> str:
    return str(path.relative_to(report.parent)) if path.is_relative_to(report.parent) else str(path)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", nargs="*", type=Path, help="cpu.py bp CPU outputs (default: cpu_qwen3_4l_fp32*)")
    parser.add_argument("--sim", nargs="*", type=Path, help="simulated JSON-lines files (default: sim_*.jsonl)")
    parser.add_argument("--budget-gib", type=float, default=78.0, help="the GPU budget line of simulated plots")
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR)
    args = parser.parse_args(argv)
    try:
        pyplot()
    except ImportError:
        sys.exit("cpu.py report needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)")
    out_dir, bench_dir = args.out_dir, BENCH_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "REPORT.md"

    every = [f for f in (read_bench(p) for p in sorted(bench_dir.glob("*.json"))) if f]
    cpu_paths = args.cpu if args.cpu is not None else sorted(bench_dir.glob("cpu_qwen3_4l_fp32*.json"))
    cpu = [f for f in (read_bench(p) for p in cpu_paths) if f and f["meta"]["device"] == "cpu"]
    gpu = [f for f in every if f["meta"]["device"] == "cuda" and "objective" not in f["meta"]]
    objectives = [f for f in every if "objective" in f["meta"] and f["meta"]["device"] == "cpu"]
    sim_paths = args.sim if args.sim is not None else sorted(bench_dir.glob("sim_*.jsonl"))
    sim_records, sim_notes = read_sim([p for p in sim_paths if p.exists()])

    lines = [
        "# Benchmark report",
        "",
        "Generated by `python scripts/cpu.py report` from the records in `benchmarks/` (the plots are beside this"
        " file). Memory is the peak of ONE forward+backward; each (mode, length) ran in a fresh process.",
        "",
        "## Measured on the CPU",
        "",
    ]
    if cpu:
        series = bench_series(cpu)
        meta = cpu[0]["meta"]
        mem = plot_bench(series, meta, out_dir / "cpu_memory.png", "memory")
        time = plot_bench(series, meta, out_dir / "cpu_time_per_token.png", "time")
        lines += [f"![peak memory vs length, CPU]({_rel(mem, report)})", ""]
        lines += [f"![time per token vs length, CPU]({_rel(time, report)})", ""]
        lines += _describe(cpu)
    else:
        lines.append("No CPU records (run `scripts/cpu.py bp ... --out cpu_qwen3_4l_fp32`).")
    if objectives:
        obj = plot_objectives(objectives, out_dir / "cpu_objectives_memory.png")
        heading = "### DPO, GRPO, reward and distillation steps"
        lines += ["", heading, "", f"![step memory per objective, CPU]({_rel(obj, report)})", ""]
        lines += _describe(objectives)

    lines += ["", "## Simulated CUDA memory (`../shared/cudasim`, not a GPU run)", ""]
    if sim_records:
        lines.append(
            "Peak `torch.cuda.max_memory_allocated` of the step as the simulator computes it (FakeTensors on "
            f"`cuda`, sm80 attention rules); the dotted line is the {args.budget_gib:g} GiB budget of an 80 GB card; "
            "dashed lines on the right axis are the host memory of offloaded checkpoints."
        )
        by_model = defaultdict(list)
        for r in sim_records:
            by_model[r["model"]].append(r)
        for model, recs in sorted(by_model.items()):
            png = plot_sim(model, recs, args.budget_gib, out_dir / f"sim_{model.replace('/', '_')}_memory.png")
            lines += ["", f"![simulated peak GPU memory, {model}]({_rel(png, report)})"]
        files = sorted({r["file"] for r in sim_records})
        lines += ["", f"- records: {', '.join(f'`{f}`' for f in files)}"]
        lines += [f"- `{note}`" for note in sim_notes]
    else:
        lines.append("No simulated records yet (`benchmarks/sim_*.jsonl`, JSON lines of `../shared/cudasim/sim.py`).")

    lines += ["", "## Measured on a GPU", ""]
    if gpu:
        for f in gpu:
            series = bench_series([f])
            stem = f["path"].stem
            mem = plot_bench(series, f["meta"], out_dir / f"{stem}_memory.png", "memory")
            time = plot_bench(series, f["meta"], out_dir / f"{stem}_time_per_token.png", "time")
            lines += [f"![{stem} memory]({_rel(mem, report)})", "", f"![{stem} time]({_rel(time, report)})", ""]
            lines += _describe([f])
    else:
        lines.append(
            "No `scripts/cpu.py bp --device cuda` records. The GPU records of `scripts/gpu.py bench`, "
            "`scripts/gpu.py profile` and `scripts/gpu.py long-context` (`gpu_*.md`, each with its device, versions "
            "and commands) are quoted in `docs/benchmarks.md`."
        )
    report.write_text("\n".join(lines) + "\n")
    print(f"wrote {report}")
