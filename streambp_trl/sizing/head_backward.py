"""The memory of the LM head's backward: the logit kernel's gradient in each of its forms (:data:`HEAD_FORMS`). Part of
the memory model (:mod:`.memory_model`, which exports it)."""

from __future__ import annotations

from ..logits.eager import eager_rows
from ..logits.forms import HEAD_FORMS, HeadForm

_VOCAB_TILE = 8192  # the logit kernel's default vocabulary tile (streambp_trl.logits.DEFAULT_VOCAB_CHUNK)


def head_backward_bytes(
    vocab: int,
    hidden: int,
    n: int,
    logits_chunk: int,
    db: int = 2,
    *,
    head_trained: bool = True,
    form: HeadForm = HeadForm.TWO_NODE,
    weight_grad_formed: bool = False,
) -> int:
    """Peak bytes the logit kernel's gradient takes for ``n`` rows (:data:`HEAD_FORMS`), beyond the hidden states it
    reads: logit tiles (the matmul product, its float32 copy and the probabilities: 10 bytes per element, beside a
    tile of hidden rows), and

    * ``two-node``: the larger of the weight node's dW ``V H db`` with one float32 vocabulary tile of it, and the
      hidden node's dh ``H db n`` with its tile's float32 and gathered copies of the hidden rows; where the backward
      forms the head's gradient (``weight_grad_formed``: pending gradients), dW stays beside the hidden node (as the
      simulator shows it, ``benchmarks/sim_qwen3_8b_kept.jsonl``);
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
    hidden_node = h * db * n + min(logits_chunk, n) * h * (4 + 2 * db)
    if weight_grad_formed:
        return v * h * db + max(_VOCAB_TILE * h * 4, hidden_node) + tile
    return max(v * h * db + _VOCAB_TILE * h * 4, hidden_node) + tile
