"""The stream options every ``Stream*Config`` adds to its TRL config."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from ..engine.options import AUTO, StreamOptions
from ..sizing.choices import KV_MODES


def _from_text(value):
    """A chunk size as YAML or the command line give it: ``"512"`` is the int 512; anything else as it is (the
    options say whether it is valid)."""
    return int(value) if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value) else value


@dataclass
class StreamArguments:
    """Options of the stream engine (see ``streambp_trl.enable_streambp``).

    Parameters:
        stream_chunk_size (`int` or `"auto"`, defaults to `"auto"`):
            Tokens per chunk of each decoder layer's streamed forward and backward. `"auto"` chooses, for each batch
            shape, the chunk of the plan of least predicted time (chunk, kept layer inputs, offload, keys/values)
            whose predicted peak fits `memory_budget` (or the GPU's free memory), from the engine's memory model
            (`streambp_trl.sizing`); on the CPU the host memory available.
        logits_chunk_size (`int`, `"auto"` or `None`, defaults to `None`):
            Tokens per tile of the chunked logit kernel; `None` or `"auto"` uses the stream chunk size.
        stream_kv_mode (`str` or `None`, defaults to `None`):
            How each layer's backward gets its keys/values: `"recompute"` them from the saved layer input, or
            `"capture"` them during the forward (no key/value pass in backward, 2 x kv_dim values per token per
            attention layer kept). `None`: each batch shape's plan captures them where they fit.
        offload_checkpoints (`bool` or `None`, defaults to `None`):
            Keep each layer's saved input in pinned host memory between forward and backward (brought back one layer
            ahead, copies overlapped with compute): GPU memory then grows by a few hidden vectors per token instead of
            one per layer, for host memory of layers x hidden x 2 bytes per token. `None`: each batch shape's plan
            turns it on where the layer inputs do not fit the GPU and the host has the memory. TRL's
            `activation_offloading=True` turns it on; `False` beside it is refused as contradictory.
        memory_budget (`str` or `None`, defaults to `None`):
            GPU memory the step may use, for each batch shape's plan, a size with its unit: `"78GiB"`, `"80GB"`,
            `"512MiB"` (a bare number such as `80` is refused); `None`: the GPU's free memory. A step predicted to
            exceed it is refused before it runs, whatever the other options fix.
        stream_keep_every (`int` or `None`, defaults to `None`):
            Keep only the first input of every `stream_keep_every` consecutive decoder layers (on the GPU, or in host
            memory with `offload_checkpoints`); the layers between rebuild theirs in backward by one more chunked
            forward. Divides the kept inputs (and the host memory of offload) by about k, for k - 1 extra layer
            forwards out of every k. Not with FSDP or DeepSpeed ZeRO-3. `None`: each batch shape's plan keeps every
            input where they fit, else rebuilds the fewest that make the step fit.
        stream_keep_activations (`int` or `None`, defaults to `None`):
            How many of the top decoder layers keep their activations from the forward, so their backward recomputes
            nothing: about a quarter of those layers' step saved, for one layer's full-length activations held per
            layer, bit-identical gradients. Not with `stream_keep_every` > 1, FSDP or DeepSpeed ZeRO-3. `None`: each
            batch shape's plan keeps as many as the memory leaves room for.
        stream_keep_attention (`bool` or `None`, defaults to `None`):
            Each decoder layer that recomputes keeps its attention outputs (and log-sum-exps) from the forward, so its
            recompute in backward skips the attention kernels, the quadratic part of a long sequence: query heads x
            head_dim values per token per layer, the same gradients bit for bit. `None`: each batch shape's plan
            keeps them where they fit.
        activation_checkpointing (`bool`, defaults to `True`):
            TRL's default (which TRL writes as the deprecated `gradient_checkpointing=True`, a FutureWarning on every
            config), under the current name. A stream trainer takes it over: the engine checkpoints and streams every
            decoder layer itself, and Hugging Face's own checkpointing is turned off in the trainer's copy of the
            config. Setting `gradient_checkpointing` still works, with transformers' deprecation warning.
    """

    # `int | str`: the `streambp-trl` parser reads it as given (TRL's parser would take every value for an int)
    stream_chunk_size: int | str = field(
        default=AUTO,
        metadata={
            "help": "Tokens per chunk of each streamed decoder layer: an int, or 'auto' (default): per batch shape, "
            "the plan of least predicted time (chunk, kept layer inputs, offload, keys/values) whose predicted peak "
            "fits memory_budget (or the GPU's free memory, or on the CPU the host memory available)."
        },
    )
    logits_chunk_size: int | str | None = field(
        default=None,
        metadata={"help": "Tokens per tile of the logit kernel: an int or 'auto' (default: the stream chunk size)."},
    )
    stream_kv_mode: str | None = field(
        default=None,
        metadata={
            "help": f"Keys/values for backward: {' or '.join(map(repr, KV_MODES))} (default: each batch shape's plan "
            "captures them where they fit)."
        },
    )
    offload_checkpoints: bool | None = field(
        default=None,
        metadata={
            "help": "Keep each layer's saved input in pinned host memory between forward and backward (default: "
            "where each batch shape's plan needs it)."
        },
    )
    memory_budget: str | None = field(
        default=None,
        metadata={
            "help": "GPU memory for 'auto' chunk sizes, with its unit: '78GiB', '80GB', '512MiB' (a bare number is "
            "refused) (default: the GPU's free memory)."
        },
    )
    stream_keep_every: int | None = field(
        default=None,
        metadata={
            "help": "Keep only every k-th decoder layer's input; the others are recomputed in backward (default: "
            "chosen by each batch shape's plan)."
        },
    )
    stream_keep_activations: int | None = field(
        default=None,
        metadata={
            "help": "How many top decoder layers keep their activations from the forward, not recomputed in backward "
            "(default: as many as each batch shape's plan has room for)."
        },
    )
    stream_keep_attention: bool | None = field(
        default=None,
        metadata={
            "help": "Keep each layer's attention outputs from the forward, so the backward's recompute skips the "
            "attention kernels (default: where each batch shape's plan has room)."
        },
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Hugging Face activation checkpointing (default: on, as in TRL); a stream trainer takes it over: "
            "the engine checkpoints and streams every decoder layer itself.",
            "nargs": "?",
            "const": True,
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of `activation_checkpointing` (transformers).",
            "nargs": "?",
            "const": True,
        },
    )

    def __post_init__(self):
        self.stream_chunk_size = _from_text(self.stream_chunk_size)
        self.logits_chunk_size = _from_text(self.logits_chunk_size)
        self.to_options()  # every option is checked there, once
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default, without the deprecated name
        super().__post_init__()

    def to_options(self, **engine_options) -> StreamOptions:
        """The engine options of this config, with ``engine_options`` (those a trainer sets itself: the sampling
        ``temperature``, ``fused_outputs``, ``stream_eval``)."""
        return StreamOptions(
            stream_chunk_size=self.stream_chunk_size,
            logits_chunk_size=self.logits_chunk_size,
            kv_mode=self.stream_kv_mode,
            offload_checkpoints=checkpoint_offload(
                getattr(self, "activation_offloading", False), self.offload_checkpoints
            ),
            memory_budget=self.memory_budget,
            keep_every=self.stream_keep_every,
            keep_activations=self.stream_keep_activations,
            keep_attention=self.stream_keep_attention,
            **compile_options(self),
            **engine_options,
        )


# the options a Stream*Config adds to TRL's (the others re-declare TrainingArguments' checkpointing fields)
STREAM_FIELDS = tuple(f.name for f in fields(StreamArguments) if f.name not in TrainingArguments.__dataclass_fields__)


def checkpoint_offload(activation_offloading: bool, offload_checkpoints: bool | None) -> bool | None:
    """The engine's ``offload_checkpoints`` of a config: as set, or on where TRL's ``activation_offloading=True`` asks
    for offload (the engine's: each layer's saved input, the only activation it keeps per layer, in host memory).
    ``offload_checkpoints=False`` beside it is refused: neither setting can win without ignoring the other."""
    if not activation_offloading:
        return offload_checkpoints
    if offload_checkpoints is False:
        raise ValueError(
            "offload_checkpoints=False contradicts activation_offloading=True (which is the stream engine's "
            "offload_checkpoints=True): set activation_offloading=False to keep the layer inputs on the GPU, or leave "
            "offload_checkpoints unset to offload them."
        )
    return True


def stream_options(args, **engine_options) -> StreamOptions:
    """The engine options of a trainer's config as the user gave it: a ``Stream*Config``'s own, or the defaults for
    TRL's configs, with TRL's ``activation_offloading`` read by :func:`checkpoint_offload`."""
    if isinstance(args, StreamArguments):
        return args.to_options(**engine_options)
    offload = checkpoint_offload(getattr(args, "activation_offloading", False), None)
    compiling = compile_options(args)
    return StreamOptions(stream_chunk_size=AUTO, offload_checkpoints=offload, **compiling, **engine_options)


def compile_options(args) -> dict:
    """The engine's compile options of a config: TrainingArguments' ``torch_compile``, ``torch_compile_backend`` and
    ``torch_compile_mode``, which the engine honours for each layer's per-chunk body
    (:mod:`streambp_trl.layers.compiled`)."""
    return {
        "torch_compile": bool(getattr(args, "torch_compile", False)),
        "torch_compile_backend": getattr(args, "torch_compile_backend", None),
        "torch_compile_mode": getattr(args, "torch_compile_mode", None),
    }
