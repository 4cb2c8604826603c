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

* ``hf-gc`` (Hugging Face gradient checkpointing, the model's own loss over full logits) and ``trl-default``
  (checkpointing + TRL's fused LM head): the saved layer inputs, and either the logits with their float32 copies
  and gradients (``hf-gc``) or one layer recomputed at full length with its gradients (``trl-default``).

The coefficients of the chunk activations and the recomputed layer are those of a Llama/Qwen-style layer (RMSNorm,
rotary attention with grouped heads, SwiGLU MLP), of a Qwen3.5 Gated DeltaNet layer, a Mamba2 and a Mamba v1 layer
(transformers' torch kernels) as the CUDA simulator ``../shared/cudasim`` measures them; the model is checked against
it (``tests/test_memory_model.py``, ``benchmarks/sim_qwen3_bf16.jsonl``, ``benchmarks/sim_qwen3_5.md``,
``benchmarks/sim_hybrid_kinds.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from itertools import accumulate

from ..logits.eager import eager_rows
from ..logits.forms import HEAD_FORMS, HeadForm
from .choices import CHUNKS, KVMode, StepPlan, Trained
from .forward import forward_peak_bytes
from .layout import Layout
from .mixers import (
    boundaries,
    indexer_scores_bytes,
    lightning_chunk_token_bytes,
    linear_chunk_token_bytes,
    recurrent_kinds,
    ssm_chunk_token_bytes,
)
from .model_shape import ModelShape
from .setup import (
    LORA_RANK,
    MODES,
    OBJECTIVES,
    QUANTIZED,
    StepSetup,
    adapter_sums,
    dequantized_bytes,
    lora_layer_params,
    optimizer_bytes,
    optimizer_step_bytes,
    static_bytes,
    trained_params,
    weight_bytes,
)
from .units import UNITS, GiB, gib, parse_budget, parse_size

__all__ = [
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
    "lora_layer_params",
    "optimizer_bytes",
    "optimizer_step_bytes",
    "parse_budget",
    "parse_size",
    "static_bytes",
    "trained_params",
    "weight_bytes",
]

ALL_TRAINED = Trained()  # every parameter trained, in half precision
_VOCAB_TILE = 8192  # the logit kernel's default vocabulary tile (streambp_trl.logits.DEFAULT_VOCAB_CHUNK)


def _chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a layer's chunk backward, in the SwiGLU MLP's backward (as the
    simulator's peak shows them): eight intermediate-sized tensors (the MLP's saved and recomputed products and their
    gradients), six hidden-sized ones and two float32 norm copies, four query-sized ones (projections, rotary,
    attention output) and one float32 copy."""
    q = shape.heads * shape.head_dim
    return 8 * shape.intermediate * db + 6 * shape.hidden * db + 8 * shape.hidden + 4 * q * db + 4 * q


def _per_token_bytes(shape: ModelShape, db: int) -> int:
    """Token bookkeeping held through the step: rotary tables (cos, sin) and integer ids, labels, row indices; and
    the int32 top-k indices the layers hand the next one for a shared indexer (:attr:`ModelShape.shared_topk`)."""
    return 2 * (shape.rotary_dim or shape.head_dim) * db + 48 + 4 * shape.shared_topk * max(shape.layers - 1, 0)


def captured_bytes(shape: ModelShape, n: int, chunk: int, db: int = 2) -> tuple[int, ...]:
    """What each layer (by index) keeps from its forward to its backward with ``kv_mode="capture"``, for ``n`` tokens
    (rows x length) in chunks of ``chunk``: a softmax-attention layer its keys/values of every position ``2 kv db n``
    and, with a sparse indexed attention, its indexer keys ``index_head_dim db n``; a state-carrying layer
    (:func:`.mixers.recurrent_kinds`: Gated DeltaNet, lightning attention, Mamba2, Mamba v1, short convolution) the
    carry entering each chunk but the first, ``boundaries x carry`` (:func:`.mixers.boundaries`,
    :meth:`.mixers.RecurrentKind.carry`), beside its attention's keys/values where it runs attention too (Falcon-H1,
    Zamba); a layer with no token mixer nothing. A recompute collects the same in each layer's backward, for that
    layer alone, where the backward's moments count it."""
    kv = 2 * shape.kv_dim * db * n
    kept = [0] * shape.layers
    for i in shape.plain_attention_layers:
        kept[i] = kv + (shape.index_head_dim * db * n if shape.index_heads else 0)
    for kind in recurrent_kinds(shape, db):
        for i in kind.layers:
            kept[i] = boundaries(n, chunk) * kind.carry(db) + (kv if kind.with_attention else 0)
    return tuple(kept)


def _saved_inputs(
    layers: int,
    layout: Layout,
    offload: bool,
    among: Collection[int] | None = None,
    input_bytes: int = 1,
    grad_bytes: int = 0,
    captured: Callable[[int], int] | None = None,
) -> int:
    """Bytes of the layer inputs on the device during the backward's worst layer (of ``among``: those layer indices
    only; all by default), each input ``input_bytes``; with ``grad_bytes`` (a layer's parameter gradients, when they
    are formed by the backward: ``pending_grads``), the gradients of the layers above it too; with ``captured`` (the
    bytes of the keys/values captured below a layer index), those below it too (at the segment's layer where the
    inputs, the gradients above and the keys/values below weigh most). The first layer's input
    is rebuilt from the token ids (:mod:`streambp_trl.layers.kept.rebuild`). Each segment of the ``layout`` keeps its
    first input and rebuilds the others while the segment's backward runs (every layer its own segment: each keeps its
    own): segment i's backward holds its inputs and the kept first inputs of segments 1..i-1, or, with offload, its
    inputs and the prefetched first input of segment i-1 (none for segment 0, whose first input is rebuilt from the
    ids)."""
    worst = 0
    for i, (start, size) in enumerate(layout.segments(layers)):
        counted = [j for j in range(start, start + size) if among is None or j in among]
        if not counted:
            continue
        below = (1 if i >= 2 else 0) if offload else max(i - 1, 0)
        for j in counted if captured is not None else counted[:1]:  # (without captures the lowest weighs most)
            held = (size + below) * input_bytes + (layers - 1 - j) * grad_bytes
            worst = max(worst, held + (captured(j) if captured is not None else 0))
    return worst


def estimate_activation_bytes(
    shape: ModelShape,
    n: int,
    plan: StepPlan,
    trained: Trained = ALL_TRAINED,
    logits_chunk: int | None = None,
    head_form: HeadForm = HeadForm.TWO_NODE,
) -> int:
    """Peak bytes of a streamed forward+backward above weights and parameter gradients, for ``n`` tokens (rows x
    length) run as ``plan`` says (its chunk, the layer inputs its layout keeps, offload, key/value mode) with logit
    tiles of ``logits_chunk`` rows (``None``: the plan's chunk), for what ``trained`` says is trained. With
    ``trained.pending_grads`` (no parameter gradient allocated when the step starts) the peak is above the weights
    alone and counts each gradient from the moment the backward forms it: none in the forward, the head's from its
    backward on, a layer's from its own backward on (beside the inputs still kept below it), every one and the
    embedding's at the end. ``head_form``: the logit kernel's gradient form (:func:`head_backward_bytes`; two-node,
    the form the engine takes where memory is short). With keys/values captured (:attr:`KVMode.CAPTURE`) each layer
    keeps what its backward reads of earlier positions from its forward (:func:`captured_bytes`), so a layer's forward
    and backward hold those of the layers below it and the head's backward every layer's (with offload: the one below
    it, whose copy to the host, or back, may run beside it).

    The larger of the forward's peak (:func:`.forward.forward_peak_bytes`: the top layer's first chunk beside the
    inputs kept below it) and the backward's: the worst of a softmax-attention layer's backward, each state-carrying
    or MLP-only kind of layer's (hybrids) and the LM head's. The kept inputs, a layer's dY and its full-length output
    are ``shape.residual`` wide (all its hyper-connection streams)."""
    h, r, kv, d = shape.hidden, shape.residual, shape.kv_dim, shape.head_dim
    db, layout, offload, chunk = trained.db, plan.layout, plan.offload, plan.chunk
    pending_grads, layer_trained_params, head_trained = trained.pending_grads, trained.layer_params, trained.head
    logits_chunk = chunk if logits_chunk is None else logits_chunk
    # pending gradients: the head's (formed by its backward, the first) and a layer's on average (formed by its own)
    head_grad = shape.vocab * h * db if pending_grads and head_trained else 0
    layer_grad = 0
    if pending_grads:
        layer_params = (shape.params - shape.embedding_params) // max(shape.layers, 1)
        layer_grad = (layer_params if layer_trained_params is None else layer_trained_params) * db

    chunk_rows = min(chunk, n)
    captures = plan.kv_mode == KVMode.CAPTURE
    kept = captured_bytes(shape, n, chunk_rows, db) if captures else (0,) * shape.layers
    below_sums = list(accumulate(kept, initial=0))

    def captured(below: int) -> int:
        """What capture keeps on the device from the layers below layer ``below``: every one's, or with offload the
        one just below's (its copy to the host in the forward, back in the backward)."""
        if offload:
            return kept[below - 1] if below >= 1 else 0
        return below_sums[below]

    def common(among: Collection[int] | None) -> int:
        """The kept inputs, captured keys/values and token bookkeeping at the worst backward of a layer of ``among``
        (beside the pending gradients formed by then), or at the head's backward (``None``: every input, every
        captured key/value, no gradient yet)."""
        if among is None:
            inputs = _saved_inputs(shape.layers, layout, offload, None, r * db * n)
            return inputs + captured(shape.layers) + _per_token_bytes(shape, db) * n
        inputs = _saved_inputs(shape.layers, layout, offload, among, r * db * n, layer_grad, captured)
        return inputs + _per_token_bytes(shape, db) * n + head_grad

    # a layer's parameter gradient sums: in the parameters' dtype, an adapter's in float32 (setup.adapter_sums)
    adapters_trained = layer_trained_params is not None and adapter_sums(layer_trained_params, shape.layer_params)
    sum_bytes = max(db, 4) if adapters_trained else db
    fresh_grad = (shape.hidden if layer_trained_params is None else LORA_RANK) * shape.intermediate * db
    mlp = chunk_rows * _chunk_token_bytes(shape, db) + fresh_grad
    peaks = []
    if shape.plain_attention_layers:
        # a softmax-attention layer's backward: dY, the keys/values and their gradient sums, the layer's parameter
        # gradient sums, and either one chunk's MLP backward (beside one weight's fresh gradient, added to its sum at
        # once) or its attention backward, whose key/value gradients span the prefix (the whole sequence at the last
        # chunk): one head group's dK/dV and flash's expanded workspace, the prefix part added into the sums group by
        # group (grouped heads), or all heads' dK/dV at once (as many key/value heads as query heads)
        grads = shape.layer_params if layer_trained_params is None else layer_trained_params
        layer = common(shape.plain_attention_layers) + (r + 4 * kv) * db * n + grads * sum_bytes
        group = shape.heads // shape.kv_heads
        attention = (2 * d + 2 * group * d if group > 1 else 2 * kv + 2 * d) * db * n
        attention += chunk_rows * (6 * shape.heads * d * db + 4 * shape.heads * d + 8 * h)
        peaks.append(layer + max(mlp, attention, indexer_scores_bytes(shape, n, chunk_rows)))
    for kind in recurrent_kinds(shape, db):
        # a state-carrying layer's backward (Gated DeltaNet, lightning attention, Mamba2, Mamba v1, short convolution,
        # :mod:`.mixers`): dY, the parameter gradient sums and the carry of every chunk boundary (with attention beside
        # it: its keys/values and their gradient sums too), and either the no-grad chunked forward that collects those
        # carries (its full-length output beside them) or one chunk's backward (its activations and its incoming
        # carry's gradient)
        grads = kind.params if layer_trained_params is None else layer_trained_params
        layer = common(kind.layers) + r * db * n + grads * sum_bytes + boundaries(n, chunk_rows) * kind.carry(db)
        layer += 4 * kv * db * n if kind.with_attention else 0
        backward = chunk_rows * kind.token_bytes + fresh_grad + kind.carry_grad(chunk_rows, db)
        peaks.append(layer + max(r * db * n, backward))
    if shape.mlp_layers:
        # a layer with no token mixer (Nemotron-H's MLP / MoE blocks): dY, its gradient sums, one chunk's MLP backward
        grads = shape.mlp_params + h if layer_trained_params is None else layer_trained_params
        peaks.append(common(shape.mlp_layers) + r * db * n + grads * sum_bytes + mlp)
    head = common(None) + h * db * n
    head += head_backward_bytes(shape.vocab, h, n, logits_chunk, db, head_trained=head_trained, form=head_form)
    if shape.streams > 1:
        # the final mix of the hyper-connection streams, after the head's backward: the head input's gradient, the
        # last layer's output the mix kept and a copy of it, and the mix's backward in float32 over every stream
        # (five r-wide float32 tensors; as HY-V4 holds them under the simulator)
        head = max(head, common(None) + head_grad + (h + 2 * r) * db * n + 5 * 4 * r * n)
    if pending_grads:
        # the end of the backward: every gradient (the embedding's too, when not tied to the head) beside the first
        # layer's input gradient
        embedding = shape.vocab * h * db if head_trained and not shape.tied else 0
        peaks.append(head_grad + embedding + shape.layers * layer_grad + (r * db + _per_token_bytes(shape, db)) * n)
    forward = _per_token_bytes(shape, db) * n
    forward += forward_peak_bytes(
        shape, n, chunk_rows, db, lora=trained.adapters, layout=layout, offload=offload, captured=captured
    )
    return max(*peaks, head, forward)


def head_backward_bytes(
    vocab: int,
    hidden: int,
    n: int,
    logits_chunk: int,
    db: int = 2,
    *,
    head_trained: bool = True,
    form: HeadForm = HeadForm.TWO_NODE,
) -> int:
    """Peak bytes the logit kernel's gradient takes for ``n`` rows (:data:`HEAD_FORMS`), beyond the hidden states it
    reads: logit tiles (the matmul product, its float32 copy and the probabilities: 10 bytes per element, beside a
    tile of hidden rows), and

    * ``two-node``: the larger of the weight node's dW ``V H db`` with one float32 vocabulary tile of it, and the
      hidden node's dh ``H db n``;
    * ``fused``: dh and dW together, with a float32 (V, H) accumulator beside dW when ``db`` < 4 (half precision);
    * ``eager`` (the gradient in the forward): the bases dh and dW in the accumulation dtype (float32 at least), then
      their casts to the parameter dtype beside them (half precision), and the forward's whole-vocabulary tiles
      (:func:`streambp_trl.logits.eager.eager_rows` rows x V, three such at 4 bytes).

    An untrained head (LoRA) takes dh alone (``eager``: in the accumulation dtype), whatever the form.
    """
    if form not in HEAD_FORMS:
        raise ValueError(f"form must be one of {HEAD_FORMS}, got {form!r}.")
    h, v, acc = hidden, vocab, max(db, 4)
    tile = min(logits_chunk, n) * (min(v, _VOCAB_TILE) * 10 + h * (db + 4))
    if form == "eager":
        cast = db < acc
        weight = v * h * (acc + (db if cast else 0)) if head_trained else 0
        return h * n * (acc + (db if cast else 0)) + weight + 3 * 4 * eager_rows(v, logits_chunk) * v
    if not head_trained:
        return h * db * n + tile
    if form == "fused":
        return h * db * n + v * h * db + (v * h * 4 if db < 4 else 0) + tile
    return max(v * h * db + _VOCAB_TILE * h * 4, h * db * n) + tile


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
    return saved + (recomputed + _per_token_bytes(shape, setup.dtype_bytes)) * n


def estimate_peak_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Peak device bytes (``torch.cuda.max_memory_allocated``) of one step at ``seq_len`` tokens per sequence:
    :func:`static_bytes` plus the activations' peak, in stream modes the larger of the forward's and the backward's
    (:func:`estimate_activation_bytes`), or the optimizer step's moment where that is more
    (:func:`optimizer_step_bytes`)."""
    n = setup.rows * seq_len
    if setup.mode.startswith("stream"):
        activations = estimate_activation_bytes(
            shape, n, setup.plan(), setup.trained(shape), setup.logits_chunk, setup.head_form
        )
    else:
        activations = _checkpointing_bytes(shape, setup, n)
    return max(static_bytes(shape, setup) + activations, optimizer_step_bytes(shape, setup))


def estimate_host_bytes(shape: ModelShape, plan: StepPlan, n: int, db: int = 2) -> int:
    """Pinned host bytes a step on ``n`` tokens run as ``plan`` holds: the offloaded layer inputs (the first input of
    every segment but the first, which is rebuilt from the token ids; every layer's input but the first one's where
    every input is kept) and, with keys/values captured, what every layer keeps from its forward
    (:func:`captured_bytes`, at the plan's chunk); 0 without offload. ``db``: bytes per element."""
    if not plan.offload:
        return 0
    inputs = len(plan.layout.segments(shape.layers)) - 1
    captures = plan.kv_mode == KVMode.CAPTURE
    captured = sum(captured_bytes(shape, n, min(plan.chunk, n), db)) if captures else 0
    return inputs * shape.residual * db * n + captured
