"""A tiny random model for every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built from configs only.

``tiny_config(model_type)`` starts from the config class's defaults, shrinks every size-like field by name
(hidden sizes, layer counts, heads, head dims, MLA ranks, experts, vocabularies, positions, windows), keeps
per-layer lists (``layer_types``, ``mlp_layer_types``, ...) consistent by selecting one layer of each kind,
zeroes every dropout / jitter, and then applies the small per-model overrides of ``_OVERRIDES``. Composite
configs (``text_config``, ``vision_config``, ...) are shrunk recursively. ``tiny_causal_lm`` builds the model
with ``AutoModelForCausalLM.from_config`` in training mode (float64 by default).

Token ids: pad 0, bos 1, eos 2; ids ``3 .. VOCAB - 1`` are valid ordinary tokens for every model. ``batch`` gives a
batch of them, padded and with a prompt that is not labelled.

Special cases: ``musicgen`` / ``musicgen_melody`` build their CausalLM from the composite config's ``decoder``
(as transformers does); the Gemma 4 assistants are built with unshared keys/values (see ``_unshare_kv``);
``gemma3n`` needs ``timm`` (and its ``pillow`` / ``torchvision``) for its vision tower, like transformers does.
"""

from __future__ import annotations

import copy
import re

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 101
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
INTERMEDIATE = 48
MOE_INTERMEDIATE = 16
EXPERTS = 4
MAX_POSITIONS = 128
WINDOW = 5

ZOO_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

# config keys that are bookkeeping, not architecture
_META = {
    "transformers_version",
    "architectures",
    "id2label",
    "label2id",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "output_attentions",
    "output_hidden_states",
    "_attn_implementation_autoset",
    "problem_type",
}

# ---- generic shrinking by field name ---------------------------------------------------------------------
_HIDDEN_KEYS = {
    "hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embedding_dim", "d_embed", "model_dim",
    "word_embed_proj_dim", "embedding_size", "input_embedding_size", "output_embedding_size",
    "backbone_hidden_size", "attention_hidden_size", "lru_width", "hidden_dim", "n_embed",
}  # fmt: skip
_INTERMEDIATE_KEYS = {
    "intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "dim_ff", "d_ff", "d_inner",
    "ffn_hidden_size", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size", "dff",
    "ffn_inner_dim", "mlp_dim", "filter_size",
}  # fmt: skip
_MOE_INTERMEDIATE_KEYS = {
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
    "shared_experts_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size",
    "expert_intermediate_size",
}  # fmt: skip
_LAYER_KEYS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers",
}  # fmt: skip
_HEAD_KEYS = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
    "num_decoder_attention_heads", "num_encoder_attention_heads", "attention_heads", "swa_num_attention_heads",
}  # fmt: skip
_KV_HEAD_KEYS = {"num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "multi_query_group_num"}
_HEAD_DIM_KEYS = {
    "head_dim", "attention_head_dim", "attention_head_size", "d_head", "dim_head", "kv_channels", "swa_head_dim",
    "v_head_dim", "qk_nope_head_dim", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head",
    "mamba_head_dim", "mamba_headdim", "linear_head_dim", "index_head_dim",
}  # fmt: skip
_EXPERT_KEYS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k"}
_POSITION_KEYS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length", "context_length",
    "max_target_positions", "max_source_positions", "seq_length", "model_max_length",
}  # fmt: skip
_WINDOW_KEYS = {"sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len"}
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_sub_config(v) -> bool:
    return isinstance(v, dict) and ("model_type" in v or "architectures" in v)


