"""The memory terms of the decoder layers that carry a state instead of keys/values (Gated / Kimi DeltaNet, MiniMax's
lightning attention, Mamba2, Mamba v1, short convolution), and of the layers with no token mixer, for
:func:`.memory_model.estimate_activation_bytes`.

Each such layer's backward holds the carry of every chunk boundary (what its no-grad chunked forward stored: the
state entering each chunk, :class:`streambp_trl.layers.carry.ChunkCache`), and during one chunk's backward that
chunk's activations (:attr:`RecurrentKind.token_bytes` per chunk token) and the gradient of the carry it received.
A sparse indexed attention's indexer adds its chunk's scores against every position (:func:`indexer_scores_bytes`).
"""

from __future__ import annotations

import dataclasses

from .model_shape import ModelShape

# a Gated DeltaNet layer's chunk backward, bytes per chunk token: per float32 value-head width, per hidden unit, per
# intermediate unit (least squares over the simulator's runs in benchmarks/sim_qwen3_5.json)
_GDN_PER_VALUE_WIDTH, _GDN_PER_HIDDEN, _GDN_PER_INTERMEDIATE = 23.3, 56.2, 13.3
# a Mamba2 layer's chunk backward, bytes per chunk token: per head x d_state unit, per inner unit, per hidden unit
# (differences of the simulator's runs in benchmarks/sim_hybrid_kinds.md)
_MAMBA_PER_HEAD_STATE, _MAMBA_PER_INNER, _MAMBA_PER_HIDDEN = 32.0, 84.0, 13.0
# a lightning attention layer's chunk backward, bytes per chunk token: per query unit (heads x head_dim), per hidden
# unit (least squares over the simulator's chunk differences in benchmarks/sim_hybrid_kinds.md)
_LIGHTNING_PER_QUERY, _LIGHTNING_PER_HIDDEN = 33.0, 27.0
# a Mamba v1 layer's chunk backward, bytes per chunk token: per inner x d_state unit (the difference of the simulator's
# runs at two d_state), per inner unit (the least that leaves none of them under; benchmarks/sim_hybrid_kinds.md)
_SSM_PER_INNER_STATE, _SSM_PER_INNER = 34.0, 64.0


@dataclasses.dataclass(frozen=True)
class RecurrentKind:
    """One kind of state-carrying layer of a shape: its layer indices, the elements of its state per sequence
    (counted as float32: a lightning attention's is float32 or the model's dtype), its convolution's channels and
    kernel (none for lightning attention), one chunk token's activations at its backward's peak, one
    layer's parameters, and whether these layers also hold softmax attention's keys/values (Falcon-H1, Zamba2's
    hybrid layers)."""

    layers: tuple[int, ...]
    state: int
    conv_channels: int
    kernel: int
    token_bytes: int
    params: int
    with_attention: bool = False

    def carry(self, db: int) -> int:
        """One chunk boundary's carry per sequence: the float32 state entering the chunk and a copy of the
        convolution's last ``kernel`` inputs."""
        return self.state * 4 + self.kernel * self.conv_channels * db

    def carry_grad(self, chunk_rows: int, db: int) -> int:
        """The gradient of a chunk's incoming carry: the float32 state's and that of the joined convolution input,
        (chunk + kernel) x channels."""
        return self.state * 4 + (chunk_rows + self.kernel) * self.conv_channels * db


def indexer_scores_bytes(shape: ModelShape, n: int, chunk: int) -> int:
    """A sparse indexed attention's indexer scores in a chunk's forward (each recompute's too): each query's float32
    scores per indexer head against every position's indexer keys, (rows, index_heads, chunk, T), twice (scaled and
    after the ReLU): ``2 x 4 index_heads chunk n`` for ``n`` = rows x T tokens. It grows with the chunk times the
    sequence, so at long sequences it sets the chunk."""
    return 8 * shape.index_heads * chunk * n


def linear_chunk_token_bytes(shape: ModelShape) -> int:
    """Activations of one chunk token at the peak of a Gated DeltaNet layer's chunk backward (its MLP's backward
    beside the mixer's saved tensors: the float32 queries, keys repeated to the value heads, values, their beta-,
    decay- and l2-scaled forms, the 64-token sub-chunk products and the recurrent states the sequential scan saves),
    as the simulator measures them for transformers' torch kernels (the fla CUDA kernels hold fewer): bytes per
    float32 value-head width, per hidden and per intermediate unit, fitted in ``benchmarks/sim_qwen3_5.md``."""
    value_widths = shape.linear_v_heads * shape.linear_v_dim * 4
    return int(
        _GDN_PER_VALUE_WIDTH * value_widths
        + _GDN_PER_HIDDEN * shape.hidden
        + _GDN_PER_INTERMEDIATE * shape.intermediate
    )


def _mlp_token_bytes(shape: ModelShape, db: int) -> int:
    """A SwiGLU MLP's backward per token: its saved and recomputed intermediate-sized products and their gradients,
    hidden-sized inputs / gradients and two float32 norm copies."""
    return 8 * shape.intermediate * db + 6 * shape.hidden * db + 8 * shape.hidden


