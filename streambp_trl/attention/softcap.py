"""Attention with logit softcapping (Gemma 2, VaultGemma), tiled over the keys with an online softmax.

No fused SDPA kernel applies ``softcap * tanh(scores / softcap)`` to the scores, so :func:`softcap_attention` computes
it itself, on the CPU and on CUDA alike, exactly as the models' own eager attention defines it:

    S = softcap * tanh(scale * Q K^T / softcap),  S[masked] = -inf,  O = softmax(S) V

one block of ``TILE`` keys at a time, with a running maximum and sum (the log-sum-exp ``L`` of each query row is kept
for the backward). The backward recomputes each block's scores from Q, K and L:

    P = exp(S - L),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),
    dS_raw = dS * (1 - tanh^2),  dQ = scale * dS_raw K,  dK = scale * dS_raw^T Q.

Memory: besides the inputs and the output, one (batch, heads, q_len, TILE) block of scores at a time and the (batch,
heads, q_len) statistics; grouped key/value heads are broadcast, not copied. A query row with no visible key (a padded
position) outputs zeros and gets no gradient.
"""

from __future__ import annotations

import torch

TILE = 512  # keys per block


def softcap_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block: torch.Tensor | None,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """(batch, q_len, heads, d_v) attention of ``query`` (batch, heads, q_len, d) over ``key``/``value`` (batch,
    kv_heads, kv_len, d); ``block``: the boolean (batch, 1, q_len, kv_len) mask block (True: attend), or ``None`` for
    bottom-right causal (the queries end where the keys end)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _SoftcapAttention.apply(query, key, value, block, float(scale), float(softcap))
    return out.transpose(1, 2).contiguous()


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, q, d) as (batch, kv_heads, group, q, d)."""
    b, h, q, d = query.shape
    return query.reshape(b, kv_heads, h // kv_heads, q, d)


def _visible(block: torch.Tensor | None, q_len: int, kv_len: int, k0: int, k1: int, device) -> torch.Tensor:
    """Which keys [k0, k1) each query sees, broadcastable to (batch, kv_heads, group, q_len, k1 - k0)."""
    if block is not None:
        return block[:, :, None, :, k0:k1]
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(k0, k1, device=device)[None, :] <= rows


def _scores(q, k, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The capped scores of one key block and their tanh (kept for the derivative)."""
    t = torch.tanh(torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * (scale / softcap))
    return t * softcap, t


class _SoftcapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, block, scale: float, softcap: float):
        kv_heads, kv_len, q_len = key.shape[1], key.shape[2], query.shape[2]
        q = _grouped(query, kv_heads)
        stats = (*q.shape[:-1], 1)
        acc_dtype = torch.promote_types(query.dtype, torch.float32)
        m = q.new_full(stats, float("-inf"), dtype=acc_dtype)
        total = q.new_zeros(stats, dtype=acc_dtype)
        acc = q.new_zeros((*q.shape[:-1], value.shape[-1]), dtype=acc_dtype)
        for k0 in range(0, kv_len, TILE):
            k1 = min(k0 + TILE, kv_len)
            s, _ = _scores(q, key[:, :, k0:k1], scale, softcap)
            s = s.to(acc_dtype).masked_fill(~_visible(block, q_len, kv_len, k0, k1, q.device), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe)
            rescale = torch.exp(m - safe)
            total = total * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p.to(value.dtype), value[:, :, k0:k1].unsqueeze(2)).to(acc_dtype)
            m = m_new
        seen = total > 0
        out = torch.where(seen, acc / total.clamp_min(torch.finfo(acc_dtype).tiny), 0.0)
        lse = torch.where(seen, m + torch.log(total.clamp_min(torch.finfo(acc_dtype).tiny)), float("inf"))
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.block, ctx.scale, ctx.softcap = block, scale, softcap
        return out.reshape(query.shape[:-1] + value.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        block, scale, softcap = ctx.block, ctx.scale, ctx.softcap
        kv_heads, kv_len, q_len = key.shape[1], key.shape[2], query.shape[2]
        q = _grouped(query, kv_heads)
        do = _grouped(grad_out, kv_heads)
        acc_dtype = lse.dtype
        delta = (do.to(acc_dtype) * out.to(acc_dtype)).sum(-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk, dv = torch.empty_like(key), torch.empty_like(value)
        for k0 in range(0, kv_len, TILE):
            k1 = min(k0 + TILE, kv_len)
            kt, vt = key[:, :, k0:k1].unsqueeze(2), value[:, :, k0:k1].unsqueeze(2)
            s, t = _scores(q, key[:, :, k0:k1], scale, softcap)
            visible = _visible(block, q_len, kv_len, k0, k1, q.device)
            p = torch.exp(s.to(acc_dtype) - lse).masked_fill(~visible, 0.0)
            dv[:, :, k0:k1] = torch.matmul(p.transpose(-1, -2).to(value.dtype), do).sum(2)
            dp = torch.matmul(do, vt.transpose(-1, -2)).to(acc_dtype)
            ds = p * (dp - delta) * (1 - t.to(acc_dtype) ** 2) * scale
            dq += torch.matmul(ds.to(key.dtype), kt).to(acc_dtype)
            dk[:, :, k0:k1] = torch.matmul(ds.transpose(-1, -2).to(query.dtype), q).sum(2)
        return dq.to(query.dtype).reshape(query.shape), dk, dv, None, None, None
