"""The memory model of one training step: peak device bytes from the model's shape, the length and the settings.

Everything is counted in buffers the step allocates, per token of the micro-batch (``N`` = rows x length) or per
chunk token, in the parameter dtype (``db`` bytes; float32 statistics where the engine keeps them), with the CUDA
caching allocator's view of ``max_memory_allocated`` (no fragmentation, no CUDA context):

* static: weights ``P db``, parameter gradients ``P_train db`` (allocated from the first step on), optimizer state.
* stream (``enable_streambp``), the largest of three moments:

  - a decoder layer's backward (the top layer's, when all saved inputs are still there): the saved inputs
    ``(L - 1) H db N`` (the first layer's is rebuilt from the token ids; with ``offload_checkpoints``: the layer's own
    and the prefetched one, ``2 H db N``), dY ``H db N``
    (the input gradient takes the place of the saved input), the keys/values and their gradient accumulators
    ``4 kv db N``, the rotary tables, the layer's parameter gradient sums, and the larger of one chunk's MLP backward
    (``chunk x`` :func:`_chunk_token_bytes`, beside one weight's fresh gradient) and its attention backward (with
    grouped heads, one group's key/value gradients over the whole prefix and flash's expanded workspace; with as many
    key/value heads as query heads, all heads' key/value gradients ``2 kv db N``);
  - the LM head's backward (:func:`head_backward_bytes`) in its two-node form, which the engine takes wherever the
    fused form's (V, H) accumulator would not fit: the weight node (runs first in backward) with the last hidden
    state, dW ``V H db`` and one float32 vocabulary tile of dW, then the hidden-state node with the last hidden
    state and its gradient ``2 H db N``, plus logit tiles.

* ``hf-gc`` (Hugging Face gradient checkpointing, the model's own loss over full logits) and ``trl-default``
  (checkpointing + TRL's fused LM head): the saved layer inputs, and either the logits with their float32 copies
  and gradients (``hf-gc``) or one layer recomputed at full length with its gradients (``trl-default``).

The coefficients of the chunk activations and the recomputed layer are those of a Llama/Qwen-style layer (RMSNorm,
rotary attention with grouped heads, SwiGLU MLP) as the CUDA simulator ``../shared/cudasim`` measures them; the model
is checked against it (``tests/test_memory_model.py``, ``benchmarks/sim_memory_model.md``).
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable

from .shapes import NAMED_MODELS, canonical_model_name

MODES = ("hf-gc", "trl-default", "stream", "stream+offload")
OBJECTIVES = ("sft", "dpo", "grpo")
GiB = 2**30
_VOCAB_TILE = 8192  # the logit kernel's default vocabulary tile (streambp_trl.logits.DEFAULT_VOCAB_CHUNK)
_EAGER_TILE_ELEMENTS = 2**25  # its whole-vocabulary tiles in the eager form (streambp_trl.logits.eager)
HEAD_FORMS = ("two-node", "fused", "eager")  # the forms of the logit kernel's gradient, by memory taken
CHUNKS = (512, 1024, 2048, 4096, 8192, 16384)  # the stream chunk sizes "auto" chooses among
_LORA_RANK = 16


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer step depends on. ``params`` 0: counted from the shape."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int = 0
    tied: bool = False

    def __post_init__(self):
        if not self.params:
            object.__setattr__(self, "params", self.layers * self.layer_params + self.embedding_params)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention projections, SwiGLU MLP, norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (its text config for a multimodal one)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @classmethod
    def from_model(cls, model) -> ModelShape:
        """From a loaded model: its config's shape with its actual parameter count."""
        return dataclasses.replace(cls.from_config(model.config), params=sum(p.numel() for p in model.parameters()))

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        """A named shape of :data:`streambp_trl.sizing.shapes.NAMED_MODELS` (``qwen3-8b``, a size such as ``8B``, or
        the Hub name of one such as ``Qwen/Qwen3-8B``: no network), else a local config path or a Hub model id (its
        ``config.json`` only; ``OSError`` when it cannot be read)."""
        key = canonical_model_name(name)
        if key in NAMED_MODELS and "model_type" not in NAMED_MODELS[key]:  # a Qwen3 shape: the formula's count
            return cls.from_config(types.SimpleNamespace(**NAMED_MODELS[key]))
        from transformers import AutoConfig

        if key in NAMED_MODELS:  # another architecture (the Qwen3.5 hybrids): its parameters counted on meta tensors
            import torch
            from transformers import AutoModelForCausalLM

            kwargs = dict(NAMED_MODELS[key])
            config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
            with torch.device("meta"):
                return cls.from_model(AutoModelForCausalLM.from_config(config))

        return cls.from_config(AutoConfig.from_pretrained(name))


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """How the step runs. ``chunk``/``logits_chunk`` ``None`` (stream modes): the smallest chunk of :data:`CHUNKS`,
    which ``"auto"`` takes at the longest lengths a budget allows."""

    mode: str = "stream"
    objective: str = "sft"
    lora: bool = False
    dtype_bytes: int = 2
    chunk: int | None = None
    logits_chunk: int | None = None
    optimizer_bytes_per_param: int = 0  # e.g. 8 for AdamW's two float32 moments of every trainable parameter
    keep_every: int = 1  # stream modes: only every k-th layer keeps its input (streambp_trl.layers.segments)
    head_form: str = "two-node"  # stream modes: the logit kernel's gradient form (HEAD_FORMS), as the engine chose it

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}.")
        if self.head_form not in HEAD_FORMS:
            raise ValueError(f"head_form must be one of {HEAD_FORMS}, got {self.head_form!r}.")

    @property
    def rows(self) -> int:
        """Sequences per micro-batch: DPO scores the chosen and the rejected completion together."""
        return 2 if self.objective == "dpo" else 1

    @property
    def offload(self) -> bool:
        return self.mode == "stream+offload"


