"""Whether the compute stream waited for a copy, read from a chrome trace of ``torch.profiler`` (tests/test_cuda.py's
offload check; tests/test_trace_waits.py runs it on made-up traces).

A kernel on the compute stream is *ready* once it has been launched by the host (its runtime or driver API call,
tied to it by the correlation id) and the stream's previous kernel has ended. Between ready and its start the stream
has work queued and does nothing: it waits for an event (another stream's copy) or the device's scheduling. The
parts of such waits, beyond a tolerance for the scheduling, that fall while a copy runs are time the compute stream
waited for the copies. A gap where the next kernel was not yet launched is the host's (launch-bound work, the
profiler's overhead): the stream was not waiting for the copy then, whatever the copy did meanwhile.
"""

from __future__ import annotations

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def copy_waits(
    events: list[dict], compute_stream: int, copies: list[tuple[float, float]], tolerance_us: float = 50.0
) -> dict[str, float]:
    """``waited``: microseconds the compute stream sat with a launched kernel, not started, while a copy of
    ``copies`` ((start, end) intervals) ran, each wait less ``tolerance_us``; ``host_bound``: microseconds of gaps
    before kernels not yet launched, during copies (reported, not a wait)."""
    launched = {
        (e.get("args") or {}).get("correlation"): e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and (e.get("args") or {}).get("correlation") is not None
    }
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and (e.get("args") or {}).get("stream") == compute_stream),
        key=lambda e: e["ts"],
    )
    waited = host_bound = 0.0
    previous_end = None
    for k in kernels:
        start = k["ts"]
        if previous_end is not None and start > previous_end:
            launch = launched.get(k["args"].get("correlation"))
            ready = previous_end if launch is None else max(previous_end, launch)
            waited += _inside((ready + tolerance_us, start), copies)
            host_bound += _inside((previous_end, min(ready, start)), copies)
        previous_end = max(previous_end or start, start + k["dur"])
    return {"waited": waited, "host_bound": host_bound}


def _inside(span: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """Length of ``span`` covered by ``intervals`` (disjoint: the copies run one after another on their stream)."""
    start, end = span
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals) if end > start else 0.0
