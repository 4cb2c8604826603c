"""``gpu.py bench``'s pure decisions: the output name of a device, the memory model's estimate of a measurement,
whether a measurement still fits the time budget (its wall time predicted from the earlier ones), and the bracket
of the longest length that fits the memory budget."""

from __future__ import annotations

import math
import re
from typing import Any

from streambp_trl.bench.spec import Mode
from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
DEFAULT_TIME_EXPONENT = 2.0  # step time ~ length**2 (attention) until two lengths of a mode give the exponent


def device_slug(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def estimated_peak_mb(
    model: str,
    mode: Mode,
    seq_len: int,
    dtype: str,
    chunk: int,
    head_form: str | None = None,
    capture: bool = False,
    logits_chunk: int | None = None,
) -> float | None:
    """The memory model's peak (MiB, weights and gradients included) of ``mode`` at ``seq_len``, stream modes with
    the logit gradient form the step took (``head_form``; None: the two-node form); None for a model that is not a
    named shape (no config is read) and for ``plain`` (which the memory model has no name for). The model holds every
    parameter's gradient through the step (gradients accumulated from an earlier micro-batch). ``capture``: the
    stream step keeps its keys/values from the forward (sized without offload: ``None`` for ``stream+offload``).
    ``logits_chunk``: the logit tile (None: the chunk)."""
    name = canonical_model_name(model)
    if name not in NAMED_MODELS or mode is Mode.PLAIN or (capture and mode is Mode.STREAM_OFFLOAD):
        return None
    setup = mm.StepSetup(
        mode=mode.memory_model_mode,
        dtype_bytes=DTYPE_BYTES[dtype],
        chunk=chunk if mode.streams else None,
        logits_chunk=(logits_chunk or chunk) if mode.streams else None,
        head_form=head_form or "two-node",
        kv_mode="capture" if capture and mode is Mode.STREAM else "recompute",
    )
    return mm.estimate_peak_bytes(mm.ModelShape.from_name(name), setup, seq_len) / 2**20


def _full_length_steps(warmup_seq_len: int | None, repeats: int = 1) -> int:
    """Steps at the measured length in one process: the measured ones, and the warm-up unless it is shorter."""
    return repeats + (0 if warmup_seq_len is not None else 1)


def _time_exponent(pool: list[dict[str, Any]]) -> float:
    """How the step time grows with the length, ``t ~ n**e``, from the two longest lengths in ``pool`` (clamped to
    [1, 2]: linear layers to attention); :data:`DEFAULT_TIME_EXPONENT` with fewer than two lengths."""
    slowest: dict[int, float] = {}
    for r in pool:
        slowest[r["seq_len"]] = max(slowest.get(r["seq_len"], 0.0), r["time_s"])
    if len(slowest) < 2:
        return DEFAULT_TIME_EXPONENT
    (n0, t0), (n1, t1) = sorted(slowest.items())[-2:]
    if t0 <= 0 or t1 <= 0:
        return DEFAULT_TIME_EXPONENT
    return min(max(math.log(t1 / t0) / math.log(n1 / n0), 1.0), 2.0)


def predict_wall_s(
    records: list[dict[str, Any]], mode: Mode, seq_len: int, warmup_seq_len: int | None
) -> float | None:
    """Likely wall-clock seconds of measuring ``mode`` at ``seq_len`` (the whole process), from earlier records'
    ``wall_s``: the one of the same mode (else of any mode) that ran ok at the longest length up to ``seq_len`` (else
    the shortest above), its fixed part (start, model, short warm-up) kept and its full-length steps scaled by
    ``(seq_len / n0) ** e`` (:func:`_time_exponent`). Without an ok record, the longest wall time so far; None
    before the first measurement."""
    timed = [r for r in records if r.get("wall_s") is not None]
    ok = [r for r in timed if r.get("status") == "ok"]
    pool = [r for r in ok if r["mode"] == mode] or ok
    if not pool:
        return max((r["wall_s"] for r in timed), default=None)
    lengths = sorted({r["seq_len"] for r in pool})
    below = [n for n in lengths if n <= seq_len]
    n0 = below[-1] if below else lengths[0]
    ref = max((r for r in pool if r["seq_len"] == n0), key=lambda r: r["wall_s"])
    steps0 = _full_length_steps(ref.get("warmup_seq_len"), ref.get("repeats", 1))
    fixed = max(ref["wall_s"] - steps0 * ref["time_s"], 0.0)
    scale = (seq_len / n0) ** _time_exponent(pool)
    return fixed + _full_length_steps(warmup_seq_len, ref.get("repeats", 1)) * ref["time_s"] * scale


def skip_reason(elapsed_s: float, time_budget_s: float, predicted_s: float | None) -> str | None:
    """Why a measurement is not started (None: start it): the time budget is spent, or the measurement would
    likely end past it."""
    if elapsed_s >= time_budget_s:
        return f"time budget spent ({elapsed_s:.0f} s of {time_budget_s:.0f} s)"
    if predicted_s is not None and elapsed_s + predicted_s > time_budget_s:
        left = time_budget_s - elapsed_s
        return f"would likely pass the time budget (about {predicted_s:.0f} s needed, {left:.0f} s left)"
    return None


def fits(record: dict[str, Any], budget_bytes: float) -> bool:
    """The trial ran and its total peak is within the budget."""
    return record.get("status") == "ok" and record["total_peak_mb"] * 2**20 <= budget_bytes


def bracket(trials: list[dict[str, Any]], budget_bytes: float) -> tuple[int, int | None]:
    """``(longest fit, shortest failure above it)`` of the trials so far (0: none fits; None: none failed). A
    failure ran out of memory or peaked above the budget; a trial that failed otherwise (e.g. timed out) is
    neither."""
    longest = max((t["seq_len"] for t in trials if fits(t, budget_bytes)), default=0)
    failures = [
        t["seq_len"]
        for t in trials
        if t["seq_len"] > longest
        and (t.get("status") == "oom" or t.get("status") == "ok" and not fits(t, budget_bytes))
    ]
    return longest, min(failures, default=None)
