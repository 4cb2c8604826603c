#!/usr/bin/env python
"""Benchmark the memory and time of ONE forward+backward of a causal LM under different backprop strategies.

Modes (``--mode``, one or more):

* ``plain``: no checkpointing, the Hugging Face loss over the full logits:
  ``model(input_ids, labels=labels).loss.backward()``.
* ``checkpoint``: HF gradient checkpointing (``use_reentrant=False``), full-logit HF loss.
* ``checkpoint+chunked-loss``: what TRL 1.16 does by default: HF gradient checkpointing plus
  ``trl.trainer.utils.add_fused_lm_head(model)``, then ``model(input_ids, labels=labels, fused_lm_head=True).loss``.
* ``stream``: ``streambp_trl.enable_streambp(model, stream_chunk_size=..., logits_chunk_size=..., kv_mode=...)``,
  then the same ``fused_lm_head=True`` call.

Every (mode, seq_len) measurement runs in a fresh subprocess (this script re-invoked with the hidden ``--worker``
flag; it prints one JSON line back), so no allocator cache, peak counter or patched model leaks between them.
In the worker, the model is built with random weights, one warm-up forward+backward runs, the gradients are
dropped (``zero_grad(set_to_none=True)``) and then the measured forward+backward runs ``--repeats`` times:

* CPU: the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` so that glibc returns large frees to the OS. Before
  each measured step the kernel's peak-RSS counter is reset (``5`` written to ``/proc/self/clear_refs``) and the
  current ``VmRSS`` is the baseline; after it, ``peak = VmHWM - baseline``.
* CUDA: ``torch.cuda.reset_peak_memory_stats()``, baseline ``torch.cuda.memory_allocated()``, and
  ``peak = torch.cuda.max_memory_allocated() - baseline``.

So ``peak_mb`` is the peak memory ABOVE the loaded model (its parameters; buffers), in MiB (2**20 bytes); it
includes the parameter gradients, which are the same for every mode. The time is the wall-clock seconds of the
measured forward+backward (synchronised on CUDA), median over the repeats; the peak is the largest over them.
``cpu_s`` is the process CPU time of the step (all threads): on a shared machine a wall time far above
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

``--find-max-seq`` (CUDA only) searches, per mode, for the longest sequence (a multiple of 1024) whose
forward+backward fits in GPU memory: doubling from 1024, then bisecting, every probe in a fresh subprocess.

Examples::

    python scripts/bench_bp.py --model qwen3-cpu-bench --dtype float32 --seq-len 8192 16384 \\
        --mode plain checkpoint checkpoint+chunked-loss stream --out cpu_qwen3_4l_fp32
    python scripts/bench_bp.py --model qwen3-8b --dtype bfloat16 --mode checkpoint+chunked-loss stream \\
        --find-max-seq --out h100_qwen3_8b_maxseq
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "benchmarks"
RESULT_PREFIX = "BENCH_BP_RESULT "

MODES = ("plain", "checkpoint", "checkpoint+chunked-loss", "stream")
KV_MODES = ("recompute", "capture")
DTYPES = ("float32", "bfloat16", "float64")

# Acceptance targets of the CPU benchmark (reported, never enforced).
TARGET_MEM_RATIO = 0.35  # stream KiB per extra token <= 0.35 x checkpoint+chunked-loss's
TARGET_TIME_RATIO = 1.3  # stream time <= 1.3 x checkpoint's

_QWEN3_COMMON: dict[str, Any] = {
    "head_dim": 128,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
}

# Named sizes: Qwen3Config keyword arguments (random weights). The published Qwen3 shapes; the small
# "qwen3-cpu-bench" is a 4-layer model for the CPU acceptance benchmark.
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-cpu-bench": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8000,
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 36,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "qwen3-14b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
}


# --------------------------------------------------------------------------------------------------------------
# Worker: one (mode, seq_len) measurement, in its own process.
# --------------------------------------------------------------------------------------------------------------


def _read_status_kib(field: str) -> int:
    """A ``kB`` field (e.g. ``VmRSS``, ``VmHWM``) of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


