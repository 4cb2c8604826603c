"""Memory and time of one step of a preference or RL objective with TRL's defaults and with the stream engine,
each measurement in a fresh process (``streambp_trl.bench.measure``, the measuring code of ``bench_bp.py`` and
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

    python scripts/bench_objectives.py --objective dpo --seq-len 2048 4096 --out cpu_dpo_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_bp  # noqa: E402  (metadata and output directory)

from streambp_trl.bench.measure import measure  # noqa: E402
from streambp_trl.bench.spec import DTYPES, OBJECTIVE_MODES, MeasureSpec  # noqa: E402
from streambp_trl.sizing import memory_model as mm  # noqa: E402

MODES = tuple(OBJECTIVE_MODES)  # this script's names of the modes: "trl", "stream"
OBJECTIVES = tuple(o for o in mm.OBJECTIVES if o != "sft")  # the preference / RL objectives
TITLE = {"dpo": "One DPO step (reference + policy)", "grpo": "The policy update of a GRPO step (temperature 0.7)"}
TARGET_MEM_RATIO = 0.4  # stream KiB per extra token <= 0.4 x TRL's (reported, never enforced)


def summarize(records: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
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


def render(meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lengths = sorted({r["seq_len"] for r in records})
    by = {(r["mode"], r["seq_len"]): r for r in records if r.get("status") == "ok"}
    head = "| mode | " + " | ".join(f"peak MiB at 2x{n}" for n in lengths) + " | KiB per extra token | "
    head += " | ".join(f"time s at 2x{n}" for n in lengths) + " |"
    lines = [
        f"# {TITLE[meta['objective']]}, {meta['model']}, {meta['dtype']}, {meta['device_name']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Versions: {json.dumps(meta['versions'])}; git {meta['git']}; engine {meta['engine_sha256']}  ",
        f"Stream chunk {meta['stream_chunk_size']}, logit tile {meta['logits_chunk_size']} (TRL's fused head: the "
        "same); memory: " + meta["memory"],
        "",
        head,
        "|---|" + "---:|" * (2 * len(lengths) + 1),
    ]
    for mode in MODES:
        peaks = " | ".join(_fmt(by.get((mode, n), {}).get("peak_mb")) for n in lengths)
        times = " | ".join(_fmt(by.get((mode, n), {}).get("time_s"), ".2f") for n in lengths)
        lines.append(f"| {mode} | {peaks} | {_fmt(summary['kib_per_token'].get(mode))} | {times} |")
    if "memory_ratio" in summary:
        lines += [
            "",
            f"Memory per extra token, stream / TRL: **{summary['memory_ratio']:.2f}x** (target <= "
            f"{TARGET_MEM_RATIO}); time at the longest length: {summary['time_ratio_at_longest']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objective", choices=OBJECTIVES, default="dpo")
    parser.add_argument("--model", default="qwen3-cpu-bench", help="named size of bench_bp.py, Hub name or dir")
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
    meta = {**bench_bp.metadata(meta_args, args.device), "objective": args.objective}
    summary = summarize(records, args.seq_len)
    print(render(meta, records, summary))
    if args.out:
        bench_bp.BENCH_DIR.mkdir(exist_ok=True)
        result = {"meta": meta, "records": records, "summary": summary}
        (bench_bp.BENCH_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        (bench_bp.BENCH_DIR / f"{args.out}.md").write_text(render(meta, records, summary))


if __name__ == "__main__":
    main()
