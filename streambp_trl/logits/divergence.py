"""The chunked divergence kernel: TRL's generalised Jensen-Shannon divergence between a student's and a teacher's
next-token distributions, without a (tokens x vocab) tensor.

For N scored rows (rows ``rows`` of the student's (M, H_s) and the teacher's (M, H_t) hidden states), each model's
optional final norm (its own module, applied row-wise) and LM head W (V, H) and bias b, the logits are

    z_s = f_s(norm_s(h_s) W_s^T + b_s) / temperature,   z_t = f_t(norm_t(h_t) W_t^T + b_t) / temperature,

f(y) = softcap(scale * y) (softcap(y) = c * tanh(y / c), when the model sets one), p_s = softmax(z_s) and
p_t = softmax(z_t). The kernel returns, per row, the divergence D and the student's entropy -sum_v p_s log p_s
(without gradient), where D is, as TRL's ``DistillationTrainer`` defines it,

* ``beta = 0``: the forward KL(p_t || p_s);
* ``beta = 1``: the reverse KL(p_s || p_t);
* otherwise: beta KL(p_t || m) + (1 - beta) KL(p_s || m), with m = (1 - beta) p_s + beta p_t.

Forward (no grad): per token tile, one sweep over vocabulary tiles folds both models' logits into online
log-sum-exp statistics (running max, sum of exponentials, and the exponential-weighted sums of z_s and of the gap
z_t - z_s that give the entropy and the two KLs); the generalised JSD, which needs both normalisers to form m, takes
a second sweep. Backward: each tile's logits are recomputed and the gradient of D with respect to z_s is

    beta = 0:  p_s - p_t
    beta = 1:  p_s (log p_s - log p_t - D)
    else:      (1 - beta) p_s (log p_s - log m - KL(p_s || m)),

then chained through the transform to dL/dy, and one sweep over (token tile x vocabulary tile) forms the gradient of
the student's hidden states, final norm parameters, LM head weight and bias. The teacher gets no gradient.

Memory beyond the inputs: a few tiles of (token_chunk x vocab_chunk), a few floats per row, and in backward dh
(M, H_s), a (V,) accumulator for db and dW (V, H_s): in the fused form (``form=FUSED``) accumulated whole in the
accumulation dtype beside the hidden states' sweep, else formed after it vocabulary tile by vocabulary tile in one
(vocab_chunk, H_s) accumulator (both heads' logits computed once more), as the logit kernel's two-node form does.
The hidden states are saved as they are (no gathered or normalised copy). Accumulation is float64 for float64
students and float32 otherwise; the matmuls take each side's dtype (the autocast dtype, when autocast is on), and a
half-precision product is accumulated and kept in float32 (its logits are not rounded to half precision, as in TRL's
kernel).

Sharded parameters: ``gathered`` (a factory of context managers, e.g. the engine's ZeRO-3 gather of both heads and
norms) is entered once around the forward and once around the backward, whatever the number of tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

from .forms import HeadForm
from .tiles import DEFAULT_VOCAB_CHUNK, Transform, acc_dtype, addmm_acc, autocast_state, rowdot


@dataclasses.dataclass
class DivergenceCall:
    """Everything about one divergence call that is not a tensor autograd tracks."""

    beta: float
    student: Transform
    teacher: Transform
    token_chunk: int
    vocab_chunk: int
    norm: nn.Module | None
    teacher_norm: nn.Module | None
    rows: torch.Tensor | None  # (N,) row indices into both models' hidden states, or None for every row
    n: int
    cdt: tuple[torch.dtype, torch.dtype]  # the matmul dtype of the student and of the teacher
    acc: torch.dtype
    autocast: dict
    gathered: Callable[[], ContextManager] = contextlib.nullcontext
    form: HeadForm = (
        HeadForm.FUSED
    )  # FUSED: the weight's gradient in the hidden states' sweep (a (V, H_s) accumulator)

    def token_tiles(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.token_chunk, self.n)) for i in range(0, self.n, self.token_chunk)]

    def vocab_tiles(self, vocab: int) -> list[tuple[int, int]]:
        return [(v, min(v + self.vocab_chunk, vocab)) for v in range(0, vocab, self.vocab_chunk)]

    def hidden_rows(self, hidden: torch.Tensor, i: int, j: int) -> torch.Tensor:
        return hidden[i:j] if self.rows is None else hidden.index_select(0, self.rows[i:j])

    def student_normed(self, h: torch.Tensor) -> torch.Tensor:
        """norm(h) in the student's matmul dtype, under the forward's autocast state (the norm's ``forward``, so no
        module hook runs per tile)."""
        if self.norm is not None:
            with torch.autocast(**self.autocast):
                h = self.norm.forward(h)
        return h.to(self.cdt[0])

    def teacher_rows(self, hidden: torch.Tensor, i: int, j: int) -> torch.Tensor:
        """The teacher's normalised rows [i, j) in its matmul dtype (no graph: the kernel runs the teacher under no
        grad, forward and backward alike)."""
        h = self.hidden_rows(hidden, i, j)
        if self.teacher_norm is not None:
            with torch.autocast(**self.autocast):
                h = self.teacher_norm.forward(h)
        return h.to(self.cdt[1])

    def logits(self, side: int, n: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, v0: int, v1: int):
        """A fresh (rows x vocabulary tile) tensor n @ W[v0:v1].T + b of ``side`` (0 student, 1 teacher) in the
        accumulation dtype (a half-precision product is accumulated and kept in float32, not rounded), and the
        tile's W in the matmul dtype."""
        w = weight[v0:v1].to(self.cdt[side])
        y = torch.zeros((n.shape[0], v1 - v0), device=n.device, dtype=self.acc)
        addmm_acc(y, n, w.t())
        return y if bias is None else y.add_(bias[v0:v1].to(self.acc)), w

    def log_mixture(self, log_ps: torch.Tensor, log_pt: torch.Tensor) -> torch.Tensor:
        """log m = log((1 - beta) p_s + beta p_t), for 0 < beta < 1."""
        return torch.logaddexp(log_ps + math.log(1 - self.beta), log_pt + math.log(self.beta))


