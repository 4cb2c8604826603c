"""The shape of a decoder-only model as the memory model (:mod:`.memory_model`) sees it: widths, layer counts by
kind (softmax attention, Gated / Kimi DeltaNet, Mamba2, Mamba v1, short convolution, no token mixer), vocabulary,
parameter count; from a config, a loaded model or a name."""

from __future__ import annotations

import dataclasses
import types

from .shapes import NAMED_MODELS, canonical_model_name


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer step depends on. ``params`` 0: counted from the shape.

    A hybrid decoder (Qwen3.5, Qwen3-Next: ``config.layer_types``) has Gated DeltaNet layers (``linear_layers``, their
    indices) beside its softmax-attention ones: ``linear_k_heads`` query/key heads of ``linear_k_dim`` and
    ``linear_v_heads`` value heads of ``linear_v_dim``, after a depthwise causal convolution of ``linear_kernel`` taps
    over the ``conv_dim`` = 2 key widths + the value width of the projected inputs. They hold no keys/values: their
    carry is a recurrent state (``linear_v_heads`` x ``linear_k_dim`` x ``linear_v_dim``) and the convolution's last
    inputs. Kimi Linear and Bailing hybrid layers (Kimi Delta Attention: ``linear_num_heads`` of ``linear_head_dim``)
    are counted as such with as many key as value heads.

    Mamba2 layers (``mamba_layers``: Falcon-H1, Bamba, Granite 4 hybrid, Nemotron-H, Zamba2) have ``mamba_heads`` SSM
    heads of ``mamba_head_dim`` channels, ``mamba_groups`` groups of B/C of ``mamba_state`` entries, a convolution of
    ``mamba_kernel`` taps over ``mamba_conv_dim`` channels and an SSD scan in blocks of ``mamba_chunk`` tokens; their
    carry is the SSM state (heads x head_dim x d_state) and the convolution's last inputs. Those of
    ``mamba_attention_layers`` also run softmax attention (Falcon-H1: every layer, in parallel; Zamba2: its shared
    attention block).

    Mamba v1 layers (``ssm_layers``: Mamba, FalconMamba, Jamba, Zamba) project to ``ssm_inner`` channels x and gate z,
    convolve x over ``ssm_kernel`` taps, project it to the step's ``ssm_dt_rank`` inputs and ``ssm_state`` entries of
    B and C, and scan channel by channel (Zamba splits the channels into heads with their own projections: the same
    sizes); their carry is the float32 SSM state (inner x d_state) and the convolution's last inputs. Those of
    ``ssm_attention_layers`` also run attention and its MLP (Zamba's shared attention block); the others hold an MLP
    (or MoE) of their own only in a model with an MLP and no such layers (Jamba: :attr:`ssm_mlp`); a pure Mamba
    (``intermediate`` 0, no attention heads) has none.

    Short-convolution layers (``conv_layers``: LFM2) convolve ``hidden`` channels over ``conv_kernel`` taps (carry: the
    last inputs). ``mlp_layers`` (Nemotron-H's MLP / MoE blocks) mix no tokens: no carry. The other fields describe
    the softmax-attention layers: every layer not of another kind is one.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int = 0
    tied: bool = False
    linear_layers: tuple[int, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_kernel: int = 0
    rotary_dim: int = 0  # rotated channels of a head (0: all of head_dim; Qwen3.5 rotates a quarter)
    mamba_layers: tuple[int, ...] = ()
    mamba_attention_layers: tuple[int, ...] = ()
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_kernel: int = 0
    mamba_chunk: int = 0
    ssm_layers: tuple[int, ...] = ()
    ssm_attention_layers: tuple[int, ...] = ()
    ssm_inner: int = 0
    ssm_state: int = 0
    ssm_kernel: int = 0
    ssm_dt_rank: int = 0
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    mlp_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.params:
            decoder = (
                len(self.plain_attention_layers) * self.layer_params
                + len(self.linear_layers) * self.linear_layer_params
                + len(self.mamba_layers) * self.mamba_layer_params
                + len(self.mamba_attention_layers) * (self.layer_params - self.mlp_params)
                + len(self.ssm_layers) * self.ssm_layer_params
                + len(self.ssm_attention_layers) * self.layer_params
                + len(self.conv_layers) * self.conv_layer_params
                + len(self.mlp_layers) * (self.mlp_params + self.hidden)
            )
            object.__setattr__(self, "params", decoder + self.embedding_params)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with softmax attention (keys/values): those of no other kind, and the Mamba2 / Mamba
        v1 layers that run attention too."""
        beside = {*self.mamba_attention_layers, *self.ssm_attention_layers}
        return tuple(sorted({*self.plain_attention_layers, *beside}))

    @property
    def plain_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers of no other kind: softmax attention and an MLP."""
        other = {*self.linear_layers, *self.mamba_layers, *self.ssm_layers, *self.conv_layers, *self.mlp_layers}
        return tuple(i for i in range(self.layers) if i not in other)

    @property
    def full_layers(self) -> int:
        """Softmax-attention layers (with keys/values)."""
        return len(self.attention_layers)

    @property
    def mlp_params(self) -> int:
        """Parameters of a SwiGLU MLP."""
        return 3 * self.hidden * self.intermediate

    @property
    def mamba_inner(self) -> int:
        """Channels of a Mamba2 layer's SSM input x (and its gate z): heads x head_dim."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of a Mamba2 layer's convolution: x, B and C."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    @property
    def mamba_ssm_state(self) -> int:
        """Elements of a Mamba2 layer's SSM state per sequence: heads x head_dim x d_state."""
        return self.mamba_inner * self.mamba_state

    @property
    def mamba_layer_params(self) -> int:
        """Parameters of one Mamba2 layer: the input projection (z, x, B, C, dt), the convolution, the per-head A,
        D and dt bias, the gated norm, the output projection, SwiGLU MLP and the two norms."""
        projection = self.hidden * (self.mamba_inner + self.mamba_conv_dim + self.mamba_heads)
        mixer = projection + self.mamba_conv_dim * (self.mamba_kernel + 1) + 3 * self.mamba_heads + self.mamba_inner
        return mixer + self.mamba_inner * self.hidden + self.mlp_params + 2 * self.hidden

    @property
    def ssm_mlp(self) -> bool:
        """Whether each Mamba v1 layer holds an MLP (or MoE) beside its mixer: in a model with an MLP whose Mamba v1
        layers run no attention block (Jamba); a pure Mamba has no MLP, and Zamba's runs in its attention block."""
        return bool(self.intermediate) and not self.ssm_attention_layers

    @property
    def ssm_state_elements(self) -> int:
        """Elements of a Mamba v1 layer's SSM state per sequence: inner x d_state."""
        return self.ssm_inner * self.ssm_state

    @property
    def ssm_mixer_params(self) -> int:
        """Parameters of one Mamba v1 mixer: the input projection (x, z: 2 x inner x hidden), the convolution with its
        bias (inner x (kernel + 1)), x_proj (inner x (dt_rank + 2 d_state): the step's inputs, B, C), dt_proj with
        its bias (inner x (dt_rank + 1)), A_log (inner x d_state), D (inner) and the output projection (inner x
        hidden). Jamba's three norms of the step's inputs, B and C add dt_rank + 2 d_state more."""
        inner, state, rank = self.ssm_inner, self.ssm_state, self.ssm_dt_rank
        return inner * (3 * self.hidden + self.ssm_kernel + 2 * rank + 3 * state + 3)

    @property
    def ssm_layer_params(self) -> int:
        """Parameters of one Mamba v1 layer: its mixer and norm, with a SwiGLU MLP and its norm where it holds one
        (:attr:`ssm_mlp`)."""
        return self.ssm_mixer_params + self.hidden + (self.mlp_params + self.hidden if self.ssm_mlp else 0)

    @property
    def conv_layer_params(self) -> int:
        """Parameters of one short-convolution layer (LFM2): the input projection (B, C, x), the depthwise
        convolution, the output projection, SwiGLU MLP and the two norms."""
        return 4 * self.hidden * self.hidden + self.conv_kernel * self.hidden + self.mlp_params + 2 * self.hidden

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's convolution: its queries, keys and values."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def recurrent_state(self) -> int:
        """Elements of a Gated DeltaNet layer's recurrent state per sequence: value heads x d_k x d_v."""
        return self.linear_v_heads * self.linear_k_dim * self.linear_v_dim

    @property
    def linear_layer_params(self) -> int:
        """Parameters of one Gated DeltaNet layer: input projections (convolution channels, output gate z, the
        per-head beta and decay inputs), the convolution, the per-head decay parameters, the gated norm, the output
        projection, SwiGLU MLP and the two norms."""
        value = self.linear_v_heads * self.linear_v_dim
        projections = self.hidden * (self.conv_dim + 2 * value + 2 * self.linear_v_heads)
        mixer = projections + self.conv_dim * self.linear_kernel + 2 * self.linear_v_heads + self.linear_v_dim
        return mixer + self.mlp_params + 2 * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one softmax-attention decoder layer: attention projections, SwiGLU MLP, norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + self.mlp_params + 2 * self.hidden + 2 * self.head_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (its text config for a multimodal one). A pure state-space model (Mamba,
        FalconMamba) has no attention heads: 0."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(config, "num_attention_heads", None) or 0
        head_dim = (
            getattr(config, "qk_head_dim", None)  # multi-head latent attention: its keys' width
            or getattr(config, "attention_head_dim", None)
            or getattr(config, "head_dim", None)
            or (config.hidden_size // heads if heads else 0)
        )
        rope = getattr(config, "rope_parameters", None)
        rope = rope if isinstance(rope, dict) else {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        fields = dict(
            layers=len(getattr(config, "layer_types", None) or ()) or config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            rotary_dim=int(head_dim * partial) if partial < 1 else 0,
        )
        return cls(**{**fields, **layer_kinds(config)})

    @classmethod
    def from_model(cls, model) -> ModelShape:
        """From a loaded model: its config's shape with its actual parameter count."""
        return dataclasses.replace(cls.from_config(model.config), params=sum(p.numel() for p in model.parameters()))

    @classmethod
    def from_name(cls, name: str) -> ModelShape:
        """A named shape of :data:`streambp_trl.sizing.shapes.NAMED_MODELS` (``qwen3-8b``, a size such as ``8B``, or
        the Hub name of one such as ``Qwen/Qwen3-8B``: no network), else a local config path or a Hub model id (its
        ``config.json`` only; ``OSError`` when it cannot be read)."""
        key = canonical_model_name(name)
        if key in NAMED_MODELS and "model_type" not in NAMED_MODELS[key]:  # a Qwen3 shape: the formula's count
            return cls.from_config(types.SimpleNamespace(**NAMED_MODELS[key]))
        from transformers import AutoConfig

        if key in NAMED_MODELS:  # another architecture (the Qwen3.5 hybrids): its parameters counted on meta tensors
            import torch
            from transformers import AutoModelForCausalLM

            kwargs = dict(NAMED_MODELS[key])
            config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
            with torch.device("meta"):
                return cls.from_model(AutoModelForCausalLM.from_config(config))

        return cls.from_config(AutoConfig.from_pretrained(name))


def _first(config, *names: str) -> int:
    """The first of ``names`` that ``config`` sets to a number (0 if none does)."""
    return next((v for v in (getattr(config, n, None) for n in names) if isinstance(v, int)), 0)


# a Mamba v1 mixer's config: the rank of its step's projection, and none of a Mamba2 mixer's head sizes (Mamba2Config
# keeps a time_step_rank it does not use; Zamba's n_mamba_heads split a Mamba v1 mixer, Zamba2's come with a head dim)
_DT_RANK = ("mamba_dt_rank", "time_step_rank")
_MAMBA2_SIZES = ("mamba_n_heads", "mamba_num_heads", "num_heads", "mamba_headdim", "mamba_d_head", "mamba_head_dim")


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


def layer_kinds(config) -> dict:
    """The :class:`ModelShape` fields of a config's layers other than softmax attention, from its per-layer kinds
    (``layer_types`` / ``layers_block_type``; transformers spells Mamba layers ``linear_attention`` too): Gated
    DeltaNet (``linear_num_key_heads``) or Kimi Delta Attention (``linear_num_heads``) layers, Mamba2 layers
    (``hybrid``: Zamba2's, with attention), Mamba v1 layers where the config has a step rank and no Mamba2 head sizes
    (``hybrid``: Zamba's, with attention), short-convolution layers (``conv``), MLP / MoE-only layers. A config with
    Mamba2 sizes and no such list (Falcon-H1) runs Mamba2 and attention in every layer; one with Mamba v1 sizes and no
    such list, Mamba v1 alone."""
    kinds = list(getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None) or ())
    v1 = bool(_first(config, *_DT_RANK)) and not _first(config, *_MAMBA2_SIZES)
    mamba_sizes = 0 if v1 else _first(config, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    if not kinds and (mamba_sizes or v1):
        kinds = ["mamba" if v1 else "hybrid"] * config.num_hidden_layers
    delta = hasattr(config, "linear_num_key_heads") or hasattr(config, "linear_num_heads")
    mamba_kinds = ("mamba", "hybrid") if delta else ("mamba", "hybrid", "linear_attention")
    linear = tuple(i for i, k in enumerate(kinds) if k == "linear_attention" and delta)
    mamba = tuple(i for i, k in enumerate(kinds) if k in mamba_kinds)
    hybrid = tuple(i for i in mamba if kinds[i] == "hybrid")
    fields: dict = dict(
        linear_layers=linear,
        mamba_layers=() if v1 else mamba,
        mamba_attention_layers=() if v1 else hybrid,
        conv_layers=tuple(i for i, k in enumerate(kinds) if k == "conv"),
        mlp_layers=tuple(i for i, k in enumerate(kinds) if k in ("mlp", "moe")),
    )
    if linear:
        heads = _first(config, "linear_num_heads")
        fields.update(
            linear_k_heads=_first(config, "linear_num_key_heads") or heads,
            linear_v_heads=_first(config, "linear_num_value_heads") or heads,
            linear_k_dim=_first(config, "linear_key_head_dim", "linear_head_dim"),
            linear_v_dim=_first(config, "linear_value_head_dim", "linear_head_dim"),
            linear_kernel=_first(config, "linear_conv_kernel_dim"),
        )
    if mamba and v1:
        fields.update(_mamba_v1_fields(config, mamba, hybrid))
    elif mamba:
        heads = mamba_sizes
        fields.update(
            mamba_heads=heads,
            mamba_head_dim=_first(config, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
            or _first(config, "mamba_d_ssm") // heads,
            mamba_groups=_first(config, "mamba_n_groups", "n_groups", "mamba_ngroups") or 1,
            mamba_state=_first(config, "mamba_d_state", "ssm_state_size"),
            mamba_kernel=_first(config, "mamba_d_conv", "conv_kernel"),
            mamba_chunk=_first(config, "mamba_chunk_size", "chunk_size"),
        )
    if fields["conv_layers"]:
        fields["conv_kernel"] = _first(config, "conv_L_cache")
    return {k: v for k, v in fields.items() if v or k == "intermediate"}
