"""The kernel's autograd nodes (see :mod:`streambp_trl.logits`): the logit node (the forward's statistics; in
backward the gradient of the hidden states and the norm's parameters, and in the fused form of the weight and bias
too) and, in the two-node form, the weight node (the gradient of the LM head's weight and bias, apart)."""

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


class LogitNode(torch.autograd.Function):
    """(call, hidden (M, H), weight, bias, *norm parameters) -> log Z and the statistics; in backward, one sweep over
    (token tile x vocabulary tile) that recomputes each logit tile once and forms from it the gradient of the hidden
    states and the norm's parameters, and of the weight and bias when they arrive with ``requires_grad`` (the fused
    form; in the two-node form they arrive detached and :class:`WeightNode` forms theirs).

    Memory in backward: dh (M, H); with the weight, a (V, H) accumulator in the accumulation dtype (dW itself when
    the weight has that dtype, else a float32 buffer beside the dW it is cast to) and a (V,) one for the bias."""

    @staticmethod
    def forward(ctx, call: LogitCall, hidden, weight, bias, *norm_params):
        ctx.set_materialize_grads(False)
        # the tiles' products are cast to the matmul dtype explicitly; autocast would also lower the row sums
        with torch.no_grad(), torch.autocast(call.autocast["device_type"], enabled=False):
            log_z, *stats = statistics(call, hidden, weight, bias)
        ctx.save_for_backward(hidden, log_z, stats[1], *call.reread())
        ctx.call, ctx.norm_params = call, norm_params
        ctx.mark_non_differentiable(log_z, *(x for x in stats[2:] if x is not None))
        return log_z, *stats

    @staticmethod
    def backward(ctx, _g_log_z, g_logp, g_ent, *_):
        params = list(ctx.norm_params)
        need = ctx.needs_input_grad[1:4]  # hidden, weight, bias
        need_p = [ctx.needs_input_grad[4 + k] for k in range(len(params))]
        if (g_logp is None and g_ent is None) or not (any(need) or any(need_p)):
            return (None,) * (4 + len(params))
        first_order()
        with ctx.call.gathered():
            hidden, log_z, entropy, weight, bias, *_ = ctx.saved_tensors
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            grads = LogitNode._backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need)
        return None, *grads

    @staticmethod
    def _backward(ctx, hidden, weight, bias, log_z, entropy, g_logp, g_ent, need):
        call: LogitCall = ctx.call
        _, need_w, need_b = need
        to_hidden = HiddenGradient(ctx, hidden)
        acc_w = torch.zeros(weight.shape, device=weight.device, dtype=call.acc) if need_w else None
        acc_b = torch.zeros(bias.shape, device=bias.device, dtype=call.acc) if need_b else None
        for i, j in call.token_tiles():
            h, n = to_hidden.normed(hidden, i, j)
            dn = torch.zeros(n.shape, device=n.device, dtype=call.acc) if to_hidden.needed else None
            for v0, v1 in call.vocab_tiles(weight.shape[0]):
                dy, w = call.dlogits(n.detach(), weight, bias, v0, v1, i, j, log_z, entropy, g_logp, g_ent)
                dy_c = dy.to(call.cdt)
                if dn is not None:
                    addmm_acc(dn, dy_c, w)
                if need_w:
                    addmm_acc(acc_w[v0:v1], dy_c.t(), n.detach())
                if need_b:
                    acc_b[v0:v1] += dy.sum(0)
            if dn is not None:
                to_hidden.add(i, j, h, n, dn)
        dw = None if acc_w is None else acc_w.to(weight.dtype)
        db = None if acc_b is None else acc_b.to(bias.dtype)
        dh, dparams = to_hidden.result()
        return dh, dw, db, *dparams


class HiddenGradient:
    """The gradient of the hidden states (M, H) and of the norm's parameters, filled token tile by token tile from
    dL/dn of the tile's scored rows: back through the norm (recomputed on the tile, in the model's own arithmetic,
    its parameters' gradients summed over tiles in the accumulation dtype), into dh at the tile's rows."""

    def __init__(self, ctx, hidden: torch.Tensor):
        self.call: LogitCall = ctx.call
        self.need_h, self.params = ctx.needs_input_grad[1], list(ctx.norm_params)
        self.need_p = [ctx.needs_input_grad[4 + k] for k in range(len(self.params))]
        self.grad_params = [p for p, need in zip(self.params, self.need_p, strict=True) if need]
        self.dh = None
        if self.need_h:
            self.dh = (torch.zeros_like if self.call.rows is not None else torch.empty_like)(hidden)
        self.dparams = [
            torch.zeros(p.shape, device=p.device, dtype=acc_dtype(p.dtype)) if need else None
            for p, need in zip(self.params, self.need_p, strict=True)
        ]

    @property
    def needed(self) -> bool:
        return self.need_h or bool(self.grad_params)

    def normed(self, hidden: torch.Tensor, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) of the scored rows [i, j), h a leaf that requires grad where dh goes through the norm."""
        h = self.call.hidden_rows(hidden, i, j).detach()
        with torch.enable_grad():
            h.requires_grad_(self.need_h and self.call.norm is not None)
            return h, self.call.normed(h)

    def add(self, i: int, j: int, h: torch.Tensor, n: torch.Tensor, dn: torch.Tensor) -> None:
        """Take dL/dn of the scored rows [i, j) (``h``, ``n`` from :meth:`normed`)."""
        call = self.call
        if call.norm is None:
            dh_rows = dn
        else:
            inputs = ([h] if self.need_h else []) + self.grad_params
            grads = iter(torch.autograd.grad(n, inputs, dn.to(n.dtype), allow_unused=True))
            dh_rows = next(grads) if self.need_h else None
            for k, need in enumerate(self.need_p):
                g = next(grads) if need else None
                if g is not None:
                    self.dparams[k] += g
        if self.need_h:
            if call.rows is None:
                self.dh[i:j] = dh_rows
            else:
                self.dh.index_copy_(0, call.rows[i:j], dh_rows.to(self.dh.dtype))

    def result(self) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """dh and the norm's parameter gradients in their parameters' dtypes."""
        return self.dh, [None if d is None else d.to(p.dtype) for d, p in zip(self.dparams, self.params, strict=True)]


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
