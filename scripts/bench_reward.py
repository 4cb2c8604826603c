"""Memory and time of one reward-model step with TRL's ``RewardTrainer`` defaults and with the stream engine, each
measurement in a fresh process.

The step, as ``RewardTrainer.compute_loss`` runs it: a sequence classifier (the ``--model`` decoder with a score
head, ``num_labels=1``, random weights, dropout off as TRL's ``disable_dropout`` leaves it) scores [chosen;
rejected], two sequences of ``--seq-len`` random tokens (pad id 0, never drawn, so each score is read at the last
token), and the Bradley-Terry loss ``-logsigmoid(r_chosen - r_rejected)`` is backpropagated.

Modes (the names of ``scripts/bench_objectives.py``):

* ``trl``: RewardTrainer's defaults: Hugging Face activation checkpointing as its ``Trainer`` enables it
  (``activation_checkpointing_enable()``: non-reentrant), the model's own forward (the score head at every position).
* ``stream``: ``enable_streambp(model, stream_chunk_size=...)``: the decoder streamed, the score head (and the final
  norm) on the read rows only.

Memory is the peak above the loaded model (CPU: peak RSS with ``MALLOC_MMAP_THRESHOLD_=131072``, the kernel's
peak counter reset before the step; CUDA: peak allocated), parameter gradients included, after one warm-up step;
the figure of merit is its growth per extra token (KiB/token) between the two lengths. Results go to
``benchmarks/NAME.json`` and ``.md`` in the form of ``scripts/bench_objectives.py``.

    python scripts/bench_reward.py --seq-len 2048 4096 --out cpu_reward_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_bp  # noqa: E402  (metadata and output directory)
import bench_objectives  # noqa: E402  (modes and summary)

from streambp_trl.bench.memory_meter import MemoryMeter  # noqa: E402
from streambp_trl.bench.spec import DTYPES  # noqa: E402

RESULT_PREFIX = "BENCH_REWARD_RESULT "


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured step (after a warm-up step) of ``spec``; returns its record."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification
    from trl.trainer.utils import disable_dropout_in_model

    from streambp_trl import enable_streambp
    from streambp_trl.bench.models import build_config

    device = torch.device(spec["device"])
    config = build_config(spec["model"])
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(
            config, dtype=getattr(torch, spec["dtype"]), attn_implementation="sdpa"
        )
    model.train()
    disable_dropout_in_model(model)
    if spec["mode"] == "trl":
        model.activation_checkpointing_enable()
    else:
        enable_streambp(model, stream_chunk_size=spec["stream_chunk_size"])
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(1, config.vocab_size, (2, spec["seq_len"]), generator=generator).to(device)
    mask = torch.ones_like(ids)

    def step() -> float:
        rewards = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.squeeze(-1)
        loss = -F.logsigmoid(rewards[0] - rewards[1])
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss.item()

    step()  # first-touch pages, lazy initialisation
    model.zero_grad(set_to_none=True)
    meter = MemoryMeter(device)
    times, peaks, losses = [], [], []
    for _ in range(spec["repeats"]):
        meter.reset()
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
        peaks.append(meter.peak_above_baseline())
        model.zero_grad(set_to_none=True)
    return {
        **spec,
        "objective": "reward",
        "status": "ok",
        "peak_mb": max(peaks) / 2**20,
        "time_s": statistics.median(times),
        "times_s": times,
        "loss": losses[-1],
        "model_mb": sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20,
        "torch_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],  # other processes on the machine: the times are theirs too
    }


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` in a fresh process (this script with ``--worker``)."""
    env = {**os.environ, "PYTHONPATH": str(bench_bp.REPO_ROOT)}
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    print(f"[measure] mode={spec['mode']} seq_len={spec['seq_len']} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    return {**spec, "status": "error", "returncode": proc.returncode, "error": proc.stderr[-2000:]}


def render(meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The Markdown table of ``scripts/bench_objectives.py``, for the reward step (no logit tile: no LM head)."""
    lengths = sorted({r["seq_len"] for r in records})
    by = {(r["mode"], r["seq_len"]): r for r in records if r.get("status") == "ok"}

    def fmt(value, spec: str = ".1f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"# One reward-model step ([chosen; rejected] scores, Bradley-Terry loss), {meta['model']}, {meta['dtype']}, "
        f"{meta['device_name']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Versions: {json.dumps(meta['versions'])}; git {meta['git']}; engine {meta['engine_sha256']}  ",
        f"Stream chunk {meta['stream_chunk_size']}; memory: {meta['memory']}; 1-minute load average at the "
        f"measurements: {fmt(max((r.get('load_average_1m', 0) for r in records), default=None))} on "
        f"{meta['cpu_cores']} cores",
        "",
        "| mode | "
        + " | ".join(f"peak MiB at 2x{n}" for n in lengths)
        + " | KiB per extra token | "
        + " | ".join(f"time s at 2x{n}" for n in lengths)
        + " |",
        "|---|" + "---:|" * (2 * len(lengths) + 1),
    ]
    for mode in bench_objectives.MODES:
        peaks = " | ".join(fmt(by.get((mode, n), {}).get("peak_mb")) for n in lengths)
        times = " | ".join(fmt(by.get((mode, n), {}).get("time_s"), ".2f") for n in lengths)
        lines.append(f"| {mode} | {peaks} | {fmt(summary['kib_per_token'].get(mode))} | {times} |")
    if "memory_ratio" in summary:
        lines += [
            "",
            f"Memory per extra token, stream / TRL: **{summary['memory_ratio']:.2f}x** (target <= "
            f"{summary['target_memory_ratio']}); time at the longest length: {summary['time_ratio_at_longest']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-cpu-bench", help="named size of bench_bp.py, Hub name or dir")
    parser.add_argument("--mode", nargs="+", choices=bench_objectives.MODES, default=list(bench_objectives.MODES))
    parser.add_argument("--seq-len", nargs="+", type=int, default=[2048, 4096], help="tokens per sequence")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--stream-chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="NAME", help="write benchmarks/NAME.json and benchmarks/NAME.md")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return
    records = []
    for seq_len in args.seq_len:
        for mode in args.mode:
            spec = {
                "mode": mode,
                "seq_len": seq_len,
                "model": args.model,
                "dtype": args.dtype,
                "device": args.device,
                "seed": args.seed,
                "repeats": args.repeats,
                "stream_chunk_size": args.stream_chunk_size,
            }
            records.append(measure(spec))
    meta_args = argparse.Namespace(
        **vars(args), batch_size=2, logits_chunk_size=None, same_logits_tile=True, kv_mode="recompute"
    )
    meta = {**bench_bp.metadata(meta_args, args.device), "objective": "reward"}
    for key in ("logits_chunk_size", "trl_token_chunk_size"):  # no LM head, no logit tile
        del meta[key]
    summary = bench_objectives.summarize(records, args.seq_len)
    print(render(meta, records, summary))
    if args.out:
        bench_bp.BENCH_DIR.mkdir(exist_ok=True)
        result = {"meta": meta, "records": records, "summary": summary}
        (bench_bp.BENCH_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        (bench_bp.BENCH_DIR / f"{args.out}.md").write_text(render(meta, records, summary))


if __name__ == "__main__":
    main()
