"""One logit kernel call's description and the tile arithmetic shared by its forward and backward: the logit
transform, a tile's logits and its gradient dL/dy, and float32 accumulation of half-precision products."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import torch
from torch import nn

STAT_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DEFAULT_VOCAB_CHUNK = 8192


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_state(device_type: str) -> dict:
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
    }


class Transform:
    """The logit transform z = softcap(scale * y) / temperature, applied in place on a tile."""

    def __init__(self, temperature: float, softcap: float | None, scale: float):
        self.inv_t, self.softcap, self.scale = 1.0 / temperature, softcap, scale

    def forward_(self, y: torch.Tensor) -> torch.Tensor:
        """z, computed in y's storage (y itself when the transform is the identity: no pass over the tile)."""
        if self.softcap is None:
            factor = self.scale * self.inv_t
            return y if factor == 1.0 else y.mul_(factor)
        return y.mul_(self.scale / self.softcap).tanh_().mul_(self.softcap * self.inv_t)

    def with_tanh_(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, t), t = tanh(scale * y / softcap) kept in y's storage for :meth:`chain_` (None without softcap)."""
        if self.softcap is None:
            return self.forward_(y), None
        t = y.mul_(self.scale / self.softcap).tanh_()
        return t * (self.softcap * self.inv_t), t

    def chain_(self, dz: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """dL/dy from dL/dz, in dz's storage (t is consumed); no pass for a factor of 1."""
        factor = self.inv_t * self.scale
        if factor != 1.0:
            dz.mul_(factor)
        return dz if t is None else dz.mul_(t.square_().neg_().add_(1))


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[i, v] * b[i, v] per row, without an (n x v) temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2))[:, 0, 0]


_CAST_SLICE_ELEMENTS = 2**24  # elements of one operand slice cast to the accumulation dtype (64 MiB in float32)


def addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, accumulating in acc's dtype without rounding the product to a lower precision first.

    On CUDA a half-precision product accumulates into float32 directly (``out_dtype``). Elsewhere the operands are
    cast to acc's dtype, a slice of the contracted dimension at a time, so no whole-operand copy is made (the eager
    form's ``dy @ W`` would cast the whole (V, H) head weight to float32: 2.5 GB for Qwen3-8B on the CPU)."""
    if acc.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    k = a.shape[1]
    step = max(1, min(k, _CAST_SLICE_ELEMENTS // max(a.shape[0], b.shape[1], 1)))
    for k0 in range(0, k, step):
        acc.addmm_(a[:, k0 : k0 + step].to(acc.dtype), b[k0 : k0 + step].to(acc.dtype))


@dataclasses.dataclass
class LogitCall:
    """Everything about one logit kernel call that is not a differentiable tensor."""

    transform: Transform
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
        if g_logp is not None:  # + g_logp at the target, for the rows whose target is in the tile (0 elsewhere: exact)
            local = self.targets[i:j] - v0
            inside = (local >= 0) & (local < v1 - v0)
            hit = torch.where(inside, g_logp[i:j].to(self.acc), 0.0)
            dz.scatter_add_(1, local.clamp(0, v1 - v0 - 1)[:, None], hit[:, None])
        return self.transform.chain_(dz, t), w
