"""Finding the pieces of a causal LM the engine streams: the model under a PEFT wrapper, its decoder, the decoder
layers that take a key/value cache, the decoder's final norm and the LM head's ``nn.Linear``."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from .support import refuse, takes_cache


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper, if any."""
    if hasattr(model, "get_base_model") and callable(model.get_base_model):
        model = model.get_base_model()
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"StreamBP needs a transformers PreTrainedModel, got {type(model).__name__}.")
    return model


def find_decoder(lm: PreTrainedModel) -> PreTrainedModel | None:
    """The decoder (the model that runs the layers), as ``get_decoder()`` finds it, or else the first transformers
    model among ``lm``'s submodules that holds decoder layers."""
    decoder = lm.get_decoder()
    if isinstance(decoder, PreTrainedModel) and decoder is not lm:
        return decoder
    for module in lm.modules():
        if module is not lm and isinstance(module, PreTrainedModel) and decoder_layers(module):
            return module
    return None


def decoder_layers(decoder: nn.Module) -> list[GradientCheckpointingLayer]:
    """The layers to stream: those of ``decoder`` that take a key/value cache (causal self-attention layers).

    Other checkpointable layers (a vision or audio encoder inside a multimodal decoder) are left as they are.
    """
    return [layer for _, layer in named_decoder_layers(decoder)]


def named_decoder_layers(decoder: nn.Module) -> list[tuple[str, GradientCheckpointingLayer]]:
    """:func:`decoder_layers` with each layer's name in ``decoder``."""
    return [
        (name, m)
        for name, m in decoder.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and takes_cache(m)
    ]


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def final_norm_name(decoder: nn.Module | None) -> str | None:
    """The attribute of ``decoder`` holding its final norm (:func:`final_norm`), if any.

    The logit kernel applies that module tile by tile when the probe shows it is the decoder's last step, so its
    full-length input is the only thing kept for its backward (no float32 copies of the last hidden state).
    """
    return next((name for name in _FINAL_NORM_NAMES if final_norm(decoder, name) is not None), None)


def final_norm(decoder: nn.Module | None, name: str) -> nn.Module | None:
    """The module ``decoder`` holds as ``name`` now, if it is a row-wise norm: a leaf module with vector parameters
    only, or PEFT's ``modules_to_save`` wrapper of one (each of its copies such a module; the wrapper, which applies
    the active one, is returned). ``None`` for anything else, which the decoder then applies itself."""
    module = getattr(decoder, name, None)
    if not isinstance(module, nn.Module):
        return None
    copies = [module]
    if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
        copies = [module.original_module, *module.modules_to_save.values()]
    row_wise = all(not any(True for _ in m.children()) and all(p.dim() == 1 for p in m.parameters()) for m in copies)
    return module if row_wise else None


def lm_head_linear(lm: PreTrainedModel) -> nn.Linear:
    """The ``nn.Linear`` the LM head applies, looking through PEFT's ``modules_to_save`` wrapper.

    Subclasses of ``nn.Linear`` that keep its ``forward`` are accepted: FSDP2 turns a sharded module into a dynamic
    subclass (``FSDPLinear``) whose parameters are whole inside the root's forward and backward. Anything that
    computes differently (an adapter such as PEFT's LoRA layer, a quantized linear) is refused.
    """
    head = lm.get_output_embeddings()
    while hasattr(head, "modules_to_save") and hasattr(head, "original_module"):
        active = list(getattr(head, "active_adapters", []))
        use_original = head.disable_adapters or not active or active[0] not in head.modules_to_save
        head = head.original_module if use_original else head.modules_to_save[active[0]]
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        why = f"its LM head is a {type(head).__module__}.{type(head).__name__}, not the torch.nn.Linear the chunked "
        why += "logit kernel applies"
        if hasattr(head, "base_layer"):
            why += " (an adapter on lm_head: keep lm_head out of target_modules, or list it in modules_to_save)"
        refuse(lm, why)
    return head


def decoder_keywords(lm: PreTrainedModel, decoder: nn.Module) -> frozenset[str] | None:
    """The arguments ``lm``'s own forward hands its decoder, where it hands it only those it names (Mamba2's
    ``backbone(input_ids, cache_params=..., attention_mask=...)``: any other keyword goes to its loss alone), by
    name (a positional one by the name of the forward's own argument it passes); ``None`` where it passes its
    ``**kwargs`` on too, or where its source does not show one call of the decoder."""
    names = [name for name, module in lm.named_children() if module is decoder]
    return _decoder_keywords(type(lm), names[0]) if len(names) == 1 else None


@functools.cache
def _decoder_keywords(cls: type, attribute: str) -> frozenset[str] | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError):
        return None
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attribute
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ]
    if len(calls) != 1 or any(k.arg is None for k in calls[0].keywords):
        return None
    positional = {a.id for a in calls[0].args if isinstance(a, ast.Name)}  # its own arguments, by the same names
    return frozenset({k.arg for k in calls[0].keywords} | positional)
