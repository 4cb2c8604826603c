"""Counting one training step instead of timing it: FLOPs, kernel operations and host synchronisations.

A timing depends on the machine and its load; these counts do not. :class:`StepCounter` is a dispatch mode that sees
every aten operation of a forward and backward (autograd's included) and records:

* ``flops``: matrix products by :mod:`torch.utils.flop_counter`'s formulas (in-place ones too); attention (the
  CPU's fused SDPA operations) by the same formulas with the (query x key) product replaced by the pairs the mask
  allows: a causal mask over T tokens allows T (T + 1) / 2 pairs, not T^2, so one full-length causal call and the
  same attention cut into chunks over a prefix count alike. A matrix product is attributed to the weight whose shape
  it has as an operand or output, the largest such when several match (``lm_head``, ``q/o_proj``,
  ``k/v_proj``, ``mlp``: whichever of the model's weights share the shape), attention to ``attention``, the
  rest to ``other``.
* ``ops``: aten operations, views and other aliasing operations left out (each is at least one kernel launch on a
  GPU).
* ``syncs``: operations that make the host wait for the device on a GPU, because their output's size or value is
  read on the host: ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``.item()`` / ``bool()``
  (``_local_scalar_dense``), ``equal``, ``is_nonzero``; each with the file and line of the innermost frame in this
  package (or else transformers) that asked for it.

Counting runs the real computation (on the CPU here): a count is of what the step does, not of a model of it.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .spec import MeasureSpec

aten = torch.ops.aten

SYNC_OPS = frozenset(
    {
        aten.nonzero.default,
        aten._local_scalar_dense.default,
        aten.masked_select.default,
        aten.equal.default,
        aten.is_nonzero.default,
        aten.unique_consecutive.default,
        aten._unique2.default,
        aten.unique_dim.default,
    }
)
_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "forward",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "backward",
}
# in-place products, which flop_counter's registry leaves out, by the formula of their out-of-place form
_IN_PLACE = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}
_INDEXING = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default})
_WEIGHT_GROUPS = {"q_proj": "q/o_proj", "o_proj": "q/o_proj", "k_proj": "k/v_proj"}
_WEIGHT_GROUPS |= {"v_proj": "k/v_proj", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _bound(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    return dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs


def allowed_pairs(q_len: int, kv_len: int, causal: bool, mask: torch.Tensor | None) -> int:
    """(query, key) pairs one attention head of one row computes: those a boolean (True) or additive (finite) mask
    allows, averaged over its batch and head dimensions; top-left causal (query i sees keys 0..i); or all."""
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else torch.isfinite(mask)
        return int(allowed.sum()) // (allowed.numel() // (q_len * kv_len))
    if causal:
        return sum(min(i + 1, kv_len) for i in range(q_len))
    return q_len * kv_len


def attention_flops(func: Any, args: tuple, kwargs: dict) -> int:
    """torch's SDPA FLOP formulas with L x S replaced by :func:`allowed_pairs` (per batch row and head)."""
    a = _bound(func, args, kwargs)
    query, key, value = a["query"], a["key"], a["value"]
    b, h, q_len, d = query.shape
    pairs = allowed_pairs(q_len, key.shape[-2], bool(a.get("is_causal")), a.get("attn_mask"))
    d_v = value.shape[-1]
    if _ATTENTION[func] == "forward":  # scores, then probabilities @ values
        return b * h * pairs * 2 * (d + d_v)
    return b * h * pairs * 2 * (3 * d + 2 * d_v)  # scores again, dP and dV, then dQ and dK


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _bool_index(func: Any, args: tuple) -> bool:
    """Indexing with a boolean mask: its output's size is the mask's count (a ``nonzero`` inside)."""
    if func not in _INDEXING or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


def _caller() -> str:
    """``file:line (function)`` of the innermost frame in this package, else in transformers, else ``?``."""
    frames = traceback.extract_stack()[:-2]
    for marker in ("streambp_trl/", "transformers/"):
        for frame in reversed(frames):
            if marker in frame.filename and "bench/counting.py" not in frame.filename:
                return f"{marker}{frame.filename.split(marker)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