# int fields capped at a small value (0 and negatives are kept; None stays None unless listed in _FILL)
_FIXED = {
    **dict.fromkeys(
        _HIDDEN_KEYS
        | {"hidden_size_global", "ple_embed_dim", "vision_output_dim", "adapter_in_dim", "adapter_out_dim"}
        | {"adapter_input_size"},
        HIDDEN,
    ),
    **dict.fromkeys(_INTERMEDIATE_KEYS, INTERMEDIATE),
    **dict.fromkeys(_MOE_INTERMEDIATE_KEYS | {"router_hidden_size"}, MOE_INTERMEDIATE),
    **dict.fromkeys(_LAYER_KEYS | {"num_blocks"}, 2),
    **dict.fromkeys(
        _HEAD_KEYS | {"index_n_heads", "linear_num_heads", "linear_num_value_heads", "num_attention_heads_per_layer"},
        HEADS,
    ),
    **dict.fromkeys(_HEAD_DIM_KEYS | {"query_pre_attn_scalar"}, HEAD_DIM),
    **dict.fromkeys(_EXPERT_KEYS, EXPERTS),
    **dict.fromkeys(_TOPK_KEYS, 2),
    **dict.fromkeys(_WINDOW_KEYS | {"window_size", "keep_window_size"}, WINDOW),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank"), 16),
    "qk_rope_head_dim": 4,
    "qk_head_dim": 12,
    "rotary_dim": 4,
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "num_kv_shared_layers"), 1),
    **dict.fromkeys(("decoder_sparse_step", "moe_layer_interval", "interleave_moe_layer_step"), 1),
    "num_nextn_predict_layers": 0,
    # sparse / chunked attention: small enough to matter on ~23 tokens
    "index_topk": 8,
    "index_block_size": 4,
    "attention_chunk_size": 8,
    "block_size": 8,
    # state-space / linear-attention mixers
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    "mamba_d_ssm": 64,
    **dict.fromkeys(("mamba_dt_rank", "time_step_rank"), 4),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 8),
    **dict.fromkeys(("mamba_n_groups", "n_groups", "mamba_ngroups"), 1),
    # low ranks / small side dims
    **dict.fromkeys(("laurel_rank", "hidden_size_per_layer_input", "hc_lowrank", "adapter_rank"), 8),
    "zero_expert_num": 2,
    # vision / audio towers of composite models
    **dict.fromkeys(("ext_pw_out_channel", "depthwise_separable_out_channel"), HIDDEN),
    **dict.fromkeys(("output_channels", "nemo_conv_channels"), 16),
}
# None-valued fields that the modelling code uses as numbers
_FILL = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}


def _is_index_list(k: str, v: list, n: int) -> bool:
    """A list of layer indices (``full_attn_idxs``, ``moe_layers``, ``mlp_only_layers``, ``hybrid_layer_ids``)."""
    return (
        bool(v)
        and all(_is_int(x) for x in v)
        and v == sorted(set(v))
        and v[-1] < n
        and (len(v) != n or v == list(range(n)))
        and re.search(r"idx|ids|indices|layers$", k) is not None
    )


def _select_layers(d: dict, n: int) -> list[int] | None:
    """Keep one layer of each kind (every value of every per-layer list appears); remap per-layer fields."""
    index_lists = {k: v for k, v in d.items() if isinstance(v, list) and _is_index_list(k, v, n)}
    lists = {
        k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and "token" not in k and k not in index_lists
    }
    views = {**lists, **{k: [i in v for i in range(n)] for k, v in index_lists.items()}}
    per_layer = d.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer:
        views["per_layer_config"] = [per_layer.get(f"{i:02d}", per_layer.get(str(i))) for i in range(n)]
    if not views:
        return None
    keep: list[int] = []
    for values in views.values():
        for i, v in enumerate(values):
            if all(repr(values[j]) != repr(v) for j in keep):
                keep.append(i)
    for i in range(n):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    for k, v in lists.items():
        d[k] = [_FIXED.get(k, x) if _is_int(x) and k in _FIXED else x for x in (v[i] for i in keep)]
    for k, v in index_lists.items():
        d[k] = [new for new, old in enumerate(keep) if old in v]
    if "per_layer_config" in views:
        v = views["per_layer_config"]
        d["per_layer_config"] = {f"{new:02d}": _shrink(v[old]) for new, old in enumerate(keep) if v[old]}
    return keep


