"""Memory and time of one distillation step: TRL's ``DistillationTrainer`` with its defaults against
``StreamDistillationTrainer``, each measurement in a fresh process.

The step is the trainers' own loss, ``trainer.compute_loss(model, batch)`` and its backward, on a batch as TRL's
generation hands it over (generation excluded): two sequences of ``--seq-len`` tokens, the first eighth the prompt,
the rest the completion (every completion token scored), random ids. The student is ``--model`` (a named size of
``streambp_trl.sizing.shapes``, random weights) and the teacher the same shape ``--teacher-width`` wide (hidden size,
MLP and heads scaled alike), sharing its vocabulary. float32 on the CPU, no optimizer.

Modes:

* ``trl``: ``DistillationTrainer`` with ``DistillationConfig``'s defaults: Hugging Face activation checkpointing on
  the student (enabled as ``Trainer.train`` enables it), the teacher's full-length no-grad forward, and TRL's tiled
  divergence kernel on both models' last hidden states (its tile set to ``--logits-chunk-size`` x 8192, so both
  modes hold the same logit tile).
* ``stream``: ``StreamDistillationTrainer`` (``stream_chunk_size``, ``logits_chunk_size``): the student and the
  teacher streamed, ``streambp_trl.logits.chunked_divergence`` with the student's final norm inside.

Memory is the peak above both loaded models (peak RSS with ``MALLOC_MMAP_THRESHOLD_=131072``,
``streambp_trl.bench.memory_meter``), parameter gradients included; the figure of merit is its growth per extra
token (KiB/token) between the two lengths. One warm-up step, then ``--repeats`` measured steps. Compare lengths
where both peaks are per-token phases: at 2 x 2048 tokens TRL's peak is the tile temporaries of its kernel's torch
fallback (a fixed few hundred MiB), which understates its growth between 2048 and 4096 (measured: 24.9 KiB/token,
against 68.4 between 4096 and 8192).

    python scripts/cpu.py distillation --seq-len 4096 8192 --out cpu_distillation_qwen3_4l_fp32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from . import cpu_bp
from .common import REPO_ROOT, entry, prefixed_record
from .cpu_objectives import MODES, measured_steps, render_table, summarize, write_results

RESULT_PREFIX = "BENCH_DISTILLATION_RESULT "
VOCAB_TILE = 8192  # vocabulary columns per logit tile, in both modes (the stream kernel's default)
HEADING = (  # the report's title and settings line (cpu_objectives.render_table)
    "# One distillation step (student forward/backward, teacher forward, generalised JSD with beta 0.5), {model} "
    "student, teacher {teacher_width}x as wide, {dtype}, {device_name}",
    "Stream chunk {stream_chunk_size}, logit tile {logits_chunk_size} x {vocab_tile} (TRL's divergence kernel: the "
    "same); memory: {memory}",
)


def teacher_config(model: str, width: float) -> Any:
    """The student's named shape ``width`` times as wide (hidden size, MLP, attention heads), the same vocabulary."""
    from transformers import Qwen3Config

    from streambp_trl.sizing.shapes import NAMED_MODELS

    shape = dict(NAMED_MODELS[model])
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        shape[key] = round(shape[key] * width)
    return Qwen3Config(**shape)


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build both models and the mode's trainer, warm up, measure one step (``spec``: this subcommand's arguments)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streambp_trl import StreamDistillationConfig, StreamDistillationTrainer
    from streambp_trl.bench.models import build_model

    device = torch.device("cpu")
    student = build_model(spec["model"], "float32", device, spec["seed"])
    torch.manual_seed(spec["seed"] + 2)
    teacher = AutoModelForCausalLM.from_config(
        teacher_config(spec["model"], spec["teacher_width"]), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    options = dict(output_dir="/tmp/bench_distillation", bf16=False, use_cpu=True, report_to="none", beta=0.5)
    if spec["mode"] == "trl":
        import trl.kernels.chunked_divergence as trl_kernel
        from trl import DistillationConfig, DistillationTrainer

        trl_kernel.TOKEN_CHUNK_SIZE, trl_kernel.VOCAB_CHUNK_SIZE = spec["logits_chunk_size"], VOCAB_TILE
        trainer_cls, config = DistillationTrainer, DistillationConfig(**options)
    else:
        chunks = {k: spec[k] for k in ("stream_chunk_size", "logits_chunk_size")}
        trainer_cls, config = StreamDistillationTrainer, StreamDistillationConfig(**options, **chunks)
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / "configs" / "tiny_model")
    trainer = trainer_cls(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "a"}]),
        processing_class=tokenizer,
    )
    if trainer.args.activation_checkpointing:  # as Trainer.train enables it (TRL's default)
        trainer.model.activation_checkpointing_enable()
    model = trainer.model.train()
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    vocab, prompt = student.config.vocab_size, spec["seq_len"] // 8
    ids = torch.randint(0, vocab, (2, spec["seq_len"]), generator=generator)
    batch = {
        "prompt_ids": ids[:, :prompt],
        "prompt_mask": torch.ones_like(ids[:, :prompt]),
        "completion_ids": ids[:, prompt:],
        "completion_mask": torch.ones_like(ids[:, prompt:]),
        "num_items_in_batch": torch.tensor(2 * (spec["seq_len"] - prompt)),
    }

    def step() -> float:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        return loss.item()

    times, peaks, losses = measured_steps(step, model, device, spec["repeats"])
    return {
        "mode": spec["mode"],
        "seq_len": spec["seq_len"],
        "status": "ok",
        "peak_mb": max(peaks) / 2**20,
        "time_s": statistics.median(times),
        "loss": losses[-1],
        "model_mb": sum(p.numel() * p.element_size() for m in (student, teacher) for p in m.parameters()) / 2**20,
        "torch_threads": torch.get_num_threads(),
    }


