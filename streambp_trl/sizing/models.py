"""The models a measurement runs and how each mode sets them up (the vocabulary of a measuring *spec*).

Modes:

* ``plain``: no checkpointing, Hugging Face's loss over the full logits.
* ``checkpoint``: Hugging Face gradient checkpointing (``use_reentrant=False``), full logits.
* ``checkpoint+chunked-loss``: TRL 1.16's default: checkpointing plus ``trl.trainer.utils.add_fused_lm_head``,
  called with ``fused_lm_head=True``.
* ``stream``: ``enable_streambp(...)``, the same ``fused_lm_head=True`` call.
* ``stream+offload``: the same with the engine option ``offload_checkpoints=True``.

Models: a named Qwen3 size (:data:`NAMED_MODELS`) or the config of a Hub name / local directory, with random
weights (fixed seed), sdpa attention and dropout set to 0.
"""

from __future__ import annotations

from typing import Any

MODES = ("plain", "checkpoint", "checkpoint+chunked-loss", "stream", "stream+offload")
FUSED_MODES = ("checkpoint+chunked-loss", "stream", "stream+offload")
STREAM_MODES = ("stream", "stream+offload")
OBJECTIVES = ("sft", "dpo", "grpo")
TEMPERATURE = {"sft": 1.0, "dpo": 1.0, "grpo": 0.7}
KV_MODES = ("recompute", "capture")
DTYPES = ("float32", "bfloat16", "float64")

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
# 4-layer model of the CPU benchmarks, "qwen3-tiny" a 2-layer one for quick CPU bisections (tests).
NAMED_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": _qwen3(2, 256, 512, 4, 2, False, head_dim=64, vocab_size=2048),
    "qwen3-cpu-bench": _qwen3(4, 512, 1536, 8, 4, False, head_dim=64, vocab_size=8000),
    "qwen3-0.6b": _qwen3(28, 1024, 3072, 16, 8, True),
    "qwen3-4b": _qwen3(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _qwen3(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _qwen3(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _qwen3(64, 5120, 25600, 64, 8, False),
}
_NOT_ON_THE_HUB = ("qwen3-tiny", "qwen3-cpu-bench")


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


def build_config(name: str) -> Any:
    """A named Qwen3 size, or the config of a Hub name / local directory (config only, never weights)."""
    from transformers import AutoConfig, Qwen3Config

    name = canonical_model_name(name)
    if name in NAMED_MODELS:
        return Qwen3Config(**NAMED_MODELS[name])
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


def _stream_options(spec: dict[str, Any]) -> dict[str, Any]:
    options = {
        "stream_chunk_size": spec["stream_chunk_size"],
        "logits_chunk_size": spec["logits_chunk_size"],
        "kv_mode": spec.get("kv_mode", "recompute"),
        "temperature": TEMPERATURE[spec.get("objective", "sft")],
    }
    if spec["mode"] == "stream+offload":
        options["offload_checkpoints"] = True
    if spec.get("keep_every", 1) > 1:
        options["keep_every"] = spec["keep_every"]
    return options


def prepare_model(model: Any, spec: dict[str, Any], *, trainable: bool = True) -> Any:
    """Set ``model`` up for ``spec["mode"]`` (and LoRA); returns the model to call (a PEFT wrapper with LoRA)."""
    mode, objective = spec["mode"], spec.get("objective", "sft")
    outputs = ("log_probs",) if objective == "sft" else ("log_probs", "entropy")
    if mode in ("checkpoint", "checkpoint+chunked-loss") and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "checkpoint+chunked-loss":
        import trl.kernels.chunked_logprob as trl_kernel
        from trl.trainer.utils import add_fused_lm_head

        if spec.get("same_logits_tile"):  # TRL's kernel reads its token tile from this module constant
            trl_kernel.TOKEN_CHUNK_SIZE = spec["logits_chunk_size"]
        add_fused_lm_head(model, temperature=TEMPERATURE[objective], outputs=outputs)  # before PEFT, as TRL says
    if spec.get("lora") and trainable:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    if mode in STREAM_MODES:
        from streambp_trl import enable_streambp

        enable_streambp(model, **_stream_options(spec), fused_outputs=outputs, stream_eval=not trainable)
    return model


def trl_token_chunk() -> int | None:
    """The token tile of TRL's fused LM head."""
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    except ImportError:
        return None
    return TOKEN_CHUNK_SIZE