def _fold(run_max, total, weighted, z, values):
    """Online log-sum-exp over a vocabulary tile: with the running max m, total = sum e^(z - m) and, for each tensor
    of ``values`` (tile-shaped), its sum weighted by e^(z - m), updated in place; returns the updated max."""
    m_new = torch.maximum(run_max, z.amax(1))
    rescale = torch.exp(run_max - m_new)
    e = (z - m_new[:, None]).exp_()
    total.mul_(rescale).add_(e.sum(1))
    for acc, value in zip(weighted, values, strict=True):
        acc.mul_(rescale).add_(rowdot(e, value))
    return m_new


def _statistics(call: DivergenceCall, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias):
    """Forward: per row, the student's and the teacher's log Z, the divergence, the student's entropy and what the
    backward needs besides them (D for beta = 1, KL(p_s || m) for the generalised JSD)."""
    kw = {"device": s_hidden.device, "dtype": call.acc}
    vocab = s_weight.shape[0]
    s_max, t_max = torch.full((call.n,), -torch.inf, **kw), torch.full((call.n,), -torch.inf, **kw)
    s_sum, t_sum, s_z, s_gap, t_gap = (torch.zeros(call.n, **kw) for _ in range(5))
    for i, j in call.token_tiles():
        ns = call.student_normed(call.hidden_rows(s_hidden, i, j))
        nt = call.teacher_rows(t_hidden, i, j)
        for v0, v1 in call.vocab_tiles(vocab):
            zs = call.student.forward_(call.logits(0, ns, s_weight, s_bias, v0, v1)[0])
            zt = call.teacher.forward_(call.logits(1, nt, t_weight, t_bias, v0, v1)[0])
            gap = zt - zs
            s_max[i:j] = _fold(s_max[i:j], s_sum[i:j], (s_z[i:j], s_gap[i:j]), zs, (zs, gap))
            t_max[i:j] = _fold(t_max[i:j], t_sum[i:j], (t_gap[i:j],), zt, (gap,))
            del zs, zt, gap
    s_log_z, t_log_z = s_max + torch.log(s_sum), t_max + torch.log(t_sum)
    entropy = s_log_z - s_z / s_sum
    if call.beta == 0.0:
        divergence = t_gap / t_sum - t_log_z + s_log_z  # E_pt[z_t - z_s] - log Z_t + log Z_s
        return s_log_z, t_log_z, divergence, entropy, divergence
    if call.beta == 1.0:
        divergence = -s_gap / s_sum - s_log_z + t_log_z  # E_ps[z_s - z_t] - log Z_s + log Z_t
        return s_log_z, t_log_z, divergence, entropy, divergence
    divergence, kl_student = torch.zeros(call.n, **kw), torch.zeros(call.n, **kw)
    for i, j in call.token_tiles():
        ns = call.student_normed(call.hidden_rows(s_hidden, i, j))
        nt = call.teacher_rows(t_hidden, i, j)
        for v0, v1 in call.vocab_tiles(vocab):
            log_ps = call.student.forward_(call.logits(0, ns, s_weight, s_bias, v0, v1)[0]).sub_(s_log_z[i:j, None])
            log_pt = call.teacher.forward_(call.logits(1, nt, t_weight, t_bias, v0, v1)[0]).sub_(t_log_z[i:j, None])
            log_m = call.log_mixture(log_ps, log_pt)
            kl_s = rowdot(log_ps.exp(), log_ps - log_m)
            kl_t = rowdot(log_pt.exp(), log_pt - log_m)
            divergence[i:j] += call.beta * kl_t + (1 - call.beta) * kl_s
            kl_student[i:j] += kl_s
            del log_ps, log_pt, log_m
    return s_log_z, t_log_z, divergence, entropy, kl_student


