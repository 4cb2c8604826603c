"""Quantized base weights: the formats the engine trains exactly, and the refusal of the others at enable.

Exact, tested against plain autograd on the same quantized model (``tests/test_quantized.py``): bitsandbytes' 4-bit
linear layers (NF4, FP4, double quantization; any compute dtype), the base of QLoRA, and its 8-bit ones (LLM.int8).
Their own autograd Functions run in each chunk's recompute like any other layer code, so the gradients are the plain
backward's, given the same weights in the same mode. What an eval-mode forward of theirs changes (bitsandbytes
re-lays a 4-bit weight for a CPU inference kernel that has no backward) the probe puts back
(:func:`~.probe._kept`).

Refused by name, before anything runs: a model that transformers loaded with another quantization method (its
``config.quantization_config.quant_method``: GPTQ, AWQ, HQQ, torchao, quanto, FP8, ...), and any parameter of a
tensor type the engine has not been tested on (a tensor subclass such as torchao's ``quantize_`` makes, a float8
parameter). Their kernels carry their own backward, with paths that can depend on the mode, the grad state or the
input's shape (a chunk's rows are not the whole sequence's); untested, they are not run. The tensor types torch itself
defines (``nn.Parameter``, FSDP2's ``DTensor``, the ``FakeTensor`` of a fake-mode trace) stand for the weights they
hold. Integer and boolean parameters (frozen masks, indices) carry no gradient and are served as they are.
"""

from __future__ import annotations

import torch
from torch import nn

TESTED_METHODS = ("bitsandbytes",)
# bitsandbytes' parameter types (its 4-bit weights are uint8 or another storage dtype; its 8-bit ones int8)
_BITSANDBYTES_PARAMETERS = {"Params4bit", "Int8Params"}
_FIX = (
    "for QLoRA load the base weights with bitsandbytes (BitsAndBytesConfig(load_in_4bit=True), TRL's "
    "--load_in_4bit), or train unquantized weights"
)


def holds_bitsandbytes(module: nn.Module) -> bool:
    """Whether ``module`` holds bitsandbytes' quantized weights (4-bit or 8-bit). Such a layer runs eagerly under
    ``torch_compile``: bitsandbytes' fake kernels give the compiler wrong shapes for a chunk (measured: the 4-bit
    layers' graph fails when it runs, after it compiled), so compiling it would stop the step."""
    return any(type(p).__name__ in _BITSANDBYTES_PARAMETERS for p in module.parameters())


def check_quantized(lm: nn.Module) -> None:
    """Raise ``ValueError`` if ``lm`` holds quantized weights of a format the engine has not been tested on (see the
    module docstring), naming the method or the parameter and its type."""
    config = getattr(lm, "config", None)
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = getattr(quantization, "quant_method", method)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod, a str enum
    if method is not None and str(method) not in TESTED_METHODS:
        raise ValueError(
            f"StreamBP cannot train {type(lm).__name__} exactly: its weights are quantized with {method} "
            f"(config.quantization_config.quant_method), whose layers StreamBP has not been tested on; {_FIX}."
        )
    for name, p in lm.named_parameters():
        why = _untested(p)
        if why is not None:
            raise ValueError(
                f"StreamBP cannot train {type(lm).__name__} exactly: the parameter `{name}` is {why}, a weight "
                f"format StreamBP has not been tested on; {_FIX}."
            )


def _untested(p: torch.Tensor) -> str | None:
    """Why ``p`` is a weight format the engine has not been tested on, or ``None``."""
    kind = type(p)
    if kind.__name__ in _BITSANDBYTES_PARAMETERS and kind.__module__.startswith("bitsandbytes"):
        return None
    if kind.__module__.partition(".")[0] != "torch":  # torch's own (Parameter, DTensor, a fake-mode FakeTensor) pass
        return f"a {kind.__module__}.{kind.__qualname__}"
    if p.dtype.is_floating_point and p.dtype.itemsize == 1:
        return f"of dtype {p.dtype}"
    return None
