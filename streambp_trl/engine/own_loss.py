"""How a causal LM's own ``labels=`` loss pairs its labels with its logits; the streamed loss pairs them the same way.

transformers' causal LMs compute that loss in one of two ways. With z_t the logits of position t, y the labels and M
the scored positions whose label is not ignored:

* through ``self.loss_function``, transformers' causal-LM loss (``ForCausalLMLoss``), the labels shifted inside the
  model: L = (1/|M|) sum_{t in M} -log softmax(z_t)[y_{t+1}] (``shift_labels``, when given, are y_{t+1} already;
  ``num_items_in_batch``, when given, replaces |M|; ``ignore_index`` marks the ignored labels, -100 unless given);
* with a ``CrossEntropyLoss()`` the forward builds itself, ``loss_fct(logits.view(-1, V), labels.view(-1))``, the
  labels not shifted: L = (1/|M|) sum_{t in M} -log softmax(z_t)[y_t], ignoring the labels -100. These are the
  decoders of the encoder-decoder families (``BartForCausalLM``, MBart, Marian, Pegasus, PLBart, Blenderbot,
  BlenderbotSmall, ``WhisperForCausalLM``), whose documentation says "The labels are **not shifted** inside the
  model". Their loss reads neither ``shift_labels`` nor ``ignore_index`` nor ``num_items_in_batch``: the forward
  hands them to its decoder with its other keyword arguments, where nothing reads them. The streamed loss ignores
  ``num_items_in_batch`` as they do (transformers' ``Trainer`` passes it to every model whose forward takes
  ``**kwargs``) and refuses the other two (:func:`check_unshifted_call`).

TRL's fused LM head (``fused_lm_head=True``) shifts the labels whatever the model: that is TRL's definition, which the
engine follows there.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


@functools.cache
def labels_shifted(cls: type) -> bool:
    """Whether the causal LM class ``cls`` scores the logits of position t against ``labels[:, t + 1]`` (``True``) or
    against ``labels[:, t]`` (``False``) in its own ``labels=`` loss.

    Read from the code of the first ``forward`` a transformers class defines in ``cls``'s MRO (a subclass, e.g. a
    user's, that wraps it calls it): ``False`` where that code builds ``CrossEntropyLoss`` and does not read
    ``loss_function``; else ``True``, transformers' causal-LM loss, which is also the loss taken for a model from
    outside transformers (remote code), whose forward no rule reads.
    """
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
        if code is not None and klass.__module__.startswith("transformers."):
            return "loss_function" in code.co_names or "CrossEntropyLoss" not in code.co_names
    return True


def check_unshifted_call(lm: nn.Module, shift_labels: object, ignore_index: int) -> None:
    """Refuse, in one line naming the cause and the fix, an argument that a causal LM whose own loss does not shift
    its labels (:func:`labels_shifted` is ``False``) does not read: ``shift_labels``, an ``ignore_index`` other than
    -100."""
    name = type(lm).__name__
    if shift_labels is not None:
        raise ValueError(
            f"{name}'s own loss takes no shift_labels: it scores labels[:, t] against the logits of position t (its "
            "labels are not shifted inside the model). Pass them as labels=."
        )
    if ignore_index != -100:
        raise ValueError(
            f"{name}'s own loss (a CrossEntropyLoss() in its forward) ignores the labels -100 only, not "
            f"ignore_index={ignore_index}: mark the positions without a loss with -100 and drop ignore_index."
        )
