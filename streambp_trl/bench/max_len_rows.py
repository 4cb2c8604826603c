"""The rows of ``streambp-trl max-len``: its modes with their labels, the cards it estimates for, and each row's
step setup for the memory model."""

from __future__ import annotations

import argparse

from streambp_trl.sizing import memory_model as mm

from .spec import Mode

_LABELS = {
    Mode.CHECKPOINT: "HF gradient checkpointing",
    Mode.CHECKPOINT_CHUNKED_LOSS: "TRL's default (checkpointing + fused LM head)",
    Mode.STREAM: "stream (streambp-trl)",
    Mode.STREAM_OFFLOAD: "stream + checkpoint offload",
}
# a row by its memory-model name (the --mode choices, the rows of the output) -> (its measured mode, its label)
ROWS: dict[str, tuple[Mode, str]] = {mode.memory_model_mode: (mode, label) for mode, label in _LABELS.items()}
OFFLOAD_ROW = Mode.STREAM_OFFLOAD.memory_model_mode  # the row --offload adds to a measured run
OPTIMIZER_BYTES = {"none": 0, "adamw": 8, "adamw-8bit": 2}  # state bytes per trainable parameter
# cards by the memory their makers state ("80 GB", "141 GB"), which is GiB: an H100's 80 GB is 80 GiB, of which
# nvidia-smi shows 79.6; an H200's 141 GB shows 140.4
GPUS = {"a100-40gb": 40, "a100-80gb": 80, "h100": 80, "h200": 141}
CUDA_RESERVE_GIB = 2  # what a step cannot have of a card: the CUDA context and library workspaces
DEFAULT_GPU = "h100"


def gpu_budget(card: str) -> str:
    """The memory a training step may use on ``card``: its stated size less :data:`CUDA_RESERVE_GIB`, as a size
    (``"h100"``: ``"78GiB"``, ``"h200"``: ``"139GiB"``)."""
    return f"{GPUS[card] - CUDA_RESERVE_GIB}GiB"


DEFAULT_GPU_MEMORY = gpu_budget(DEFAULT_GPU)


def row_label(mode: str, args: argparse.Namespace) -> str:
    measured_mode, label = ROWS[mode]
    if measured_mode.streams and (args.keep_every or 1) > 1:
        label += f", keep_every={args.keep_every}"
    return label


def row_setup(mode: str, args: argparse.Namespace) -> mm.StepSetup:
    stream = ROWS[mode][0].streams
    return mm.StepSetup(
        mode=mode,
        objective=args.objective,
        lora=args.lora,
        dtype_bytes=4 if args.dtype == "float32" else 2,
        chunk=args.chunk if stream else None,
        logits_chunk=(args.logits_chunk or args.chunk) if stream else None,
        optimizer_bytes_per_param=OPTIMIZER_BYTES[args.optimizer],
        keep_every=(args.keep_every or 1) if stream else 1,
        pending_grads=stream and args.gradient_accumulation_steps == 1,
    )


def human(n_bytes: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n_bytes >= mm.UNITS[unit.lower()]:
            return f"{n_bytes / mm.UNITS[unit.lower()]:.2f} {unit}"
    return f"{n_bytes:.0f} bytes"
