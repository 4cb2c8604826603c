"""The kernel's backward as autograd nodes (see :mod:`streambp_trl.logits`): the hidden node (gradient of the hidden
states and the norm's parameters) and the weight node (gradient of the LM head's weight and bias)."""

from __future__ import annotations

import torch

from .statistics import statistics
from .tiles import LogitCall, acc_dtype, addmm_acc


def first_order() -> None:
    """Refuse a differentiable backward (``create_graph=True``): the kernel's backward builds no graph."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "StreamBP's chunked logit kernel has no differentiable backward, so create_graph=True (double backward, "
            "gradient penalties) cannot be honoured. Call disable_streambp(model) for steps that need higher-order "
            "gradients."
        )


class HiddenNode(torch.autograd.Function):
    """(call, hidden (M, H), weight, bias, *norm parameters) -> statistics and log Z; gradients of the hidden states
    and the norm's parameters only (the weight and bias reach this node detached)."""

    @staticmethod
    def forward(ctx, call: LogitCall, hidden, weight, bias, *norm_params):
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            log_z, *stats = statistics(call, hidden, weight, bias)
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
        first_order()
        with ctx.call.gathered():
            hidden, log_z, entropy, weight, bias, *_ = ctx.saved_tensors
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            dh, dparams = HiddenNode._backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need_p)
        return None, dh, None, None, *dparams

    @staticmethod
    def _backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need_p):
        call: LogitCall = ctx.call
        need_h, params = ctx.needs_input_grad[1], list(ctx.norm_params)
        dh = (torch.zeros_like if call.rows is not None else torch.empty_like)(hidden) if need_h else None
        dparams = [
            torch.zeros(p.shape, device=p.device, dtype=acc_dtype(p.dtype)) if need else None
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
                addmm_acc(dn, dy.to(call.cdt), w)
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


class WeightNode(torch.autograd.Function):
    """(call, weight, bias, hidden, log Z, entropy) -> zeros added to the log-probs and entropy, so that the gradient
    of the weight and bias is formed here, vocabulary tile by tile, apart from the hidden states' gradient."""

    @staticmethod
    def forward(ctx, call: LogitCall, weight, bias, hidden, log_z, entropy):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, log_z, entropy, *call.reread())
        ctx.call = call
        zeros = log_z.new_zeros(call.n)
        return zeros, (log_z.new_zeros(call.n) if entropy is not None else None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        if g_logp is None and g_ent is None:
            return (None,) * 6
        first_order()
        with ctx.call.gathered():
            hidden, log_z, entropy, weight, bias, *_ = ctx.saved_tensors
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            dw, db = WeightNode._backward(ctx, weight, bias, hidden, log_z, entropy, g_logp, g_ent)
        return None, dw, db, None, None, None

    @staticmethod
    def _backward(ctx, weight, bias, hidden, log_z, entropy, g_logp, g_ent):
        call: LogitCall = ctx.call
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
                    addmm_acc(acc_w, dy.t().to(call.cdt), n)
                if need_b:
                    acc_b += dy.sum(0)
            if need_w:
                dw[v0:v1] = acc_w
            if need_b:
                db[v0:v1] = acc_b
        return dw, db
