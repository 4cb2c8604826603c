"""``gpu.py profile``'s reading of one profiled step's chrome trace (``torch.profiler``'s ``export_chrome_trace``):
the kernels' time by kind, by engine phase (each launch attributed to the innermost ``sbp/`` span open on its host
thread) and by name, the GPU's busy time over the step, and the host's launches, synchronising calls and operators."""

from __future__ import annotations

import bisect
import collections
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def kernel_kind(name: str) -> str:
    """A kernel's kind, from its name."""
    low = name.lower()
    if any(k in low for k in ("flash", "fmha", "attention", "mem_eff")):
        return "attention"
    if any(k in low for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul")):
        return "matmul"
    if "memcpy" in low or "copy" in low:
        return "copy"
    if "memset" in low or "fill" in low:
        return "fill"
    if any(k in low for k in ("reduce", "softmax", "norm", "sum")):
        return "reduction"
    if any(k in low for k in ("elementwise", "vectorized", "unrolled", "pointwise", "triton")):
        return "elementwise"
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse_trace(trace: dict[str, Any], step_name: str = "profiled_step") -> dict[str, Any]:
    """The figures of one profiled step from its chrome trace (``export_chrome_trace``'s JSON)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    step = next((e for e in events if e.get("name") == step_name), None)
    t0, t1 = (step["ts"], step["ts"] + step["dur"]) if step else (float("-inf"), float("inf"))
    annotations: dict[Any, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("sbp/"):
            annotations[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"][4:]))
    starts = {tid: sorted(v) for tid, v in annotations.items()}
    launch_phase: dict[Any, str] = {}
    launches, syncs = 0, collections.Counter()
    for e in events:
        # launches through the runtime API (cudaLaunchKernel) and the driver API (cuLaunchKernelEx: cuBLAS's and
        # cuDNN's kernels), each tied to its kernel by the correlation id
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or not t0 <= e["ts"] <= t1:
            continue
        name = str(e.get("name", ""))
        if "Launch" in name:
            launches += 1
        if any(name.startswith(s.strip()) and (s != "cudaMemcpy " or name == "cudaMemcpy") for s in SYNC_CALLS):
            syncs[name] += 1
        corr = (e.get("args") or {}).get("correlation")
        if corr is None:
            continue
        spans = starts.get(e.get("tid"), [])
        i = bisect.bisect_right(spans, (e["ts"], float("inf"), ""))
        inner = None
        for _a, b, label in reversed(spans[:i]):  # innermost open span: the latest start that still covers ts
            if b >= e["ts"]:
                inner = label
                break
        launch_phase[corr] = inner or "outside"
    by_kind: dict[str, float] = collections.Counter()
    by_phase: dict[str, float] = collections.Counter()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    count = 0
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or not t0 <= e["ts"] <= t1:
            continue
        count += 1
        dur = float(e["dur"])
        name = str(e.get("name", ""))
        kind = "copy" if e["cat"] == "gpu_memcpy" else "fill" if e["cat"] == "gpu_memset" else kernel_kind(name)
        by_kind[kind] += dur
        by_phase[launch_phase.get((e.get("args") or {}).get("correlation"), "outside")] += dur
        by_name[name[:120]][0] += dur
        by_name[name[:120]][1] += 1
        intervals.append((e["ts"], e["ts"] + dur))
    ops = collections.Counter(str(e["name"]) for e in events if e.get("cat") == "cpu_op" and t0 <= e["ts"] <= t1)
    span_us = (t1 - t0) if step else None
    busy = _union(intervals)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "step_span_ms": span_us / 1e3 if span_us is not None else None,
        "kernels": count,
        "kernel_ms": sum(by_kind.values()) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_share": busy / span_us if span_us else None,
        "kernel_ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_ms_by_phase": {k: v / 1e3 for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "ms": t / 1e3, "count": c} for n, (t, c) in top],
        "launches": launches,
        "sync_calls": dict(syncs),
        "cpu_ops": sum(ops.values()),
        "top_cpu_ops": ops.most_common(25),
    }
