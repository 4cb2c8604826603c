"""``gpu.py bench``'s summary and report: the time ratios between modes, ``NAME.md`` (the tables of peaks, times,
ratios, the longest length and what was skipped) and the plots ``NAME_memory.png`` and ``NAME_time.png``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from streambp_trl.bench.spec import Mode

from . import cpu_bp
from .plots import LABELS, new_axes, pyplot, save_figure

OFFLOAD_TARGET = 1.15  # stream + offload time <= 1.15 x stream's (reported, never enforced)
# summary key -> (numerator mode, denominator mode, target): time ratios at each length measured in both modes
TIME_RATIOS: dict[str, tuple[Mode, Mode, float | None]] = {
    "stream_vs_checkpoint_time": (Mode.STREAM, Mode.CHECKPOINT, None),
    "stream_vs_trl_default_time": (Mode.STREAM, Mode.CHECKPOINT_CHUNKED_LOSS, None),
    "offload_vs_stream_time": (Mode.STREAM_OFFLOAD, Mode.STREAM, OFFLOAD_TARGET),
}


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
    """Memory per extra token per mode (shortest vs longest length measured ok: ``cpu_bp.summarize``) and the
    time ratios of :data:`TIME_RATIOS`."""
    ok = [r for r in records if r.get("status") == "ok"]
    summary: dict[str, Any] = {"memory_per_extra_token": cpu_bp.summarize(ok)["memory_per_extra_token"]}
    for key, (num, den, target) in TIME_RATIOS.items():
        summary[key] = time_ratios(ok, num, den, target)
    return summary


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
        lines.append(f"| {LABELS[Mode(mode)]} | " + " | ".join(cells) + " |")
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
        pyplot()
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[bench]')", file=sys.stderr)
        return []
    s, env = result["settings"], result["env"]
    title = f"{s['model']}, {s['dtype']}, one forward+backward, {env['device_name']}"
    paths = []
    for what, ylabel in (("memory", "peak memory (GiB, model included)"), ("time", "ms per 1k tokens")):
        fig, ax = new_axes(title, ylabel)
        for i, mode in enumerate(Mode):
            ok = [r for r in result["records"] if r["mode"] == mode and r["status"] == "ok"]
            ok.sort(key=lambda r: r["seq_len"])
            if not ok:
                continue
            xs, label, color = [r["seq_len"] for r in ok], LABELS[mode], f"C{i}"
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
        paths.append(save_figure(fig, out_dir / f"{name}_{what}.png"))
    return paths


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
