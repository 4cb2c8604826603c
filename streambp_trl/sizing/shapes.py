"""The named model shapes: the published Qwen3 sizes, three small ones and the Qwen3.5 hybrids (Gated DeltaNet beside
full attention), as config keyword arguments (``model_type`` when it is not ``qwen3``).

The memory model sizes a named shape without reading any config (:meth:`.model_shape.ModelShape.from_name`), and
the measuring harness (:mod:`streambp_trl.bench`) builds a random-weight model of one; both read this one table.
"""

from __future__ import annotations

from typing import Any

_QWEN3_COMMON: dict[str, Any] = {
    "head_dim": 128,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
}


def _qwen3(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, tied: bool, **extra) -> dict:
    return {
        **_QWEN3_COMMON,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": tied,
        **extra,
    }


def _qwen3_5(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, linear_value_heads: int) -> dict:
    """A Qwen3.5 text decoder (``qwen3_5_text``): three Gated DeltaNet layers, then one gated full-attention layer."""
    return {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": layers,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": linear_value_heads,
        "linear_value_head_dim": 128,
        "vocab_size": 248320,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    }


# Named sizes: config keyword arguments (random weights). The published Qwen3 and Qwen3.5 (text) shapes;
# "qwen3-cpu-bench" is the 4-layer model of the CPU benchmarks, "qwen3-1k-bench" a wider 4-layer one (counted FLOPs
# and operations), "qwen3-tiny" a 2-layer one for quick CPU bisections (tests).
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": _qwen3(2, 256, 512, 4, 2, False, head_dim=64, vocab_size=2048),
    "qwen3-cpu-bench": _qwen3(4, 512, 1536, 8, 4, False, head_dim=64, vocab_size=8000),
    "qwen3-1k-bench": _qwen3(4, 1024, 3072, 16, 8, False, head_dim=64, vocab_size=32768),
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16, 8, True),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _qwen3(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _qwen3(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _qwen3(64, 5120, 25600, 64, 8, False),
    "qwen3.5-9b": _qwen3_5(32, 4096, 12288, 16, 4, 32),
    "qwen3.5-27b": _qwen3_5(64, 5120, 17408, 24, 4, 48),
}
# shapes no Hub name stands for: our own test shapes. (The Hub's Qwen3.5 checkpoints are vision-language models, but
# AutoModelForCausalLM, what the trainers load, builds their text decoder alone: the named Qwen3.5 shape.)
_NOT_ON_THE_HUB = ("qwen3-tiny", "qwen3-cpu-bench", "qwen3-1k-bench")
# Hub names of the same shape as the one they extend: the pretrained (base) checkpoint beside the post-trained one
_HUB_SUFFIXES = ("", "-base")


def canonical_model_name(name: str) -> str:
    """``8b`` / ``Qwen3-8B`` / a Hub name of a named shape (``Qwen/Qwen3-8B``, ``Qwen/Qwen3.5-9B``,
    ``Qwen/Qwen3-8B-Base``; any case) -> its named shape (``qwen3-8b``, ``qwen3.5-9b``), so a Hub name of one needs no
    network; anything else unchanged."""
    low = name.lower()
    org, _, repo = low.rpartition("/")
    if not org:
        candidates: tuple[str, ...] = (low, f"qwen3-{low}")
    elif org == "qwen":
        candidates = tuple(repo.removesuffix(suffix) for suffix in _HUB_SUFFIXES if repo.endswith(suffix))
        candidates = tuple(c for c in candidates if c not in _NOT_ON_THE_HUB)
    else:
        candidates = ()
    return next((candidate for candidate in candidates if candidate in NAMED_MODELS), name)
