"""DeepSpeed ZeRO-3: decoder layers as leaf modules, and gathering the LM head / final norm for the logit kernel.

deepspeed is imported only when the model or the run uses ZeRO-3.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..layers.sharding import partitioned
from ..logs import get_logger
from .model_parts import causal_lm, decoder_layers, find_decoder

logger = get_logger(__name__)


def _zero3_params(params) -> list[nn.Parameter]:
    """The parameters among ``params`` that ZeRO-3 partitions (they carry ``ds_id``)."""
    return [p for p in params if p is not None and partitioned(p)]


def zero3_enabled(model: nn.Module) -> bool:
    """Whether ``model`` is (or will be) trained under DeepSpeed ZeRO-3: its parameters are partitioned already
    (``zero.Init``), or transformers' DeepSpeed config (set by ``TrainingArguments``) says stage 3."""
    if _zero3_params(model.parameters()):
        return True
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return is_deepspeed_zero3_enabled()


def mark_zero3_leaves(model: nn.Module) -> None:
    """Make each streamed decoder layer a ZeRO-3 leaf module (``deepspeed.utils.set_z3_leaf_module``).

    ZeRO-3 gathers a module's parameters in forward and backward hooks on every submodule. A streamed layer runs
    its submodules once per chunk, and its autograd Function takes the layer's parameters as inputs (their whole
    shapes must be there when it is applied, and when its gradients arrive), so the layer must be gathered whole:
    as a leaf, its parameters are gathered once for its forward and once for its backward, whatever the number of
    chunks. Must run before ``deepspeed.initialize`` (which registers the hooks); the trainers do this at construction.
    The flag is DeepSpeed's own and stays after ``disable_streambp``: DeepSpeed's hooks were registered by it, and a
    leaf layer runs its own forward just as well.

    DeepSpeed reduces a leaf's gradients in a backward hook on the layer, which fires once the gradient of the layer's
    input is ready, or, where the input needs none (frozen embeddings: LoRA), as soon as its output's is: before the
    layer's backward has given its parameters theirs, which would then be lost (or added to the zeros the hook left,
    a shape error). So each leaf layer with trained parameters takes, in a call with grad, an input that requires
    grad (a forward pre-hook, before DeepSpeed's: :func:`_input_requires_grad`): the first layer's backward then also
    computes its input gradient (a trained embedding needs it anyway), and that layer keeps its input rather than
    rebuilding it from the token ids. The hook stays with the layer, as the leaf flag does.
    """
    lm = causal_lm(model)
    decoder = find_decoder(lm)
    layers = decoder_layers(decoder) if decoder is not None else []
    if not layers:
        return
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    late = [layer for layer in layers if not z3_leaf_module(layer) and _registered_by_deepspeed(layer)]
    if late:
        logger.warning(
            "StreamBP: %s was prepared by DeepSpeed ZeRO-3 before its decoder layers were made leaf modules; each "
            "chunk may gather parameters again. Install the engine (or call mark_zero3_leaves) before "
            "deepspeed.initialize.",
            type(lm).__name__,
        )
    for layer in layers:
        set_z3_leaf_module(layer, True)
        if not getattr(layer, "_streambp_input_grad", False):
            layer.register_forward_pre_hook(_input_requires_grad)
            layer._streambp_input_grad = True


def _input_requires_grad(layer: nn.Module, args: tuple) -> tuple | None:
    """A leaf layer's forward pre-hook: in a call with grad, a floating input hidden state that requires none is
    handed on as a detached copy that does, where the layer has trained parameters (see :func:`mark_zero3_leaves`)."""
    x = args[0] if args else None
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad):
        return None
    if not any(p.requires_grad for p in layer.parameters()):
        return None
    return (x.detach().requires_grad_(), *args[1:])


def _registered_by_deepspeed(layer: nn.Module) -> bool:
    """Whether DeepSpeed's ZeRO-3 hooks were registered on ``layer``'s submodules (each then has a ``ds_id``)."""
    return any(partitioned(m) for m in layer.modules() if m is not layer)


def zero3_gathered(params) -> functools.partial | None:
    """A context factory for the logit kernel: the ZeRO-3 parameters among ``params`` that are partitioned when it is
    entered are gathered, and partitioned again on exit; those DeepSpeed already holds whole (the LM head as an
    external parameter of the causal LM, gathered by its forward and pre-backward hooks) are left to it. Every rank
    runs the same modules, so every rank issues the same gathers; ``None`` without ZeRO-3 parameters."""
    params = _zero3_params(params)
    return functools.partial(_gather_partitioned, params) if params else None


@contextlib.contextmanager
def _gather_partitioned(params: list[nn.Parameter]):
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    partitioned = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with GatheredParameters(partitioned, enabled=bool(partitioned)):
        yield