def _lora_params(shape: ModelShape) -> int:
    """Adapter parameters of rank-16 LoRA on every linear layer of every decoder layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_dim
    per_layer = (shape.hidden + q) * 2 + (shape.hidden + kv) * 2 + (shape.hidden + shape.intermediate) * 3
    return shape.layers * per_layer * _LORA_RANK


def static_bytes(shape: ModelShape, setup: StepSetup) -> int:
    """Weights, parameter gradients and optimizer state."""
    trainable = _lora_params(shape) if setup.lora else shape.params
    weights = shape.params * setup.dtype_bytes + (trainable * setup.dtype_bytes if setup.lora else 0)
    return weights + trainable * (setup.dtype_bytes + setup.optimizer_bytes_per_param)


def _chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a layer's chunk backward, in the SwiGLU MLP's backward (as the
    simulator's peak shows them): eight intermediate-sized tensors (the MLP's saved and recomputed products and their
    gradients), six hidden-sized ones and two float32 norm copies, four query-sized ones (projections, rotary,
    attention output) and one float32 copy."""
    q = shape.heads * shape.head_dim
    return 8 * shape.intermediate * db + 6 * shape.hidden * db + 8 * shape.hidden + 4 * q * db + 4 * q


def _per_token_bytes(shape: ModelShape, db: int) -> int:
    """Token bookkeeping held through the step: rotary tables (cos, sin) and integer ids, labels, row indices."""
    return 2 * shape.head_dim * db + 48


def _saved_inputs(layers: int, keep_every: int, offload: bool) -> int:
    """Layer inputs on the device during the backward's worst layer. The first layer's is rebuilt from the token ids
    (:mod:`streambp_trl.layers.rebuild`). Segments of ``keep_every`` layers keep their first input and rebuild the
    others while the segment's backward runs (``keep_every=1``: every layer keeps its own): segment i's backward holds
    its inputs and the kept first inputs of segments 1..i-1, or, with offload, its inputs and the prefetched first
    input of segment i-1 (none for segment 0, whose first input is rebuilt from the ids)."""
    worst = 0
    for i, start in enumerate(range(0, layers, keep_every)):
        size = min(keep_every, layers - start)
        below = (1 if i >= 2 else 0) if offload else max(i - 1, 0)
        worst = max(worst, size + below)
    return worst


