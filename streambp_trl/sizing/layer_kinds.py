"""Which kind each decoder layer of a transformers config is, and the sizes of its state-carrying layers: the
:class:`.model_shape.ModelShape` fields other than those of softmax attention."""

from __future__ import annotations


def _first(config, *names: str) -> int:
    """The first of ``names`` that ``config`` sets to a number (0 if none does)."""
    return next((v for v in (getattr(config, n, None) for n in names) if isinstance(v, int)), 0)


# a Mamba v1 mixer's config: the rank of its step's projection, and none of a Mamba2 mixer's head sizes (Mamba2Config
# keeps a time_step_rank it does not use; Zamba's n_mamba_heads split a Mamba v1 mixer, Zamba2's come with a head dim)
_DT_RANK = ("mamba_dt_rank", "time_step_rank")
_MAMBA2_SIZES = ("mamba_n_heads", "mamba_num_heads", "num_heads", "mamba_headdim", "mamba_d_head", "mamba_head_dim")
# a pure Mamba2 model's config (Mamba2Config): SSM heads of a head dim, B/C groups of d_state, and no attention heads
_PURE_MAMBA2 = ("num_heads", "head_dim", "n_groups", "state_size")


def _mamba_v1_fields(config, layers: tuple[int, ...], hybrid: tuple[int, ...]) -> dict:
    """The Mamba v1 fields of ``layers`` (``hybrid``: those with an attention block). The channels are
    ``mamba_expand`` x hidden (Jamba, Zamba) or ``intermediate_size`` (Mamba, FalconMamba: a model with no MLP,
    ``intermediate`` 0)."""
    expand = _first(config, "mamba_expand")
    fields = dict(
        ssm_layers=layers,
        ssm_attention_layers=hybrid,
        ssm_inner=expand * config.hidden_size if expand else config.intermediate_size,
        ssm_state=_first(config, "mamba_d_state", "state_size"),
        ssm_kernel=_first(config, "mamba_d_conv", "conv_kernel"),
        ssm_dt_rank=_first(config, *_DT_RANK),
    )
    return fields if expand else {**fields, "intermediate": 0}


