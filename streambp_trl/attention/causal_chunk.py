"""A plainly causal chunk's attention: the prefix and the diagonal block as two fused calls, merged.

A chunk's queries Q (positions [s, s + c)) attend bottom-right causally to the keys of [p, s + c): every prefix key
[p, s) and the chunk's own keys up to their position. Here the two parts run separately, each without a mask: the
prefix unmasked, the diagonal (c x c) with ``is_causal`` (top-left alignment is bottom-right when queries and keys
are equally many), and the results merge through their row log-sum-exps L1, L2:

    L = logaddexp(L1, L2),    O = exp(L1 - L) O1 + exp(L2 - L) O2.

Backward runs the fused backward of each part with the merged O and L (the softmax statistics of the whole row),
which is each part's exact share of the gradient: dQ = dQ1 + dQ2, and the key/value gradients of the prefix and of
the chunk. So the masked half of the diagonal block is never computed and no mask is built.

Two kernels (:class:`LseKernel`) take this form, each a fused attention that returns its row log-sum-exps and whose
backward takes a given output and log-sum-exp:

* :data:`CPU_FLASH`: PyTorch's CPU flash kernel (PyTorch's bottom-right causal bias on the CPU would materialise the
  (c x (s - p + c)) mask and run over the whole block);
* :data:`CUDNN`: cuDNN's fused attention on CUDA (bfloat16/float16). PyTorch's bottom-right causal bias reaches only
  its flash and memory-efficient kernels; on Hopper GPUs cuDNN's is the fastest (PyTorch prefers it for plain causal
  SDPA there), about twice flash's speed. Its first use on a device, dtype and head dimension is checked against
  SDPA's math kernel on a small problem (:func:`cudnn_usable`); where it fails or differs, the flash kernel is used.

Holds what a fused backward holds (Q, K, V, O and L), and in forward one more (c x d) output per head; in backward
each part's key/value gradient, joined. Without dropout only (a fused kernel draws its own mask per call). Where the
layer keeps its attention outputs (:mod:`.kept_outputs`), the forward records O and L and the recompute takes them
back instead of running the two forward kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import torch

from . import kept_outputs

_cpu_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_cudnn_forward = torch.ops.aten._scaled_dot_product_cudnn_attention
_cudnn_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

# (query, key, value, causal, scale) -> (out, lse (batch, heads, q_len), what its backward needs besides)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, "float | None"], tuple]
# (grad, query, key, value, out, lse, causal, scale, extra) -> (dq, dk, dv)
Backward = Callable[..., tuple]


@dataclasses.dataclass(frozen=True)
class LseKernel:
    """A fused attention that returns its row log-sum-exps, and its backward at a given output and log-sum-exp."""

    name: str
    forward: Forward
    backward: Backward


def _cpu_fwd(query, key, value, causal, scale):
    out, lse = _cpu_forward(query, key, value, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_bwd(grad, query, key, value, out, lse, causal, scale, extra):
    return _cpu_backward(grad.contiguous(), query, key, value, out, lse, 0.0, causal, scale=scale)


def _cudnn_fwd(query, key, value, causal, scale):
    out, lse, _, _, max_q, max_k, seed, offset, _ = _cudnn_forward(
        query, key, value, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse.squeeze(-1), (max_q, max_k, seed, offset)


def _cudnn_bwd(grad, query, key, value, out, lse, causal, scale, extra):
    max_q, max_k, seed, offset = extra
    if grad.stride() != out.stride():  # the kernel reads dO in O's layout
        grad = torch.empty_strided(out.shape, out.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return _cudnn_backward(
        grad_out=grad,
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=lse.unsqueeze(-1),
        philox_seed=seed,
        philox_offset=offset,
        attn_bias=None,
        cum_seq_q=None,
        cum_seq_k=None,
        max_q=max_q,
        max_k=max_k,
        dropout_p=0.0,
        is_causal=causal,
        scale=scale,
    )[:3]


CPU_FLASH = LseKernel("cpu-flash", _cpu_fwd, _cpu_bwd)
CUDNN = LseKernel("cudnn", _cudnn_fwd, _cudnn_bwd)


class CausalChunkAttention(torch.autograd.Function):
    """Bottom-right causal attention of ``query`` (batch, heads, c, d) over ``key``/``value`` (batch, kv_heads,
    prefix + c, d; grouped heads as the fused kernel takes them), scaled by ``scale`` (``None``: 1/sqrt(d)), through
    ``kernel`` (:data:`CPU_FLASH` or :data:`CUDNN`); returns (batch, heads, c, d_v). The two parts' outputs merge in
    float32 (one rounding to a low-precision dtype, as a single fused call's output).

    ``align``: both calls run on ``c`` rounded up to a multiple of it (zero queries appended, and as many keys and
    values after the diagonal block's), so a kernel that builds a plan per shape sees few shapes (with a prefix that
    is a multiple of ``align``). Exact: an appended key comes after every real query, which the causal diagonal hides
    from it; an appended query's output is dropped and its gradient is zero, which adds nothing to any other's.
    """

    @staticmethod
    def forward(ctx, query, key, value, scale: float | None, kernel: LseKernel = CPU_FLASH, align: int = 1):
        c = query.shape[2]
        p = key.shape[2] - c
        pad = -c % align
        kept = kept_outputs.active()
        taken = kept.take(query, key) if kept is not None and kept.replay else None
        if taken is not None:  # the forward's output and statistics (a recompute: kernels skipped)
            out, lse, extras = taken
            ctx.save_for_backward(_pad(query, pad), key, value, out, lse)
            ctx.scale, ctx.prefix, ctx.pad, ctx.kernel, ctx.extras = scale, p, pad, kernel, extras
            return out[:, :, :c] if pad else out
        query_in = query
        query, key_diag, value_diag = (_pad(t, pad) for t in (query, key[:, :, p:], value[:, :, p:]))
        out, lse, extra = kernel.forward(query, key_diag, value_diag, True, scale)
        extras = [extra]
        if p:
            out_prefix, lse_prefix, extra_prefix = kernel.forward(query, key[:, :, :p], value[:, :, :p], False, scale)
            merged = torch.logaddexp(lse_prefix, lse)
            w_prefix, w = (lse_prefix - merged).exp_().unsqueeze(-1), (lse - merged).exp_().unsqueeze(-1)
            if out.dtype in (torch.bfloat16, torch.float16):
                both = out_prefix.float().mul_(w_prefix).add_(out.float().mul_(w))
                out = torch.empty_like(out).copy_(both)  # the fused kernel's output layout
                del both
            else:
                out = out_prefix.mul_(w_prefix).add_(out.mul_(w))
            lse = merged
            extras.append(extra_prefix)
        if kept is not None and not kept.replay:
            kept.keep(query_in, key, out, lse, extras)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.prefix, ctx.pad, ctx.kernel, ctx.extras = scale, p, pad, kernel, extras
        return out[:, :, :c] if pad else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        p, pad, kernel, extras = ctx.prefix, ctx.pad, ctx.kernel, ctx.extras
        ctx.extras = None
        grad = _pad(grad, pad)
        key_diag, value_diag = _pad(key[:, :, p:], pad), _pad(value[:, :, p:], pad)
        dq, dk, dv = kernel.backward(grad, query, key_diag, value_diag, out, lse, True, ctx.scale, extras[0])
        if pad:
            c = query.shape[2] - pad
            dq, dk, dv = dq[:, :, :c], dk[:, :, :c], dv[:, :, :c]
        if p:
            dq_prefix, dk_prefix, dv_prefix = kernel.backward(
                grad, query, key[:, :, :p], value[:, :, :p], out, lse, False, ctx.scale, extras[1]
            )
            dq += dq_prefix[:, :, : dq.shape[2]]
            dk, dv = torch.cat([dk_prefix, dk], dim=2), torch.cat([dv_prefix, dv], dim=2)
        return dq, dk, dv, None, None, None


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` (batch, heads, length, d) with ``n`` zero rows appended along the length (itself when ``n`` is 0)."""
    return torch.nn.functional.pad(t, (0, 0, 0, n)) if n else t


def cudnn_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :data:`CUDNN` runs, and agrees with SDPA's math kernel, for ``dtype`` and ``head_dim`` on ``device``
    (a CUDA device of compute capability 9.0 or newer, where PyTorch's cuDNN attention is enabled and deterministic
    algorithms are not required: :func:`deterministic_only`). Checked once per
    (device, dtype, head dimension): forward and input gradients of a small grouped-query chunk with a prefix, its
    queries padded as :class:`CausalChunkAttention`'s ``align`` pads them."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim > 128:
        return False
    if not (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()) or deterministic_only():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _cudnn_check(torch.device("cuda", index), dtype, head_dim)


def deterministic_only() -> bool:
    """Deterministic algorithms are required (``torch.use_deterministic_algorithms(True)``, not warn-only), which
    cuDNN's attention backward is not: PyTorch's SDPA does not choose it then, nor does this form."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


@functools.cache
def _cudnn_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    # its own tensors and graph, whatever the caller's mode (no grad, inference mode, autocast)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        return _cudnn_compare(device, dtype, head_dim)


def _cudnn_compare(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    generator = torch.Generator(device=device).manual_seed(0)
    chunk, prefix = 64, 96
    q, k, v = (
        torch.randn(1, 4, n, head_dim, device=device, dtype=dtype, generator=generator)
        for n in (chunk, prefix + chunk, prefix + chunk)
    )
    k, v = k[:, :1], v[:, :1]
    grad = torch.randn(1, 4, chunk, head_dim, device=device, dtype=dtype, generator=generator)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        out = CausalChunkAttention.apply(*leaves, None, CUDNN, 128)  # 64 queries padded to 128
        got = (out, *torch.autograd.grad(out, leaves, grad))
    except RuntimeError as e:
        warnings.warn(
            f"StreamBP: cuDNN attention unavailable ({str(e).splitlines()[0]}); using flash attention.", stacklevel=3
        )
        return False
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool, device=device).tril(prefix)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_leaves[:1], *(t.expand(-1, 4, -1, -1) for t in ref_leaves[1:]), attn_mask=mask
    )
    want = (ref, *torch.autograd.grad(ref, ref_leaves, grad.double()))
    errors = [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]
    if max(errors) > 2e-2:
        warnings.warn(
            f"StreamBP: cuDNN attention differs from the reference (relative errors {errors}); using flash attention.",
            stacklevel=3,
        )
        return False
    return True
