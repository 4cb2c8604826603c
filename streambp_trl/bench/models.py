"""The models a measurement runs and how each mode (:class:`~streambp_trl.bench.spec.Mode`) sets them up.

Models: a named shape (:data:`streambp_trl.sizing.shapes.NAMED_MODELS`) or the config of a Hub name / local
directory, with random weights (fixed seed), sdpa attention and dropout set to 0.
"""

from __future__ import annotations

from typing import Any

from streambp_trl.sizing.shapes import NAMED_MODELS, canonical_model_name

from .spec import TEMPERATURE, MeasureSpec, Mode


def build_config(name: str) -> Any:
    """A named size, or the config of a Hub name / local directory (config only, never weights)."""
    from transformers import AutoConfig

    name = canonical_model_name(name)
    if name in NAMED_MODELS:
        kwargs = dict(NAMED_MODELS[name])
        return AutoConfig.for_model(kwargs.pop("model_type", "qwen3"), **kwargs)
    return AutoConfig.from_pretrained(name)


def _zero_dropout(config: Any) -> None:
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for key, value in list(vars(cfg).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                setattr(cfg, key, 0.0)


def build_model(name: str, dtype_name: str, device: Any, seed: int) -> Any:
    """The causal LM with random weights (fixed seed), sdpa attention, in train mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(name)
    _zero_dropout(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name), attn_implementation="sdpa")
    model.train()
    return model


def quantize_4bit(model: Any, quant_type: str = "nf4") -> Any:
    """``model`` with every linear map of its decoder layers replaced by bitsandbytes' 4-bit layer holding its weight
    quantized (``quant_type``, computing in the model's dtype), as ``BitsAndBytesConfig(load_in_4bit=True)`` loads a
    checkpoint (the embedding and the LM head stay as they are); the model then reads as loaded in 4-bit, so TRL takes
    its QLoRA path (the adapters cast to bfloat16). One layer's weights are quantized at a time, on their device."""
    import bitsandbytes as bnb
    import torch
    from transformers import BitsAndBytesConfig

    dtype = next(model.parameters()).dtype
    for layer in model.get_decoder().layers:
        for name, linear in list(layer.named_modules()):
            if type(linear) is not torch.nn.Linear:
                continue
            parent, _, attr = name.rpartition(".")
            quantized = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=dtype,
                quant_type=quant_type, device="meta",
            )  # fmt: skip
            weight = bnb.nn.Params4bit(
                linear.weight.data, requires_grad=False, quant_type=quant_type, module=quantized
            )
            quantized.weight = weight.to(linear.weight.device)
            quantized.bias = linear.bias
            setattr(layer.get_submodule(parent) if parent else layer, attr, quantized)
    model.is_loaded_in_4bit = True
    model.config.quantization_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=dtype
    )
    return model


def _stream_options(spec: MeasureSpec) -> dict[str, Any]:
    """The engine options of a stream mode."""
    return {
        "stream_chunk_size": spec.stream_chunk_size,
        "logits_chunk_size": spec.logits_chunk_size,
        "kv_mode": spec.kv_mode if spec.kv_mode is not None or spec.planned else "recompute",
        "temperature": TEMPERATURE[spec.objective],
        "offload_checkpoints": True if spec.mode is Mode.STREAM_OFFLOAD else (None if spec.planned else False),
        "keep_every": None if spec.planned else spec.keep_every,
        "keep_activations": None if spec.planned else 0,
        "keep_attention": None if spec.planned else False,
        "token_mean_loss": spec.objective == "sft",  # as StreamSFTTrainer sets it for TRL's nll loss
        "memory_budget": spec.memory_budget,
        "torch_compile": spec.compile,
    }


def prepare_model(model: Any, spec: MeasureSpec, *, trainable: bool = True) -> Any:
    """Set ``model`` up for ``spec.mode`` (and LoRA, and ``torch_compile``); returns the model to call (a PEFT wrapper
    with LoRA, a compiled module where a mode other than stream compiles)."""
    outputs = ("log_probs",) if spec.objective == "sft" else ("log_probs", "entropy")
    if spec.mode.checkpoints and trainable:
        enable = getattr(model, "activation_checkpointing_enable", None)  # the name since transformers 5.23
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.mode is Mode.CHECKPOINT_CHUNKED_LOSS:
        import trl.kernels.chunked_logprob as trl_kernel
        from trl.trainer.utils import add_fused_lm_head

        if spec.same_logits_tile:  # TRL's kernel reads its token tile from this module constant
            trl_kernel.TOKEN_CHUNK_SIZE = spec.logits_chunk_size
        add_fused_lm_head(model, temperature=TEMPERATURE[spec.objective], outputs=outputs)  # before PEFT, as TRL says
    if spec.lora and trainable:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    if spec.mode.streams:
        from streambp_trl import enable_streambp

        enable_streambp(model, **_stream_options(spec), fused_outputs=outputs, stream_eval=not trainable)
    elif spec.compile:  # as accelerate does for TrainingArguments' torch_compile=True
        import torch

        model = torch.compile(model)
    return model


def trl_token_chunk() -> int | None:
    """The token tile of TRL's fused LM head."""
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    except ImportError:
        return None
    return TOKEN_CHUNK_SIZE