def _mamba2_fields(config, layers: tuple[int, ...], hybrid: tuple[int, ...], pure: bool) -> dict:
    """The Mamba2 fields of ``layers`` (``hybrid``: those with attention beside the mixer). ``pure``: a Mamba2 model
    (Mamba2Config), whose ``head_dim`` is the SSM heads' (it has no attention) and which has no MLP."""
    heads = _first(config, *(("num_heads",) if pure else ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")))
    head_dim = _first(config, *(("head_dim",) if pure else ("mamba_d_head", "mamba_head_dim", "mamba_headdim")))
    fields = dict(
        mamba_layers=layers,
        mamba_attention_layers=hybrid,
        mamba_heads=heads,
        mamba_head_dim=head_dim or _first(config, "mamba_d_ssm") // heads,
        mamba_groups=_first(config, "mamba_n_groups", "n_groups", "mamba_ngroups") or 1,
        mamba_state=_first(config, "mamba_d_state", "ssm_state_size", "state_size"),
        mamba_kernel=_first(config, "mamba_d_conv", "conv_kernel"),
        mamba_chunk=_first(config, "mamba_chunk_size", "chunk_size"),
    )
    return {**fields, "intermediate": 0, "head_dim": 0} if pure else fields


def layer_kinds(config) -> dict:
    """The :class:`.model_shape.ModelShape` fields of a config's layers other than softmax attention, from its
    per-layer kinds (``layer_types`` / ``layers_block_type``; transformers spells Mamba and lightning layers
    ``linear_attention`` too): Gated DeltaNet (``linear_num_key_heads``) or Kimi Delta Attention
    (``linear_num_heads``) layers, MiniMax's lightning attention (a ``block_size``), Mamba2 layers (``hybrid``:
    Zamba2's, with attention), Mamba v1 layers where the config has a step rank and no Mamba2 head sizes (``hybrid``:
    Zamba's, with attention), short-convolution layers (``conv``), MLP / MoE-only layers. A config with Mamba2 sizes
    and no such list (Falcon-H1) runs Mamba2 and attention in every layer; one with Mamba v1 sizes and no such list,
    Mamba v1 alone; a Mamba2Config (SSM ``num_heads``, no attention heads), Mamba2 alone."""
    kinds = list(getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None) or ())
    v1 = bool(_first(config, *_DT_RANK)) and not _first(config, *_MAMBA2_SIZES)
    pure2 = all(_first(config, n) for n in _PURE_MAMBA2) and not _first(config, "num_attention_heads")
    mamba_sizes = not v1 and (pure2 or bool(_first(config, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")))
    if not kinds and (mamba_sizes or v1):
        kinds = ["mamba" if v1 or pure2 else "hybrid"] * config.num_hidden_layers
    delta = hasattr(config, "linear_num_key_heads") or hasattr(config, "linear_num_heads")
    lightning = not delta and bool(_first(config, "block_size"))
    if not (v1 or mamba_sizes):  # "hybrid" layers without Mamba sizes are attention layers (Zaya's CCA and MoE)
        mamba_kinds: tuple[str, ...] = ()
    elif delta or lightning:
        mamba_kinds = ("mamba", "hybrid")
    else:
        mamba_kinds = ("mamba", "hybrid", "linear_attention")
    linear = tuple(i for i, k in enumerate(kinds) if k == "linear_attention" and (delta or lightning))
    mamba = tuple(i for i, k in enumerate(kinds) if k in mamba_kinds)
    hybrid = tuple(i for i in mamba if kinds[i] == "hybrid")
    fields: dict = dict(
        conv_layers=tuple(i for i, k in enumerate(kinds) if k == "conv"),
        mlp_layers=tuple(i for i, k in enumerate(kinds) if k in ("mlp", "moe")),
    )
    if linear and lightning:
        fields.update(lightning_layers=linear, lightning_block=_first(config, "block_size"))
    elif linear:
        heads = _first(config, "linear_num_heads")
        fields.update(
            linear_layers=linear,
            linear_k_heads=_first(config, "linear_num_key_heads") or heads,
            linear_v_heads=_first(config, "linear_num_value_heads") or heads,
            linear_k_dim=_first(config, "linear_key_head_dim", "linear_head_dim"),
            linear_v_dim=_first(config, "linear_value_head_dim", "linear_head_dim"),
            linear_kernel=_first(config, "linear_conv_kernel_dim"),
        )
    if mamba and v1:
        fields.update(_mamba_v1_fields(config, mamba, hybrid))
    elif mamba:
        fields.update(_mamba2_fields(config, mamba, hybrid, pure2))
    if fields["conv_layers"]:
        fields["conv_kernel"] = _first(config, "conv_L_cache")
    return {k: v for k, v in fields.items() if v or k in ("intermediate", "head_dim")}


# a dense MLP's width under its names (GPT-2's ``n_inner``, OPT's ``ffn_dim``, the Bart family's decoder, Llama 4's
# dense layers beside its experts, LongCat's ``ffn_hidden_size``); a list (Gemma 3n) gives one per layer
_DENSE_WIDTHS = (
    "intermediate_size",
    "dense_intermediate_size",
    "intermediate_size_mlp",
    "ffn_dim",
    "decoder_ffn_dim",
    "ffn_hidden_size",
    "n_inner",
)
_TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k", "top_k_experts", "moe_k")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_WIDTHS = ("moe_intermediate_size", "expert_ffn_hidden_size", "ffn_hidden_size", "intermediate_size")
_SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_SHARED_WIDTHS = ("shared_expert_intermediate_size", "shared_intermediate_size", "moe_shared_expert_intermediate_size")


def mlp_width(config) -> int:
    """The MLP width one token takes in its widest layer, the unit of the memory model's MLP terms: a dense MLP's
    width, or a mixture of experts' routed experts (top-k of them, each of the expert width) plus its shared experts,
    whichever is larger (both, where a layer runs its experts beside its dense MLP: Gemma 4). A config without a
    dense width and without experts: 4 x hidden (GPT-2's convention without ``n_inner``; above xLSTM's
    ``ffn_proj_factor`` x hidden). DBRX keeps its expert sizes in ``ffn_config``."""
    sources = [config] + ([config.ffn_config] if getattr(config, "ffn_config", None) is not None else [])

    def first(names: tuple[str, ...]) -> int:
        return next((v for s in sources if (v := _first(s, *names))), 0)

    dense = max(
        (max(v) if isinstance(v, list) else v for n in _DENSE_WIDTHS if (v := getattr(config, n, None))), default=0
    )
    top_k = first(_TOP_K) if getattr(config, "is_moe", True) else 0
    routed = 0
    if top_k and first(_EXPERTS) > 1:
        width = first(_EXPERT_WIDTHS)
        shared = _first(config, *_SHARED_WIDTHS) or first(_SHARED_EXPERTS) * width
        routed = top_k * width + shared
    if getattr(config, "enable_moe_block", False):  # Gemma 4's MoE layers run their experts beside the dense MLP
        return dense + routed
    return max(dense, routed) or 4 * config.hidden_size


class WidestLayer:
    """A heterogeneous config (sizes that differ per layer, ``per_layer_config``: Gemma 4's full-attention head dim,
    dots3's heads) read as its widest layer: each per-layer size the largest any layer has; anything else the
    config's own. So the memory model sizes every layer as large as the largest (never under)."""

    def __init__(self, config):
        self._config = config
        self._widest: dict[str, int] = {}
        for name in config.per_layer_attributes:
            values = [getattr(layer, name) for layer in config.per_layer_config]
            if all(isinstance(v, int) for v in values):
                self._widest[name] = max(values)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (its own fields, before __init__ set them: copy, pickle)
            raise AttributeError(name)
        return self._widest[name] if name in self._widest else getattr(self._config, name)


def widest_layer(config):
    """``config``, or its :class:`WidestLayer` view when its sizes differ per layer."""
    return WidestLayer(config) if getattr(config, "is_heterogeneous", False) else config
