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

It runs as two autograd nodes, so their large buffers are never alive together:

* the weight node (runs first): for each vocabulary tile, dW[tile] = sum over token tiles of dy^T n, accumulated in
  a (vocab_chunk, H) float32 buffer and written into dW (V, H) in W's dtype; db likewise;
* the hidden node: for each token tile, dn = sum over vocabulary tiles of dy W (float32), then back through the norm
  (recomputed on the tile, with its parameters' gradients summed over tiles), written into dh (M, H).

Accumulators are float32 for half-precision inputs and the input dtype otherwise (float64 stays exact).

Sharded parameters: ``gathered`` (a factory of context managers, given by the caller, e.g. the engine's ZeRO-3 gather)
is entered once around the forward and once around each backward node, whatever the number of tiles, so every rank
issues the same collectives. The norm is applied with its ``forward`` (no module hooks per tile), and the weight, bias
and norm parameters are read inside that context: the backward nodes keep the parameters themselves (not detached
copies), so they see whatever the parameters hold when the node runs (DeepSpeed ZeRO-3 swaps ``param.data``).

What the backward reads again (the hidden states, the weight and bias, the norm's parameters, trainable or frozen,
the rows and targets) goes through ``save_for_backward``, so autograd's own check raises its in-place error if one
was changed in place between the forward and the backward, as it does for plain autograd (a ``param.data`` swap
keeps the version). The backward is not differentiable: ``create_graph=True`` is refused (:func:`_first_order`).

Memory beyond the inputs: a few tiles, per-row statistics (a few floats per row), dh (M, H) in the hidden node and
dW (V, H) in the weight node. ``h`` is saved as it is (no gathered copy of the labelled rows, no normalised copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

STAT_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_VOCAB_CHUNK = 8192


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
    }


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


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] per row, without an (n x v) temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2))[:, 0, 0]


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, accumulating in acc's dtype without rounding the product to a lower precision first."""
    if acc.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@dataclasses.dataclass
class _LogitCall:
    """Everything about one logit kernel call that is not a differentiable tensor."""

    transform: _Transform
    token_chunk: int
    vocab_chunk: int
    outputs: tuple[str, ...]
    norm: nn.Module | None
    rows: torch.Tensor | None  # (N,) row indices into hidden, or None for every row
    targets: torch.Tensor  # (N,)
    cdt: torch.dtype  # the matmul dtype (the autocast dtype, if autocast is on)
    acc: torch.dtype
    autocast: dict
    weight: torch.Tensor  # the LM head's weight and bias as given (parameters), read again in backward
    bias: torch.Tensor | None
    gathered: Callable[[], ContextManager] = contextlib.nullcontext

    @property
    def n(self) -> int:
        return self.targets.shape[0]

    def token_tiles(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.token_chunk, self.n)) for i in range(0, self.n, self.token_chunk)]

    def vocab_tiles(self, vocab: int) -> list[tuple[int, int]]:
        return [(v, min(v + self.vocab_chunk, vocab)) for v in range(0, vocab, self.vocab_chunk)]

    def reread(self) -> tuple[torch.Tensor | None, ...]:
        """What both backward nodes read again besides their own inputs, saved so that autograd checks its version."""
        return self.weight, self.bias, self.targets, self.rows, *(self.norm.parameters() if self.norm else ())

    def hidden_rows(self, hidden: torch.Tensor, i: int, j: int) -> torch.Tensor:
        return hidden[i:j] if self.rows is None else hidden.index_select(0, self.rows[i:j])

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """norm(h) in the matmul dtype (under the forward's autocast state). The norm's ``forward`` is called, not the
        module: per-tile module hooks (ZeRO-3's gather and release) would make the collectives depend on the tiles."""
        if self.norm is not None:
            with torch.autocast(**self.autocast):
                h = self.norm.forward(h)
        return h.to(self.cdt)

    def tile_logits(self, n: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int):
        """A fresh (rows x vocab-tile) tensor of n @ W[v0:v1].T + b in the accumulation dtype."""
        w = weight[v0:v1].to(self.cdt)
        y = n @ w.t() if bias is None else torch.addmm(bias[v0:v1].to(n.dtype), n, w.t())
        return y.to(self.acc), w

    def dlogits(self, n, weight, bias, v0, v1, i, j, log_z, entropy, g_logp, g_ent):
        """dL/dy (pre-transform) of rows [i, j) and vocabulary tile [v0, v1), and the tile's W in the matmul dtype."""
        y, w = self.tile_logits(n, weight, bias, v0, v1)
        z, t = self.transform.with_tanh_(y)
        log_p = z.sub_(log_z[i:j, None])
        p = torch.exp(log_p)
        if g_ent is not None:
            coef = log_p.add_(entropy[i:j, None]).mul_(-g_ent[i:j].to(self.acc)[:, None])
            if g_logp is not None:
                coef.sub_(g_logp[i:j].to(self.acc)[:, None])
            dz = p.mul_(coef)
        else:
            dz = p.mul_(-g_logp[i:j].to(self.acc)[:, None])
        del z, log_p
        if g_logp is not None:
            local = self.targets[i:j] - v0
            hit = torch.nonzero((local >= 0) & (local < v1 - v0))[:, 0]
            dz[hit, local[hit]] += g_logp[i:j].to(self.acc)[hit]
        return self.transform.chain_(dz, t), w


