"""The named model shapes: the published Qwen3 sizes and two small ones, as ``Qwen3Config`` keyword arguments.

The memory model sizes a named shape without reading any config (:meth:`.memory_model.ModelShape.from_name`), and
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


# Named sizes: Qwen3Config keyword arguments (random weights). The published Qwen3 shapes; "qwen3-cpu-bench" is the
# 4-layer model of the CPU benchmarks, "qwen3-1k-bench" a wider 4-layer one (counted FLOPs and operations),
# "qwen3-tiny" a 2-layer one for quick CPU bisections (tests).
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": _qwen3(2, 256, 512, 4, 2, False, head_dim=64, vocab_size=2048),
    "qwen3-cpu-bench": _qwen3(4, 512, 1536, 8, 4, False, head_dim=64, vocab_size=8000),
    "qwen3-1k-bench": _qwen3(4, 1024, 3072, 16, 8, False, head_dim=64, vocab_size=32768),
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16, 8, True),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _qwen3(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _qwen3(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _qwen3(64, 5120, 25600, 64, 8, False),
}
_NOT_ON_THE_HUB = ("qwen3-tiny", "qwen3-cpu-bench", "qwen3-1k-bench")


def canonical_model_name(name: str) -> str:
    """``8b`` / ``Qwen3-8B`` / the Hub name ``Qwen/Qwen3-8B`` -> ``qwen3-8b`` when that is a named size (the
    published shape, so a Hub name of one needs no network); anything else unchanged."""
    low = name.lower()
    org, _, repo = low.rpartition("/")
    candidates = (low, f"qwen3-{low}") if not org else (repo,) if org == "qwen" and repo not in _NOT_ON_THE_HUB else ()
    for candidate in candidates:
        if candidate in NAMED_MODELS:
            return candidate
    return name
