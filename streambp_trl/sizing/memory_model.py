"""The memory model of one training step: peak device bytes from the model's shape, the length and the settings.

Everything is counted in buffers the step allocates, per token of the micro-batch (``N`` = rows x length) or per
chunk token, in the parameter dtype (``db`` bytes; float32 statistics where the engine keeps them), with the CUDA
caching allocator's view of ``max_memory_allocated`` (no fragmentation, no CUDA context):

* static (:mod:`.setup`): weights ``P db`` (quantized base weights at their stored size), parameter gradients
  ``P_train db`` (held through the step where the model holds them when it starts, as a micro-step of gradient
  accumulation after the first; otherwise, ``pending_grads``, each counted from the moment the backward forms it),
  the optimizer state of ``TrainingArguments.optim`` in the trained parameters' dtype (:mod:`.optimizers`); with
  LoRA, the adapters and their gradients in float32 (PEFT's upcast of half-precision adapters; bfloat16 beside
  quantized weights, TRL's cast). The optimizer step's own moment (every gradient and the state, and what ``step()``
  allocates) is a floor of the peak (:func:`.setup.optimizer_step_bytes`).
* stream (``enable_streambp``), the larger of the forward's peak and the backward's. The forward's
  (:mod:`.forward`): the top layer of each kind running its first chunk, whose linear outputs (with LoRA, their
  float32 adapter products) the engine's unread-output check keeps until the chunk ends, beside the inputs of every
  layer below it and, for softmax attention, its full-length keys/values ``2 kv db N``. The backward's, the largest
  of three moments:

  - a decoder layer's backward (the top layer's, when all saved inputs are still there): the saved inputs
    ``(L - 1) H db N`` (the first layer's is rebuilt from the token ids; with ``offload_checkpoints``: the layer's own
    and the prefetched one, ``2 H db N``), dY ``H db N``
    (the input gradient takes the place of the saved input), the keys/values and their gradient accumulators
    ``4 kv db N``, the rotary tables, the layer's parameter gradient sums, and the larger of one chunk's MLP backward
    (``chunk x`` :func:`_chunk_token_bytes`, beside one weight's fresh gradient) and its attention backward (with
    grouped heads, one group's key/value gradients over the whole prefix and flash's expanded workspace; with as many
    key/value heads as query heads, all heads' key/value gradients ``2 kv db N``);
  - in a hybrid (Gated DeltaNet, lightning attention, Mamba2, Mamba v1 or short-convolution layers beside full
    attention, :class:`ModelShape`; or a pure Mamba / Mamba2), the keys/values above are a full-attention layer's
    only; a state-carrying layer's backward holds instead the carry of every chunk boundary
    (:class:`.mixers.RecurrentKind`) beside dY and either its chunked forward's full-length output or one chunk's
    backward (with attention beside its Mamba mixer, Falcon-H1, Zamba, its keys/values too); a layer with no token
    mixer (Nemotron-H's MLP blocks) only dY and one chunk's MLP backward;
  - the LM head's backward (:func:`head_backward_bytes`) in its two-node form, which the engine takes wherever the
    fused form's (V, H) accumulator would not fit: the weight node (runs first in backward) with the last hidden
    state, dW ``V H db`` and one float32 vocabulary tile of dW, then the hidden-state node with the last hidden
    state and its gradient ``2 H db N``, plus logit tiles.

  With ``kv_mode="capture"`` every layer keeps from its forward to its backward what a recompute collects in its
  own backward (:func:`captured_bytes`: keys/values, indexer keys, the carries of every chunk boundary), so each
  moment also holds that of the layers below it (with offload, of the one layer whose copy may still run), and the
  host holds every layer's.

  With ``keep_activations`` the top layers hold their activations at full length from their forward to their
  backward (:func:`kept_bytes`), which the forward's peak, the LM head's backward and the top kept layer's backward
  (with dY and a separate dx) count; the recomputing layers' backwards come after theirs. With ``keep_attention``
  every softmax-attention layer that recomputes keeps its attention output and log-sum-exps from its forward to its
  backward (:func:`attention_output_bytes`), counted as captured keys/values are, but never offloaded.

  A chunk holds its positions of every row (``rows`` x chunk tokens). A chunk that is not plainly causal (padded or
  packed rows, a 4D mask: the whole prefix; a sliding-window or chunked layer: its window) attends under a mask block
  (:class:`~.choices.MaskBlocks`), held as an additive mask ``rows x chunk x keys x db`` from the chunk's recompute
  through its backward (and beside the bool block it is built from in the forward); a layer keeping its activations
  keeps every chunk's. DPO's rows (``StepSetup.objective``) are sized padded.

* ``hf-gc`` (Hugging Face gradient checkpointing, the model's own loss over full logits) and ``trl-default``
  (checkpointing + TRL's fused LM head): the saved layer inputs, and either the logits with their float32 copies
  and gradients (``hf-gc``) or one layer recomputed at full length with its gradients (``trl-default``).

The coefficients of the chunk activations and the recomputed layer are those of a Llama/Qwen-style layer (RMSNorm,
rotary attention with grouped heads, SwiGLU MLP), of a Qwen3.5 Gated DeltaNet layer, a Mamba2 and a Mamba v1 layer
(transformers' torch kernels) as the CUDA simulator ``../shared/cudasim`` measures them; the model is checked against
it (``tests/test_memory_model.py``, ``benchmarks/sim_qwen3_bf16.jsonl``, ``benchmarks/sim_qwen3_5.md``,
``benchmarks/sim_hybrid_kinds.md``). The stream modes' moments are computed in :mod:`.stream_step`.
"""

