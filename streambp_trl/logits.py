"""The chunked logit-gradient kernel: per-token log-probabilities without a (tokens x vocab) tensor.

For N labelled positions with hidden states h (N, H), LM head W (V, H) and bias b, the logits are

    z = softcap(scale * (h W^T + b)) / temperature,   softcap(y) = c * tanh(y / c) (when set)

and the kernel returns log p[target] = z[target] - logsumexp(z), and on request the entropy
H = logsumexp(z) - sum_v p_v z_v (with gradient), and without gradient log(sum_v p_v^2), mean_v z_v and whether
the target is the first argmax. The tokens are processed in tiles of ``token_chunk`` rows and the vocabulary in
tiles of ``vocab_chunk`` columns with an online log-sum-exp, so the largest temporary is one
(token_chunk x vocab_chunk) tile. The backward recomputes each tile's logits and forms

    dL/dz_v = g_logp * (1[v = target] - p_v) - g_H * p_v * (log p_v + H)

then accumulates dh (per token tile, over the vocabulary tiles) and dW, db (over all tiles). Statistics and
gradient accumulators are float32 for half-precision inputs and the input dtype otherwise (float64 stays exact).

Memory beyond the inputs: one tile and its exponentials, the per-token statistics (a few floats per token),
dh (N, H) and the dW accumulator (V, H) in the accumulation dtype.
"""

from __future__ import annotations

import torch

STAT_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_VOCAB_CHUNK = 32768


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


