"""Measure one training step for real: peak memory and time, each (mode, length) in a fresh process.

This is the measuring code shared by ``streambp-trl max-len`` (its real bisection) and ``scripts/bench_bp.py`` /
``scripts/bench_objectives.py``. A *spec* (a JSON-able dict) names the model, the mode and the length;
:func:`measure` runs it in a fresh ``python`` process (this file run as a script, which prints one JSON line
back), so no allocator cache, peak counter or patched model leaks between measurements.

Modes:

* ``plain``: no checkpointing, Hugging Face's loss over the full logits.
* ``checkpoint``: Hugging Face gradient checkpointing (``use_reentrant=False``), full logits.
* ``checkpoint+chunked-loss``: TRL 1.16's default: checkpointing plus ``trl.trainer.utils.add_fused_lm_head``,
  called with ``fused_lm_head=True``.
* ``stream``: ``enable_streambp(...)``, the same ``fused_lm_head=True`` call.
* ``stream+offload``: the same with the engine option ``offload_checkpoints=True``.

Objectives (``spec["objective"]``): ``sft`` (the loss over ``batch_size`` sequences, every token labelled),
``dpo`` (a frozen reference in eval mode and the policy score [chosen; rejected], the sigmoid loss) and ``grpo``
(the policy update: per-token log-probs at temperature 0.7 of two sequences, the clipped surrogate). Random token
ids, random weights (fixed seed), dropout set to 0.

In the worker, one warm-up step runs (``spec["warmup"]``, default on), the gradients are dropped
(``set_to_none``), then the measured step runs ``repeats`` times. Memory:

* CPU: the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then returns large frees to the OS, so peak
  RSS tracks live tensors); the kernel's peak-RSS counter is reset (``5`` into ``/proc/self/clear_refs``) and
  ``VmRSS`` is the baseline; ``peak = VmHWM - baseline``.
* CUDA: ``reset_peak_memory_stats``, baseline ``memory_allocated``, ``peak = max_memory_allocated - baseline``;
  the host's peak RSS above its baseline is recorded too (``host_peak_mb``: offloaded checkpoints).

``peak_mb`` is the peak above the loaded model(s) in MiB, parameter gradients included; ``total_peak_mb`` adds
the model: on CUDA the allocated baseline (what ``max_memory_allocated`` reports), on CPU the bytes of the
parameters and buffers (plus ``reserve_bytes``, a tensor held like optimizer states). An out-of-memory error (or
a child killed by the OS) gives ``status: "oom"``.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT_PREFIX = "BENCH_BP_RESULT "
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding streambp_trl/

MODES = ("plain", "checkpoint", "checkpoint+chunked-loss", "stream", "stream+offload")
FUSED_MODES = ("checkpoint+chunked-loss", "stream", "stream+offload")
STREAM_MODES = ("stream", "stream+offload")
OBJECTIVES = ("sft", "dpo", "grpo")
TEMPERATURE = {"sft": 1.0, "dpo": 1.0, "grpo": 0.7}
KV_MODES = ("recompute", "capture")
DTYPES = ("float32", "bfloat16", "float64")

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


def _qwen3(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, tied: bool, **extra) -> dict:
    return {
        **_QWEN3_COMMON,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": tied,
        **extra,
    }


# Named sizes: Qwen3Config keyword arguments (random weights). The published Qwen3 shapes; "qwen3-cpu-bench" is the
# 4-layer model of the CPU benchmarks, "qwen3-tiny" a 2-layer one for quick CPU bisections (tests).
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": _qwen3(2, 256, 512, 4, 2, False, head_dim=64, vocab_size=2048),
    "qwen3-cpu-bench": _qwen3(4, 512, 1536, 8, 4, False, head_dim=64, vocab_size=8000),
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16, 8, True),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _qwen3(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _qwen3(40, 5120, 17408, 40, 8, False),
}


# ------------------------------------------------------------------------------------------------------------
# In the worker process
# ------------------------------------------------------------------------------------------------------------


def read_status_kib(field: str) -> int:
    """A ``kB`` field (e.g. ``VmRSS``, ``VmHWM``) of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


class MemoryProbe:
    """Peak memory above a baseline: peak RSS on CPU, peak allocated memory on CUDA (and the host's peak RSS)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.baseline = self.host_baseline = 0

    def reset(self) -> int:
        """Reset the peak counters; returns (and keeps) the current memory in bytes as the baseline."""
        import torch

        gc.collect()
        self.reset_peak()
        self.host_baseline = read_status_kib("VmRSS") * 1024
        cuda = self.device.type == "cuda"
        self.baseline = torch.cuda.memory_allocated(self.device) if cuda else self.host_baseline
        return self.baseline

    def reset_peak(self) -> None:
        """Restart the peak counters from the current memory, keeping the baselines."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS

    def host_peak_above_baseline(self) -> int:
        return read_status_kib("VmHWM") * 1024 - self.host_baseline

    def peak_above_baseline(self) -> int:
        """Bytes of the peak since :meth:`reset`, above the baseline."""
        import torch

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self.host_peak_above_baseline()