from __future__ import annotations

from ..logits.forms import HEAD_FORMS
from .choices import CHUNKS, KVMode, StepPlan
from .head_backward import head_backward_bytes
from .held import attention_output_bytes, captured_bytes, kept_bytes, kept_token_bytes
from .mixers import lightning_chunk_token_bytes, linear_chunk_token_bytes, ssm_chunk_token_bytes
from .model_shape import ModelShape
from .setup import (
    MODES,
    OBJECTIVES,
    QUANTIZED,
    StepSetup,
    dequantized_bytes,
    lora_layer_params,
    optimizer_bytes,
    optimizer_step_bytes,
    static_bytes,
    trained_params,
    weight_bytes,
)
from .stream_step import estimate_activation_bytes, per_token_bytes
from .units import UNITS, GiB, gib, parse_budget, parse_size

__all__ = [
    "attention_output_bytes",
    "CHUNKS",
    "GiB",
    "HEAD_FORMS",
    "MODES",
    "OBJECTIVES",
    "QUANTIZED",
    "UNITS",
    "ModelShape",
    "StepSetup",
    "captured_bytes",
    "dequantized_bytes",
    "estimate_activation_bytes",
    "estimate_host_bytes",
    "estimate_peak_bytes",
    "gib",
    "head_backward_bytes",
    "kept_bytes",
    "kept_token_bytes",
    "lora_layer_params",
    "optimizer_bytes",
    "optimizer_step_bytes",
    "parse_budget",
    "parse_size",
    "static_bytes",
    "trained_params",
    "weight_bytes",
]


def _checkpointing_bytes(shape: ModelShape, setup: StepSetup, n: int) -> int:
    """Hugging Face checkpointing: the saved inputs, plus one layer recomputed at full length with its gradients
    (``trl-default``: TRL's fused head keeps no logits), or the full-length logits, their float32 copies and
    gradients (``hf-gc``). Coefficients per intermediate / hidden / vocabulary unit as the simulator measures them
    on Qwen3-4B and -8B (``benchmarks/sim_qwen3_bf16.jsonl``), at lengths where these terms dominate. A hybrid's
    recomputed layer is the larger of a softmax-attention layer and a Gated DeltaNet, lightning attention or Mamba v1
    layer, whose mixer holds :func:`.mixers.linear_chunk_token_bytes` / :func:`.mixers.lightning_chunk_token_bytes` /
    :func:`.mixers.ssm_chunk_token_bytes` per token in place of the attention's query-sized tensors (not simulated in
    this mode)."""
    saved = shape.layers * shape.residual * setup.dtype_bytes * n
    if setup.mode == "hf-gc":
        return saved + int((11.2 * shape.vocab + 38.7 * shape.hidden) * n)
    q = shape.heads * shape.head_dim
    mlp_and_norms = 13.5 * shape.intermediate + 24.5 * shape.hidden
    recomputed = int(mlp_and_norms + 16 * q if shape.full_layers else 0)
    if shape.linear_layers:
        recomputed = max(recomputed, linear_chunk_token_bytes(shape))
    if shape.lightning_layers:
        recomputed = max(recomputed, lightning_chunk_token_bytes(shape, setup.dtype_bytes))
    if shape.ssm_layers:
        with_mlp = shape.ssm_mlp or bool(shape.ssm_attention_layers)
        recomputed = max(recomputed, ssm_chunk_token_bytes(shape, setup.dtype_bytes, with_mlp))
    return saved + (recomputed + per_token_bytes(shape, setup.dtype_bytes)) * n


def estimate_peak_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Peak device bytes (``torch.cuda.max_memory_allocated``) of one step at ``seq_len`` tokens per sequence:
    :func:`static_bytes` plus the activations' peak, in stream modes the larger of the forward's and the backward's
    (:func:`estimate_activation_bytes`), or the optimizer step's moment where that is more
    (:func:`optimizer_step_bytes`)."""
    n = setup.rows * seq_len
    if setup.mode.startswith("stream"):
        activations = estimate_activation_bytes(
            shape, n, setup.plan(), setup.trained(shape), setup.logits_chunk, setup.head_form,
            rows=setup.rows, masks=setup.masks,
        )  # fmt: skip
    else:
        activations = _checkpointing_bytes(shape, setup, n)
    return max(static_bytes(shape, setup) + activations, optimizer_step_bytes(shape, setup))


def estimate_host_bytes(shape: ModelShape, plan: StepPlan, n: int, db: int = 2, rows: int = 1) -> int:
    """Pinned host bytes a step on ``n`` tokens (``rows`` x length) run as ``plan`` holds: the offloaded layer inputs
    (the first input of every segment but the first, which is rebuilt from the token ids; every layer's input but
    the first one's where every input is kept) and, with keys/values captured, what every layer keeps from its
    forward (:func:`captured_bytes`, at the plan's chunk); 0 without offload. ``db``: bytes per element."""
    if not plan.offload:
        return 0
    inputs = len(plan.layout.segments(shape.layers)) - 1
    captures = plan.kv_mode == KVMode.CAPTURE
    captured = sum(captured_bytes(shape, n, min(plan.chunk, -(-n // rows)), db, rows=rows)) if captures else 0
    return inputs * shape.residual * db * n + captured