class _Transform:
    """The logit transform z = softcap(scale * y) / temperature, applied in place on a tile."""

    def __init__(self, temperature: float, softcap: float | None, scale: float):
        self.inv_t, self.softcap, self.scale = 1.0 / temperature, softcap, scale

    def forward_(self, y: torch.Tensor) -> torch.Tensor:
        """z, computed in y's storage."""
        if self.softcap is None:
            return y.mul_(self.scale * self.inv_t)
        return y.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap * self.inv_t)

    def with_tanh_(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, t), t = tanh(scale * y / softcap) kept in y's storage for :meth:`chain_` (None without softcap)."""
        if self.softcap is None:
            return self.forward_(y), None
        t = y.mul_(self.scale / self.softcap).tanh_()
        return t * (self.softcap * self.inv_t), t

    def chain_(self, dz: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """dL/dy from dL/dz, in dz's storage (t is consumed)."""
        dz.mul_(self.inv_t * self.scale)
        return dz if t is None else dz.mul_(t.square_().neg_().add_(1))


def _tile_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """A fresh (tokens x vocab-tile) tensor of h @ w.T + b in the accumulation dtype."""
    y = h @ w.t() if b is None else torch.addmm(b.to(h.dtype), h, w.t())
    return y.to(acc)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] per row, without an (n x v) temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2))[:, 0, 0]


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, accumulating in acc's dtype without rounding the product to a lower precision first."""
    if acc.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class ChunkedLogProbs(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) | None, targets (N,)) -> per-token statistics, see module doc."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        transform: _Transform,
        token_chunk: int,
        vocab_chunk: int,
        outputs: tuple[str, ...],
    ):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        cdt = _compute_dtype(hidden)
        acc = _acc_dtype(hidden.dtype)
        kw = {"device": hidden.device, "dtype": acc}
        run_max = torch.full((n,), -torch.inf, **kw)
        sum_exp = torch.zeros(n, **kw)
        sum_ez = torch.zeros(n, **kw) if "entropy" in outputs else None
        sum_e2 = torch.zeros(n, **kw) if "log_sum_sq_probs" in outputs else None
        sum_z = torch.zeros(n, **kw) if "mean_logits" in outputs else None
        argmax = torch.zeros(n, device=hidden.device, dtype=torch.long) if "is_top1" in outputs else None
        target_z = torch.zeros(n, **kw)
        for i in range(0, n, token_chunk):
            j = min(i + token_chunk, n)
            h, tgt = hidden[i:j].to(cdt), targets[i:j]
            for v0 in range(0, vocab, vocab_chunk):
                v1 = min(v0 + vocab_chunk, vocab)
                z = transform.forward_(
                    _tile_logits(h, weight[v0:v1].to(cdt), None if bias is None else bias[v0:v1], acc)
                )
                local = tgt - v0
                inside = (local >= 0) & (local < v1 - v0)
                picked = z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
                target_z[i:j] = torch.where(inside, picked, target_z[i:j])
                if sum_z is not None:
                    sum_z[i:j] += z.sum(1)
                tile_max, tile_arg = z.max(1)
                if argmax is not None:  # the first maximum wins, as argmax's does: later tiles must be strictly larger
                    argmax[i:j] = torch.where(tile_max > run_max[i:j], tile_arg + v0, argmax[i:j])
                m_new = torch.maximum(run_max[i:j], tile_max)
                rescale = torch.exp(run_max[i:j] - m_new)
                e = (z - m_new[:, None]).exp_()
                sum_exp[i:j] = sum_exp[i:j] * rescale + e.sum(1)
                if sum_ez is not None:
                    sum_ez[i:j] = sum_ez[i:j] * rescale + _rowdot(e, z)
                if sum_e2 is not None:
                    sum_e2[i:j] = sum_e2[i:j] * rescale.square() + _rowdot(e, e)
                run_max[i:j] = m_new
                del z, e
        log_z = run_max + torch.log(sum_exp)
        log_probs = target_z - log_z
        entropy = log_z - sum_ez / sum_exp if sum_ez is not None else None
        log_sum_sq = torch.log(sum_e2) - 2 * torch.log(sum_exp) if sum_e2 is not None else None
        mean_logits = sum_z / vocab if sum_z is not None else None
        is_top1 = argmax == targets if argmax is not None else None

        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.transform, ctx.token_chunk, ctx.vocab_chunk, ctx.cdt, ctx.acc = (
            transform,
            token_chunk,
            vocab_chunk,
            cdt,
            acc,
        )
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, g_logp, g_ent, *_):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return (None,) * 8
        tf, cdt, acc = ctx.transform, ctx.cdt, ctx.acc
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if need_w else None
        db = torch.zeros(bias.shape, device=bias.device, dtype=acc) if need_b else None
        for i in range(0, n, ctx.token_chunk):
            j = min(i + ctx.token_chunk, n)
            h, tgt = hidden[i:j].to(cdt), targets[i:j]
            dh_tile = torch.zeros((j - i, hidden.shape[1]), device=hidden.device, dtype=acc) if need_h else None
            for v0 in range(0, vocab, ctx.vocab_chunk):
                v1 = min(v0 + ctx.vocab_chunk, vocab)
                w = weight[v0:v1].to(cdt)
                z, t = tf.with_tanh_(_tile_logits(h, w, None if bias is None else bias[v0:v1], acc))
                log_p = z.sub_(log_z[i:j, None])
                p = torch.exp(log_p)
                # dL/dz_v = p_v * (-g_logp - g_H * (log p_v + H)) + g_logp * 1[v = target]
                if g_ent is not None:
                    coef = log_p.add_(entropy[i:j, None]).mul_(-g_ent[i:j].to(acc)[:, None])
                    if g_logp is not None:
                        coef.sub_(g_logp[i:j].to(acc)[:, None])
                    dz = p.mul_(coef)
                else:
                    dz = p.mul_(-g_logp[i:j].to(acc)[:, None])
                del z, log_p
                if g_logp is not None:
                    local = tgt - v0
                    rows = torch.nonzero((local >= 0) & (local < v1 - v0))[:, 0]
                    dz[rows, local[rows]] += g_logp[i:j].to(acc)[rows]
                dy = tf.chain_(dz, t)
                if need_h:
                    _addmm_acc(dh_tile, dy.to(cdt), w)
                if need_w:
                    _addmm_acc(dw[v0:v1], dy.t().to(cdt), h)
                if need_b:
                    db[v0:v1] += dy.sum(0)
            if need_h:
                dh[i:j] = dh_tile
        return (
            dh,
            dw.to(weight.dtype) if need_w else None,
            db.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    token_chunk: int = 4096,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    outputs: tuple[str, ...] = ("log_probs",),
) -> dict[str, torch.Tensor | None]:
    """Per-token statistics of ``hidden @ weight.T (+ bias)`` at ``targets``; see the module docstring.

    Returns a dict with every name of :data:`STAT_OUTPUTS`; those not in ``outputs`` are ``None``.
    """
    unknown = set(outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"Tile sizes must be positive, got token_chunk={token_chunk}, vocab_chunk={vocab_chunk}.")
    values = ChunkedLogProbs.apply(
        hidden, weight, bias, targets, _Transform(temperature, softcap, logit_scale), token_chunk, vocab_chunk, outputs
    )
    return dict(zip(STAT_OUTPUTS, values, strict=True))
