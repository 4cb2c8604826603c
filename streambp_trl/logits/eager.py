"""The gradient in the forward: for a loss that weights every scored row alike (SFT's token mean), the LM head's
gradient is formed while the forward computes the log-probabilities, so no logit tile is computed twice.

For ``g`` the same for every row, the gradient of ``sum_i g * log p_i[target_i]`` is ``g`` times that of
``sum_i log p_i[target_i]``, whose parts (the bases) need only the forward's logits:

    dy_i = chain(1[v = target_i] - p_i),   dW_basis = sum_i dy_i^T n_i,   dn_basis_i = dy_i W,

and dh_basis, the norm's parameter bases, from dn_basis through the norm (linear in dn for a fixed h). Each token tile
spans the whole vocabulary, so its softmax is exact at once: 3 vocabulary matmul passes in all (the logits, dn, dW),
the count of the model's own backward over stored logits, against 4 for the fused recompute.

The backward checks what it was given (one host synchronisation per call): with no entropy gradient and the same
log-prob gradient ``g`` on every row, it returns ``g`` times the bases; otherwise it forgets them and recomputes, as
:class:`~.nodes.LogitNode` does (exact either way; the bases were then wasted work).

Memory: the bases, held from the forward to the backward, in the accumulation dtype: dh (M, H), dW (V, H), db (V,)
and the norm's; in the forward, a few (rows x V) tiles with rows = :data:`EAGER_TILE_ELEMENTS` // V (at most the
token tile).
"""

from __future__ import annotations

import torch

from .nodes import HiddenGradient, LogitNode, first_order
from .tiles import LogitCall, addmm_acc, rowdot

# elements of one (rows x vocabulary) tile: 512 MiB in float32. Each tile adds its rows' part of dW into the (V, H)
# float32 basis, a pass over that accumulator: at 2**25 (220 rows of Qwen3's vocabulary) the eager forward of a 16k
# step took 0.25 s on an H200, at 2**27 (883 rows) 0.14 s (benchmarks/gpu_nvidia_h200_profile.md)
EAGER_TILE_ELEMENTS = 2**27


def eager_rows(vocab: int, token_chunk: int) -> int:
    """Rows of one eager tile: as many as :data:`EAGER_TILE_ELEMENTS` allows over the whole vocabulary, at most the
    token tile, at least one."""
    return max(1, min(token_chunk, EAGER_TILE_ELEMENTS // vocab))


def _tile_statistics(call: LogitCall, z: torch.Tensor, i: int, j: int) -> tuple:
    """(log Z, log p[target], entropy, log sum p^2, mean z, is top-1) of rows [i, j) from their whole logits ``z``;
    and p (a fresh tile)."""
    outputs, targets = call.outputs, call.targets[i:j]
    log_z = torch.logsumexp(z, 1)
    p = torch.exp(z - log_z[:, None])
    log_probs = z.gather(1, targets[:, None])[:, 0] - log_z
    entropy = log_z - rowdot(p, z) if "entropy" in outputs else None
    log_sum_sq = torch.log(rowdot(p, p)) if "log_sum_sq_probs" in outputs else None
    mean_logits = z.mean(1) if "mean_logits" in outputs else None
    is_top1 = z.argmax(1) == targets if "is_top1" in outputs else None  # argmax: the first maximum
    return (log_z, log_probs, entropy, log_sum_sq, mean_logits, is_top1), p


class EagerNode(LogitNode):
    """:class:`~.nodes.LogitNode` with the gradient's bases formed in the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, call: LogitCall, hidden, weight, bias, *norm_params):
        ctx.bases = None
        if call.n == 0:  # nothing to score: nothing to form early
            return LogitNode.forward(ctx, call, hidden, weight, bias, *norm_params)
        # the tiles' products are cast to the matmul dtype explicitly; autocast would also lower the row sums
        with torch.autocast(call.autocast["device_type"], enabled=False):
            return EagerNode._forward(ctx, call, hidden, weight, bias, *norm_params)

    @staticmethod
    def _forward(ctx, call: LogitCall, hidden, weight, bias, *norm_params):
        ctx.set_materialize_grads(False)
        need_w, need_b = ctx.needs_input_grad[2:4]
        need_dn = ctx.needs_input_grad[1] or any(ctx.needs_input_grad[4:])
        vocab, device = weight.shape[0], hidden.device
        rows = eager_rows(vocab, call.token_chunk)
        outs: list[tuple] = []
        dn = torch.empty((call.n, hidden.shape[1]), device=device, dtype=call.acc) if need_dn else None
        dw = torch.zeros(weight.shape, device=device, dtype=call.acc) if need_w else None
        db = torch.zeros(bias.shape, device=device, dtype=call.acc) if need_b else None
        for i in range(0, call.n, rows):
            j = min(i + rows, call.n)
            n = call.normed(call.hidden_rows(hidden, i, j))
            y, w = call.tile_logits(n, weight, bias, 0, vocab)
            z, t = call.transform.with_tanh_(y)
            stats, p = _tile_statistics(call, z, i, j)
            outs.append(stats)
            del z, y
            dz = p.neg_().scatter_add_(1, call.targets[i:j, None], p.new_ones(j - i, 1))
            dy = call.transform.chain_(dz, t)
            dy_c = dy.to(call.cdt)
            if need_dn:
                dn[i:j] = 0
                addmm_acc(dn[i:j], dy_c, w)
            if need_w:
                addmm_acc(dw, dy_c.t(), n)
            if need_b:
                db += dy.sum(0)
            del dy, dy_c, p
        log_z, *stats = (None if col[0] is None else torch.cat(col) for col in zip(*outs, strict=True))
        ctx.save_for_backward(hidden, log_z, stats[1], *call.reread())
        ctx.call, ctx.norm_params = call, norm_params
        ctx.bases = (dn, dw, db)
        ctx.mark_non_differentiable(log_z, *(x for x in stats[2:] if x is not None))
        return log_z, *stats

    @staticmethod
    def backward(ctx, _g_log_z, g_logp, g_ent, *_):
        bases, ctx.bases = ctx.bases, None  # freed with this node either way
        uniform = g_ent is None and g_logp is not None and bool((g_logp == g_logp[:1]).all())
        if bases is None or not uniform:
            del bases
            return LogitNode.backward(ctx, _g_log_z, g_logp, g_ent)
        first_order()
        dn, dw, db = bases
        g = g_logp[:1].to(ctx.call.acc)
        with ctx.call.gathered():
            hidden, _, _, weight, bias, *_ = ctx.saved_tensors
            dh, dparams = _through_norm(ctx, hidden, None if dn is None else dn.mul_(g))
        dw = None if dw is None else dw.mul_(g).to(weight.dtype)
        db = None if db is None else db.mul_(g).to(bias.dtype)
        return None, dh, dw, db, *dparams


def _through_norm(ctx, hidden: torch.Tensor, dn: torch.Tensor | None) -> tuple:
    """dh (M, H) and the norm's parameter gradients from dL/dn (N, H) of the scored rows, token tile by token tile."""
    if dn is None:
        return None, [None] * len(ctx.norm_params)
    to_hidden = HiddenGradient(ctx, hidden)
    for i, j in ctx.call.token_tiles():
        h, n = to_hidden.normed(hidden, i, j)
        to_hidden.add(i, j, h, n, dn[i:j])
    return to_hidden.result()
