"""Optimizer state, by the name ``TrainingArguments.optim`` gives the optimizer: the one rule the memory model
(:mod:`.setup`), ``streambp-trl max-len`` and a trainer's per-call plan (:mod:`.auto`) count it by.

What each optimizer allocates for a trained parameter ``p`` of ``numel`` elements of ``db`` bytes (its own dtype), at
its first ``step()``, as the optimizer classes the Trainer builds for these names do:

* ``adamw_torch_fused`` (transformers' default), ``adamw_torch``: ``exp_avg`` and ``exp_avg_sq``, each
  ``torch.zeros_like(p)``, so ``2 db`` per element **in the parameter's dtype**: 4 bytes for bfloat16 weights, 8 for
  float32 ones (PEFT's float32 LoRA adapters beside a bfloat16 base), 4 for the bfloat16 adapters TRL makes of a
  quantized model's; the ``step`` counter is a scalar. ``adamw_torch`` (``foreach``) also allocates, inside
  ``step()``, ``sqrt(exp_avg_sq)`` of every parameter at once: ``db`` more per element while the step runs (after the
  backward, beside every gradient: :attr:`OptimizerRule.step_bytes`), the fused kernel nothing.
* ``adamw_8bit`` / ``adamw_bnb_8bit`` / ``paged_adamw_8bit`` (bitsandbytes' blockwise 8-bit Adam): two uint8 states
  and a float32 absmax per block of 256 elements of each, ``2 + 8/256`` bytes per element whatever the dtype (a
  tensor under 4096 elements keeps float32 states, 8 bytes: counted for a model's own tensors, left out of the
  memory model's per-element figure, where norms are 0.004% of Qwen3-8B; the shared 2 KiB quantization maps are not
  counted). The paged variants' states
  live in CUDA managed memory, which the driver may move to the host under pressure: counted on the GPU as the others.
* ``paged_adamw_32bit``, ``lion_32bit`` / ``paged_lion_32bit``: bitsandbytes' float32 states, 8 and 4 bytes;
  ``lion_8bit`` / ``paged_lion_8bit``: one uint8 state, ``1 + 4/256``.
* ``adafactor`` (transformers' Adafactor as the Trainer builds it: no first moment): a float32 mean of the squared
  gradient per row and per column of each matrix, ``4 (rows + cols)`` bytes, and a float32 ``exp_avg_sq`` of each
  vector; inside ``step()``, one parameter at a time, float32 copies of a half-precision parameter's gradient and
  weight and two float32 updates: 16 bytes per element of the largest trained matrix.
* ``adagrad``, ``rmsprop``: one ``zeros_like`` state, ``db``. ``sgd`` (momentum 0, the Trainer's default) and
  ``none`` (no optimizer step: the forward+backward alone): nothing.

``adamw`` and ``adamw-8bit``, max-len's earlier spellings, name ``adamw_torch_fused`` and ``adamw_8bit``. An optimizer
whose state DeepSpeed keeps in host memory (``offload_optimizer``, ``configs/accelerate/zero3_offload.yaml``) holds
none on the GPU: callers pass ``offloaded``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch

_BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantize each state in blocks of 256, one float32 absmax each
_BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep float32 states


@dataclasses.dataclass(frozen=True)
class OptimizerRule:
    """The state of one optimizer per trained element: ``moments`` tensors of the parameter's dtype
    (``zeros_like``), ``fixed`` bytes whatever the dtype (bitsandbytes' quantized or float32 states), or Adafactor's
    ``factored`` float32 row and column means; and what ``step()`` allocates while it runs: ``step_moments`` more
    tensors of the parameter's dtype for every parameter at once (torch's foreach AdamW), ``step_copies`` float32
    copies of one parameter at a time (Adafactor)."""

    moments: int = 0
    fixed: float = 0.0
    factored: bool = False
    step_moments: int = 0
    step_copies: int = 0
    small: int = 0  # bitsandbytes: a tensor of fewer elements keeps float32 states (small_bytes an element)
    small_bytes: float = 0.0

    def element_bytes(self, db: int, narrow: int = 1) -> float:
        """State bytes per trained element of ``db`` bytes; ``narrow``: the narrower side of the trained matrices
        (Adafactor's ``4 (rows + cols) / (rows cols)`` is at most ``8 / narrow``)."""
        if self.factored:
            return 8 / max(narrow, 1)
        return self.moments * db + self.fixed

    def tensor_bytes(self, shape: torch.Size | tuple[int, ...], db: int) -> int:
        """State bytes of one trained tensor of ``shape`` and ``db`` bytes an element."""
        numel = math.prod(shape)
        if self.factored:
            return 4 * (math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2 else numel)
        if numel < self.small:
            return math.ceil(numel * self.small_bytes)
        return math.ceil(numel * (self.moments * db + self.fixed))

    def step_bytes(self, trained: int, db: int, largest: int) -> int:
        """Bytes ``step()`` allocates beyond the state while it runs, for ``trained`` elements of ``db`` bytes whose
        largest tensor has ``largest`` elements."""
        return self.step_moments * trained * db + self.step_copies * 4 * largest


_ADAM = OptimizerRule(moments=2)
_ADAM_8BIT = OptimizerRule(fixed=2 + 2 * 4 / _BNB_BLOCK, small=_BNB_MIN_8BIT, small_bytes=8)
_LION_8BIT = OptimizerRule(fixed=1 + 4 / _BNB_BLOCK, small=_BNB_MIN_8BIT, small_bytes=4)
_ONE_MOMENT = OptimizerRule(moments=1)
_NONE = OptimizerRule()

OPTIMIZERS: dict[str, OptimizerRule] = {
    "adamw_torch_fused": _ADAM,
    "adamw_torch": OptimizerRule(moments=2, step_moments=1),
    "adamw_8bit": _ADAM_8BIT,
    "adamw_bnb_8bit": _ADAM_8BIT,
    "paged_adamw_8bit": _ADAM_8BIT,
    "paged_adamw_32bit": OptimizerRule(fixed=8),
    "lion_8bit": _LION_8BIT,
    "paged_lion_8bit": _LION_8BIT,
    "lion_32bit": OptimizerRule(fixed=4),
    "paged_lion_32bit": OptimizerRule(fixed=4),
    "adafactor": OptimizerRule(factored=True, step_copies=4),
    "adagrad": _ONE_MOMENT,
    "rmsprop": _ONE_MOMENT,
    "sgd": _NONE,
    "none": _NONE,
}
ALIASES = {"adamw": "adamw_torch_fused", "adamw-8bit": "adamw_8bit"}  # max-len's earlier spellings
DEFAULT = "adamw_torch_fused"  # TrainingArguments' default optim


def canonical(name: object) -> str:
    """The name of :data:`OPTIMIZERS` for ``name`` (an ``optim`` string or ``OptimizerNames`` member, or an alias);
    raises ``ValueError`` for an optimizer this module does not size."""
    text = str(getattr(name, "value", name))
    text = ALIASES.get(text, text)
    if text not in OPTIMIZERS:
        raise ValueError(f"optimizer state of {text!r} is not sized; known: {', '.join([*OPTIMIZERS, *ALIASES])}.")
    return text


def rule(name: object) -> OptimizerRule:
    """The :class:`OptimizerRule` of an ``optim`` name (:func:`canonical`)."""
    return OPTIMIZERS[canonical(name)]


def state_bytes(params: Iterable[torch.nn.Parameter], optim: object, optimizer=None) -> tuple[int, int]:
    """``(all, pending)``: device bytes the state of ``optim`` holds for the trained ones of ``params``, and of those
    the bytes not allocated yet. A parameter whose state ``optimizer`` (the trainer's, once built) already holds is
    counted at the bytes of its state tensors on the parameter's device (none where they live elsewhere); one without
    state yet by :meth:`OptimizerRule.tensor_bytes` of its shape and dtype, until the optimizer has stepped (it holds
    some state): the first ``step()`` allocates every state it will, so a parameter still without one (it got no
    gradient) holds none (a bitsandbytes 4-bit parameter is never trained: frozen base weights). ``optim``
    ``None``: nothing."""
    if optim is None:
        return 0, 0
    each = rule(optim)
    states = getattr(optimizer, "state", None) or {}
    held = pending = 0
    seen: set[int] = set()  # (bitsandbytes hands every parameter's state the same quantization maps)
    for p in params:
        if not p.requires_grad:
            continue
        state = states.get(p) if isinstance(states, dict) else None
        if state:
            for t in state.values():
                if torch.is_tensor(t) and t.device == p.device and t.dim() > 0 and id(t) not in seen:
                    seen.add(id(t))
                    held += t.numel() * t.element_size()
        elif not states:
            expected = each.tensor_bytes(p.shape, p.element_size())
            held, pending = held + expected, pending + expected
    return held, pending
