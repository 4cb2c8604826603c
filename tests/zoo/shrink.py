"""Generic shrinking of a config dict by field name: hidden sizes, layer counts, heads, head dims, MLA ranks,
experts, vocabularies, positions and windows capped at tiny sizes; per-layer lists (``layer_types``, ...) kept
consistent by selecting one layer of each kind; every dropout / jitter zeroed; token ids pad 0, bos 1, eos 2."""

from __future__ import annotations

import re

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
        d["per_layer_config"] = {f"{new:02d}": shrink(v[old]) for new, old in enumerate(keep) if v[old]}
    return keep


def shrink(d: dict) -> dict:
    """``d`` (a config's ``to_dict()``) shrunk: the module docstring; sub-configs recursively."""
    orig = d
    d = {k: v for k, v in d.items() if k not in _META}
    n_layers = next((d[k] for k in _LAYER_KEYS if _is_int(d.get(k))), None)
    heads = next((d[k] for k in _HEAD_KEYS if _is_int(d.get(k))), None)
    linear_heads = (d.get("linear_num_key_heads"), d.get("linear_num_value_heads"))
    for k, v in list(d.items()):
        lk = k.lower()
        if _is_sub_config(v):
            d[k] = shrink(v)
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
