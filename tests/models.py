"""Tiny decoder-only models of each supported family, built from configs (no weights from the Hub), and their
batches."""

from __future__ import annotations

import contextlib

import torch
import transformers
from zoo import batch  # noqa: F401 (the tests' batch: padded, a prompt unlabelled)

VOCAB = 101
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="sdpa",
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),  # q/k/v biases
    "qwen3": (transformers.Qwen3Config, {}),  # q/k norms
    "mistral": (transformers.MistralConfig, {"sliding_window": 5}),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {
            "num_hidden_layers": 3,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 8,
        },
    ),
    "phi3": (transformers.Phi3Config, {}),  # fused qkv projection
    "olmo2": (transformers.Olmo2Config, {}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 1,
            "experts_implementation": "eager",
        },
    ),
}

# Gemma3RMSNorm computes in float32 even inside a float64 model, so a float64 Gemma3 would agree with plain autograd
# only to float32 rounding of the norm, summed in another order, whose size depends on the CPU's float32 kernels: the
# tests run such a family with its float32 internals in float64 (:func:`internals`), where the agreement is ~1e-15.
FLOAT32_INTERNALS = {"gemma3"}


def internals(family: str):
    """The context a float64 ``family`` model is compared in: its float32 internals computed in float64
    (:class:`~model_support.Float64Internals`) for the families of ``FLOAT32_INTERNALS``."""
    from model_support import Float64Internals

    return Float64Internals() if family in FLOAT32_INTERNALS else contextlib.nullcontext()


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides):
    """A tiny ``family`` model (see ``FAMILIES``) in training mode, its weights drawn from ``seed``; ``overrides``
    change its config."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.train()
    return model
