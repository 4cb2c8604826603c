"""Measure one training step for real: peak memory and time, each (mode, length) in a fresh process.

This is the measuring code shared by ``streambp-trl max-len`` (its real bisection) and ``scripts/cpu.py bp`` /
``scripts/cpu.py objectives``. A :class:`~streambp_trl.bench.spec.MeasureSpec` names the model, the mode and the
length; :func:`measure` runs it in a fresh ``python`` process (the worker, :mod:`streambp_trl.bench.worker`, run as
a script, which prints one JSON line back), so no allocator cache, peak counter or patched model leaks between
measurements. On the CPU the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then returns large frees to
the OS, so peak RSS tracks live tensors). An out-of-memory error (or a child killed by the OS) gives
``status: "oom"``. :func:`bisect_max_len` finds the longest length that fits from such measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import worker
from .metadata import PACKAGE_ROOT
from .spec import MeasureSpec


def measure(spec: MeasureSpec, timeout: float | None = None, *, log: bool = True) -> dict[str, Any]:
    """Run ``spec`` in a fresh process; returns its record (status "ok", "oom", or "error" if the child failed).

    ``log`` prints a line per measurement on stderr.
    """
    cmd = [sys.executable, str(Path(worker.__file__).resolve()), spec.to_json()]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    if spec.device == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    label = f"mode={spec.mode} seq_len={spec.seq_len}"
    say = (lambda text: print(f"[measure] {text}", file=sys.stderr, flush=True)) if log else (lambda text: None)
    say(f"{label} ...")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        record = {"status": "error", "error": f"timed out after {timeout} s"}
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith(worker.RESULT_PREFIX)]
        if proc.returncode == 0 and lines:
            record = json.loads(lines[-1][len(worker.RESULT_PREFIX) :])
        else:
            tail = proc.stderr.strip().splitlines()[-15:]
            killed = proc.returncode in (-9, 137)
            oom = killed or (proc.returncode != 0 and "out of memory" in proc.stderr.lower())
            why = "killed by the OS (out of memory?)" if killed else "\n".join(tail)
            record = {"status": "oom" if oom else "error", "returncode": proc.returncode, "error": why[-2000:]}
            say(f"{label} failed (rc={proc.returncode}):\n" + "\n".join(tail))
    for key in ("mode", "seq_len", "batch_size", "dtype", "model"):
        record.setdefault(key, getattr(spec, key))
    if record["status"] == "ok":
        say(f"{label}: peak {record['peak_mb']:.1f} MiB, {record['time_s']:.2f} s, loss {record['loss']:.6f}")
    return record


def bisect_max_len(
    trial: Callable[[int], float | None],
    *,
    step: int = 1024,
    budget: float | None = None,
    target: float | None = None,
    start: int | None = None,
    limit: int = 1 << 22,
    progress: Callable[[int, bool], None] | None = None,
) -> tuple[int, int | None, dict[int, float | None]]:
    """Longest multiple of ``step`` (up to ``limit``) that fits; returns ``(best, first_failure, trials)``.

    ``trial(n)`` runs length ``n`` and returns its peak (any unit, the ``budget``'s) or ``None`` when it ran out
    of memory. ``n`` fits when it ran and, with a ``budget``, its peak is within it. Memory grows about linearly
    with the length, so the next length is the linear interpolation (or extrapolation, at most 8x) of the peaks
    measured so far to ``target`` (default: the budget; e.g. the GPU's memory when running out of it decides);
    without either, doubling then halving the bracket. ``start``: the
    first length to try (e.g. an estimate). ``best`` is 0 when not even ``step`` fits; ``first_failure`` is None
    when ``limit`` fits. ``progress(n, fits)`` is called after every trial.
    """
    trials: dict[int, float | None] = {}
    target = budget if target is None else target
    lo, hi = 0, None  # longest known to fit, shortest known not to
    top = limit // step * step

    def snap(n: float) -> int:
        upper = (hi - step) if hi is not None else top
        return int(min(max(n // step * step, lo + step), upper))

    n, outcomes = snap(start if start else step), []
    while n > lo and (hi is None or n < hi):
        peak = trial(n)
        trials[n] = peak
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
        known = sorted((k, v) for k, v in trials.items() if v is not None)
        guess = None
        # interpolate unless, inside a bracket, the last two trials fell on the same side (then halve it)
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
    return lo, hi, trials
