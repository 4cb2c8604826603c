"""Records of the CUDA simulator (``../shared/cudasim``, run by ``scripts/sim.py grid``) in the memory model's terms.

The simulator names its modes ``gc`` (Hugging Face checkpointing), ``gc+fused`` (TRL's default) and ``streambp``
(:data:`SIMULATOR_MODES`); a record's ``stream_kwargs`` are the engine options of a ``streambp`` run, its ``chunk``
and ``logits_chunk`` the chunk sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from streambp_trl.sizing import memory_model as mm

from .spec import Mode

SIMULATOR_MODES: dict[str, Mode] = {
    "gc": Mode.CHECKPOINT,
    "gc+fused": Mode.CHECKPOINT_CHUNKED_LOSS,
    "streambp": Mode.STREAM,
}


def record_mode(record: dict[str, Any]) -> Mode:
    """The mode a simulator record ran: ``streambp`` with ``offload_checkpoints`` is ``stream+offload``."""
    mode = SIMULATOR_MODES[record["mode"]]
    if mode is Mode.STREAM and (record.get("stream_kwargs") or {}).get("offload_checkpoints"):
        return Mode.STREAM_OFFLOAD
    return mode


def record_shape(record: dict[str, Any]) -> mm.ModelShape:
    """The simulator's model: its embedding and head are separate tensors even for Qwen3-4B (``to_empty`` unties
    them), so they are counted untied: the named shape's parameters and, where it ties them, one more vocabulary x
    hidden matrix (a recount from the shape's formula would miss what only the model's own count holds, such as
    the Qwen3.5 attention's output gate)."""
    shape = mm.ModelShape.from_name(record["model"])
    untied = shape.params + (shape.vocab * shape.hidden if shape.tied else 0)
    return dataclasses.replace(shape, tied=False, params=untied)


def record_setup(record: dict[str, Any]) -> mm.StepSetup:
    """The memory model's setup of a simulator record (``grads_ready``: the parameter gradients are allocated before
    the step, else the backward forms them, the memory model's ``pending_grads``; ``lora``: rank-16 LoRA on every
    linear layer)."""
    mode, lora = record_mode(record), bool(record.get("lora"))
    if not mode.streams:
        return mm.StepSetup(mode=mode.memory_model_mode, lora=lora)
    kwargs = record.get("stream_kwargs") or {}
    return mm.StepSetup(
        mode=mode.memory_model_mode,
        lora=lora,
        chunk=record.get("chunk"),
        logits_chunk=record.get("logits_chunk"),
        keep_every=kwargs.get("keep_every", 1),
        pending_grads=record.get("grads_ready") is False,
        kv_mode=kwargs.get("kv_mode") or "recompute",
        keep_activations=kwargs.get("keep_activations") or 0,
        keep_attention=bool(kwargs.get("keep_attention")),
    )


def estimate_peak_gib(record: dict[str, Any]) -> float:
    """The memory model's peak (GiB) for a simulator record."""
    return mm.gib(mm.estimate_peak_bytes(record_shape(record), record_setup(record), record["seq_len"]))
