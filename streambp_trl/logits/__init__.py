"""The chunked logit-gradient kernel: per-token log-probabilities without a (tokens x vocab) tensor.

For N labelled rows of the hidden states h (rows ``rows`` of an (M, H) tensor), an optional final norm (the model's
own module, applied row-wise), LM head W (V, H) and bias b, the logits are

    n = norm(h),   z = softcap(scale * (n W^T + b)) / temperature,   softcap(y) = c * tanh(y / c) (when set)

and the kernel returns log p[target] = z[target] - logsumexp(z), and on request the entropy
H = logsumexp(z) - sum_v p_v z_v (with gradient), and without gradient log(sum_v p_v^2), mean_v z_v and whether
the target is the first argmax. Rows are processed in tiles of ``token_chunk`` and the vocabulary in tiles of
``vocab_chunk`` columns with an online log-sum-exp, so the largest temporary is one (token_chunk x vocab_chunk) tile.
The backward recomputes each tile's logits and forms

    dL/dz_v = g_logp * (1[v = target] - p_v) - g_H * p_v * (log p_v + H).

It takes one of two forms (``form``, a :class:`~.forms.HeadForm`; the engine chooses by the room a call has at the
head, :func:`streambp_trl.sizing.room.head_form`), or a third, eager, for a loss that weights every row alike
(:mod:`.eager`):

* fused (one autograd node): for each token tile, dn = sum over vocabulary tiles of dy W, and in the same sweep
  dW[tile] += dy^T n (db likewise) into a (V, H) accumulator, so each logit tile is recomputed once: 3 vocabulary
  matmul passes in backward (4 with the forward's), where the model's own backward over stored logits takes 2 (3)
  and the two-node form 4 (5);
* two-node, so that their large buffers are never alive together: the weight node (runs first): for each vocabulary
  tile, dW[tile] = sum over token tiles of dy^T n, accumulated in a (vocab_chunk, H) float32 buffer and written into
  dW (V, H) in W's dtype; db likewise; then the hidden node: for each token tile, dn = sum over vocabulary tiles of
  dy W (float32).

In both, dn goes back through the norm (recomputed on the tile, with its parameters' gradients summed over tiles) into
dh (M, H). Both sum the same products in the same order: their gradients are equal. With an untrained head (LoRA) the
hidden part runs alone.

Accumulators are float32 for half-precision inputs and the input dtype otherwise (float64 stays exact).

Sharded parameters: ``gathered`` (a factory of context managers, given by the caller, e.g. the engine's ZeRO-3 gather)
is entered once around the forward and once around each backward node, whatever the number of tiles, so every rank
issues the same collectives. The norm is applied with its ``forward`` (no module hooks per tile), and the weight, bias
and norm parameters are read inside that context: the backward nodes keep the parameters themselves (not detached
copies), so they see whatever the parameters hold when the node runs (DeepSpeed ZeRO-3 swaps ``param.data``).

What the backward reads again (the hidden states, the weight and bias, the norm's parameters, trainable or frozen,
the rows and targets) goes through ``save_for_backward``, so autograd's own check raises its in-place error if one
was changed in place between the forward and the backward, as it does for plain autograd (a ``param.data`` swap
keeps the version). The backward is not differentiable: ``create_graph=True`` is refused (:func:`.nodes.first_order`).

Memory beyond the inputs: a few tiles, per-row statistics (a few floats per row), and dh (M, H) with, in the fused
form, a (V, H) accumulator in the accumulation dtype (dW itself for float32 weights); in the two-node form dW (V, H)
in the weight node and dh in the hidden node, one after the other. ``h`` is saved as it is (no gathered copy of the
labelled rows, no normalised copy). No host synchronisation per tile: the target's term is a scatter-add of zeros
outside the tile.
"""

from .divergence import chunked_divergence
from .forms import HEAD_FORMS, HeadForm
from .kernel import chunked_logprobs
from .tiles import DEFAULT_VOCAB_CHUNK, STAT_OUTPUTS

__all__ = ["DEFAULT_VOCAB_CHUNK", "HEAD_FORMS", "STAT_OUTPUTS", "HeadForm", "chunked_divergence", "chunked_logprobs"]
