"""The memory of a streamed step (``enable_streambp``), moment by moment: :func:`estimate_activation_bytes` over a
:class:`StreamStep` (each kind of decoder layer's backward, the LM head's, the end of the backward, the forward; the
head's buffers are :func:`.head_backward.head_backward_bytes`, what layers hold from their forward to their backward
in :mod:`.held`). Part of the memory model (:mod:`.memory_model`, whose docstring states the terms, and which
exports these names)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection

from ..logits.forms import HeadForm
from .choices import NO_MASKS, KVMode, MaskBlocks, StepPlan, Trained
from .forward import forward_peak_bytes
from .head_backward import head_backward_bytes
from .held import attention_output_bytes, captured_bytes, kept_bytes, kept_token_bytes
from .layout import Layout
from .mixers import boundaries, indexer_scores_bytes, recurrent_kinds
from .model_shape import ModelShape
from .setup import LORA_RANK, adapter_sums

ALL_TRAINED = Trained()  # every parameter trained, in half precision


def _chunk_token_bytes(shape: ModelShape, db: int) -> int:
    """Activations of one chunk token at the peak of a layer's chunk backward, in the SwiGLU MLP's backward (as the
    simulator's peak shows them): eight intermediate-sized tensors (the MLP's saved and recomputed products and their
    gradients), six hidden-sized ones and two float32 norm copies, four query-sized ones (projections, rotary,
    attention output) and one float32 copy."""
    q = shape.heads * shape.head_dim
    return 8 * shape.intermediate * db + 6 * shape.hidden * db + 8 * shape.hidden + 4 * q * db + 4 * q


def per_token_bytes(shape: ModelShape, db: int) -> int:
    """Token bookkeeping held through the step: rotary tables (cos, sin) and integer ids, labels, row indices; and
    the int32 top-k indices the layers hand the next one for a shared indexer (:attr:`ModelShape.shared_topk`)."""
    return 2 * (shape.rotary_dim or shape.head_dim) * db + 48 + 4 * shape.shared_topk * max(shape.layers - 1, 0)


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
    ranks: int = 1,
    rows: int = 1,
    masks: MaskBlocks = NO_MASKS,
) -> int:
    """Peak bytes of a streamed forward+backward above weights and parameter gradients, for ``n`` tokens (``rows`` x
    length; a chunk takes its positions of every row) run as ``plan`` says (its chunk, the layer inputs its layout
    keeps, offload, key/value mode) with logit tiles of ``logits_chunk`` rows (``None``: the plan's chunk), for what
    ``trained`` says is trained. With
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
    are ``shape.residual`` wide (all its hyper-connection streams).

    ``ranks``: the rows are one rank's share of rows split across that many
    (:mod:`streambp_trl.layers.sequence_split`), sized for the last rank, whose key/value store spans the whole rows
    (``ranks x n`` positions): the store, its gradient sums and the attention's prefix gradients at that length, the
    forward's exchange of keys/values (a share each way), the input gradient beside the kept input (the returned
    gradients' pass reads it again) and the exchange of the returned gradients as a moment of its own
    (:meth:`StreamStep.split_exchange`).

    ``masks``: the attention mask blocks the call's layers build (:class:`~.choices.MaskBlocks`), each held from a
    chunk's recompute through its backward (and in the forward, with the bool block it is built from)."""
    step = StreamStep(shape, n, plan, trained, ranks, rows, masks)
    logits_chunk = plan.chunk if logits_chunk is None else logits_chunk
    return max(*step.layer_backwards(), step.head_backward(logits_chunk, head_form), step.forward())


@dataclasses.dataclass(frozen=True)
class StreamStep:
    """A streamed step on ``n`` tokens run as ``plan`` says, training what ``trained`` says, moment by moment: each
    kind of decoder layer's backward, the LM head's, the end of the backward and the forward's peak. What every moment
    holds beside its own buffers is :meth:`common`: the kept layer inputs, the keys/values captured below it, the
    token bookkeeping and the gradients formed by then."""

    shape: ModelShape
    n: int
    plan: StepPlan
    trained: Trained
    ranks: int = 1  # the rows are the last rank's share of rows split across this many (see estimate_activation_bytes)
    rows: int = 1  # the sequences the n tokens are, each chunk taking its positions of every one
    masks: MaskBlocks = NO_MASKS

    @functools.cached_property
    def length(self) -> int:
        """Positions per row of the call."""
        return -(-self.n // self.rows)

    @functools.cached_property
    def chunk(self) -> int:
        """Positions per chunk: the plan's chunk, at most the row."""
        return min(self.plan.chunk, self.length)

    @functools.cached_property
    def chunk_tokens(self) -> int:
        """Tokens of one chunk: its positions of every row."""
        return self.rows * self.chunk

    @functools.cached_property
    def mask_block(self) -> int:
        """The widest attention mask block a softmax-attention layer's chunk holds from its recompute through its
        backward (:meth:`.choices.MaskBlocks.block_bytes`; its keys span the whole rows' prefix under a split)."""
        length = self.kv_n // self.rows
        return self.masks.block_bytes(self.rows, self.chunk, length, self.trained.db)

    @functools.cached_property
    def kv_n(self) -> int:
        """The positions of a layer's key/value store: the call's own, or with a sequence split, the whole rows'."""
        return self.n * self.ranks

    @functools.cached_property
    def head_grad(self) -> int:
        """The head's gradient where the backward forms it (``pending_grads``), from the head's backward on."""
        trained = self.trained
        return self.shape.vocab * self.shape.hidden * trained.db if trained.pending_grads and trained.head else 0

    @functools.cached_property
    def layer_grad(self) -> int:
        """A layer's parameter gradient on average where the backward forms it, from its own backward on."""
        if not self.trained.pending_grads:
            return 0
        shape, trained = self.shape, self.trained
        layer_params = (shape.params - shape.embedding_params) // max(shape.layers, 1)
        return (layer_params if trained.layer_params is None else trained.layer_params) * trained.db

    @functools.cached_property
    def kept(self) -> tuple[int, ...]:
        """What each layer keeps from its forward for its backward with keys/values captured (none recomputed; a
        layer that keeps its activations captures nothing: :attr:`activations`)."""
        if self.plan.kv_mode != KVMode.CAPTURE:
            return (0,) * self.shape.layers
        captured = captured_bytes(self.shape, self.n, self.chunk, self.trained.db, self.kv_n, self.rows)
        return tuple(0 if held else c for c, held in zip(captured, self.activations, strict=True))

    @functools.cached_property
    def activations(self) -> tuple[int, ...]:
        """What each of the top ``keep_activations`` layers holds from its forward to its backward
        (:func:`kept_bytes`), a softmax-attention one also every chunk's mask block (its kernels saved them), 0 for
        the others."""
        held = kept_bytes(self.shape, self.n, self.plan.keep_activations, self.trained.db)
        blocks = self.masks.every_block_bytes(self.rows, self.chunk, self.kv_n // self.rows, self.trained.db)
        plain = set(self.shape.plain_attention_layers)
        return tuple(h + blocks if h and i in plain else h for i, h in enumerate(held))

    @functools.cached_property
    def attention_kept(self) -> tuple[int, ...]:
        """What each softmax-attention layer that recomputes keeps of its attention from its forward with
        ``keep_attention`` (:func:`attention_output_bytes`), 0 for the others."""
        if not self.plan.keep_attention:
            return (0,) * self.shape.layers
        each = attention_output_bytes(self.shape, self.n, self.trained.db)
        plain = set(self.shape.plain_attention_layers)
        return tuple(each if i in plain and not held else 0 for i, held in enumerate(self.activations))

    def captured(self, below: int) -> int:
        """What the layers below layer ``below`` keep on the device from their forward for their backward: captured
        keys/values (every one's, or with offload the one just below's: its copy to the host in the forward, back in
        the backward) and kept attention outputs (every one's: they are not offloaded)."""
        attention = sum(self.attention_kept[:below])
        if self.plan.offload:
            return attention + (self.kept[below - 1] if below >= 1 else 0)
        return attention + sum(self.kept[:below])

    def common(self, among: Collection[int] | None) -> int:
        """The kept inputs, captured keys/values and token bookkeeping at the worst backward of a layer of ``among``
        (beside the pending gradients formed by then), or at the head's backward (``None``: every input, every
        captured key/value, no gradient yet)."""
        shape, db, n, plan = self.shape, self.trained.db, self.n, self.plan
        tokens = per_token_bytes(shape, db) * n
        input_bytes = shape.residual * db * n
        if among is None:
            inputs = _saved_inputs(shape.layers, plan.layout, plan.offload, None, input_bytes)
            return inputs + self.captured(shape.layers) + tokens
        layout, offload, grad, captured = plan.layout, plan.offload, self.layer_grad, self.captured
        return (
            _saved_inputs(shape.layers, layout, offload, among, input_bytes, grad, captured) + tokens + self.head_grad
        )

    @functools.cached_property
    def sum_bytes(self) -> int:
        """Bytes of an element of a layer's parameter gradient sums: the parameters' dtype, an adapter's float32
        (:func:`.setup.adapter_sums`)."""
        params, db = self.trained.layer_params, self.trained.db
        return max(db, 4) if params is not None and adapter_sums(params, self.shape.layer_params) else db

    @functools.cached_property
    def fresh_grad(self) -> int:
        """One weight's fresh gradient (the MLP's widest, or a LoRA factor's), added to its sum at once."""
        shape = self.shape
        return (
            (shape.hidden if self.trained.layer_params is None else LORA_RANK) * shape.intermediate * self.trained.db
        )

    @functools.cached_property
    def mlp(self) -> int:
        """One chunk's MLP backward, beside one weight's fresh gradient."""
        return self.chunk_tokens * _chunk_token_bytes(self.shape, self.trained.db) + self.fresh_grad

    def layer_backwards(self) -> list[int]:
        """The worst backward of each kind of decoder layer the model has, and the end of the backward."""
        peaks = [self.kept_backward()] if self.plan.keep_activations else []
        peaks += [self.attention_backward()] if self.shape.plain_attention_layers else []
        peaks += [self.split_exchange()] if self.ranks > 1 and self.shape.plain_attention_layers else []
        peaks += self.recurrent_backwards()
        peaks += [self.mlp_backward()] if self.shape.mlp_layers else []
        return peaks + ([self.backward_end()] if self.trained.pending_grads else [])

    def attention_backward(self) -> int:
        """A softmax-attention layer's backward: dY, the keys/values and their gradient sums, the layer's parameter
        gradient sums, the chunk's mask block, and either one chunk's MLP backward or its attention backward, whose
        key/value gradients span
        the prefix (the whole sequence at the last chunk): one head group's dK/dV and flash's expanded workspace, the
        prefix part added into the sums group by group (grouped heads), or all heads' dK/dV at once (as many
        key/value heads as query heads)."""
        shape, db, tokens, kv_n = self.shape, self.trained.db, self.chunk_tokens, self.kv_n
        kv, d, h = shape.kv_dim, shape.head_dim, shape.hidden
        grads = shape.layer_params if self.trained.layer_params is None else self.trained.layer_params
        layer = self.common(shape.plain_attention_layers) + self._dy_dx + 4 * kv * db * kv_n
        layer += grads * self.sum_bytes + max(self.attention_kept) + self.mask_block  # (its kept attention too)
        group = shape.heads // shape.kv_heads
        attention = (2 * d + 2 * group * d if group > 1 else 2 * kv + 2 * d) * db * kv_n
        attention += tokens * (6 * shape.heads * d * db + 4 * shape.heads * d + 8 * h)
        return layer + max(self.mlp, attention, indexer_scores_bytes(shape, self.n, self.chunk))

    @functools.cached_property
    def _dy_dx(self) -> int:
        """A layer backward's dY, and with a sequence split its dx beside the kept input (which the returned
        gradients' pass reads after the chunks; one process's dx takes the input's place)."""
        return (2 if self.ranks > 1 else 1) * self.shape.residual * self.trained.db * self.n

    def split_exchange(self) -> int:
        """With a sequence split, a softmax-attention layer's backward once its chunks are done: dY and dx, the
        parameter gradient sums, the key/value store and its gradient sums over the whole rows, and the exchange of
        the earlier ranks' part, one share at a time (a share sent, one received, the keys' returned sum beside the
        values'; ``kv db n`` each)."""
        shape, db = self.shape, self.trained.db
        grads = shape.layer_params if self.trained.layer_params is None else self.trained.layer_params
        held = self.common(shape.plain_attention_layers) + self._dy_dx + grads * self.sum_bytes
        return held + 4 * shape.kv_dim * db * self.kv_n + 4 * shape.kv_dim * db * self.n

    def kept_backward(self) -> int:
        """The backward of the top layer that keeps its activations: every kept layer's activations (its own among
        them, freed chunk by chunk), every kept input, dY and dx (which does not take the input's place: the kept
        graphs hold it), the layer's parameter gradient sums and one chunk's backward beside its kept activations."""
        shape, db, n = self.shape, self.trained.db, self.n
        grads = shape.layer_params if self.trained.layer_params is None else self.trained.layer_params
        own = self.common(None) + self.head_grad + self.layer_grad + sum(self.activations)
        # one chunk's backward beside its kept activations (counted above): its gradients and one weight's fresh one
        chunk = max(self.mlp - self.chunk_tokens * kept_token_bytes(shape, db), self.fresh_grad)
        return own + 2 * shape.residual * db * n + grads * self.sum_bytes + chunk

    def recurrent_backwards(self) -> list[int]:
        """Each state-carrying kind of layer's backward (Gated DeltaNet, lightning attention, Mamba2, Mamba v1, short
        convolution, :mod:`.mixers`): dY, the parameter gradient sums and the carry of every chunk boundary (with
        attention beside it: its keys/values and their gradient sums too), and either the no-grad chunked forward
        that collects those carries (its full-length output beside them) or one chunk's backward (its activations
        and its incoming carry's gradient)."""
        shape, db, n, rows, chunk = self.shape, self.trained.db, self.n, self.rows, self.chunk
        r = shape.residual
        peaks = []
        for kind in recurrent_kinds(shape, db):
            grads = kind.params if self.trained.layer_params is None else self.trained.layer_params
            layer = self.common(kind.layers) + r * db * n + grads * self.sum_bytes
            carries = rows * boundaries(self.length, chunk) * kind.carry(db)
            layer += carries + (4 * shape.kv_dim * db * n + self.mask_block if kind.with_attention else 0)
            backward = rows * (chunk * kind.token_bytes + kind.carry_grad(chunk, db)) + self.fresh_grad
            peaks.append(layer + max(r * db * n, backward))
        return peaks

    def mlp_backward(self) -> int:
        """A layer with no token mixer (Nemotron-H's MLP / MoE blocks): dY, its gradient sums, one chunk's MLP
        backward."""
        shape, params = self.shape, self.trained.layer_params
        grads = shape.mlp_params + shape.hidden if params is None else params
        return (
            self.common(shape.mlp_layers)
            + shape.residual * self.trained.db * self.n
            + grads * self.sum_bytes
            + self.mlp
        )

    def backward_end(self) -> int:
        """The end of a backward that forms the gradients: every gradient (the embedding's too, when not tied to the
        head) beside the first layer's input gradient."""
        shape, db, n = self.shape, self.trained.db, self.n
        embedding = shape.vocab * shape.hidden * db if self.trained.head and not shape.tied else 0
        held = self.head_grad + embedding + shape.layers * self.layer_grad
        return held + (shape.residual * db + per_token_bytes(shape, db)) * n

    def head_backward(self, logits_chunk: int, head_form: HeadForm) -> int:
        """The LM head's backward (:func:`head_backward_bytes`, in ``head_form`` over logit tiles of
        ``logits_chunk`` rows) beside every kept input and the last hidden state; with hyper-connection streams, the
        final mix's backward after it, if more: the head input's gradient, the last layer's output the mix kept and a
        copy of it, and the mix's backward in float32 over every stream (five r-wide float32 tensors; as HY-V4 holds
        them under the simulator)."""
        shape, db, n, trained = self.shape, self.trained.db, self.n, self.trained
        h, r = shape.hidden, shape.residual
        head = self.common(None) + sum(self.activations) + h * db * n
        head += head_backward_bytes(
            shape.vocab, h, n, logits_chunk, db, head_trained=trained.head, form=head_form,
            weight_grad_formed=trained.pending_grads,
        )  # fmt: skip
        if shape.streams > 1:
            head = max(head, self.common(None) + self.head_grad + (h + 2 * r) * db * n + 5 * 4 * r * n)
        return head

    def forward(self) -> int:
        """The forward's peak (:func:`.forward.forward_peak_bytes`) beside the token bookkeeping."""
        shape, db, n, plan = self.shape, self.trained.db, self.n, self.plan
        peak = forward_peak_bytes(
            shape, n, self.chunk, db, lora=self.trained.adapters, layout=plan.layout, offload=plan.offload,
            captured=self.captured, kv_n=self.kv_n, rows=self.rows,
        )  # fmt: skip
        if shape.plain_attention_layers:  # the last chunk's mask block and the bool block it is built from
            peak += self.masks.block_bytes(self.rows, self.chunk, self.kv_n // self.rows, db, built=True)
        # with a sequence split, the exchange of the keys' (then the values') shares beside the store: its own, and
        # one received at a time
        gathered = 2 * shape.kv_dim * db * n if self.ranks > 1 and shape.plain_attention_layers else 0
        return per_token_bytes(shape, db) * n + peak + sum(self.activations) + gathered