class PhaseMarks:
    """Splits the measured step into phases and records each one's peak (above the baseline) and duration.

    Boundaries are gradient hooks on the decoder layers' hidden states, registered by module forward hooks while
    armed: ``forward``; ``head backward`` (loss, LM head, final norm: until dL/d(last layer output) exists);
    ``layer i backward`` (until dL/d(layer i input) exists); ``rest`` (embedding backward, gradient accumulation).
    Each mark restarts the peak counter, so the step's peak is the largest phase peak.
    """

    def __init__(self, model: Any, probe: MemoryProbe) -> None:
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


def canonical_model_name(name: str) -> str:
    """``8b`` / ``Qwen3-8B`` -> ``qwen3-8b`` when that is a named size; anything else unchanged."""
    low = name.lower()
    for candidate in (low, f"qwen3-{low}"):
        if candidate in NAMED_MODELS:
            return candidate
    return name


def build_config(name: str) -> Any:
    """A named Qwen3 size, or the config of a Hub name / local directory (config only, never weights)."""
    from transformers import AutoConfig, Qwen3Config

    name = canonical_model_name(name)
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


def _stream_options(spec: dict[str, Any]) -> dict[str, Any]:
    options = {
        "stream_chunk_size": spec["stream_chunk_size"],
        "logits_chunk_size": spec["logits_chunk_size"],
        "kv_mode": spec.get("kv_mode", "recompute"),
        "temperature": TEMPERATURE[spec.get("objective", "sft")],
    }
    if spec["mode"] == "stream+offload":
        options["offload_checkpoints"] = True  # a TypeError until the engine has the option
    return options


def prepare_model(model: Any, spec: dict[str, Any], *, trainable: bool = True) -> Any:
    """Set ``model`` up for ``spec["mode"]`` (and LoRA); returns the model to call (a PEFT wrapper with LoRA)."""
    mode, objective = spec["mode"], spec.get("objective", "sft")
    outputs = ("log_probs",) if objective == "sft" else ("log_probs", "entropy")
    if mode in ("checkpoint", "checkpoint+chunked-loss") and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "checkpoint+chunked-loss":
        import trl.kernels.chunked_logprob as trl_kernel
        from trl.trainer.utils import add_fused_lm_head

        if spec.get("same_logits_tile"):  # TRL's kernel reads its token tile from this module constant
            trl_kernel.TOKEN_CHUNK_SIZE = spec["logits_chunk_size"]
        add_fused_lm_head(model, temperature=TEMPERATURE[objective], outputs=outputs)  # before PEFT, as TRL says
    if spec.get("lora") and trainable:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    if mode in STREAM_MODES:
        from streambp_trl import enable_streambp

        enable_streambp(model, **_stream_options(spec), fused_outputs=outputs, stream_eval=not trainable)
    return model


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _log_probs(model: Any, ids: Any, labels: Any, spec: dict[str, Any]) -> Any:
    """Per-token log-probs of the next-token labels (0 where the label is -100), shape (batch, seq_len - 1)."""
    if spec["mode"] in FUSED_MODES:
        return model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / TEMPERATURE[spec["objective"]]
    target = labels[:, 1:]
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp * (target != -100)


