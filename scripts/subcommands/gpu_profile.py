"""Where a training step's GPU time goes: per mode, the step's wall time split by phase, and (profiled) the GPU
kernels' time by kind and by phase, the GPU's busy share of the step and the host's launches and syncs.

What: the harness of :mod:`streambp_trl.bench.worker` (a named shape with random weights, one SFT
forward+backward on random ids, every token labelled), one fresh process per configuration. A configuration is
``MODE[:CHUNK[:KV_MODE]]``, e.g. ``trl`` (TRL's default: checkpointing + its fused LM head), ``checkpoint``,
``stream:4096``, ``stream:4096:capture``, ``stream+offload:4096``; the stream chunk is also the logit tile.

How, in each process: one warm-up step at ``--warmup-seq-len`` tokens, then ``--repeats`` timed steps (forward
and backward each closed by a device synchronisation), then one step at each of ``--extra-lengths`` (what a new
length costs: a kernel's plans for new shapes, the allocator), then one step with a synchronised timer around each
engine phase (a layer's chunked forward, its key/value collection, its chunk backwards, the logit nodes'
backwards; these syncs add a little time, so the phases are compared with each other, not with the timed steps),
then, for the configurations in ``--profile``, one step under ``torch.profiler`` whose trace gives:

* kernel time by kind (matrix products, attention, elementwise/reductions, copies, other) and the top kernels;
* kernel time by engine phase (each launch, through the runtime or the driver API, attributed to the innermost
  phase open on its host thread);
* the union of kernel intervals over the profiled step's span (how busy the GPU was: launch-bound or not);
* the host's kernel launches and its synchronising calls (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  synchronous ``cudaMemcpy``) inside the step.

Output: ``--out-dir/NAME.json`` (one record per configuration, the environment and the command) and a summary
printed as it goes. On a CPU the same runs (no kernels: the profile part records the host's operators only)::

    python scripts/gpu.py profile --device cpu --model qwen3-tiny --dtype float32 --seq-len 256 \\
        --warmup-seq-len 64 --configs trl stream:64 --profile stream:64 --out-dir /tmp/prof
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streambp_trl.bench.metadata import PACKAGE_ROOT, environment
from streambp_trl.bench.spec import MeasureSpec, Mode

from .common import command_line, entry, prefixed_record
from .gpu_profile_trace import analyse_trace

MODES = {
    "trl": Mode.CHECKPOINT_CHUNKED_LOSS,
    "checkpoint": Mode.CHECKPOINT,
    "stream": Mode.STREAM,
    "stream+offload": Mode.STREAM_OFFLOAD,
}
RESULT_PREFIX = "GPU_PROFILE_RESULT "


def parse_config(text: str) -> dict[str, Any]:
    """``MODE[:CHUNK[:KV_MODE]]`` -> the spec fields it sets."""
    mode, *rest = text.split(":")
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {mode!r} in {text!r}; choose from {sorted(MODES)}")
    fields: dict[str, Any] = {"mode": MODES[mode]}
    if rest:
        fields["stream_chunk_size"] = fields["logits_chunk_size"] = int(rest[0])
    if len(rest) > 1:
        fields["kv_mode"] = rest[1]
    return fields


@contextlib.contextmanager
def phase_wrappers(sync: bool, times: dict[str, float]):
    """Wrap the engine's phases with a ``record_function("sbp/<phase>")`` (and, with ``sync``, a synchronised timer
    adding into ``times``); undone on exit. Measuring code only: the engine is not changed."""
    import torch

    from streambp_trl.layers.call import StreamLayerFunction
    from streambp_trl.layers.call.backward import ChunkBackward
    from streambp_trl.logits.eager import EagerNode
    from streambp_trl.logits.nodes import LogitNode, WeightNode

    def timed(label: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function("sbp/" + label):
                if not sync:
                    return fn(*args, **kwargs)
                _sync()
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    _sync()
                    times[label] = times.get(label, 0.0) + time.perf_counter() - start

        return wrapper

    targets = [
        (StreamLayerFunction, "forward", "layer_forward", True),
        (StreamLayerFunction, "backward", "layer_backward", True),
        (ChunkBackward, "collect_kv", "collect_kv", False),
        (ChunkBackward, "_chunk_backwards", "chunk_backwards", False),
        (LogitNode, "forward", "logit_forward", True),
        (LogitNode, "backward", "logit_backward", True),
        (WeightNode, "backward", "weight_backward", True),
        (EagerNode, "forward", "eager_forward", True),
        (EagerNode, "backward", "eager_backward", True),
    ]
    try:  # TRL's fused LM head (TRL's default mode)
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        targets += [
            (ChunkedLogProbFunction, "forward", "trl_head_forward", True),
            (ChunkedLogProbFunction, "backward", "trl_head_backward", True),
        ]
    except ImportError:
        pass
    saved = []
    for owner, attr, label, static in targets:
        original = owner.__dict__[attr]
        fn = original.__func__ if isinstance(original, staticmethod) else original
        wrapped = timed(label, fn)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)
        saved.append((owner, attr, original))
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_config(args: argparse.Namespace, config: str, profile: bool) -> dict[str, Any]:
    """One configuration, in this process."""
    import dataclasses

    import torch

    from streambp_trl.bench.models import build_model, prepare_model
    from streambp_trl.bench.worker import step_function

    spec = MeasureSpec(
        seq_len=args.seq_len, model=args.model, device=args.device, dtype=args.dtype, **parse_config(config)
    )
    device = torch.device(args.device)
    if args.eager_tile_elements:
        import streambp_trl.logits.eager as eager

        eager.EAGER_TILE_ELEMENTS = args.eager_tile_elements
    policy = prepare_model(build_model(spec.model, spec.dtype, device, spec.seed), spec)
    loss_fn = step_function(spec, device, [policy])[0]
    warm_fn = step_function(dataclasses.replace(spec, seq_len=args.warmup_seq_len), device, [policy])[0]
    record: dict[str, Any] = {"config": config, "seq_len": args.seq_len, "profiled": profile}

    def step(fn, marks: dict[str, float] | None = None) -> float:
        _sync()
        start = time.perf_counter()
        loss = fn()
        _sync()
        middle = time.perf_counter()
        loss.backward()
        _sync()
        end = time.perf_counter()
        policy.zero_grad(set_to_none=True)
        if marks is not None:
            marks["forward"], marks["backward"] = middle - start, end - middle
        return float(loss)

    step(warm_fn)
    steps = []
    for _ in range(args.repeats):
        marks: dict[str, float] = {}
        record["loss"] = step(loss_fn, marks)
        steps.append(marks)
    record["steps_s"] = steps
    extra = []
    for length in args.extra_lengths:  # one step each, fresh ids: what a new length costs (kernel plans, allocator)
        marks = {}
        step(step_function(dataclasses.replace(spec, seq_len=length), device, [policy])[0], marks)
        extra.append({"seq_len": length, **marks})
    if extra:
        record["extra_steps_s"] = extra
    record["step_s"] = min(s["forward"] + s["backward"] for s in steps)
    record["ms_per_1k_tokens"] = record["step_s"] * 1e3 / (args.seq_len / 1000)
    if device.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    phases: dict[str, float] = {}
    with phase_wrappers(True, phases):
        marks = {}
        step(loss_fn, marks)
    record["phase_step_s"] = marks
    record["phases_s"] = phases
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with phase_wrappers(False, {}), torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function("profiled_step"):
                step(loss_fn)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                record["profile"] = analyse_trace(json.load(f))
    return record


def summary_lines(record: dict[str, Any]) -> list[str]:
    lines = [
        f"== {record['config']} @ {record['seq_len']}: {record.get('status', 'ok')}",
    ]
    if record.get("status", "ok") != "ok":
        return lines + [str(record.get("error", ""))[:500]]
    lines.append(
        f"step {record['step_s']:.3f} s ({record['ms_per_1k_tokens']:.1f} ms/1k), steps "
        + ", ".join(f"fwd {s['forward']:.3f} bwd {s['backward']:.3f}" for s in record["steps_s"])
        + (f", peak {record['peak_gib']:.2f} GiB" if "peak_gib" in record else "")
    )
    if record.get("extra_steps_s"):
        lines.append(
            "extra lengths: "
            + ", ".join(
                f"{s['seq_len']}: fwd {s['forward']:.3f} bwd {s['backward']:.3f}" for s in record["extra_steps_s"]
            )
        )
    lines.append("phases (synced): " + ", ".join(f"{k} {v:.3f}" for k, v in record["phases_s"].items()))
    prof = record.get("profile")
    if prof:
        lines.append(
            f"profile: span {prof['step_span_ms']} ms, kernels {prof['kernels']} = {prof['kernel_ms']:.1f} ms, "
            f"busy {prof['gpu_busy_ms']:.1f} ms (share {prof['gpu_busy_share']}), launches {prof['launches']}, "
            f"syncs {prof['sync_calls']}, cpu ops {prof['cpu_ops']}"
        )
        lines.append("by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in prof["kernel_ms_by_kind"].items()))
        lines.append("by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in prof["kernel_ms_by_phase"].items()))
        lines += [f"  {k['ms']:9.2f} ms x{k['count']:6d} {k['name']}" for k in prof["top_kernels"][:15]]
        lines.append("top ops: " + ", ".join(f"{n} {c}" for n, c in prof["top_cpu_ops"][:15]))
    return lines


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--warmup-seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--extra-lengths", type=int, nargs="*", default=[], help="one more timed step at each of these lengths"
    )
    parser.add_argument("--configs", nargs="+", default=["trl", "stream:4096"])
    parser.add_argument("--profile", nargs="*", default=[], help="the configurations to profile too")
    parser.add_argument("--out-dir", default="benchmarks")
    parser.add_argument("--name", default=None)
    parser.add_argument(
        "--eager-tile-elements",
        type=int,
        default=None,
        help="the SFT logit kernel's tile (rows x vocabulary) elements",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    for config in args.configs:
        parse_config(config)
    if args.worker is not None:
        record = run_config(args, args.worker, args.worker in args.profile)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"profile_{args.model}_{args.seq_len}"
    result: dict[str, Any] = {
        "command": command_line("gpu", "profile", argv),
        "environment": environment(args.device),
        "records": [],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]))
    for config in args.configs:
        cmd = [sys.executable, str(entry("gpu")), "profile", *argv, "--worker", config]
        try:
            record, proc = prefixed_record(cmd, RESULT_PREFIX, env, args.timeout)
            if record is None:
                record = {"config": config, "seq_len": args.seq_len, "status": "failed", "error": proc.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            record = {"config": config, "seq_len": args.seq_len, "status": "timeout"}
        result["records"].append(record)
        print("\n".join(summary_lines(record)), flush=True)
        (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0