def estimate_activation_bytes(
    shape: ModelShape,
    n: int,
    chunk: int,
    logits_chunk: int,
    db: int = 2,
    *,
    offload: bool = False,
    head_trained: bool = True,
    layer_trained_params: int | None = None,
    keep_every: int = 1,
    head_form: str = "two-node",
) -> int:
    """Peak bytes of a streamed forward+backward above weights and parameter gradients, for ``n`` tokens (rows x
    length) in chunks of ``chunk`` tokens and logit tiles of ``logits_chunk`` rows; ``layer_trained_params``: a
    layer's trainable parameters (all of them by default); ``head_form``: the logit kernel's gradient form
    (:func:`head_backward_bytes`; two-node, the form the engine takes where memory is short)."""
    h, kv, d = shape.hidden, shape.kv_dim, shape.head_dim
    group = shape.heads // shape.kv_heads
    saved = _saved_inputs(shape.layers, keep_every, offload) * h * db * n
    common = saved + _per_token_bytes(shape, db) * n
    layer_grads = shape.layer_params if layer_trained_params is None else layer_trained_params
    # a layer's backward: dY, the keys/values and their gradient sums, the layer's parameter gradient sums, and either
    # one chunk's MLP backward (beside one weight's fresh gradient, added to its sum at once) or its attention
    # backward, whose key/value gradients span the prefix (the whole sequence at the last chunk): one head group's
    # dK/dV and flash's expanded workspace, the prefix part added into the sums group by group (grouped heads), or
    # all heads' dK/dV at once (as many key/value heads as query heads)
    layer = common + (h + 4 * kv) * db * n + layer_grads * db
    chunk_rows = min(chunk, n)
    fresh_grad = (shape.hidden if layer_trained_params is None else _LORA_RANK) * shape.intermediate * db
    mlp = chunk_rows * _chunk_token_bytes(shape, db) + fresh_grad
    attention = (2 * d + 2 * group * d if group > 1 else 2 * kv + 2 * d) * db * n
    attention += chunk_rows * (6 * shape.heads * d * db + 4 * shape.heads * d + 8 * h)
    layer += max(mlp, attention)
    head = common + h * db * n
    head += head_backward_bytes(shape.vocab, h, n, logits_chunk, db, head_trained=head_trained, form=head_form)
    return max(layer, head)


def head_backward_bytes(
    vocab: int,
    hidden: int,
    n: int,
    logits_chunk: int,
    db: int = 2,
    *,
    head_trained: bool = True,
    form: str = "two-node",
) -> int:
    """Peak bytes the logit kernel's gradient takes for ``n`` rows (:data:`HEAD_FORMS`), beyond the hidden states it
    reads: logit tiles (the matmul product, its float32 copy and the probabilities: 10 bytes per element, beside a
    tile of hidden rows), and

    * ``two-node``: the larger of the weight node's dW ``V H db`` with one float32 vocabulary tile of it, and the
      hidden node's dh ``H db n``;
    * ``fused``: dh and dW together, with a float32 (V, H) accumulator beside dW when ``db`` < 4 (half precision);
    * ``eager`` (the gradient in the forward): the bases dh and dW in the accumulation dtype (float32 at least), then
      their casts to the parameter dtype beside them (half precision), and the forward's whole-vocabulary tiles
      (:data:`streambp_trl.logits.eager.EAGER_TILE_ELEMENTS` elements, three such at 4 bytes).

    An untrained head (LoRA) takes dh alone (``eager``: in the accumulation dtype), whatever the form.
    """
    if form not in HEAD_FORMS:
        raise ValueError(f"form must be one of {HEAD_FORMS}, got {form!r}.")
    h, v, acc = hidden, vocab, max(db, 4)
    tile = min(logits_chunk, n) * (min(v, _VOCAB_TILE) * 10 + h * (db + 4))
    if form == "eager":
        cast = db < acc
        weight = v * h * (acc + (db if cast else 0)) if head_trained else 0
        return h * n * (acc + (db if cast else 0)) + weight + 3 * 4 * _EAGER_TILE_ELEMENTS
    if not head_trained:
        return h * db * n + tile
    if form == "fused":
        return h * db * n + v * h * db + (v * h * 4 if db < 4 else 0) + tile
    return max(v * h * db + _VOCAB_TILE * h * 4, h * db * n) + tile


def _checkpointing_bytes(shape: ModelShape, setup: StepSetup, n: int) -> int:
    """Hugging Face checkpointing: the saved inputs, plus one layer recomputed at full length with its gradients
    (``trl-default``: TRL's fused head keeps no logits), or the full-length logits, their float32 copies and
    gradients (``hf-gc``). Coefficients per intermediate / hidden / vocabulary unit as the simulator measures them
    on Qwen3-4B and -8B (``benchmarks/sim_qwen3_bf16.jsonl``), at lengths where these terms dominate."""
    saved = shape.layers * shape.hidden * setup.dtype_bytes * n
    if setup.mode == "hf-gc":
        return saved + int((11.2 * shape.vocab + 38.7 * shape.hidden) * n)
    q = shape.heads * shape.head_dim
    recomputed = int(13.5 * shape.intermediate + 24.5 * shape.hidden + 16 * q)
    return saved + (recomputed + _per_token_bytes(shape, setup.dtype_bytes)) * n