class DivergenceNode(torch.autograd.Function):
    """(call, student hidden (M, H_s), weight, bias, teacher hidden (M, H_t), weight, bias, *norm parameters) ->
    (divergence (N,), entropy (N,)); in backward, one sweep over (token tile x vocabulary tile) that recomputes
    each tile's logits of both models once and forms the gradient of the student's hidden states, norm parameters,
    LM head weight and bias. The entropy is not differentiable."""

    @staticmethod
    def forward(ctx, call: DivergenceCall, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, *norm_params):
        ctx.set_materialize_grads(False)
        # the tiles are cast explicitly; autocast would round the per-row sums (batched matmuls) to half precision
        with torch.no_grad(), torch.autocast(call.autocast["device_type"], enabled=False):
            s_log_z, t_log_z, divergence, entropy, aux = _statistics(
                call, s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias
            )
        rows = () if call.rows is None else (call.rows,)
        ctx.save_for_backward(s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, s_log_z, t_log_z, aux, *rows)
        ctx.call, ctx.norm_params = call, norm_params
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, g_divergence, _g_entropy):
        params = list(ctx.norm_params)
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        need_p = [ctx.needs_input_grad[7 + k] for k in range(len(params))]
        if g_divergence is None or not (need_h or need_w or need_b or any(need_p)):
            return (None,) * (7 + len(params))
        if torch.is_grad_enabled():
            raise RuntimeError(
                "StreamBP's chunked divergence kernel has no differentiable backward, so create_graph=True (double "
                "backward, gradient penalties) cannot be honoured."
            )
        call: DivergenceCall = ctx.call
        with call.gathered():
            s_hidden, s_weight, s_bias, t_hidden, t_weight, t_bias, s_log_z, t_log_z, aux, *_ = ctx.saved_tensors
            s_weight, s_bias = s_weight.detach(), None if s_bias is None else s_bias.detach()
            heads = (s_weight, s_bias, t_weight, t_bias, s_log_z, t_log_z, aux, g_divergence.to(call.acc))
            fused_w = need_w and call.form != HeadForm.TWO_NODE
            dh = torch.zeros_like(s_hidden) if need_h else None
            acc_w = torch.zeros(s_weight.shape, device=s_weight.device, dtype=call.acc) if fused_w else None
            acc_b = torch.zeros(s_bias.shape, device=s_bias.device, dtype=call.acc) if need_b else None
            dparams = [torch.zeros(p.shape, device=p.device, dtype=acc_dtype(p.dtype)) for p in params]
            grad_params = [p for p, need in zip(params, need_p, strict=True) if need]
            need_dn = need_h or bool(grad_params)
            for i, j in call.token_tiles() if need_dn or need_b or fused_w else ():
                h = call.hidden_rows(s_hidden, i, j).detach()
                with torch.enable_grad():
                    h.requires_grad_(need_h and call.norm is not None)
                    ns = call.student_normed(h)
                nt = call.teacher_rows(t_hidden, i, j)
                dn = torch.zeros(ns.shape, device=ns.device, dtype=call.acc) if need_dn else None
                for v0, v1 in call.vocab_tiles(s_weight.shape[0]):
                    dy, w = _tile_gradient(call, ns.detach(), nt, heads, i, j, v0, v1)
                    dy_c = dy.to(call.cdt[0])
                    if need_dn:
                        addmm_acc(dn, dy_c, w)
                    if fused_w:
                        addmm_acc(acc_w[v0:v1], dy_c.t(), ns.detach())
                    if need_b:
                        acc_b[v0:v1] += dy.sum(0)
                if not need_dn:
                    continue
                if call.norm is None:
                    dh_rows = dn
                else:
                    inputs = ([h] if need_h else []) + grad_params
                    grads = iter(torch.autograd.grad(ns, inputs, dn.to(ns.dtype), allow_unused=True))
                    dh_rows = next(grads) if need_h else None
                    for k, need_k in enumerate(need_p):
                        grad = next(grads) if need_k else None
                        if grad is not None:
                            dparams[k] += grad
                if need_h:
                    rows = torch.arange(i, j, device=dh.device) if call.rows is None else call.rows[i:j]
                    dh.index_add_(0, rows, dh_rows.to(dh.dtype))
            if fused_w:
                dw = acc_w.to(s_weight.dtype)
            else:
                dw = _weight_gradient(call, s_hidden, t_hidden, heads) if need_w else None
        db = None if acc_b is None else acc_b.to(s_bias.dtype)
        grads = [d.to(p.dtype) if need else None for d, p, need in zip(dparams, params, need_p, strict=True)]
        return None, dh, dw, db, None, None, None, *grads


