"""What the layers of a streamed step hold from their forward to their backward, per layer: the activations of those
that keep them (``keep_activations``), the attention outputs kept with ``keep_attention`` and what capturing
keys/values keeps (``kv_mode="capture"``). Part of the memory model (:mod:`.memory_model`, which exports these names);
:mod:`.stream_step` adds them to each moment of the step."""

from __future__ import annotations

from .mixers import boundaries, recurrent_kinds
from .model_shape import ModelShape


def kept_token_bytes(shape: ModelShape, db: int) -> int:
    """What a softmax-attention layer that keeps its activations (``keep_activations``) holds per token from its
    forward to its backward, its input aside: the SwiGLU MLP's four intermediate-sized products, the two norms'
    float32 copies and outputs, the residual sum between them, the queries' float32 norm copies, norm outputs and
    rotary outputs, the attention output and its copy in the heads' order, the per-head statistics, the keys
    likewise, the values' projection and the keys/values of every position with their gradient sums: a Qwen3 layer's
    tensors live at the simulator's peak (``../shared/cudasim``, Qwen3-8B, bfloat16;
    ``benchmarks/sim_qwen3_8b_kept.jsonl``), which its saved tensors on the CPU stay under
    (``tests/test_kept_activations.py``). A layer without query and key norms holds less."""
    q, kv = shape.heads * shape.head_dim, shape.kv_dim
    return (
        4 * shape.intermediate * db
        + shape.hidden * (5 * db + 8)
        + q * (4 * db + 4)
        + 8 * shape.heads
        + kv * (7 * db + 4)
        + 2 * shape.head_dim * db
    )


def attention_output_bytes(shape: ModelShape, n: int, db: int = 2) -> int:
    """What a softmax-attention layer keeps of its attention from its forward to its backward with
    ``keep_attention``, for ``n`` tokens: the output (query heads x head_dim values) and one log-sum-exp per query
    head, float32 (float64 in a float64 model: :mod:`streambp_trl.attention.kept_outputs`)."""
    return (shape.heads * shape.head_dim * db + max(db, 4) * shape.heads) * n


def kept_bytes(shape: ModelShape, n: int, kept: int, db: int = 2) -> tuple[int, ...]:
    """What each layer (by index) holds from its forward to its backward where the top ``kept`` layers keep their
    activations (``keep_activations``), for ``n`` tokens: a softmax-attention layer :func:`kept_token_bytes`, a
    state-carrying one its chunk backward's activations (:attr:`.mixers.RecurrentKind.token_bytes`, which count its
    gradients too) at full length, a layer with no token mixer its MLP's; the first layer, kept, its input too (which
    the other layouts rebuild from the token ids)."""
    layers = shape.layers
    held = [0] * layers
    top = range(max(layers - kept, 0), layers)
    attention = kept_token_bytes(shape, db)
    for i in top:
        held[i] = attention * n
    for kind in recurrent_kinds(shape, db):
        for i in set(kind.layers) & set(top):
            held[i] = kind.token_bytes * n
    for i in set(shape.mlp_layers) & set(top):
        held[i] = (4 * shape.intermediate * db + shape.hidden * (2 * db + 4)) * n
    if kept >= layers and layers:
        held[0] += shape.residual * db * n
    return tuple(held)


def captured_bytes(
    shape: ModelShape, n: int, chunk: int, db: int = 2, kv_n: int | None = None, rows: int = 1
) -> tuple[int, ...]:
    """What each layer (by index) keeps from its forward to its backward with ``kv_mode="capture"``, for ``n`` tokens
    (``rows`` x length) in chunks of ``chunk`` positions: a softmax-attention layer its keys/values of every position
    ``2 kv db n`` and, with a sparse indexed attention, its indexer keys ``index_head_dim db n``; a state-carrying
    layer (:func:`.mixers.recurrent_kinds`: Gated DeltaNet, lightning attention, Mamba2, Mamba v1, short convolution)
    the carry entering each chunk but the first, ``rows x boundaries x carry`` (:func:`.mixers.boundaries`,
    :meth:`.mixers.RecurrentKind.carry`), beside its attention's keys/values where it runs attention too (Falcon-H1,
    Zamba); a layer with no token mixer nothing. A recompute collects the same in each layer's backward, for that
    layer alone, where the backward's moments count it. ``kv_n``: the positions of the key/value store, where they
    are more than the call's own (a sequence split: every earlier rank's too)."""
    kv = 2 * shape.kv_dim * db * (n if kv_n is None else kv_n)
    kept = [0] * shape.layers
    for i in shape.plain_attention_layers:
        kept[i] = kv + (shape.index_head_dim * db * n if shape.index_heads else 0)
    for kind in recurrent_kinds(shape, db):
        for i in kind.layers:
            kept[i] = rows * boundaries(-(-n // rows), chunk) * kind.carry(db) + (kv if kind.with_attention else 0)
    return tuple(kept)