def measure(spec: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``spec`` in a fresh process (peak RSS tracks live tensors there); its record, or ``status: "error"``."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(REPO_ROOT)}
    print(f"[measure] mode={spec['mode']} seq_len={spec['seq_len']} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, str(entry("cpu")), "distillation", "--worker", json.dumps(spec)]
    try:
        record, proc = prefixed_record(cmd, RESULT_PREFIX, env, timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "error", "error": f"timed out after {timeout} s"}
    if proc.returncode != 0 or record is None:
        return {**spec, "status": "error", "error": proc.stderr[-2000:]}
    print(f"[measure]   peak {record['peak_mb']:.1f} MiB, {record['time_s']:.2f} s", file=sys.stderr, flush=True)
    return record


def render(meta: dict[str, Any], records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    return render_table(HEADING, meta, records, summary, vocab_tile=VOCAB_TILE)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-cpu-bench", help="the student: a named size of cpu.py bp")
    parser.add_argument("--teacher-width", type=float, default=1.5, help="the teacher's width over the student's")
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seq-len", nargs="+", type=int, default=[4096, 8192], help="tokens per sequence")
    parser.add_argument("--stream-chunk-size", type=int, default=1024)
    parser.add_argument("--logits-chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--out", metavar="NAME", help="write benchmarks/NAME.json and benchmarks/NAME.md")
    parser.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_PREFIX + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return
    fields = ("model", "teacher_width", "stream_chunk_size", "logits_chunk_size", "repeats", "seed")
    records = [
        measure({**{k: getattr(args, k) for k in fields}, "mode": mode, "seq_len": n}, args.timeout)
        for n in args.seq_len
        for mode in args.mode
    ]
    meta_args = argparse.Namespace(
        **vars(args), dtype="float32", batch_size=2, kv_mode="recompute", same_logits_tile=True
    )
    meta = {**cpu_bp.metadata(meta_args, "cpu"), "objective": "distillation", "teacher_width": args.teacher_width}
    summary = summarize(records, args.seq_len)
    print(render(meta, records, summary))
    write_results(args.out, meta, records, summary, render(meta, records, summary))
