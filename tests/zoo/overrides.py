"""Per-model overrides of the tiny configs (applied after generic shrinking; nested dicts merge into sub-configs),
and the fixups run on a model type's shrunk dict, its built config or its built model."""

from __future__ import annotations

import torch

from .shrink import EXPERTS, HEAD_DIM, HEADS, HIDDEN

_SWA_TYPES = ["sliding_attention", "full_attention"]

OVERRIDES: dict[str, dict] = {
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
    # input, recurrent (looped n_recurrent_loops times) and output layers, which must add up to num_hidden_layers;
    # its layer types one per layer (a config's own list pairs each with "mlp", and the counts are then halved)
    "dory": {
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
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
    # keys/values shared across layers, as Gemma 4's E models have them: the last two layers reuse the first two's
    "gemma4_text": {"num_hidden_layers": 4, "layer_types": _SWA_TYPES * 2, "num_kv_shared_layers": 2},
    "got_ocr2": {"vision_config": {"image_size": 128, "global_attn_indexes": [1]}},
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
}
OVERRIDES["qwen4_exp"] = {"text_config": OVERRIDES["qwen4_exp_text"]}
OVERRIDES["gemma4"] = {"text_config": OVERRIDES["gemma4_text"]}


def _dots3(d: dict) -> None:
    # sliding layers: head_dim = qk_nope_head_dim + qk_rope_head_dim
    d["qk_nope_head_dim"] = HEAD_DIM - d["qk_rope_head_dim"]
    for layer in d.get("per_layer_config", {}).values():
        if "qk_nope_head_dim" in layer:
            layer["qk_nope_head_dim"] = HEAD_DIM - d["qk_rope_head_dim"]


# functions run on the shrunk dict of a model type (or of its text_config for composite configs)
FIXUPS = {"dots3_note_text": _dots3, "dots3_note": lambda d: _dots3(d["text_config"])}

# kwargs needed just to build the default config of a model type
BASE: dict[str, dict] = {
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
CONFIG_FIXUPS = {"gemma4_assistant": _unshare_kv, "gemma4_unified_assistant": _unshare_kv}


def _decay_dynamic_mask(model: torch.nn.Module) -> None:
    """Doge's dynamic mask decay ``A`` drawn from N(0, 1), as a trained checkpoint has it: at its initial 0 every key
    gets the same bias, and which keys the top-k window keeps is the sort's tie order (refused)."""
    for module in model.modules():
        if isinstance(getattr(module, "A", None), torch.nn.Parameter) and hasattr(module, "keep_window_size"):
            torch.nn.init.normal_(module.A)


def _hash_routes(model: torch.nn.Module) -> None:
    """DeepSeek-V4's hash-routed experts: each token's experts (``tid2eid``, a buffer a checkpoint brings) drawn at
    random, distinct per token. Left at their initial zeros every token takes expert 0 twice, its normalised routing
    weights are constants, and the router gets no gradient at all (rounding noise, 1e-20)."""
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        weight = getattr(module, "weight", None)
        if isinstance(table, torch.Tensor) and isinstance(weight, torch.Tensor):
            experts = torch.rand(table.shape[0], weight.shape[0]).argsort(dim=-1)[:, : table.shape[1]]
            table.copy_(experts.to(table.dtype))


# applied to the built model (under the build's seed)
MODEL_FIXUPS = {"doge": _decay_dynamic_mask, "deepseek_v4": _hash_routes}
# model types whose float64 build keeps transformers' ``_keep_in_fp32_modules_strict`` in float32, as loading in
# another dtype does: Inkling 2's router casts its input to float32 against its own weight, so a float64 weight fails
FLOAT32_KEPT = {"inkling2", "inkling2_text"}
# model types whose CausalLM class takes a sub-config (AutoModelForCausalLM maps the composite config to it)
DECODER_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}