def _shrink(d: dict) -> dict:
    orig = d
    d = {k: v for k, v in d.items() if k not in _META}
    n_layers = next((d[k] for k in _LAYER_KEYS if _is_int(d.get(k))), None)
    heads = next((d[k] for k in _HEAD_KEYS if _is_int(d.get(k))), None)
    linear_heads = (d.get("linear_num_key_heads"), d.get("linear_num_value_heads"))
    for k, v in list(d.items()):
        lk = k.lower()
        if _is_sub_config(v):
            d[k] = _shrink(v)
        elif (
            ("dropout" in lk or "pdrop" in lk or "jitter" in lk or lk.endswith("layerdrop"))
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        ):
            d[k] = 0.0 if isinstance(v, float) else 0
        elif v is None and k in _FILL:
            d[k] = _FILL[k]
        elif k in _TOKEN_IDS and (v is None or _is_int(v)):
            d[k] = _TOKEN_IDS[k]
        elif not _is_int(v):
            continue
        elif k in _KV_HEAD_KEYS:
            # keep MHA as MHA and MQA as MQA, otherwise GQA with 2 kv heads
            d[k] = HEADS if heads is not None and v == heads else (1 if v == 1 else KV_HEADS)
        elif k == "linear_num_key_heads":
            d[k] = HEADS if linear_heads[0] == linear_heads[1] else KV_HEADS
        elif k in _POSITION_KEYS:
            d[k] = MAX_POSITIONS
        elif k in _FIXED:
            d[k] = min(v, _FIXED[k]) if v > 0 else v
        elif "vocab" in lk and lk not in ("type_vocab_size", "task_type_vocab_size") and v > VOCAB:
            d[k] = VOCAB
    if _is_int(n_layers) and n_layers > 2:
        keep = _select_layers(d, n_layers)
        if keep is not None:
            for k in _LAYER_KEYS:
                if _is_int(d.get(k)):
                    d[k] = len(keep)
    # MLA models: head_dim is the rotary part (or the whole q/k head)
    if _is_int(orig.get("head_dim")) and "qk_rope_head_dim" in d:
        if orig["head_dim"] == orig.get("qk_rope_head_dim"):
            d["head_dim"] = d["qk_rope_head_dim"]
        elif orig["head_dim"] == orig.get("qk_head_dim") and "qk_head_dim" in d:
            d["head_dim"] = d["qk_head_dim"]
    new_layers = next((d[k] for k in _LAYER_KEYS if _is_int(d.get(k))), None)
    if _is_int(n_layers) and d.get("num_kv_shared_layers") and orig.get("num_kv_shared_layers") == n_layers:
        d["num_kv_shared_layers"] = new_layers  # assistants: every layer reads the target model's cache
    if "is_decoder" in d:
        d["is_decoder"] = True
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = _TOKEN_IDS["eos_token_id"]
    return d


# ---- per-model overrides (applied after generic shrinking; nested dicts merge into sub-configs) ----------------
_SWA_TYPES = ["sliding_attention", "full_attention"]

_OVERRIDES: dict[str, dict] = {
    # hybrid models: contain every layer kind once
    "cohere_compass_text": {
        "layer_types": _SWA_TYPES,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
            "full_attention": None,
        },
    },
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}, "ffn_config": {"moe_top_k": 2}},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # recurrent depth: num_hidden_layers counts cache slots = num_layers_per_stack * H_cycles * (L_cycles + 1)
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 2, "L_cycles": 1, "L_bp_cycles": [1], "num_hidden_layers": 4},
    # qk_dim / v_dim round up to multiples of 64: below that the cache and the projections disagree
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "chunk_size": 64},
    "dots1": {
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # the shared attention block sees [hidden, embeddings] concatenated: attention_hidden_size = 2 * hidden_size
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
    },
    "zamba2": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
        "hybrid_layer_ids": [1, 2],
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
    },
    "mamba2": {"num_heads": 8},
    "reformer": {
        "is_decoder": True,
        "attn_layers": ["local", "lsh"],
        "num_hidden_layers": 2,
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 4,
        "axial_pos_shape": [8, 16],
        "axial_pos_embds_dim": [16, 16],
    },
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
        # per-layer n-gram embeddings (PLE) on the first layer, a Gated DeltaNet one
        "ple_layer_ids": [1],
        "ple_embed_dim": 16,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 101,
        "make_ngram_vocab_size_divisible_by": 8,
        "eos_token_id": 5,
    },
    "got_ocr2": {"vision_config": {"image_size": 128, "global_attn_indexes": [1]}},
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
}
_OVERRIDES["qwen4_exp"] = {"text_config": _OVERRIDES["qwen4_exp_text"]}


def _dots3(d: dict) -> None:
    # sliding layers: head_dim = qk_nope_head_dim + qk_rope_head_dim
    d["qk_nope_head_dim"] = HEAD_DIM - d["qk_rope_head_dim"]
    for layer in d.get("per_layer_config", {}).values():
        if "qk_nope_head_dim" in layer:
            layer["qk_nope_head_dim"] = HEAD_DIM - d["qk_rope_head_dim"]


