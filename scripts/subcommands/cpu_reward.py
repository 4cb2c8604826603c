"""Memory and time of one reward-model step with TRL's ``RewardTrainer`` defaults and with the stream engine, each
measurement in a fresh process.

The step, as ``RewardTrainer.compute_loss`` runs it: a sequence classifier (the ``--model`` decoder with a score
head, ``num_labels=1``, random weights, dropout off as TRL's ``disable_dropout`` leaves it) scores [chosen;
rejected], two sequences of ``--seq-len`` random tokens (pad id 0, never drawn, so each score is read at the last
token), and the Bradley-Terry loss ``-logsigmoid(r_chosen - r_rejected)`` is backpropagated.

Modes (the names of ``cpu.py objectives``):

* ``trl``: RewardTrainer's defaults: Hugging Face activation checkpointing as its ``Trainer`` enables it
  (``activation_checkpointing_enable()``: non-reentrant), the model's own forward (the score head at every position).
* ``stream``: ``enable_streambp(model, stream_chunk_size=...)``: the decoder streamed, the score head (and the final
  norm) on the read rows only.

Memory is the peak above the loaded model (CPU: peak RSS with ``MALLOC_MMAP_THRESHOLD_=131072``, the kernel's
peak counter reset before the step; CUDA: peak allocated), parameter gradients included, after one warm-up step;
the figure of merit is its growth per extra token (KiB/token) between the two lengths. Results go to
``benchmarks/NAME.json`` and ``.md`` in the form of ``cpu.py objectives``.

    python scripts/cpu.py reward --seq-len 2048 4096 --out cpu_reward_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from streambp_trl.bench.spec import DTYPES

from . import cpu_bp
from .common import REPO_ROOT, entry, prefixed_record
from .cpu_objectives import MODES, fmt, measured_steps, render_table, summarize, write_results

RESULT_PREFIX = "BENCH_REWARD_RESULT "
HEADING = (  # the report's title and settings line (cpu_objectives.render_table)
    "# One reward-model step ([chosen; rejected] scores, Bradley-Terry loss), {model}, {dtype}, {device_name}",
    "Stream chunk {stream_chunk_size}; memory: {memory}; 1-minute load average at the measurements: {load} on "
    "{cpu_cores} cores",
)


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

    times, peaks, losses = measured_steps(step, model, device, spec["repeats"])
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
    """``spec`` in a fresh process (``cpu.py reward --worker``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    print(f"[measure] mode={spec['mode']} seq_len={spec['seq_len']} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(entry("cpu")), "reward", "--worker", json.dumps(spec)]
    record, proc = prefixed_record(cmd, RESULT_PREFIX, env)
    if proc.returncode == 0 and record is not None:
        return record
    return {**spec, "status": "error", "returncode": proc.returncode, "error": proc.stderr[-2000:]}


def render(meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The Markdown table of ``cpu.py objectives``, for the reward step (no logit tile: no LM head)."""
    load = fmt(max((r.get("load_average_1m", 0) for r in records), default=None))
    return render_table(HEADING, meta, records, summary, load=load)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-cpu-bench", help="named size of cpu.py bp, Hub name or dir")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
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
    meta = {**cpu_bp.metadata(meta_args, args.device), "objective": "reward"}
    for key in ("logits_chunk_size", "trl_token_chunk_size"):  # no LM head, no logit tile
        del meta[key]
    summary = summarize(records, args.seq_len)
    print(render(meta, records, summary))
    write_results(args.out, meta, records, summary, render(meta, records, summary))