def _step_function(spec: dict[str, Any], device: Any, models: list[Any]) -> tuple[Callable[[], Any], int]:
    """``(loss_fn, tokens)``: the objective's loss of one step on random ids, and the tokens it processes."""
    import torch
    import torch.nn.functional as F

    objective = spec.get("objective", "sft")
    policy = models[0]
    vocab = policy.config.get_text_config().vocab_size
    rows = spec["batch_size"] if objective == "sft" else 2  # DPO: [chosen; rejected]; GRPO: two completions
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, vocab, (rows, spec["seq_len"]), generator=generator).to(device)
    labels = ids.clone()
    if objective == "sft":
        if spec["mode"] in FUSED_MODES:
            return lambda: policy(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).loss, ids.numel()
        return lambda: policy(input_ids=ids, labels=labels, use_cache=False).loss, ids.numel()
    labels[:, : spec["seq_len"] // 8] = -100  # the prompt
    completion = (labels[:, 1:] != -100).float()
    advantages = torch.tensor([[1.0], [-1.0]], device=device)

    def loss_fn() -> Any:
        logps = _log_probs(policy, ids, labels, spec)
        if objective == "dpo":
            with torch.no_grad():
                ref = _log_probs(models[1], ids, labels, spec).sum(1)
            pol = logps.sum(1)
            return -F.logsigmoid(0.1 * ((pol[0] - ref[0]) - (pol[1] - ref[1])))
        ratio = torch.exp(logps - logps.detach())  # GRPO's clipped surrogate at the first iteration (ratio 1)
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        return ((per_token * completion).sum(1) / completion.sum(1)).mean()

    return loss_fn, ids.numel()


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the model(s), warm up, measure; returns the record (``status`` "ok" or "oom")."""
    import torch

    device = torch.device(spec["device"])
    objective = spec.get("objective", "sft")
    record: dict[str, Any] = {k: spec[k] for k in ("mode", "seq_len", "batch_size", "dtype", "model") if k in spec}
    if objective != "sft":
        record["objective"] = objective
    if spec["mode"] in STREAM_MODES:
        record.update({k: spec.get(k) for k in ("stream_chunk_size", "logits_chunk_size", "kv_mode")})
    if spec["mode"] == "checkpoint+chunked-loss":
        record["logits_chunk_size"] = spec["logits_chunk_size"] if spec.get("same_logits_tile") else trl_token_chunk()
    try:
        policy = prepare_model(build_model(spec["model"], spec["dtype"], device, spec["seed"]), spec)
        models = [policy]
        if objective == "dpo":
            reference = build_model(spec["model"], spec["dtype"], device, spec["seed"]).eval()
            reference.requires_grad_(False)
            models.append(prepare_model(reference, spec, trainable=False))
        model_bytes = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        # held through the step like optimizer states (zeros: resident on the CPU too); counted with the model
        reserved = torch.zeros(spec.get("reserve_bytes", 0), dtype=torch.uint8, device=device)
        model_bytes += reserved.numel()
        loss_fn, tokens = _step_function(spec, device, models)
        probe = MemoryProbe(device)
        marks = PhaseMarks(policy, probe) if spec.get("phases") else None

        def step() -> float:
            if marks is not None:
                marks.armed = True
                marks.begin()
            loss = loss_fn()
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

        if spec.get("warmup", True):
            step()  # first-touch pages, lazy initialisation, kernel selection
            policy.zero_grad(set_to_none=True)
        times, cpu_times, peaks, host_peaks, losses, baselines = [], [], [], [], [], []
        grad_norm = None
        for i in range(spec.get("repeats", 1)):
            baselines.append(probe.reset())
            start, cpu_start = time.perf_counter(), time.process_time()
            losses.append(step())
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
            # with phase marks the peak counter restarts at each phase: the step's peak is the largest phase peak
            peaks.append(max(p["peak_mb"] for p in marks.phases) * 2**20 if marks else probe.peak_above_baseline())
            host_peaks.append(probe.host_peak_above_baseline())
            if i == spec.get("repeats", 1) - 1:
                norms = [p.grad.detach().double().norm() for p in policy.parameters() if p.grad is not None]
                grad_norm = float(torch.stack(norms).norm()) if norms else None
            policy.zero_grad(set_to_none=True)
    except Exception as exc:  # OOM is a result (for the bisections); anything else propagates
        if not is_oom(exc):
            raise
        record.update(status="oom", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return record
    time_s = statistics.median(times)
    fixed_mb = (baselines[-1] if device.type == "cuda" else model_bytes) / 2**20
    record.update(
        status="ok",
        peak_mb=max(peaks) / 2**20,
        total_peak_mb=fixed_mb + max(peaks) / 2**20,
        host_peak_mb=max(host_peaks) / 2**20 if device.type == "cuda" else None,
        time_s=time_s,
        time_min_s=min(times),
        cpu_s=statistics.median(cpu_times),
        tokens_per_s=tokens / time_s,
        times_s=times,
        loss=losses[-1],
        grad_norm=grad_norm,
        baseline_mb=baselines[-1] / 2**20,
        model_mb=model_bytes / 2**20,
        num_params=sum(p.numel() for p in policy.parameters()),
        engine_sha256=engine_hash(),
        torch_threads=torch.get_num_threads(),
    )
    if marks is not None:
        record["phases"] = marks.phases  # of the last repeat
    return record


def engine_hash() -> str:
    """First 12 hex digits of a SHA-256 over the ``streambp_trl`` sources: which engine code ran."""
    import hashlib

    digest = hashlib.sha256()
    root = PACKAGE_ROOT / "streambp_trl"
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def trl_token_chunk() -> int | None:
    """The token tile of TRL's fused LM head."""
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    except ImportError:
        return None
    return TOKEN_CHUNK_SIZE


# ------------------------------------------------------------------------------------------------------------
# In the parent process
# ------------------------------------------------------------------------------------------------------------


def measure(
    spec: dict[str, Any], timeout: float | None = None, *, script: str | None = None, log: bool = True
) -> dict[str, Any]:
    """Run ``spec`` in a fresh process; returns its record (status "ok", "oom", or "error" if the child failed).

    ``script`` runs ``python SCRIPT --worker SPEC`` instead of this module's worker (it must print one line
    ``RESULT_PREFIX + json``). ``log`` prints a line per measurement on stderr.
    """
    target = [str(Path(script).resolve()), "--worker"] if script else [str(Path(__file__).resolve())]
    cmd = [sys.executable, *target, json.dumps(spec)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    label = f"mode={spec['mode']} seq_len={spec['seq_len']}"
    say = (lambda text: print(f"[measure] {text}", file=sys.stderr, flush=True)) if log else (lambda text: None)
    say(f"{label} ...")
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
            killed = proc.returncode in (-9, 137)
            oom = killed or (proc.returncode != 0 and "out of memory" in proc.stderr.lower())
            why = "killed by the OS (out of memory?)" if killed else "\n".join(tail)
            record = {"status": "oom" if oom else "error", "returncode": proc.returncode, "error": why[-2000:]}
            say(f"{label} failed (rc={proc.returncode}):\n" + "\n".join(tail))
    for key in ("mode", "seq_len", "batch_size", "dtype", "model"):
        if key in spec:
            record.setdefault(key, spec[key])
    if record["status"] == "ok":
        say(f"{label}: peak {record['peak_mb']:.1f} MiB, {record['time_s']:.2f} s, loss {record['loss']:.6f}")
    return record


def bisect_max_len(
    probe: Callable[[int], float | None],
    *,
    step: int = 1024,
    budget: float | None = None,
    target: float | None = None,
    start: int | None = None,
    limit: int = 1 << 22,
    progress: Callable[[int, bool], None] | None = None,
) -> tuple[int, int | None, dict[int, float | None]]:
    """Longest multiple of ``step`` (up to ``limit``) that fits; returns ``(best, first_failure, probes)``.

    ``probe(n)`` runs length ``n`` and returns its peak (any unit, the ``budget``'s) or ``None`` when it ran out
    of memory. ``n`` fits when it ran and, with a ``budget``, its peak is within it. Memory grows about linearly
    with the length, so the next length is the linear interpolation (or extrapolation, at most 8x) of the peaks
    measured so far to ``target`` (default: the budget; e.g. the GPU's memory when running out of it decides);
    without either, doubling then halving the bracket. ``start``: the
    first length to try (e.g. an estimate). ``best`` is 0 when not even ``step`` fits; ``first_failure`` is None
    when ``limit`` fits. ``progress(n, fits)`` is called after every probe.
    """
    probes: dict[int, float | None] = {}
    target = budget if target is None else target
    lo, hi = 0, None  # longest known to fit, shortest known not to
    top = limit // step * step

    def snap(n: float) -> int:
        upper = (hi - step) if hi is not None else top
        return int(min(max(n // step * step, lo + step), upper))

    n, outcomes = snap(start if start else step), []
    while n > lo and (hi is None or n < hi):
        peak = probe(n)
        probes[n] = peak
        ok = peak is not None and (budget is None or peak <= budget)
        outcomes.append(ok)
        if progress is not None:
            progress(n, ok)
        if ok:
            lo = n
        else:
            hi = n
        if lo >= top or (hi is not None and hi - lo <= step):
            break
        known = sorted((k, v) for k, v in probes.items() if v is not None)
        guess = None
        # interpolate unless, inside a bracket, the last two probes fell on the same side (then halve it)
        if target is not None and known and not (hi is not None and lo and outcomes[-2:] in ([True] * 2, [False] * 2)):
            below = [(k, v) for k, v in known if v <= target]
            above = [(k, v) for k, v in known if v > target]
            pair = (below[-1:] + above[:1]) if below and above else known[-2:]
            if len(pair) == 2 and pair[1][1] != pair[0][1]:
                (x0, y0), (x1, y1) = pair
                guess = x0 + (target - y0) * (x1 - x0) / (y1 - y0)
            elif len(pair) == 1 and pair[0][1] > 0:
                guess = pair[0][0] * target / pair[0][1]
            if guess is not None and hi is None:
                guess = min(guess, 8 * max(lo, step))
        if guess is None or guess != guess:  # no usable interpolation (or NaN): double, or halve the bracket
            guess = 2 * lo if hi is None else (lo + hi) / 2
        n = snap(guess)
    return lo, hi, probes


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def environment(device: str) -> dict[str, Any]:
    """Where and with what a measurement runs: device, versions, git commit, engine hash, date."""
    import torch
    import transformers
    import trl

    import streambp_trl

    return {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "streambp_trl": streambp_trl.__version__,
        },
        "git": git_commit(),
        "engine_sha256": engine_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


if __name__ == "__main__":  # the worker: python measure.py SPEC_JSON
    print(RESULT_PREFIX + json.dumps(run_worker(json.loads(sys.argv[-1]))), flush=True)