@dataclasses.dataclass
class Counts:
    """What one :class:`StepCounter` saw."""

    flops: int = 0
    flops_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops: int = 0
    ops_by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    syncs: list[str] = dataclasses.field(default_factory=list)  # "op at file:line (function)"

    def summary(self) -> dict[str, Any]:
        return {
            "flops": self.flops,
            "flops_by": dict(self.flops_by.most_common()),
            "ops": self.ops,
            "syncs": len(self.syncs),
            "syncs_by_location": dict(collections.Counter(self.syncs).most_common()),
        }


class StepCounter(TorchDispatchMode):
    """Counts FLOPs, operations and host syncs of everything that runs inside it (see the module docstring).

    ``model``: matrix products are attributed to its weights by shape (:attr:`Counts.flops_by`).
    """

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.counts = Counts()
        groups: dict[tuple[int, ...], set[str]] = collections.defaultdict(set)
        for name, p in model.named_parameters() if model is not None else ():
            if p.dim() == 2 and not name.endswith("embed_tokens.weight"):
                leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
                group = "lm_head" if "lm_head" in name else _WEIGHT_GROUPS.get(leaf, leaf)
                for shape in (tuple(p.shape), tuple(p.shape[::-1])):
                    groups[shape].add(group)
        self._groups = {shape: "/".join(sorted(names)) for shape, names in groups.items()}

    def _matmul_group(self, args: tuple, out: Any) -> str:
        shaped = [t for t in (*args, out) if isinstance(t, torch.Tensor) and tuple(t.shape) in self._groups]
        if not shaped:
            return "other"
        return self._groups[tuple(max(shaped, key=torch.Tensor.numel).shape)]  # the largest: a tile may match too

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counts = self.counts
        if not _is_view(func):
            counts.ops += 1
            counts.ops_by_name[func.overloadpacket.__name__] += 1
        if func in SYNC_OPS or _bool_index(func, args):
            counts.syncs.append(f"{func.overloadpacket.__name__} at {_caller()}")
        if func in _ATTENTION:
            flops, group = attention_flops(func, args, kwargs), "attention"
        elif (packet := _IN_PLACE.get(func.overloadpacket, func.overloadpacket)) in flop_registry:
            flops, group = flop_registry[packet](*args, **kwargs, out_val=out), None
            group = self._matmul_group(args, out) if flops else group
        else:
            flops = 0
        if flops:
            counts.flops += flops
            counts.flops_by[group] += flops
        return out


def count_step(spec: MeasureSpec) -> dict[str, Any]:
    """Counts of one training step of ``spec`` (its objective's loss on random ids, as the memory and time workers run
    it, :func:`streambp_trl.bench.worker.step_function`) after one uncounted warm-up step; the model's weights are
    attributed by shape. Returns :meth:`Counts.summary` with the mode, length, chunk sizes and, streamed, the memory
    budget, the form the logit kernel's gradient took and how many layers kept their activations (not recomputed)."""
    from ..engine import last_head_form, last_plan
    from .worker import models_of, step_function

    device = torch.device(spec.device)
    models = models_of(spec, device)  # (DPO: a frozen reference beside the policy)
    model = models[0]
    loss_fn, tokens = step_function(spec, device, models)
    loss_fn().backward()  # warm-up: lazy initialisation and "auto" decisions are not the step's
    model.zero_grad(set_to_none=True)
    with StepCounter(model) as counter:
        loss_fn().backward()
    record = {"mode": spec.mode.value, "seq_len": spec.seq_len, "tokens": tokens}
    if spec.mode.streams:
        record |= {"stream_chunk_size": spec.stream_chunk_size, "logits_chunk_size": spec.logits_chunk_size}
        record |= {"memory_budget": spec.memory_budget, "head_form": last_head_form(model)}
        plan = last_plan(model)
        record["layers_kept"] = 0 if plan is None else min(plan.keep_activations, len(model._streambp.layers))
    return record | counter.counts.summary()