def _statistics(call: _LogitCall, hidden, weight, bias) -> tuple:
    """Forward: the per-row statistics, tile by tile, under no grad."""
    n_rows, vocab, outputs = call.n, weight.shape[0], call.outputs
    kw = {"device": hidden.device, "dtype": call.acc}
    run_max = torch.full((n_rows,), -torch.inf, **kw)
    sum_exp = torch.zeros(n_rows, **kw)
    sum_ez = torch.zeros(n_rows, **kw) if "entropy" in outputs else None
    sum_e2 = torch.zeros(n_rows, **kw) if "log_sum_sq_probs" in outputs else None
    sum_z = torch.zeros(n_rows, **kw) if "mean_logits" in outputs else None
    argmax = torch.zeros(n_rows, device=hidden.device, dtype=torch.long) if "is_top1" in outputs else None
    target_z = torch.zeros(n_rows, **kw)
    for i, j in call.token_tiles():
        n, tgt = call.normed(call.hidden_rows(hidden, i, j)), call.targets[i:j]
        for v0, v1 in call.vocab_tiles(vocab):
            z = call.transform.forward_(call.tile_logits(n, weight, bias, v0, v1)[0])
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
    is_top1 = argmax == call.targets if argmax is not None else None
    return log_z, log_probs, entropy, log_sum_sq, mean_logits, is_top1


def _first_order() -> None:
    """Refuse a differentiable backward (``create_graph=True``): the kernel's backward builds no graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "StreamBP's chunked logit kernel has no differentiable backward, so create_graph=True (double backward, "
            "gradient penalties) cannot be honoured. Call disable_streambp(model) for steps that need higher-order "
            "gradients."
        )


class _HiddenNode(torch.autograd.Function):
    """(call, hidden (M, H), weight, bias, *norm parameters) -> statistics and log Z; gradients of the hidden states
    and the norm's parameters only (the weight and bias reach this node detached)."""

    @staticmethod
    def forward(ctx, call: _LogitCall, hidden, weight, bias, *norm_params):
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            log_z, *stats = _statistics(call, hidden, weight, bias)
        ctx.save_for_backward(hidden, log_z, stats[1], *call.reread())
        ctx.call, ctx.norm_params = call, norm_params
        ctx.mark_non_differentiable(log_z, *(x for x in stats[2:] if x is not None))
        return log_z, *stats

    @staticmethod
    def backward(ctx, _g_log_z, g_logp, g_ent, *_):
        params = list(ctx.norm_params)
        need_h, need_p = ctx.needs_input_grad[1], [ctx.needs_input_grad[4 + k] for k in range(len(params))]
        if (g_logp is None and g_ent is None) or not (need_h or any(need_p)):
            return (None,) * (4 + len(params))
        _first_order()
        with ctx.call.gathered():
            hidden, log_z, entropy, weight, bias, *_ = ctx.saved_tensors
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            dh, dparams = _HiddenNode._backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need_p)
        return None, dh, None, None, *dparams

    @staticmethod
    def _backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need_p):
        call: _LogitCall = ctx.call
        need_h, params = ctx.needs_input_grad[1], list(ctx.norm_params)
        dh = (torch.zeros_like if call.rows is not None else torch.empty_like)(hidden) if need_h else None
        dparams = [
            torch.zeros(p.shape, device=p.device, dtype=_acc_dtype(p.dtype)) if need else None
            for p, need in zip(params, need_p, strict=True)
        ]
        grad_params = [p for p, need in zip(params, need_p, strict=True) if need]
        for i, j in call.token_tiles():
            h = call.hidden_rows(hidden, i, j).detach()
            with torch.enable_grad():
                h.requires_grad_(need_h and call.norm is not None)
                n = call.normed(h)
            dn = torch.zeros(n.shape, device=n.device, dtype=call.acc)
            for v0, v1 in call.vocab_tiles(weight.shape[0]):
                dy, w = call.dlogits(n.detach(), weight, bias, v0, v1, i, j, log_z, entropy, g_logp, g_ent)
                _addmm_acc(dn, dy.to(call.cdt), w)
            if call.norm is None:
                dh_rows = dn
            else:
                inputs = ([h] if need_h else []) + grad_params
                grads = iter(torch.autograd.grad(n, inputs, dn.to(n.dtype), allow_unused=True))
                dh_rows = next(grads) if need_h else None
                for k, need in enumerate(need_p):
                    g = next(grads) if need else None
                    if g is not None:
                        dparams[k] += g
            if need_h:
                if call.rows is None:
                    dh[i:j] = dh_rows
                else:
                    dh.index_copy_(0, call.rows[i:j], dh_rows.to(dh.dtype))
        return dh, [None if d is None else d.to(p.dtype) for d, p in zip(dparams, params, strict=True)]


