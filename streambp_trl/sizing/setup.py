"""How a training step runs (:class:`StepSetup`) and what it holds beside its activations (:func:`static_bytes`): the
weights (quantized ones at their stored size), the parameter gradients, LoRA adapters and the optimizer's state
(:mod:`.optimizers`); and the optimizer step's own moment (:func:`optimizer_step_bytes`). Part of the memory model
(:mod:`.memory_model`, which exports these names).

Quantized base weights (bitsandbytes through transformers' ``BitsAndBytesConfig``, :data:`QUANTIZED`), the layers'
linear weights stored as

* ``4bit`` (NF4 or FP4): two weights a byte and a float32 absmax per block of 64, ``0.5 + 4/64`` bytes a weight;
  ``4bit-nested`` (``bnb_4bit_use_double_quant``, TRL's ``use_bnb_nested_quant``): the absmax quantized to a byte
  with a float32 absmax of its own per 256 blocks, ``0.5 + 1/64 + 4/(64 x 256)``;
* ``8bit`` (LLM.int8): a byte a weight and a float32 scale per output row.

The embedding (an ``nn.Embedding``, never replaced) and the LM head (transformers leaves the output embeddings
unquantized: ``llm_int8_skip_modules`` defaults to them; a tied head is the embedding) stay in the compute dtype;
the decoder layers' norms, counted with the quantized weights, are 0.004% of Qwen3-8B. Each quantized linear layer's
forward and backward dequantize its weight into the compute dtype, one layer at a time: the widest such weight
(``hidden x intermediate``, 96 MiB for Qwen3-8B in bfloat16) is counted as held through the step, an upper bound by
that much. TRL casts the adapters of a quantized model to bfloat16 (its trainers, following the QLoRA paper), so
their gradients and optimizer state are 2-byte; beside an unquantized half-precision base PEFT keeps them float32.
``prepare_model_for_kbit_training``, which TRL's trainers do not call, would also cast the embedding, the head and the
norms to float32 (2 more bytes each: 2.3 GiB for Qwen3-8B's untied head and embedding): not counted.
"""

from __future__ import annotations

import dataclasses
import math

from ..logits.forms import HeadForm
from . import optimizers
from .choices import CHUNKS, NO_MASKS, KVMode, MaskBlocks, StepPlan, Trained
from .layout import Layout
from .model_shape import ModelShape

