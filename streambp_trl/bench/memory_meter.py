"""Peak memory of a measured step, in the worker process.

* CPU: the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then returns large frees to the OS, so peak
  RSS tracks live tensors); the kernel's peak-RSS counter is reset (``5`` into ``/proc/self/clear_refs``) and
  ``VmRSS`` is the baseline; ``peak = VmHWM - baseline``.
* CUDA: ``reset_peak_memory_stats``, baseline ``memory_allocated``, ``peak = max_memory_allocated - baseline``;
  the host's peak RSS above its baseline is recorded too (``host_peak_mb``: offloaded checkpoints).

:class:`PhaseMarks` splits the step into phases (forward, head backward, each layer's backward, the rest) and
records each one's peak and duration.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any


def read_status_kib(field: str) -> int:
    """A ``kB`` field (e.g. ``VmRSS``, ``VmHWM``) of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


class MemoryMeter:
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

    def __init__(self, model: Any, meter: MemoryMeter) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.meter = meter
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

        if self.meter.device.type == "cuda":
            torch.cuda.synchronize(self.meter.device)
        now = time.perf_counter()
        self.phases.append(
            {"phase": name, "peak_mb": self.meter.peak_above_baseline() / 2**20, "time_s": now - self.start}
        )
        self.meter.reset_peak()
        self.start = time.perf_counter()
