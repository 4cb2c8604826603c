"""The measuring worker: one :class:`~streambp_trl.bench.spec.MeasureSpec`, in a fresh process, printed back as
one JSON line.

:func:`~streambp_trl.bench.measure.measure` runs this file as a script (``python worker.py SPEC_JSON``), so no
allocator cache, peak counter or patched model leaks between measurements; it imports its siblings by absolute
name (the parent puts the package root on ``PYTHONPATH``).

Objectives (``spec.objective``): ``sft`` (the loss over ``batch_size`` sequences, every token labelled),
``dpo`` (a frozen reference in eval mode and the policy score [chosen; rejected], the sigmoid loss) and ``grpo``
(the policy update: per-token log-probs at temperature 0.7 of two sequences, the clipped surrogate). Random token
ids, random weights (fixed seed), dropout set to 0 (modes: :mod:`streambp_trl.bench.spec`; models:
:mod:`streambp_trl.bench.models`). A stream mode's ``"auto"`` chunk sizes are the engine's own choice
(:mod:`streambp_trl.sizing.auto`), recorded as chosen.

One warm-up step runs (``spec.warmup``, default on; at ``spec.warmup_seq_len`` tokens on fresh random ids of that
length when set, which still selects kernels and initialises lazily, in less time), the gradients are dropped
(``set_to_none``), then the measured step runs ``repeats`` times, its memory taken as
:mod:`streambp_trl.bench.memory_meter` describes.

``peak_mb`` is the peak above the loaded model(s) in MiB, parameter gradients included; ``total_peak_mb`` adds
the model: on CUDA the allocated baseline (what ``max_memory_allocated`` reports), on CPU the bytes of the
parameters and buffers (plus ``reserve_bytes``, a tensor held like optimizer states). An out-of-memory error
gives ``status: "oom"``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from streambp_trl.bench.memory_meter import MemoryMeter, PhaseMarks
from streambp_trl.bench.metadata import engine_hash
from streambp_trl.bench.models import build_model, prepare_model, trl_token_chunk
from streambp_trl.bench.spec import TEMPERATURE, MeasureSpec, Mode
from streambp_trl.engine import chunk_sizes, last_head_form, last_plan
from streambp_trl.sizing.auto import AUTO
from streambp_trl.sizing.units import parse_size

RESULT_PREFIX = "BENCH_BP_RESULT "


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _log_probs(model: Any, ids: Any, labels: Any, spec: MeasureSpec) -> Any:
    """Per-token log-probs of the next-token labels (0 where the label is -100), shape (batch, seq_len - 1)."""
    if spec.mode.fused:
        return model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / TEMPERATURE[spec.objective]
    target = labels[:, 1:]
    logp = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp * (target != -100)


def step_function(spec: MeasureSpec, device: Any, models: list[Any]) -> tuple[Callable[[], Any], int]:
    """``(loss_fn, tokens)``: the objective's loss of one step on random ids, and the tokens it processes."""
    import torch
    import torch.nn.functional as F

    objective = spec.objective
    policy = models[0]
    vocab = policy.config.get_text_config().vocab_size
    rows = spec.batch_size if objective == "sft" else 2  # DPO: [chosen; rejected]; GRPO: two completions
    generator = torch.Generator().manual_seed(spec.seed + 1)
    ids = torch.randint(0, vocab, (rows, spec.seq_len), generator=generator).to(device)
    labels = ids.clone()
    if objective == "sft":
        if spec.mode.fused:
            return lambda: policy(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).loss, ids.numel()
        return lambda: policy(input_ids=ids, labels=labels, use_cache=False).loss, ids.numel()
    labels[:, : spec.seq_len // 8] = -100  # the prompt
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


def run_worker(spec: MeasureSpec) -> dict[str, Any]:
    """Build the model(s), warm up, measure; returns the record (``status`` "ok" or "oom")."""
    import torch

    device = torch.device(spec.device)
    if spec.memory_cap is not None and device.type == "cuda":  # an 80 GB card's limits on a larger one
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(spec.memory_cap) / total), device.index or 0)
    record = _spec_record(spec)
    try:
        models = models_of(spec, device)
        policy = models[0]
        model_bytes = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        # held through the step like optimizer states (zeros: resident on the CPU too); counted with the model
        reserved = torch.zeros(spec.reserve_bytes, dtype=torch.uint8, device=device)
        model_bytes += reserved.numel()
        loss_fn, tokens = step_function(spec, device, models)
        measured = _measured_steps(spec, device, models, loss_fn)
        if spec.mode.streams:
            record.update(_what_the_engine_chose(spec, policy, tokens))
    except Exception as exc:  # OOM is a result (for the bisections); anything else propagates
        if not is_oom(exc):
            raise
        record.update(status="oom", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        return record
    times, peaks, baselines = measured["times"], measured["peaks"], measured["baselines"]
    time_s = statistics.median(times)
    fixed_mb = (baselines[-1] if device.type == "cuda" else model_bytes) / 2**20
    record.update(
        status="ok",
        peak_mb=max(peaks) / 2**20,
        total_peak_mb=fixed_mb + max(peaks) / 2**20,
        host_peak_mb=max(measured["host_peaks"]) / 2**20 if device.type == "cuda" else None,
        time_s=time_s,
        time_min_s=min(times),
        cpu_s=statistics.median(measured["cpu_times"]),
        tokens_per_s=tokens / time_s,
        times_s=times,
        loss=measured["losses"][-1],
        grad_norm=measured["grad_norm"],
        baseline_mb=baselines[-1] / 2**20,
        model_mb=model_bytes / 2**20,
        num_params=sum(p.numel() for p in policy.parameters()),
        engine_sha256=engine_hash(),
        torch_threads=torch.get_num_threads(),
    )
    if measured["phases"] is not None:
        record["phases"] = measured["phases"]  # of the last repeat
    return record


def _spec_record(spec: MeasureSpec) -> dict[str, Any]:
    """The record's description of what is measured, from the spec (the engine's own choices come after the steps)."""
    record: dict[str, Any] = {k: getattr(spec, k) for k in ("mode", "seq_len", "batch_size", "dtype", "model")}
    if spec.objective != "sft":
        record["objective"] = spec.objective
    if spec.mode.streams:
        record.update({k: getattr(spec, k) for k in ("stream_chunk_size", "logits_chunk_size", "kv_mode")})
        if spec.kv_mode is None:  # (what the plan chose is in record["plan"])
            record["kv_mode"] = "planned" if spec.planned else "recompute"
    if spec.mode is Mode.CHECKPOINT_CHUNKED_LOSS:
        record["logits_chunk_size"] = spec.logits_chunk_size if spec.same_logits_tile else trl_token_chunk()
    if spec.warmup and spec.warmup_seq_len is not None:
        record["warmup_seq_len"] = spec.warmup_seq_len
    return record


def models_of(spec: MeasureSpec, device: Any) -> list:
    """The trained policy, and for DPO a frozen reference beside it, each prepared as the spec's mode runs it."""
    policy = prepare_model(build_model(spec.model, spec.dtype, device, spec.seed), spec)
    if spec.objective != "dpo":
        return [policy]
    reference = build_model(spec.model, spec.dtype, device, spec.seed).eval()
    reference.requires_grad_(False)
    return [policy, prepare_model(reference, spec, trainable=False)]


def _measured_steps(spec: MeasureSpec, device: Any, models: list, loss_fn: Callable[[], Any]) -> dict[str, Any]:
    """The warm-up step (at its own length where the spec gives one), then ``spec.repeats`` measured steps: their
    wall and CPU times, peaks above the baseline (the largest phase peak with phase marks), host peaks, losses,
    baselines, the last step's gradient norm and phases."""
    import torch

    policy = models[0]
    meter = MemoryMeter(device)
    marks = PhaseMarks(policy, meter) if spec.phases else None

    def step(fn: Callable[[], Any] = loss_fn) -> float:
        if marks is not None:
            marks.armed = True
            marks.begin()
        loss = fn()
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

    if spec.warmup:
        warm_fn = loss_fn
        if spec.warmup_seq_len is not None:  # its own ids, dropped before the measured steps
            warm_fn = step_function(dataclasses.replace(spec, seq_len=spec.warmup_seq_len), device, models)[0]
        step(warm_fn)  # first-touch pages, lazy initialisation, kernel selection
        del warm_fn
        policy.zero_grad(set_to_none=True)
    out: dict[str, Any] = {k: [] for k in ("times", "cpu_times", "peaks", "host_peaks", "losses", "baselines")}
    out["grad_norm"] = None
    for i in range(spec.repeats):
        out["baselines"].append(meter.reset())
        start, cpu_start = time.perf_counter(), time.process_time()
        out["losses"].append(step())
        out["times"].append(time.perf_counter() - start)
        out["cpu_times"].append(time.process_time() - cpu_start)
        # with phase marks the peak counter restarts at each phase: the step's peak is the largest phase peak
        out["peaks"].append(max(p["peak_mb"] for p in marks.phases) * 2**20 if marks else meter.peak_above_baseline())
        out["host_peaks"].append(meter.host_peak_above_baseline())
        if i == spec.repeats - 1:
            norms = [p.grad.detach().double().norm() for p in policy.parameters() if p.grad is not None]
            out["grad_norm"] = float(torch.stack(norms).norm()) if norms else None
        policy.zero_grad(set_to_none=True)
    out["phases"] = marks.phases if marks is not None else None
    return out


def _what_the_engine_chose(spec: MeasureSpec, policy: Any, tokens: int) -> dict[str, Any]:
    """A streamed step's choices, as the record states them: the chunks "auto" chose, the logit kernel's gradient
    form (for the budget, or the free memory), the plan in words and what the memory model's estimate of the record
    needs to know of it."""
    record: dict[str, Any] = {}
    if AUTO in (spec.stream_chunk_size, spec.logits_chunk_size):
        record["stream_chunk_size"], record["logits_chunk_size"] = chunk_sizes(policy)  # what "auto" chose
    record.update(head_form=last_head_form(policy), memory_budget=spec.memory_budget)
    plan, layers = last_plan(policy), len(policy._streambp.layers)
    record["plan"] = None if plan is None else plan.describe(tokens, layers)
    record["captured"] = spec.kv_mode == "capture" if plan is None else plan.kv_mode == "capture"
    if plan is not None:
        record.update(
            inputs_rebuilt=plan.layout.rebuilt(layers),
            offloaded=plan.offload,
            layers_kept=min(plan.keep_activations, layers),
        )
    return record


if __name__ == "__main__":  # the worker: python worker.py SPEC_JSON
    print(RESULT_PREFIX + json.dumps(run_worker(MeasureSpec.from_json(sys.argv[-1]))), flush=True)
