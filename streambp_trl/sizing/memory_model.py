"""The memory model of one training step: peak GPU bytes as a function of the model's shape and the length.

(Work in progress: the interface is fixed, the terms are being refined against ``../shared/cudasim``.)
"""

from __future__ import annotations

import dataclasses

MODES = ("hf-gc", "trl-default", "stream", "stream+offload")
OBJECTIVES = ("sft", "dpo", "grpo")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer step depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    tied: bool = False

    @classmethod
    def from_config(cls, config) -> ModelShape:
        raise NotImplementedError

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        """A preset (``qwen3-4b``, ``qwen3-8b``, ``qwen3-14b``), a local config path, or a Hub model id."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """How the step runs. ``chunk``/``logits_chunk`` ``None``: chosen automatically (stream modes)."""

    mode: str = "stream"
    objective: str = "sft"
    lora: bool = False
    dtype_bytes: int = 2
    chunk: int | None = None
    logits_chunk: int | None = None
    optimizer_bytes_per_param: int = 0  # e.g. 8 for AdamW's two float32 moments of every trainable parameter


def estimate_peak_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Peak GPU bytes (``torch.cuda.max_memory_allocated``) of one step at ``seq_len`` tokens per sequence."""
    raise NotImplementedError


def estimate_host_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Pinned host bytes the step holds (the offloaded checkpoints; 0 without offload)."""
    raise NotImplementedError


def max_len(shape: ModelShape, setup: StepSetup, budget_bytes: int, step: int = 1024) -> int:
    """Longest multiple of ``step`` whose estimated peak fits in ``budget_bytes`` (0 if none does)."""
    raise NotImplementedError


def auto_chunk_sizes(shape: ModelShape, seq_len: int, budget_bytes: int, offload: bool) -> tuple[int, int]:
    """``(stream_chunk_size, logits_chunk_size)`` for ``seq_len`` within ``budget_bytes``."""
    raise NotImplementedError
