"""A tiny random model for every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built from configs only.

``tiny_config(model_type)`` starts from the config class's defaults, shrinks every size-like field by name
(hidden sizes, layer counts, heads, head dims, MLA ranks, experts, vocabularies, positions, windows), keeps
per-layer lists (``layer_types``, ``mlp_layer_types``, ...) consistent by selecting one layer of each kind,
zeroes every dropout / jitter, and then applies the small per-model overrides of ``OVERRIDES``. Composite
configs (``text_config``, ``vision_config``, ...) are shrunk recursively. ``tiny_causal_lm`` builds the model
with ``AutoModelForCausalLM.from_config`` in training mode (float64 by default).

Token ids: pad 0, bos 1, eos 2; ids ``3 .. VOCAB - 1`` are valid ordinary tokens for every model. ``batch`` gives a
batch of them, padded and with a prompt that is not labelled.

Special cases: ``musicgen`` / ``musicgen_melody`` build their CausalLM from the composite config's ``decoder``
(as transformers does); the Gemma 4 assistants are built with unshared keys/values (see ``overrides._unshare_kv``);
``gemma3n`` needs ``timm`` (and its ``pillow`` / ``torchvision``) for its vision tower, like transformers does.
Submodules: :mod:`.shrink` (generic shrinking by field name), :mod:`.overrides` (per-model overrides and fixups).
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .overrides import BASE, CONFIG_FIXUPS, DECODER_SUB_CONFIG, FIXUPS, FLOAT32_KEPT, MODEL_FIXUPS, OVERRIDES
from .shrink import VOCAB, shrink

__all__ = ["VOCAB", "ZOO_TYPES", "batch", "tiny_causal_lm", "tiny_config", "tiny_config_dict"]

ZOO_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _merge(d: dict, overrides: dict) -> dict:
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict) and not k.startswith("rope"):
            _merge(d[k], v)
        else:
            d[k] = v
    return d


def tiny_config_dict(model_type: str) -> dict:
    """The kwargs of :func:`tiny_config` (before keyword overrides)."""
    defaults = CONFIG_MAPPING[model_type](**copy.deepcopy(BASE.get(model_type, {}))).to_dict()
    d = _merge(shrink(defaults), copy.deepcopy(OVERRIDES.get(model_type, {})))
    if model_type in FIXUPS:
        FIXUPS[model_type](d)
    return d


def tiny_config(model_type: str, **overrides) -> transformers.PreTrainedConfig:
    """A tiny, dropout-free config of ``model_type`` (keyword overrides win)."""
    d = _merge(tiny_config_dict(model_type), overrides)
    config = CONFIG_MAPPING[model_type](**d)
    if model_type in CONFIG_FIXUPS:
        CONFIG_FIXUPS[model_type](config)
    return config


def _model_class(config):
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping[type(config)]


def tiny_causal_lm(model_type: str, seed: int = 0, dtype=torch.float64, **overrides) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))`` in ``dtype``, training mode."""
    config = tiny_config(model_type, **overrides)
    model_cls = _model_class(config)
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    if model_type in DECODER_SUB_CONFIG:
        config = getattr(config, DECODER_SUB_CONFIG[model_type])
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
    if model_type in MODEL_FIXUPS:
        MODEL_FIXUPS[model_type](model)
    model = model.to(dtype)
    if model_type in FLOAT32_KEPT:
        kept = model._keep_in_fp32_modules_strict
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if any(k in name for k in kept):
                t.data = t.data.float()
    return model.train()


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
