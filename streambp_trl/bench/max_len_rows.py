"""The rows of ``streambp-trl max-len``: its modes with their labels, the cards it estimates for, and each row's
step setup for the memory model."""

from __future__ import annotations

import argparse
from typing import Any

from streambp_trl.sizing import memory_model as mm
from streambp_trl.sizing import optimizers
from streambp_trl.sizing.lengths import max_len

from .plans import stream_row
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
# --optimizer: TrainingArguments' optim names whose state the memory model sizes (streambp_trl.sizing.optimizers),
# max-len's earlier spellings adamw / adamw-8bit, and none (the forward+backward alone); TRL's default by default
OPTIMIZER_CHOICES = (*optimizers.OPTIMIZERS, *optimizers.ALIASES)
DEFAULT_OPTIMIZER = optimizers.DEFAULT
ZERO3_OFFLOAD_CONFIG = "configs/accelerate/zero3_offload.yaml"
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


def quantized(args: argparse.Namespace) -> str | None:
    """The base weights' storage ``--load-in-4bit`` / ``--load-in-8bit`` ask for (:data:`memory_model.QUANTIZED`)."""
    if getattr(args, "load_in_4bit", False):
        return "4bit-nested" if getattr(args, "use_bnb_nested_quant", False) else "4bit"
    return "8bit" if getattr(args, "load_in_8bit", False) else None


def training(args: argparse.Namespace) -> str:
    """What is trained, in words: ``full fine-tuning``, ``LoRA`` or ``QLoRA (4-bit base)``."""
    kind = quantized(args)
    if kind is not None:
        return f"QLoRA ({'8-bit' if kind == '8bit' else '4-bit'} base)"
    return "LoRA" if args.lora else "full fine-tuning"


def row_setup(mode: str, args: argparse.Namespace) -> mm.StepSetup:
    stream = ROWS[mode][0].streams
    kind = quantized(args)
    return mm.StepSetup(
        mode=mode,
        objective=args.objective,
        lora=args.lora or kind is not None,
        dtype_bytes=4 if args.dtype == "float32" else 2,
        chunk=args.chunk if stream else None,
        logits_chunk=(args.logits_chunk or args.chunk) if stream else None,
        optimizer=args.optimizer,
        optimizer_offload=getattr(args, "offload_optimizer", False),
        quantized=kind,
        keep_every=(args.keep_every or 1) if stream else 1,
        # (under ZeRO-3 across several GPUs each layer's gradients are partitioned once formed: counted as sharded)
        pending_grads=stream and args.gradient_accumulation_steps == 1 and args.gpus == 1,
        gpus=args.gpus if stream else 1,
    )


# what would fit where a recipe fits at no length: (words, the arguments changed)
ALTERNATIVES = (
    ("8-bit AdamW (--optimizer adamw_8bit)", {"optimizer": "adamw_8bit"}),
    (
        f"the optimizer state in host memory (--offload-optimizer: ZeRO-3 offload, {ZERO3_OFFLOAD_CONFIG})",
        {"offload_optimizer": True},
    ),
    ("LoRA (--lora)", {"lora": True}),
    ("QLoRA (--load-in-4bit)", {"lora": True, "load_in_4bit": True, "load_in_8bit": False}),
)


def alternatives(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """The recipes of :data:`ALTERNATIVES` that differ from ``args``' own, each as its arguments (the rest kept)."""
    own = row_setup("stream", args)
    found = []
    for words, changes in ALTERNATIVES:
        other = argparse.Namespace(**{**vars(args), **changes})
        if row_setup("stream", other) != own:
            found.append((words, other))
    return found


def human(n_bytes: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n_bytes >= mm.UNITS[unit.lower()]:
            return f"{n_bytes / mm.UNITS[unit.lower()]:.2f} {unit}"
    return f"{n_bytes:.0f} bytes"


def instead(args: argparse.Namespace, shape: mm.ModelShape, budget: int) -> list[dict[str, Any]]:
    """Where no mode fits: each other recipe (:func:`alternatives`) with the longest length it fits by the same
    memory model, streamed (the stream row's: what ``stream_chunk_size="auto"`` runs without offload) and with TRL's
    default."""
    found = []
    for words, other in alternatives(args):
        streamed = stream_row(shape, row_setup("stream", other), budget, 0, False, other.keep_every, args.step)
        trl = max_len(shape, row_setup("trl-default", other), budget, step=args.step)
        found.append({"recipe": words, "stream": streamed["max_len"], "trl-default": trl})
    return found