# functions run on the shrunk dict of a model type (or of its text_config for composite configs)
_FIXUPS = {"dots3_note_text": _dots3, "dots3_note": lambda d: _dots3(d["text_config"])}

# kwargs needed just to build the default config of a model type
_BASE: dict[str, dict] = {
    "gemma4_assistant": {
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": 30,
        }
    },
}


def _unshare_kv(config) -> None:
    # Gemma 4 assistants read every layer's keys/values from the target model (num_kv_shared_layers ==
    # num_hidden_layers is validated), but transformers 5.23's Gemma4TextConfig.kv_sharing_modes raises for a
    # config without a producing layer, so from_config cannot build them: build the layers unshared instead.
    config.text_config.num_kv_shared_layers = 0


# functions run on the built config object
_CONFIG_FIXUPS = {"gemma4_assistant": _unshare_kv, "gemma4_unified_assistant": _unshare_kv}


# model types whose CausalLM class takes a sub-config (AutoModelForCausalLM maps the composite config to it)
def _decay_dynamic_mask(model: torch.nn.Module) -> None:
    """Doge's dynamic mask decay ``A`` drawn from N(0, 1), as a trained checkpoint has it: at its initial 0 every key
    gets the same bias, and which keys the top-k window keeps is the sort's tie order (refused)."""
    for module in model.modules():
        if isinstance(getattr(module, "A", None), torch.nn.Parameter) and hasattr(module, "keep_window_size"):
            torch.nn.init.normal_(module.A)


# applied to the built model (under the build's seed)
_MODEL_FIXUPS = {"doge": _decay_dynamic_mask}
_DECODER_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def _merge(d: dict, overrides: dict) -> dict:
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict) and not k.startswith("rope"):
            _merge(d[k], v)
        else:
            d[k] = v
    return d


def tiny_config_dict(model_type: str) -> dict:
    """The kwargs of :func:`tiny_config` (before keyword overrides)."""
    defaults = CONFIG_MAPPING[model_type](**copy.deepcopy(_BASE.get(model_type, {}))).to_dict()
    d = _merge(_shrink(defaults), copy.deepcopy(_OVERRIDES.get(model_type, {})))
    if model_type in _FIXUPS:
        _FIXUPS[model_type](d)
    return d


def tiny_config(model_type: str, **overrides) -> transformers.PreTrainedConfig:
    """A tiny, dropout-free config of ``model_type`` (keyword overrides win)."""
    d = _merge(tiny_config_dict(model_type), overrides)
    config = CONFIG_MAPPING[model_type](**d)
    if model_type in _CONFIG_FIXUPS:
        _CONFIG_FIXUPS[model_type](config)
    return config


def _model_class(config):
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping[type(config)]


def tiny_causal_lm(model_type: str, seed: int = 0, dtype=torch.float64, **overrides) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))`` in ``dtype``, training mode."""
    config = tiny_config(model_type, **overrides)
    model_cls = _model_class(config)
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    if model_type in _DECODER_SUB_CONFIG:
        config = getattr(config, _DECODER_SUB_CONFIG[model_type])
        build = model_cls._from_config
    else:
        build = AutoModelForCausalLM.from_config
    torch.manual_seed(seed)
    # eager experts: the default grouped_mm kernel has no float64
    try:
        model = build(config, attn_implementation=attn, experts_implementation="eager")
    except (ValueError, ImportError) as e:
        if attn == "sdpa" and "sdpa" in str(e).lower():
            model = build(config, attn_implementation="eager", experts_implementation="eager")
        else:
            raise
    if model_type == "xmod":
        model.set_default_language(config.languages[0])
    if model_type in _MODEL_FIXUPS:
        _MODEL_FIXUPS[model_type](model)
    return model.to(dtype).train()


def batch(batch_size: int = 2, seq_len: int = 23, padding: str = "right", prompt: int = 6, seed: int = 1):
    """input_ids, attention_mask and labels with -100 on padding and on a prompt prefix; ``padding`` "right" or
    "left" pads the last row's last or first 7 tokens, "none" pads nothing."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if padding == "right":
        mask[-1, seq_len - 7 :] = 0
    elif padding == "left":
        mask[-1, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if padding == "left":
        labels[-1, : 7 + prompt] = -100
        labels[:-1, :prompt] = -100
    else:
        labels[:, :prompt] = -100
    return ids, mask, labels