class _WeightNode(torch.autograd.Function):
    """(call, weight, bias, hidden, log Z, entropy) -> zeros added to the log-probs and entropy, so that the gradient
    of the weight and bias is formed here, vocabulary tile by tile, apart from the hidden states' gradient."""

    @staticmethod
    def forward(ctx, call: _LogitCall, weight, bias, hidden, log_z, entropy):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, log_z, entropy, *call.reread())
        ctx.call = call
        zeros = log_z.new_zeros(call.n)
        return zeros, (log_z.new_zeros(call.n) if entropy is not None else None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        if g_logp is None and g_ent is None:
            return (None,) * 6
        _first_order()
        with ctx.call.gathered():
            hidden, log_z, entropy, weight, bias, *_ = ctx.saved_tensors
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            dw, db = _WeightNode._backward(ctx, weight, bias, hidden, log_z, entropy, g_logp, g_ent)
        return None, dw, db, None, None, None

    @staticmethod
    def _backward(ctx, weight, bias, hidden, log_z, entropy, g_logp, g_ent):
        call: _LogitCall = ctx.call
        need_w, need_b = ctx.needs_input_grad[1:3]
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        for v0, v1 in call.vocab_tiles(weight.shape[0]):
            acc_w = torch.zeros((v1 - v0, weight.shape[1]), device=weight.device, dtype=call.acc) if need_w else None
            acc_b = torch.zeros(v1 - v0, device=weight.device, dtype=call.acc) if need_b else None
            for i, j in call.token_tiles():
                with torch.no_grad():
                    n = call.normed(call.hidden_rows(hidden, i, j))
                dy, _ = call.dlogits(n, weight, bias, v0, v1, i, j, log_z, entropy, g_logp, g_ent)
                if need_w:
                    _addmm_acc(acc_w, dy.t().to(call.cdt), n)
                if need_b:
                    acc_b += dy.sum(0)
            if need_w:
                dw[v0:v1] = acc_w
            if need_b:
                db[v0:v1] = acc_b
        return dw, db


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    token_chunk: int = 4096,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    outputs: tuple[str, ...] = ("log_probs",),
    gathered: Callable[[], ContextManager] | None = None,
) -> dict[str, torch.Tensor | None]:
    """Per-row statistics of ``norm(hidden[rows]) @ weight.T (+ bias)`` at ``targets``; see the module docstring.

    ``hidden`` is (M, H); ``rows`` (N,) selects the rows to score (all M when ``None``); ``targets`` is (N,).
    ``norm`` is a row-wise module (the model's final norm) applied to each tile (its ``forward``), or ``None``.
    ``gathered``: a factory of context managers inside which ``weight``, ``bias`` and the norm's parameters hold their
    whole values (sharded parameters); entered once for the forward and once per backward node.
    Returns a dict with every name of :data:`STAT_OUTPUTS`; those not in ``outputs`` are ``None``.
    """
    unknown = set(outputs) - set(STAT_OUTPUTS)
    if unknown:
        raise ValueError(f"Unknown outputs {sorted(unknown)}; choose among {STAT_OUTPUTS}.")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"Tile sizes must be positive, got token_chunk={token_chunk}, vocab_chunk={vocab_chunk}.")
    device = hidden.device.type
    cdt = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    call = _LogitCall(
        _Transform(temperature, softcap, logit_scale),
        token_chunk,
        vocab_chunk,
        tuple(outputs),
        norm,
        rows,
        targets,
        cdt,
        _acc_dtype(hidden.dtype),
        _autocast_state(device),
        weight,
        bias,
        gathered or contextlib.nullcontext,
    )
    # under the gather: the autograd nodes record the parameters' whole shapes
    with call.gathered():
        norm_params = [p for p in norm.parameters() if p.requires_grad] if norm is not None else []
        detached_bias = None if bias is None else bias.detach()
        log_z, log_probs, entropy, *rest = _HiddenNode.apply(
            call, hidden, weight.detach(), detached_bias, *norm_params
        )
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            hidden_only = hidden.detach()
            zero_lp, zero_ent = _WeightNode.apply(
                call, weight, bias, hidden_only, log_z, None if entropy is None else entropy.detach()
            )
            log_probs = log_probs + zero_lp
            entropy = entropy if entropy is None else entropy + zero_ent
    return dict(zip(STAT_OUTPUTS, (log_probs, entropy, *rest), strict=True))
