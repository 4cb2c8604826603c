"""The forward's peak of a streamed step: the first chunk of a layer's chunked forward, beside the inputs kept so far.

A streamed layer's forward runs chunk by chunk under no grad. On the first chunk of every training forward the engine
also finds which linear maps' outputs no backward reads (:mod:`..layers.call.unread`): for that chunk it keeps
every ``nn.Linear`` output alive, with everything computed from it by a copy, a cast, a sum or a scaling (the residual
sums, the norms' float32 upcasts), until the chunk ends. With LoRA (PEFT keeps the adapters in float32 beside a
half-precision base) each adapted map's output comes with the adapter's float32 product, its scaled copy, their float32
sum and its cast back. The top layer of each kind holds this beside the inputs of every layer below it (kept for the
backward) and, for softmax attention, its full-length keys/values. As the CUDA simulator measures it
(``benchmarks/sim_qwen3_5.md``, Qwen3.5-27B widths), this moment is the step's peak at long lengths with LoRA, above
every backward moment of :func:`.memory_model.estimate_activation_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable

from .layout import Layout
from .mixers import indexer_scores_bytes
from .model_shape import ModelShape

KEEP_ALL = Layout()

_FLOAT32 = 4


def forward_inputs(layer: int, layout: Layout, offload: bool, layers: int) -> int:
    """Layer inputs on the device while ``layer`` (an index of ``layers``) runs its forward: the first layer's (the
    embedding output) and every kept one up to ``layer``'s own (the first input of each segment of the ``layout``,
    and ``layer``'s own; with offload, the kept ones are on the host: ``layer``'s own and the one before it, whose
    copy to the host may still run)."""
    if offload:
        return min(layer + 1, 2)
    starts = [start for start, _ in layout.segments(layers) if start <= layer]
    return len(starts) + (0 if starts[-1] == layer else 1)


def _linear_outputs(shape: ModelShape, kind: str) -> int:
    """Summed output widths of a layer's linear maps: its SwiGLU MLP (gate, up, down) and its token mixer's maps
    (``attention``: queries, doubled by the output gate of the Gated DeltaNet hybrids' attention (Qwen3-Next,
    Qwen3.5), keys, values and the output projection; ``linear``: a Gated DeltaNet's query/key/value, gate, beta and
    decay projections and its output projection); other mixers: the output projection only (their input projections
    were not simulated)."""
    mlp = 2 * shape.intermediate + shape.hidden
    if kind == "attention":
        q = shape.heads * shape.head_dim * (2 if shape.linear_layers else 1)
        return mlp + q + 2 * shape.kv_dim + shape.hidden
    if kind == "linear":
        value = shape.linear_v_heads * shape.linear_v_dim
        return mlp + shape.conv_dim + value + 2 * shape.linear_v_heads + shape.hidden
    return mlp + shape.hidden


def first_chunk_token_bytes(shape: ModelShape, kind: str, db: int, lora: bool) -> int:
    """Bytes per chunk token of a layer's first forward chunk (the module docstring): every linear output ``o`` wide
    (:func:`_linear_outputs`) at ``db`` bytes, with LoRA also its adapter's float32 product, scaled copy and sum and
    the sum's cast back (``db + 12`` more); the MLP's down-projection input ``I`` (with LoRA and its float32 copy);
    the residual sum and its float32 norm upcast ``H (db + 4)``; and the mixer's own float32 copies: a Gated
    DeltaNet's values (transformers' torch kernel), or the attention's normed keys and key/value concatenation
    (``6 kv``)."""
    lora_extra = db + 3 * _FLOAT32 if lora else 0
    per_token = _linear_outputs(shape, kind) * (db + lora_extra)
    per_token += shape.intermediate * (db + (_FLOAT32 if lora else 0)) + shape.hidden * (db + _FLOAT32)
    if kind == "linear":
        per_token += _FLOAT32 * shape.linear_v_heads * shape.linear_v_dim
    elif kind == "attention":
        per_token += (_FLOAT32 + db) * shape.kv_dim
    return per_token


def forward_peak_bytes(
    shape: ModelShape,
    n: int,
    chunk: int,
    db: int,
    *,
    lora: bool,
    layout: Layout = KEEP_ALL,
    offload: bool = False,
    captured: Callable[[int], int] | None = None,
    kv_n: int | None = None,
    rows: int = 1,
) -> int:
    """Peak activation bytes of a streamed forward, for ``n`` tokens (``rows`` x length) in chunks of ``chunk``
    positions (of every row): the largest, over the
    kinds of layer (softmax attention, Gated DeltaNet, any other), of the top such layer's first chunk
    (:func:`first_chunk_token_bytes`) beside the layer inputs kept up to it (:func:`forward_inputs`, ``H db`` per
    token each, times the hyper-connection streams), what ``captured`` says the layers below it keep for their
    backward (``kv_mode="capture"``: bytes by layer index, :func:`.memory_model.captured_bytes`) and, for softmax
    attention, the layer's full-length keys/values ``2 kv db n`` and a sparse indexed attention's scores of the chunk
    against every position (:func:`.mixers.indexer_scores_bytes`). The LM head's forward (the inputs of every layer,
    the last output and one logit tile) is below its backward's moment, which the memory model counts; the token
    bookkeeping every moment holds (rotary tables, ids) is the caller's to add. ``kv_n``: the key/value store's
    positions where they are more than ``n`` (a sequence split's whole rows)."""
    attention, linear = set(shape.plain_attention_layers), set(shape.linear_layers)
    groups = {
        "attention": attention,
        "linear": linear,
        "other": set(range(shape.layers)) - attention - linear,
    }
    peaks, chunk = [0], min(chunk, -(-n // rows))
    for kind, layers in groups.items():
        if not layers:
            continue
        top = max(layers)
        held = forward_inputs(top, layout, offload, shape.layers) * shape.residual * db * n
        held += captured(top) if captured is not None else 0
        if kind == "attention":  # its keys/values, and beside its first chunk any indexer's scores
            store = 2 * shape.kv_dim * db * (n if kv_n is None else kv_n)
            held += store + indexer_scores_bytes(shape, n, chunk)
        peaks.append(held + rows * chunk * first_chunk_token_bytes(shape, kind, db, lora))
    return max(peaks)