class _MemoryProbe:
    """Peak memory above a baseline: peak RSS on CPU, peak allocated memory on CUDA."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.baseline = 0

    def reset(self) -> int:
        """Reset the peak counter; returns (and keeps) the current memory in bytes as the baseline."""
        import torch

        gc.collect()
        self.reset_peak()
        if self.device.type == "cuda":
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = _read_status_kib("VmRSS") * 1024
        return self.baseline

    def reset_peak(self) -> None:
        """Restart the peak counter from the current memory, keeping the baseline."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS

    def peak_above_baseline(self) -> int:
        """Bytes of the peak since :meth:`reset`, above the baseline."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _read_status_kib("VmHWM") * 1024 - self.baseline


class _PhaseMarks:
    """Splits the measured step into phases and records each one's peak (above the baseline) and duration.

    Boundaries are gradient hooks on the decoder layers' hidden states, registered by module forward hooks while
    armed: ``forward``; ``head backward`` (loss, LM head, final norm: until dL/d(last layer output) exists);
    ``layer i backward`` (until dL/d(layer i input) exists); ``rest`` (embedding backward, gradient accumulation).
    Each mark restarts the peak counter, so the step's peak is the largest phase peak. The phase slopes over
    sequence length show which part of the step grows with it, independent of fixed costs such as logit tiles.
    """

    def __init__(self, model: Any, probe: _MemoryProbe) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.probe = probe
        self.armed = False
        self.phases: list[dict[str, Any]] = []
        self.start = 0.0
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for i, layer in enumerate(layers):
            layer.register_forward_hook(self._layer_hook(i, last=i == len(layers) - 1), with_kwargs=True)

    def _layer_hook(self, i: int, last: bool) -> Callable:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if not self.armed:
                return
            x = args[0] if args else kwargs.get("hidden_states")
            y = output[0] if isinstance(output, (tuple, list)) else output
            if last and getattr(y, "requires_grad", False):
                y.register_hook(lambda grad: self.mark("head backward"))
            if getattr(x, "requires_grad", False):
                x.register_hook(lambda grad: self.mark(f"layer {i} backward"))

        return hook

    def begin(self) -> None:
        self.phases, self.start = [], time.perf_counter()

    def mark(self, name: str) -> None:
        import torch

        if self.probe.device.type == "cuda":
            torch.cuda.synchronize(self.probe.device)
        now = time.perf_counter()
        self.phases.append(
            {"phase": name, "peak_mb": self.probe.peak_above_baseline() / 2**20, "time_s": now - self.start}
        )
        self.probe.reset_peak()
        self.start = time.perf_counter()


def build_config(name: str) -> Any:
    """A named Qwen3 size, or the config of a Hub name / local directory (config only, never weights)."""
    from transformers import AutoConfig, Qwen3Config

    if name in NAMED_MODELS:
        return Qwen3Config(**NAMED_MODELS[name])
    return AutoConfig.from_pretrained(name)


def _zero_dropout(config: Any) -> None:
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in list(vars(cfg).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                setattr(cfg, key, 0.0)


def build_model(name: str, dtype_name: str, device: Any, seed: int) -> Any:
    """The causal LM with random weights (fixed seed), sdpa attention, in train mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(name)
    _zero_dropout(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name), attn_implementation="sdpa")
    model.train()
    return model