def _tile_gradient(call: DivergenceCall, ns: torch.Tensor, nt: torch.Tensor, heads: tuple, i: int, j: int, v0, v1):
    """dL/dy of the student's logits on rows [i, j) x vocabulary [v0, v1) (its normalised rows ``ns``, the teacher's
    ``nt``; ``heads``: both heads, both log Z, the backward's auxiliary row statistic and dL/dD), in the accumulation
    dtype, and the student's W tile in the matmul dtype."""
    s_weight, s_bias, t_weight, t_bias, s_log_z, t_log_z, aux, g = heads
    y, w = call.logits(0, ns, s_weight, s_bias, v0, v1)
    zs, tanh = call.student.with_tanh_(y)
    log_ps = zs.sub_(s_log_z[i:j, None])
    log_pt = call.teacher.forward_(call.logits(1, nt, t_weight, t_bias, v0, v1)[0])
    log_pt.sub_(t_log_z[i:j, None])
    dz = _dz(call, log_ps, log_pt, aux[i:j]).mul_(g[i:j, None])
    del log_ps, log_pt
    return call.student.chain_(dz, tanh), w


def _weight_gradient(call: DivergenceCall, s_hidden: torch.Tensor, t_hidden: torch.Tensor, heads: tuple):
    """The student's LM head weight gradient in its own dtype, vocabulary tile by vocabulary tile: each tile's sum
    over the token tiles (in their order, as the fused sweep adds them) in a (vocab_chunk, H_s) accumulator written
    once, so no (V, H_s) float32 accumulator exists (both heads' logits are computed once more)."""
    s_weight = heads[0]
    dw = torch.empty_like(s_weight)
    for v0, v1 in call.vocab_tiles(s_weight.shape[0]):
        acc = torch.zeros((v1 - v0, s_weight.shape[1]), device=s_weight.device, dtype=call.acc)
        for i, j in call.token_tiles():
            ns = call.student_normed(call.hidden_rows(s_hidden, i, j))
            nt = call.teacher_rows(t_hidden, i, j)
            dy, _ = _tile_gradient(call, ns, nt, heads, i, j, v0, v1)
            addmm_acc(acc, dy.to(call.cdt[0]).t(), ns)
        dw[v0:v1] = acc
    return dw