def estimate_peak_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Peak device bytes (``torch.cuda.max_memory_allocated``) of one step at ``seq_len`` tokens per sequence."""
    n = setup.rows * seq_len
    if setup.mode.startswith("stream"):
        chunk = setup.chunk or CHUNKS[0]  # None: the smallest, where "auto" ends up at the longest lengths
        activations = estimate_activation_bytes(
            shape,
            n,
            chunk,
            setup.logits_chunk or chunk,
            setup.dtype_bytes,
            offload=setup.offload,
            head_trained=not setup.lora,
            layer_trained_params=_lora_params(shape) // shape.layers if setup.lora else None,
            keep_every=setup.keep_every,
            head_form=setup.head_form,
        )
    else:
        activations = _checkpointing_bytes(shape, setup, n)
    return static_bytes(shape, setup) + activations


def estimate_host_bytes(shape: ModelShape, setup: StepSetup, seq_len: int) -> int:
    """Pinned host bytes the step holds: the offloaded layer inputs (all but the first layer's, rebuilt from the
    token ids; with ``keep_every`` k, the first input of each further segment of k layers); 0 without offload."""
    kept = -(-shape.layers // setup.keep_every) - 1
    return kept * shape.hidden * setup.dtype_bytes * setup.rows * seq_len if setup.offload else 0


def max_len(shape: ModelShape, setup: StepSetup, budget_bytes: int, step: int = 1024) -> int:
    """Longest multiple of ``step`` whose estimated peak fits in ``budget_bytes`` (0 if none does)."""

    def fits(tokens: int) -> bool:
        return estimate_peak_bytes(shape, setup, tokens) <= budget_bytes

    if not fits(step):
        return 0
    lo, hi = step, 2 * step
    while fits(hi):
        lo, hi = hi, 2 * hi
        if hi > 1 << 30:
            return lo
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_chunk(seq_len: int, fits: Callable[[int], bool]) -> int:
    """The largest chunk of :data:`CHUNKS` (fewest kernel launches) that ``fits``, never longer than the sequence, or
    the smallest when none does."""
    fitting = [c for c in CHUNKS if c <= max(seq_len, CHUNKS[0]) and fits(c)]
    return fitting[-1] if fitting else CHUNKS[0]


def auto_chunk_sizes(shape: ModelShape, setup: StepSetup, seq_len: int, budget_bytes: int) -> tuple[int, int]:
    """``(stream_chunk_size, logits_chunk_size)`` for ``setup`` at ``seq_len`` within ``budget_bytes`` (weights,
    gradients, optimizer state and activations): :func:`largest_chunk` whose estimated peak fits."""

    def fits(c: int) -> bool:
        return estimate_peak_bytes(shape, dataclasses.replace(setup, chunk=c, logits_chunk=c), seq_len) <= budget_bytes

    chunk = largest_chunk(seq_len, fits)
    return chunk, chunk


UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
UNITS.update({f"{p}ib": v for p, v in list(UNITS.items()) if p not in ("", "b")})
UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def parse_size(text: str | int, *, unit_required: bool = False) -> int:
    """Bytes of a size: ``80GiB`` / ``80G`` (binary), ``78GB`` (decimal), ``512MiB``, ``1.5TiB``, ``4096`` (bytes;
    with ``unit_required``, a number without a unit is refused: ``80`` is far more likely 80 GiB than 80 bytes)."""
    if isinstance(text, int) and not isinstance(text, bool) and not unit_required:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*", str(text), re.IGNORECASE)
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 80GiB, 78GB, 512MiB, 4096)")
    if unit_required and not unit:
        number = match.group(1)
        raise ValueError(f"{text!r} has no unit: write {number}GiB (binary), {number}GB (decimal) or {number}MiB")
    return int(float(match.group(1)) * UNITS[unit])


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


def parse_budget(value: str | int) -> int:
    """A memory budget in bytes: a positive size (``parse_size``), else ``ValueError`` saying what to give."""
    try:
        budget = parse_size(value)
    except ValueError as e:
        raise ValueError(f"memory_budget: {e}") from None
    if budget <= 0:
        raise ValueError(f"memory_budget must be a positive size such as '78GiB', got {value!r}.")
    return budget