def prepare_mode(model: Any, spec: dict[str, Any]) -> Callable[[Any, Any], Any]:
    """Set ``model`` up for ``spec["mode"]``; returns ``forward(input_ids, labels) -> loss``."""
    mode = spec["mode"]
    if mode in ("checkpoint", "checkpoint+chunked-loss"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "checkpoint+chunked-loss":
        import trl.kernels.chunked_logprob as trl_kernel
        from trl.trainer.utils import add_fused_lm_head

        if spec.get("same_logits_tile"):  # TRL's kernel reads its token tile from this module constant
            trl_kernel.TOKEN_CHUNK_SIZE = spec["logits_chunk_size"]
        add_fused_lm_head(model)
    elif mode == "stream":
        from streambp_trl import enable_streambp

        enable_streambp(
            model,
            stream_chunk_size=spec["stream_chunk_size"],
            logits_chunk_size=spec["logits_chunk_size"],
            kv_mode=spec["kv_mode"],
        )
    fused = mode in ("checkpoint+chunked-loss", "stream")

    def forward(input_ids: Any, labels: Any) -> Any:
        if fused:
            return model(input_ids=input_ids, labels=labels, fused_lm_head=True, use_cache=False).loss
        return model(input_ids=input_ids, labels=labels, use_cache=False).loss

    return forward


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model, warm up, measure; returns the record (``status`` "ok" or "oom")."""
    import torch

    device = torch.device(spec["device"])
    record: dict[str, Any] = {k: spec[k] for k in ("mode", "seq_len", "batch_size", "dtype", "model")}
    if spec["mode"] == "stream":
        record.update({k: spec[k] for k in ("stream_chunk_size", "logits_chunk_size", "kv_mode")})
    if spec["mode"] == "checkpoint+chunked-loss":
        record["logits_chunk_size"] = spec["logits_chunk_size"] if spec.get("same_logits_tile") else _trl_token_chunk()
    try:
        model = build_model(spec["model"], spec["dtype"], device, spec["seed"])
        forward = prepare_mode(model, spec)
        vocab = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(spec["seed"] + 1)
        input_ids = torch.randint(0, vocab, (spec["batch_size"], spec["seq_len"]), generator=generator).to(device)
        labels = input_ids.clone()

        probe = _MemoryProbe(device)
        marks = _PhaseMarks(model, probe) if spec.get("phases") else None

        def step() -> float:
            if marks is not None:
                marks.armed = True
                marks.begin()
            loss = forward(input_ids, labels)
            if marks is not None:
                marks.armed = False
                marks.mark("forward")
            loss.backward()
            value = loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if marks is not None:
                marks.mark("rest")
            return value

        step()  # warm-up: first-touch pages, lazy initialisation, kernel selection
        model.zero_grad(set_to_none=True)
        times, cpu_times, peaks, losses, baselines = [], [], [], [], []
        grad_norm = None
        for i in range(spec["repeats"]):
            baselines.append(probe.reset())
            start, cpu_start = time.perf_counter(), time.process_time()
            losses.append(step())
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            # with phase marks the peak counter restarts at each phase: the step's peak is the largest phase peak
            peaks.append(max(p["peak_mb"] for p in marks.phases) * 2**20 if marks else probe.peak_above_baseline())
            if i == spec["repeats"] - 1:
                norms = [p.grad.detach().double().norm() for p in model.parameters() if p.grad is not None]
                grad_norm = float(torch.stack(norms).norm()) if norms else None
            model.zero_grad(set_to_none=True)
    except Exception as exc:  # OOM is a result (for --find-max-seq); anything else propagates
        if not _is_oom(exc):
            raise
        record.update(status="oom", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return record
    tokens = spec["batch_size"] * spec["seq_len"]
    time_s = statistics.median(times)
    record.update(
        status="ok",
        peak_mb=max(peaks) / 2**20,
        time_s=time_s,
        time_min_s=min(times),
        cpu_s=statistics.median(cpu_times),
        tokens_per_s=tokens / time_s,
        times_s=times,
        loss=losses[-1],
        grad_norm=grad_norm,
        baseline_mb=baselines[-1] / 2**20,
        num_params=sum(p.numel() for p in model.parameters()),
        engine_sha256=engine_hash(),
        torch_threads=torch.get_num_threads(),
    )
    if marks is not None:
        record["phases"] = marks.phases  # of the last repeat
    return record


def engine_hash() -> str:
    """First 12 hex digits of a SHA-256 over the imported ``streambp_trl`` sources: which engine code ran."""
    import hashlib

    import streambp_trl

    digest = hashlib.sha256()
    root = Path(streambp_trl.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _trl_token_chunk() -> int | None:
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    except ImportError:
        return None
    return TOKEN_CHUNK_SIZE


def worker_main(spec_json: str) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    record = run_worker(json.loads(spec_json))
    print(RESULT_PREFIX + json.dumps(record), flush=True)


# --------------------------------------------------------------------------------------------------------------
# Parent: subprocesses, metadata, summary, output files.
# --------------------------------------------------------------------------------------------------------------


def measure(spec: dict[str, Any], timeout: float | None, script: str = __file__) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess of ``script --worker SPEC`` (this file by default); returns its
    record (status "error" if the child failed)."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    label = f"mode={spec['mode']} seq_len={spec['seq_len']}"
    print(f"[bench_bp] {label} ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        record = {"status": "error", "error": f"timed out after {timeout} s"}
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode == 0 and lines:
            record = json.loads(lines[-1][len(RESULT_PREFIX) :])
        else:
            tail = proc.stderr.strip().splitlines()[-15:]
            oom = proc.returncode != 0 and "out of memory" in proc.stderr.lower()
            why = "killed by the OS (out of memory?)" if proc.returncode in (-9, 137) else "\n".join(tail)
            record = {"status": "oom" if oom else "error", "returncode": proc.returncode, "error": why[-2000:]}
            print(f"[bench_bp] {label} failed (rc={proc.returncode}):\n" + "\n".join(tail), file=sys.stderr)
    for key in ("mode", "seq_len", "batch_size", "dtype", "model"):
        record.setdefault(key, spec[key])
    if record["status"] == "ok":
        done = f"peak {record['peak_mb']:.1f} MiB, {record['time_s']:.2f} s, loss {record['loss']:.6f}"
        print(f"[bench_bp] {label}: {done}", file=sys.stderr, flush=True)
    return record


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def metadata(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    sys.path.insert(0, str(REPO_ROOT))
    import streambp_trl

    if device == "cuda":
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = _cpu_name()
    return {
        "device": device,
        "device_name": device_name,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "streambp_trl": streambp_trl.__version__,
        },
        "git": _git_commit(),
        "engine_sha256": engine_hash(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "model_config": NAMED_MODELS.get(args.model),
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "stream_chunk_size": args.stream_chunk_size,
        "logits_chunk_size": args.logits_chunk_size,
        "trl_token_chunk_size": args.logits_chunk_size if args.same_logits_tile else _trl_token_chunk(),
        "kv_mode": args.kv_mode,
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
        if "stream" in phase_slopes and "checkpoint+chunked-loss" in phase_slopes:
            ratio = (
                phase_slopes["stream"]["max_kib_per_token"]
                / phase_slopes["checkpoint+chunked-loss"]["max_kib_per_token"]
            )
            summary["stream_vs_chunked_loss_steepest_phase"] = {
                "ratio": ratio,
                "target": TARGET_MEM_RATIO,
                "met": ratio <= TARGET_MEM_RATIO,
            }
    hashes = sorted(
        {r.get("engine_sha256") or "?" for r in records if r.get("status") == "ok" and r["mode"] == "stream"}
    )
    if len(hashes) > 1:
        summary["warning"] = f"records come from different streambp_trl sources (engine_sha256 {', '.join(hashes)})"
    stream = by_mode.get("stream", {})
    if "stream" in per_token and "checkpoint+chunked-loss" in per_token:
        ratio = per_token["stream"]["kib_per_token"] / per_token["checkpoint+chunked-loss"]["kib_per_token"]
        summary["stream_vs_chunked_loss_memory_per_token"] = {
            "ratio": ratio,
            "target": TARGET_MEM_RATIO,
            "met": ratio <= TARGET_MEM_RATIO,
        }
    time_ratios = {}
    for seq_len, rec in sorted(stream.items()):
        base = by_mode.get("checkpoint", {}).get(seq_len)
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
        mode = r["mode"] + (f" ({r['kv_mode']})" if r["mode"] == "stream" else "")
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
        mode = r["mode"] + (f" ({r['kv_mode']})" if r["mode"] == "stream" else "") + ("*" if r.get("source") else "")
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
    if result.get("max_seq"):
        lines += ["", "Longest sequence that fits (multiple of 1024):", ""]
        lines += ["| mode | max seq_len | peak MiB | time s | first failure |", "|---|---:|---:|---:|---:|"]
        for m in result["max_seq"]:
            lines.append(
                f"| {m['mode']} | {_fmt(m['max_seq_len'], 'd')} | {_fmt(m.get('peak_mb'), '.1f')} | "
                f"{_fmt(m.get('time_s'), '.2f')} | {_fmt(m.get('first_failure'), 'd')} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(name: str | None, result: dict[str, Any]) -> None:
    if not name:
        return
    BENCH_DIR.mkdir(exist_ok=True)
    (BENCH_DIR / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (BENCH_DIR / f"{name}.md").write_text(render_markdown(result))


def load_baseline(path: str, meta: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    """Records of modes not measured in this run, from an earlier output with the same model, dtype and batch."""
    earlier = json.loads(Path(path).read_text())
    em = earlier["metadata"]
    for key in ("model", "dtype", "batch_size", "device"):
        if em.get(key) != meta[key]:
            raise SystemExit(f"--baseline {path}: {key} is {em.get(key)!r}, this run's is {meta[key]!r}.")
    return [{**r, "source": path} for r in earlier["records"] if r["mode"] not in modes]


def find_max_seq(base_spec: dict[str, Any], limit: int, timeout: float | None) -> tuple[dict[str, Any], list]:
    """Longest multiple of 1024 that fits for ``base_spec["mode"]``: doubling, then bisection; fresh process each."""
    probes: list[dict[str, Any]] = []

    def fits(seq_len: int) -> bool:
        record = measure({**base_spec, "seq_len": seq_len}, timeout)
        probes.append(record)
        if record["status"] == "error":
            raise SystemExit(f"--find-max-seq: probe {base_spec['mode']} @ {seq_len} failed:\n{record['error']}")
        return record["status"] == "ok"

    unit = 1024
    good, bad = 0, None
    n = 1
    while n * unit <= limit:
        if not fits(n * unit):
            bad = n
            break
        good, n = n, n * 2
    if bad is None and good * unit < limit and good:  # the doubling stopped at the limit: try the limit itself
        top = limit // unit
        if top > good:
            if fits(top * unit):
                good = top
            else:
                bad = top
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid * unit):
            good = mid
        else:
            bad = mid
    best = next((p for p in probes if p["status"] == "ok" and p["seq_len"] == good * unit), {})
    return {
        "mode": base_spec["mode"],
        "max_seq_len": good * unit if good else None,
        "first_failure": bad * unit if bad is not None else None,
        "limit": limit,
        "peak_mb": best.get("peak_mb"),
        "time_s": best.get("time_s"),
    }, probes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Peak memory and time of one forward+backward: plain, HF checkpointing, TRL's chunked loss, "
        "StreamBP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="qwen3-cpu-bench",
        help=f"a named size ({', '.join(NAMED_MODELS)}) or a Hub name / local dir (config only; random weights)",
    )
    parser.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
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
    parser.add_argument("--out", metavar="NAME", help="write benchmarks/NAME.json and benchmarks/NAME.md")
    parser.add_argument("--baseline", metavar="FILE", help="earlier JSON output supplying the modes not run here")
    parser.add_argument(
        "--find-max-seq",
        action="store_true",
        help="CUDA only: per mode, the longest seq_len (multiple of 1024) that fits",
    )
    parser.add_argument("--max-seq-limit", type=int, default=1 << 20, help="--find-max-seq: largest length tried")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per measurement subprocess")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "stream_chunk_size", "logits_chunk_size", "repeats", "max_seq_limit"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if any(n < 2 for n in args.seq_len):
        parser.error("--seq-len values must be at least 2")
    if args.worker is not None:
        worker_main(args.worker)
        return
    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.find_max_seq and device != "cuda":
        parser.error(
            "--find-max-seq needs a CUDA device: it searches for the longest sequence that fits in GPU memory "
            "(catching CUDA out-of-memory); on CPU the limit is the host RAM and an overrun is an OS kill."
        )
    modes = list(dict.fromkeys(args.mode))
    meta = metadata(args, device)
    result: dict[str, Any] = {"metadata": meta, "records": []}
    baseline_records = load_baseline(args.baseline, meta, modes) if args.baseline else []
    if args.baseline:
        result["baseline"] = args.baseline

    def spec_for(mode: str, seq_len: int) -> dict[str, Any]:
        return {
            "mode": mode,
            "seq_len": seq_len,
            "batch_size": args.batch_size,
            "dtype": args.dtype,
            "model": args.model,
            "device": device,
            "seed": args.seed,
            "repeats": args.repeats,
            "stream_chunk_size": args.stream_chunk_size,
            "logits_chunk_size": args.logits_chunk_size,
            "kv_mode": args.kv_mode,
            "phases": args.phases,
            "same_logits_tile": args.same_logits_tile,
        }

    measured: list[dict[str, Any]] = []
    if args.find_max_seq:
        result["max_seq"], result["probes"] = [], []
        for mode in modes:
            best, probes = find_max_seq(spec_for(mode, 1024), args.max_seq_limit, args.timeout)
            result["max_seq"].append(best)
            result["probes"] += probes
            write_outputs(args.out, result)
    else:
        for seq_len in sorted(dict.fromkeys(args.seq_len)):
            for mode in modes:
                measured.append(measure(spec_for(mode, seq_len), args.timeout))
                result["records"] = baseline_records + measured
                result["summary"] = summarize(result["records"])
                write_outputs(args.out, result)
    result["records"] = sorted(baseline_records + measured, key=lambda r: (MODES.index(r["mode"]), r["seq_len"]))
    result["summary"] = summarize(result["records"])
    write_outputs(args.out, result)
    print(render_markdown(result))


if __name__ == "__main__":
    main()