def lightning_chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a lightning attention layer's chunk backward (MiniMax: the block
    path of transformers' torch code, continued from the incoming state by
    :mod:`streambp_trl.layers.continued.lightning`): bytes per query unit (heads x head_dim: the activated joint
    projection and its input, the decayed queries and keys, the heads' outputs and their float32 norm, the gate, the
    incoming state's share in the state's dtype, and their gradients) and per hidden unit, least squares over
    simulated steps of a MiniMax-Text-01-shaped layer that vary the chunk, the heads, head_dim, the hidden width and
    the block (``benchmarks/sim_hybrid_kinds.md``); and, counted from the block path, each block's decayed query-key
    products (heads x block per token) and the key-value state each block starts from (heads x head_dim x head_dim
    per block), in the model's dtype. No MLP / MoE backward beside it: the simulated peak did not move with the MLP's
    width."""
    q = shape.heads * shape.head_dim
    blocks = (shape.heads * shape.lightning_block + q * shape.head_dim // shape.lightning_block) * db
    return int(_LIGHTNING_PER_QUERY * q + _LIGHTNING_PER_HIDDEN * shape.hidden) + blocks


def mamba_chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a Mamba2 layer's chunk backward in transformers' torch path (the
    SSD scan in blocks of ``mamba_chunk`` tokens): bytes per head x d_state unit (the float32 states and B/C repeated
    to the heads), per inner unit (heads x head_dim: the projected, convolved, gated and dt-scaled inputs) and per
    hidden unit, fitted to simulated steps of a Nemotron-H-shaped layer that vary d_state, the heads and the SSD block
    (``benchmarks/sim_hybrid_kinds.md``; the block moved it by 2%); beside its MLP's backward when the layer holds
    one (every hybrid but those with MLP-only layers of their own, Nemotron-H; a pure Mamba2 has no MLP)."""
    mixer = (
        _MAMBA_PER_HEAD_STATE * shape.mamba_heads * shape.mamba_state
        + _MAMBA_PER_INNER * shape.mamba_inner
        + _MAMBA_PER_HIDDEN * shape.hidden
    )
    return int(mixer) + (0 if shape.mlp_layers or not shape.intermediate else _mlp_token_bytes(shape, db))


def ssm_chunk_token_bytes(shape: ModelShape, db: int, with_mlp: bool) -> int:
    """Activations of one chunk token at the peak of a Mamba v1 layer's chunk backward in transformers' torch scan
    (the one CUDA runs without mamba-ssm): bytes per inner x d_state unit (the float32 discretised A, B·Δ·x, the
    states the sequential scan keeps for its backward, the incoming state's decay ``P`` of
    :mod:`streambp_trl.layers.continued.mamba_scan`, and their gradients) and per inner unit (the projected,
    convolved, gated and dt-scaled inputs, and a chunk-independent part of the peak that this term covers at the
    smaller chunks), fitted to simulated steps of a Falcon-Mamba-7B-shaped layer that vary the chunk, d_state and
    the inner width (``benchmarks/sim_hybrid_kinds.md``); beside an MLP's backward where the layer holds one
    (``with_mlp``)."""
    mixer = _SSM_PER_INNER_STATE * shape.ssm_state_elements + _SSM_PER_INNER * shape.ssm_inner
    return int(mixer) + (_mlp_token_bytes(shape, db) if with_mlp else 0)


def conv_chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a short-convolution layer's chunk backward (LFM2): the projected
    B, C, x, the gated input B·x, the convolution's output, the gated output and their gradients (``db``, hidden
    width each), beside its MLP's backward."""
    return 8 * shape.hidden * db + _mlp_token_bytes(shape, db)


def recurrent_kinds(shape: ModelShape, db: int) -> list[RecurrentKind]:
    """The shape's state-carrying layer kinds (a Mamba2 or Mamba v1 layer with attention beside it is a kind of its
    own)."""
    kinds = []
    if shape.lightning_layers:
        kinds.append(
            RecurrentKind(
                shape.lightning_layers,
                shape.lightning_state,
                0,
                0,
                lightning_chunk_token_bytes(shape, db),
                shape.lightning_layer_params,
            )
        )
    if shape.linear_layers:
        kinds.append(
            RecurrentKind(
                shape.linear_layers,
                shape.recurrent_state,
                shape.conv_dim,
                shape.linear_kernel,
                linear_chunk_token_bytes(shape),
                shape.linear_layer_params,
            )
        )
    attention = set(shape.mamba_attention_layers)
    for layers, with_attention in (
        (tuple(i for i in shape.mamba_layers if i not in attention), False),
        (shape.mamba_attention_layers, True),
    ):
        if layers:
            params = shape.mamba_layer_params + (shape.layer_params - shape.mlp_params if with_attention else 0)
            kinds.append(
                RecurrentKind(
                    layers,
                    shape.mamba_ssm_state,
                    shape.mamba_conv_dim,
                    shape.mamba_kernel,
                    mamba_chunk_token_bytes(shape, db),
                    params,
                    with_attention,
                )
            )
    hybrid = set(shape.ssm_attention_layers)
    for layers, with_attention in (
        (tuple(i for i in shape.ssm_layers if i not in hybrid), False),
        (shape.ssm_attention_layers, True),
    ):
        if layers:
            kinds.append(
                RecurrentKind(
                    layers,
                    shape.ssm_state_elements,
                    shape.ssm_inner,
                    shape.ssm_kernel,
                    ssm_chunk_token_bytes(shape, db, with_mlp=shape.ssm_mlp or with_attention),
                    shape.ssm_layer_params + (shape.layer_params if with_attention else 0),
                    with_attention,
                )
            )
    if shape.conv_layers:
        kinds.append(
            RecurrentKind(
                shape.conv_layers,
                0,
                shape.hidden,
                shape.conv_kernel,
                conv_chunk_token_bytes(shape, db),
                shape.conv_layer_params,
            )
        )
    return kinds


def boundaries(n: int, chunk_rows: int) -> int:
    """Chunk boundaries of ``n`` tokens in chunks of ``chunk_rows`` (``rows`` sequences share each boundary's
    tensors, batched)."""
    return max(-(-n // chunk_rows) - 1, 0)