MODES = ("hf-gc", "trl-default", "stream", "stream+offload")
OBJECTIVES = ("sft", "dpo", "grpo")
LORA_RANK = 16
_ADAPTER_BYTES = 4  # PEFT keeps LoRA adapters in float32 beside a half-precision base (autocast_adapter_dtype)
_QUANTIZED_ADAPTER_BYTES = 2  # TRL casts a quantized model's adapters to bfloat16
# bytes a quantized linear weight takes (its scales included; 8-bit's per-row scale is added per output row)
QUANTIZED = {"4bit": 0.5 + 4 / 64, "4bit-nested": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """How the step runs. ``chunk``/``logits_chunk`` ``None`` (stream modes): the smallest chunk of
    :data:`~.memory_model.CHUNKS`, which ``"auto"`` takes at the longest lengths a budget allows. ``optimizer``: the
    ``TrainingArguments.optim`` whose state the step holds (:mod:`.optimizers`; ``"none"``: the forward+backward
    alone), ``optimizer_offload``: that state in host memory (DeepSpeed's ``offload_optimizer``), none on the device.
    ``quantized``: the base weights' storage (:data:`QUANTIZED`; LoRA adapters are then what is trained).
    ``gpus``: each sequence split across that many GPUs (:mod:`streambp_trl.layers.sequence_split`; stream modes),
    the weights, gradients and optimizer state sharded across them by ZeRO-3 (:func:`static_bytes`); the activations
    are the last GPU's share's (:func:`~.stream_step.estimate_activation_bytes`' ``ranks``)."""

    mode: str = "stream"
    objective: str = "sft"
    lora: bool = False
    dtype_bytes: int = 2
    chunk: int | None = None
    logits_chunk: int | None = None
    optimizer: str = "none"
    keep_every: int = 1  # stream modes: only every k-th layer keeps its input (streambp_trl.layers.kept.segments)
    drop: int = 0  # stream modes: layers below the top one whose input is rebuilt (.layout.Layout)
    head_form: HeadForm = HeadForm.TWO_NODE  # stream modes: the logit kernel's gradient form, as the engine chose it
    # stream modes: no parameter gradient is allocated when the step starts (a trainer's zero_grad(set_to_none=True)
    # between optimizer steps, every micro-step with gradient_accumulation_steps=1): each is counted from the moment
    # the backward forms it (estimate_activation_bytes' pending_grads), not beside the whole step
    pending_grads: bool = False
    kv_mode: KVMode = KVMode.RECOMPUTE  # stream modes: how each layer's backward gets its keys/values
    keep_activations: int = 0  # stream modes: top layers that keep their activations from the forward
    keep_attention: bool = False  # stream modes: the other layers keep their attention outputs from the forward
    optimizer_offload: bool = False
    quantized: str | None = None
    gpus: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}.")
        for name, kind in (("head_form", HeadForm), ("kv_mode", KVMode)):
            if getattr(self, name) not in tuple(kind):
                raise ValueError(f"{name} must be one of {tuple(map(str, kind))}, got {getattr(self, name)!r}.")
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.quantized is not None and (self.quantized not in QUANTIZED or not self.lora):
            raise ValueError(f"quantized must be one of {tuple(QUANTIZED)}, with lora=True; got {self.quantized!r}.")
        object.__setattr__(self, "optimizer", optimizers.canonical(self.optimizer))
        if self.gpus < 1 or (self.gpus > 1 and not self.mode.startswith("stream")):
            raise ValueError(f"gpus > 1 (a sequence split) is a stream mode's, got gpus={self.gpus} in {self.mode}.")

    @property
    def rows(self) -> int:
        """Sequences per micro-batch: DPO scores the chosen and the rejected completion together."""
        return 2 if self.objective == "dpo" else 1

    @property
    def masks(self) -> MaskBlocks:
        """The attention mask blocks the step's layers build: DPO's over the whole prefix (the chosen and the rejected
        completion are padded to the longer), none for one row of the other objectives (a Qwen3 shape has no
        sliding-window layers)."""
        return MaskBlocks(whole=True) if self.objective == "dpo" else NO_MASKS

    @property
    def offload(self) -> bool:
        return self.mode == "stream+offload"

    def plan(self) -> StepPlan:
        """The stream modes' plan this setup runs: its chunk (``None``: the smallest of :data:`CHUNKS`, where
        ``"auto"`` ends up at the longest lengths), kept layer inputs, offload, key/value mode, the layers that keep
        their activations and whether the others keep their attention outputs."""
        layout = Layout(every=self.keep_every, drop=self.drop)
        return StepPlan(
            self.chunk or CHUNKS[0], layout, self.offload, kv_mode=self.kv_mode,
            keep_activations=self.keep_activations, keep_attention=self.keep_attention,
        )  # fmt: skip

    def trained(self, shape: ModelShape) -> Trained:
        """What the step trains (the head and whole layers, or LoRA adapters on the layers of ``shape``)."""
        return Trained(
            db=self.dtype_bytes,
            head=not self.lora,
            adapters=self.lora,
            layer_params=lora_layer_params(shape) if self.lora else None,
            pending_grads=self.pending_grads,
        )

    @property
    def trained_bytes(self) -> int:
        """Bytes of a trained element: the parameter dtype; LoRA adapters float32 at least (PEFT's upcast), or
        bfloat16 beside quantized weights (TRL's cast)."""
        if not self.lora:
            return self.dtype_bytes
        return _QUANTIZED_ADAPTER_BYTES if self.quantized else max(self.dtype_bytes, _ADAPTER_BYTES)


def adapter_sums(trained: int, total: int) -> bool:
    """Whether a layer of ``total`` parameter elements, ``trained`` of them trained, trains adapters beside frozen
    weights (LoRA, DoRA): no more than half its elements are trained. Its low-precision gradient sums are then float32
    (:func:`streambp_trl.layers.call.backward.ChunkBackward`), at most 4 bytes per trained element, no more than the
    layer's frozen elements (about 1% of a layer's for a 16-rank LoRA of an 8B model); the memory model counts them
    so."""
    return 0 < 2 * trained <= total


def whole_numel(p: object) -> int:
    """A parameter's elements, whole: a ZeRO-3 partition's ``ds_numel`` (its own ``numel()`` is 0 outside a gather)."""
    return getattr(p, "ds_numel", None) or p.numel()


