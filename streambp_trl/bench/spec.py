"""What one measurement runs: the measured modes (:class:`Mode`) and the typed spec of a step (:class:`MeasureSpec`).

Modes:

* ``plain``: no checkpointing, Hugging Face's loss over the full logits.
* ``checkpoint``: Hugging Face gradient checkpointing (``use_reentrant=False``), full logits.
* ``checkpoint+chunked-loss``: TRL 1.16's default: checkpointing plus ``trl.trainer.utils.add_fused_lm_head``,
  called with ``fused_lm_head=True``.
* ``stream``: ``enable_streambp(...)``, the same ``fused_lm_head=True`` call.
* ``stream+offload``: the same with the engine option ``offload_checkpoints=True``.

Objectives (:data:`streambp_trl.sizing.memory_model.OBJECTIVES`): ``sft``, ``dpo`` and ``grpo`` (the worker,
:mod:`streambp_trl.bench.worker`, says what each step computes).
"""

from __future__ import annotations

import dataclasses
import json
from enum import Enum

from streambp_trl.sizing.auto import AUTO


class Mode(str, Enum):
    """How a measured step runs; the value is its name on the command lines and in the records."""

    PLAIN = "plain"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_CHUNKED_LOSS = "checkpoint+chunked-loss"
    STREAM = "stream"
    STREAM_OFFLOAD = "stream+offload"

    def __str__(self) -> str:
        return self.value

    @property
    def streams(self) -> bool:
        """The stream engine runs the step."""
        return self in (Mode.STREAM, Mode.STREAM_OFFLOAD)

    @property
    def checkpoints(self) -> bool:
        """Hugging Face gradient checkpointing runs the step."""
        return self in (Mode.CHECKPOINT, Mode.CHECKPOINT_CHUNKED_LOSS)

    @property
    def fused(self) -> bool:
        """The step calls the model with ``fused_lm_head=True`` (no full logits)."""
        return self in (Mode.CHECKPOINT_CHUNKED_LOSS, Mode.STREAM, Mode.STREAM_OFFLOAD)

    @property
    def memory_model_mode(self) -> str:
        """The memory model's name of this mode (:data:`streambp_trl.sizing.memory_model.MODES`), which has no
        ``plain``."""
        if self not in _MEMORY_MODEL_MODES:
            raise ValueError(f"the memory model has no {self.value!r} mode")
        return _MEMORY_MODEL_MODES[self]


_MEMORY_MODEL_MODES = {
    Mode.CHECKPOINT: "hf-gc",
    Mode.CHECKPOINT_CHUNKED_LOSS: "trl-default",
    Mode.STREAM: "stream",
    Mode.STREAM_OFFLOAD: "stream+offload",
}
# The modes of scripts/cpu.py objectives, by its names (its command line and records): TRL's default and stream.
OBJECTIVE_MODES: dict[str, Mode] = {"trl": Mode.CHECKPOINT_CHUNKED_LOSS, "stream": Mode.STREAM}
DTYPES = ("float32", "bfloat16", "float64")
TEMPERATURE = {"sft": 1.0, "dpo": 1.0, "grpo": 0.7}  # of the log-probs each objective computes (GRPO's sampling)


@dataclasses.dataclass(frozen=True)
class MeasureSpec:
    """One measurement: which model, how the step runs and at which length. The worker gets it as JSON
    (:meth:`to_json` / :meth:`from_json`)."""

    mode: Mode
    seq_len: int
    model: str  # a named shape (streambp_trl.sizing.shapes), a Hub name or a local directory (config only)
    device: str  # "cpu" or "cuda"
    dtype: str  # one of DTYPES
    batch_size: int = 1  # sequences of an sft step (dpo and grpo steps score two)
    seed: int = 0  # of the weights; the token ids use seed + 1
    repeats: int = 1  # measured steps after the warm-up (the time is their median, the peak their largest)
    warmup: bool = True  # one step before the measured ones (first-touch pages, lazy initialisation)
    objective: str = "sft"  # one of streambp_trl.sizing.memory_model.OBJECTIVES
    lora: bool = False  # LoRA (rank 16, every linear layer) instead of full fine-tuning
    stream_chunk_size: int | str = AUTO  # stream modes: tokens per chunk, or "auto" (as the trainers)
    logits_chunk_size: int | str | None = None  # stream modes: the logit kernel's tile (None: the chunk)
    kv_mode: str | None = (
        None  # stream modes: one of streambp_trl.sizing.choices.KV_MODES; None: recompute, or planned
    )
    # with ``planned`` (as the trainers leave it)
    keep_every: int = 1  # stream modes: keep only every k-th layer's input
    same_logits_tile: bool = False  # checkpoint+chunked-loss: TRL's fused head takes logits_chunk_size as its tile
    phases: bool = False  # also record each phase's peak and time (streambp_trl.bench.memory_meter.PhaseMarks)
    reserve_bytes: int = 0  # a tensor held through the step like optimizer states, counted with the model
    warmup_seq_len: int | None = None  # the warm-up step's length (fresh random ids); None: seq_len
    memory_budget: str | None = None  # stream modes: enable_streambp's memory_budget ("78GiB"); None: free memory
    planned: bool = False  # stream modes: kept inputs, offload (stream+offload: on) and, with kv_mode None, kept
    # keys/values left to the plan (as the trainers leave them)
    memory_cap: str | None = None  # CUDA: PyTorch's allocator capped at this size, e.g. "78GiB" (an 80 GB card's)
    compile: bool = False  # TrainingArguments' torch_compile=True: the checkpointing modes compile the whole model, as
    # accelerate does; the stream modes their layers' per-chunk bodies (torch_compile=True); plain: the whole model

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.warmup_seq_len is not None and self.warmup_seq_len < 2:
            raise ValueError(f"warmup_seq_len must be at least 2 tokens, got {self.warmup_seq_len}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MeasureSpec:
        return cls(**json.loads(text))