def _dz(call: DivergenceCall, log_ps: torch.Tensor, log_pt: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """dD/dz_s on a tile (fresh storage, or ``log_ps``'s)."""
    if call.beta == 0.0:
        return log_ps.exp().sub_(log_pt.exp_())
    if call.beta == 1.0:
        return log_ps.exp().mul_(log_ps.sub_(log_pt).sub_(aux[:, None]))
    log_m = call.log_mixture(log_ps, log_pt)
    return log_ps.exp().mul_(log_ps.sub_(log_m).sub_(aux[:, None])).mul_(1 - call.beta)


def chunked_divergence(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    *,
    beta: float,
    rows: torch.Tensor | None = None,
    norm: nn.Module | None = None,
    teacher_norm: nn.Module | None = None,
    temperature: float = 1.0,
    student_softcap: float | None = None,
    student_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    token_chunk: int = 4096,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    gathered: Callable[[], ContextManager] | None = None,
    form: HeadForm = HeadForm.FUSED,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row generalised JSD between the student's and the teacher's next-token distributions, and the student's
    entropy (no gradient); see the module docstring.

    ``student_hidden`` is (M, H_s) and ``teacher_hidden`` (M, H_t): the same M positions of both models, each with
    its own width; ``rows`` (N,) selects the rows to score in both (all M when ``None``). ``norm`` and
    ``teacher_norm`` are each model's row-wise final norm (its ``forward`` applied to each tile), or ``None`` when
    its hidden states are final. Only the student gets gradients (hidden states, norm parameters, LM head).
    ``gathered``: a factory of context managers inside which both heads and norms hold their whole values
    (sharded parameters); entered once for the forward and once for the backward. ``form``: ``FUSED`` forms the LM
    head weight's gradient in the same sweep as the hidden states' (one recompute of both heads' logits, a (V, H_s)
    accumulator), ``TWO_NODE`` vocabulary tile by vocabulary tile after it (two recomputes, no (V, H_s) accumulator
    beside the gradient itself).
    Returns ``(divergence, entropy)``, each of shape (N,), in the accumulation dtype.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, else the generalised JSD), got {beta}."
        )
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"Tile sizes must be positive, got token_chunk={token_chunk}, vocab_chunk={vocab_chunk}.")
    # (a ZeRO-3 partition's whole shape is its ds_shape: the heads are whole inside `gathered`)
    student_vocab, teacher_vocab = (getattr(w, "ds_shape", w.shape)[0] for w in (student_weight, teacher_weight))
    if student_vocab != teacher_vocab:
        raise ValueError(
            f"The student's LM head has {student_vocab} rows and the teacher's {teacher_vocab}: the divergence "
            "compares distributions over one shared vocabulary."
        )
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student_hidden has {student_hidden.shape[0]} rows and teacher_hidden {teacher_hidden.shape[0]}: pass "
            "the hidden states of the same positions of both models."
        )
    device = student_hidden.device.type

    def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype

    call = DivergenceCall(
        beta=float(beta),
        student=Transform(temperature, student_softcap, student_logit_scale),
        teacher=Transform(temperature, teacher_softcap, teacher_logit_scale),
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
        norm=norm,
        teacher_norm=teacher_norm,
        rows=rows,
        n=student_hidden.shape[0] if rows is None else rows.shape[0],
        cdt=(matmul_dtype(student_hidden), matmul_dtype(teacher_hidden)),
        acc=acc_dtype(student_hidden.dtype),
        autocast=autocast_state(device),
        gathered=gathered or contextlib.nullcontext,
        form=form,
    )
    with call.gathered():  # the autograd node records the parameters' whole shapes
        norm_params = [p for p in norm.parameters() if p.requires_grad] if norm is not None else []
        student = (student_hidden, student_weight, student_bias)
        return DivergenceNode.apply(call, *student, teacher_hidden, teacher_weight, teacher_bias, *norm_params)