def _lora_params(shape: ModelShape) -> int:
    """Adapter parameters of rank-16 LoRA on every linear layer of every decoder layer (a Gated DeltaNet layer's:
    its four input projections and its output projection; a lightning attention layer's: qkv_proj, output_gate,
    out_proj; a Mamba v1 layer's: in_proj, x_proj, dt_proj, out_proj)."""
    q, kv, i = shape.heads * shape.head_dim, shape.kv_dim, shape.intermediate
    mlp = (shape.hidden + i) * 3
    full = (shape.hidden + q) * 2 + (shape.hidden + kv) * 2 + mlp
    value, v_heads = shape.linear_v_heads * shape.linear_v_dim, shape.linear_v_heads
    linear = 5 * shape.hidden + shape.conv_dim + 2 * value + 2 * v_heads + mlp
    lightning = 3 * shape.hidden + 5 * q + mlp
    inner, rank = shape.ssm_inner, shape.ssm_dt_rank
    ssm = 2 * shape.hidden + 4 * inner + 2 * rank + 2 * shape.ssm_state + (mlp if shape.ssm_mlp else 0)
    mixers = len(shape.linear_layers) * linear + len(shape.lightning_layers) * lightning + len(shape.ssm_layers) * ssm
    return (shape.full_layers * full + mixers) * LORA_RANK


def lora_layer_params(shape: ModelShape) -> int:
    """Adapter parameters of one decoder layer, on average (:func:`_lora_params` over the layers)."""
    return _lora_params(shape) // shape.layers


def trained_params(shape: ModelShape, setup: StepSetup) -> int:
    """Parameters the step trains: the adapters with LoRA, else every one."""
    return _lora_params(shape) if setup.lora else shape.params


def weight_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """The model's weights (not the adapters): every parameter in the parameter dtype, or with quantized base
    weights, the decoder layers' at their stored size (:data:`QUANTIZED`) beside the embedding and head in the
    compute dtype, plus the widest weight dequantized (see the module docstring)."""
    db = setup.dtype_bytes
    if setup.quantized is None:
        return shape.params * db
    quantized = shape.params - shape.embedding_params
    stored = math.ceil(quantized * QUANTIZED[setup.quantized])
    if setup.quantized == "8bit":
        stored += 4 * quantized // max(shape.hidden, 1)  # a float32 scale per output row (rows ~ params / hidden)
    return shape.embedding_params * db + stored + dequantized_bytes(shape, setup)


def dequantized_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """The widest quantized weight dequantized into the compute dtype, as each quantized linear layer's forward and
    backward make it (0 without quantized weights)."""
    if setup.quantized is None:
        return 0
    return shape.hidden * max(shape.intermediate, shape.heads * shape.head_dim, shape.ssm_inner) * setup.dtype_bytes


def optimizer_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """The optimizer state on the device (:mod:`.optimizers`, in the trained parameters' dtype where it follows it);
    0 when it is offloaded to host memory."""
    if setup.optimizer_offload:
        return 0
    narrow = LORA_RANK if setup.lora else min(shape.hidden, shape.kv_dim or shape.hidden)
    each = optimizers.OPTIMIZERS[setup.optimizer].element_bytes(setup.trained_bytes, narrow)
    return math.ceil(trained_params(shape, setup) * each)


def static_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """Weights (:func:`weight_bytes`), parameter gradients (unless ``setup.pending_grads`` in a stream mode: the
    activations' estimate counts them as the backward forms them) and optimizer state (:func:`optimizer_bytes`). LoRA:
    the adapters and their gradients at :attr:`StepSetup.trained_bytes`."""
    grads = 0 if setup.pending_grads and setup.mode.startswith("stream") else 1
    adapters = _lora_params(shape) * setup.trained_bytes if setup.lora else 0
    trained = trained_params(shape, setup) * setup.trained_bytes
    held = weight_bytes(shape, setup) + adapters + grads * trained + optimizer_bytes(shape, setup)
    if setup.gpus == 1:
        return held
    # ZeRO-3 over the GPUs: each holds its partition of every one, and a decoder layer's weights gathered while it
    # runs, with the next one's prefetched (each layer's gradients, summed in its backward, are the activations')
    layer = (shape.params - shape.embedding_params) // max(shape.layers, 1) * setup.dtype_bytes
    return math.ceil(held / setup.gpus) + 2 * layer


def optimizer_step_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """Device bytes while ``optimizer.step()`` runs, after the backward: the weights, adapters, every gradient, the
    state and what the step allocates beside it (torch's foreach AdamW: a moment of every parameter; Adafactor: float32
    copies of the largest trained matrix, the embedding in full fine-tuning); nothing beyond the state for the fused
    AdamW and bitsandbytes' optimizers, or where the state is offloaded (the step runs on the host)."""
    held = static_bytes(shape, dataclasses.replace(setup, pending_grads=False))
    if setup.optimizer_offload:
        return held
    largest = shape.intermediate * LORA_RANK if setup.lora else shape.vocab * shape.hidden
    each = optimizers.OPTIMIZERS[setup.optimizer]
    # (under ZeRO-3 across several GPUs each steps its partition)
    return held + each.step_bytes(trained_params(shape, setup), setup.trained_bytes, largest) // setup.gpus
