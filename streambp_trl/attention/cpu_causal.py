"""A plainly causal chunk's attention on the CPU: the prefix and the diagonal block as two flash calls, merged.

A chunk's queries Q (positions [s, s + c)) attend bottom-right causally to the keys of [p, s + c): every prefix key
[p, s) and the chunk's own keys up to their position. PyTorch's bottom-right causal bias on the CPU materialises that
(c x (s - p + c)) mask and runs the flash kernel over the whole block, masked half of the diagonal included. Here the
two parts run separately, each without a mask: the prefix unmasked, the diagonal (c x c) with ``is_causal`` (top-left
alignment is bottom-right when queries and keys are equally many), and the results merge through their row
log-sum-exps L1, L2:

    L = logaddexp(L1, L2),    O = exp(L1 - L) O1 + exp(L2 - L) O2.

Backward runs the flash backward of each part with the merged O and L (the softmax statistics of the whole row), which
is each part's exact share of the gradient: dQ = dQ1 + dQ2, and the key/value gradients of the prefix and of the chunk.
So the masked half of the diagonal block is never computed and no mask is built: about 1/n of a layer's attention
work with n chunks, and the mask's (c x kv_len) build per call.

Holds what SDPA's flash backward holds (Q, K, V, O and L), and in forward one more (c x d) output per head.
Without dropout only (the flash kernel draws its own mask per call).
"""

from __future__ import annotations

import torch

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class CausalChunkAttention(torch.autograd.Function):
    """Bottom-right causal attention of ``query`` (batch, heads, c, d) over ``key``/``value`` (batch, kv_heads,
    prefix + c, d; grouped heads as the flash kernel takes them), scaled by ``scale`` (``None``: 1/sqrt(d)); returns
    (batch, heads, c, d_v)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None):
        p = key.shape[2] - query.shape[2]
        out, lse = _forward(query, key[:, :, p:], value[:, :, p:], 0.0, True, scale=scale)
        if p:
            out_prefix, lse_prefix = _forward(query, key[:, :, :p], value[:, :, :p], 0.0, False, scale=scale)
            merged = torch.logaddexp(lse_prefix, lse)
            out = out_prefix.mul_((lse_prefix - merged).exp_().unsqueeze(-1)).add_(
                out.mul_((lse - merged).exp_().unsqueeze(-1))
            )
            lse = merged
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.prefix = scale, p
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        p, grad = ctx.prefix, grad.contiguous()
        dq, dk, dv = _backward(grad, query, key[:, :, p:], value[:, :, p:], out, lse, 0.0, True, scale=ctx.scale)
        if p:
            dq_prefix, dk_prefix, dv_prefix = _backward(
                grad, query, key[:, :, :p], value[:, :, :p], out, lse, 0.0, False, scale=ctx.scale
            )
            dq += dq_prefix
            dk, dv = torch.cat([dk_prefix, dk], dim=2), torch.cat([dv_prefix, dv], dim=2)
        return dq, dk, dv, None
