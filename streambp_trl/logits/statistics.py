"""The kernel's forward: per-row log Z, log-probabilities and TRL's fused-head statistics, tile by tile with an
online log-sum-exp, under no grad. Holds a few floats per row and one (token tile x vocabulary tile) temporary."""

from __future__ import annotations

import torch

from .tiles import LogitCall, rowdot


def statistics(call: LogitCall, hidden, weight, bias) -> tuple:
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
                sum_ez[i:j] = sum_ez[i:j] * rescale + rowdot(e, z)
            if sum_e2 is not None:
                sum_e2[i:j] = sum_e2[i:j] * rescale.square() + rowdot(e, e)
            run_max[i:j] = m_new
            del z, e
    log_z = run_max + torch.log(sum_exp)
    log_probs = target_z - log_z
    entropy = log_z - sum_ez / sum_exp if sum_ez is not None else None
    log_sum_sq = torch.log(sum_e2) - 2 * torch.log(sum_exp) if sum_e2 is not None else None
    mean_logits = sum_z / vocab if sum_z is not None else None
    is_top1 = argmax == call.targets if argmax is not None else None
    return log_z, log_probs, entropy, log_sum_sq, mean_logits, is_top1
