"""The shape of a decoder-only model as the memory model (:mod:`.memory_model`) sees it: widths, layer counts by
kind (softmax attention, Gated / Kimi DeltaNet, lightning attention, Mamba2, Mamba v1, short convolution, no token
mixer), vocabulary, parameter count; from a config (:mod:`.layer_kinds` reads the layers' kinds), a loaded model or a
name."""

from __future__ import annotations

import dataclasses
import types

from .layer_kinds import layer_kinds, mlp_width, widest_layer
from .shapes import NAMED_MODELS, canonical_model_name

# the hidden-state streams a layer's input holds: hyper-connections (Qwen4-Exp, DeepSeek-V4), Gemma 3n's AltUp
_STREAMS = ("hc_count", "hc_mult", "altup_num_inputs")


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

    MiniMax's lightning attention layers (``lightning_layers``) project to ``heads`` queries, keys and values of
    ``head_dim`` (the attention's sizes) and run linear attention with a per-head decay in blocks of
    ``lightning_block`` tokens, with no convolution; their carry is the key-value state (heads x head_dim x head_dim).

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
    (``intermediate`` 0, no attention heads) has none. A pure Mamba2 (Mamba2Config) has Mamba2 layers only, with no
    MLP (``intermediate`` 0) and no attention heads (``heads`` and ``head_dim`` 0).

    Short-convolution layers (``conv_layers``: LFM2) convolve ``hidden`` channels over ``conv_kernel`` taps (carry: the
    last inputs). ``mlp_layers`` (Nemotron-H's MLP / MoE blocks) mix no tokens: no carry. The other fields describe
    the softmax-attention layers: every layer not of another kind is one.

    ``streams``: the residual streams a layer's input and output hold (hyper-connections: Qwen4-Exp's ``hc_count``,
    HY-V4's ``hc_mult``; Gemma 3n's AltUp predictions, ``altup_num_inputs``), each ``hidden`` wide; the layers mix them
    into one ``hidden``-wide input of their attention and MLP. So the tensors kept per layer and handed between layers
    are :attr:`residual` wide.

    ``index_heads``: the heads of a sparse indexed attention's indexer (DeepSeek Sparse Attention's
    ``index_n_heads``), which scores each query of a chunk against the indexer keys of every position in float32;
    ``index_head_dim``: the width of those keys (one per position and layer).
    (Qwen4-Exp's indexer, which scores pooled key blocks one query at a time, is not counted: it holds boolean
    chunk x T masks.)
    ``shared_topk``: the top-k key indices (int32) every layer returns beside its output for the next layer, whose
    indexer may be "shared" (``config.indexer_types``: GLM-MoE-DSA, HY-V4); each layer's call keeps the ones it was
    given until its backward.
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
    lightning_layers: tuple[int, ...] = ()
    lightning_block: int = 0
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
    streams: int = 1
    index_heads: int = 0
    index_head_dim: int = 0
    shared_topk: int = 0

    def __post_init__(self):
        if not self.params:
            decoder = (
                len(self.plain_attention_layers) * self.layer_params
                + len(self.linear_layers) * self.linear_layer_params
                + len(self.lightning_layers) * self.lightning_layer_params
                + len(self.mamba_layers) * self.mamba_layer_params
                + len(self.mamba_attention_layers) * (self.layer_params - self.mlp_params)
                + len(self.ssm_layers) * self.ssm_layer_params
                + len(self.ssm_attention_layers) * self.layer_params
                + len(self.conv_layers) * self.conv_layer_params
                + len(self.mlp_layers) * (self.mlp_params + self.hidden)
            )
            object.__setattr__(self, "params", decoder + self.embedding_params)

    @property
    def residual(self) -> int:
        """Width of a layer's input and output: ``streams`` x ``hidden``."""
        return self.streams * self.hidden

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with softmax attention (keys/values): those of no other kind, and the Mamba2 / Mamba
        v1 layers that run attention too."""
        beside = {*self.mamba_attention_layers, *self.ssm_attention_layers}
        return tuple(sorted({*self.plain_attention_layers, *beside}))

    @property
    def plain_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers of no other kind: softmax attention and an MLP."""
        other = {*self.linear_layers, *self.lightning_layers, *self.mamba_layers, *self.ssm_layers}
        other |= {*self.conv_layers, *self.mlp_layers}
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
    def mamba_mixer_params(self) -> int:
        """Parameters of one Mamba2 mixer: the input projection (z, x, B, C, dt), the convolution with its bias, the
        per-head A, D and dt bias, the gated norm and the output projection."""
        projection = self.hidden * (self.mamba_inner + self.mamba_conv_dim + self.mamba_heads)
        mixer = projection + self.mamba_conv_dim * (self.mamba_kernel + 1) + 3 * self.mamba_heads + self.mamba_inner
        return mixer + self.mamba_inner * self.hidden

    @property
    def mamba_layer_params(self) -> int:
        """Parameters of one Mamba2 layer: its mixer, a SwiGLU MLP and the two norms (a pure Mamba2, ``intermediate``
        0: the mixer and its norm)."""
        return self.mamba_mixer_params + self.mlp_params + (2 if self.intermediate else 1) * self.hidden

    @property
    def lightning_state(self) -> int:
        """Elements of a lightning attention layer's key-value state per sequence: heads x head_dim x head_dim."""
        return self.heads * self.head_dim * self.head_dim

    @property
    def lightning_mixer_params(self) -> int:
        """Parameters of one lightning attention module: the joint query/key/value projection (3 q x hidden, q =
        heads x head_dim), the output gate (q x hidden), the output projection (hidden x q) and the norm of the heads'
        outputs (q)."""
        q = self.heads * self.head_dim
        return 5 * q * self.hidden + q

    @property
    def lightning_layer_params(self) -> int:
        """Parameters of one lightning attention layer: its mixer, a SwiGLU MLP (MiniMax's MoE counted as one) and the
        two norms."""
        return self.lightning_mixer_params + self.mlp_params + 2 * self.hidden

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
        FalconMamba, Mamba2) has no attention heads: 0, and no MLP (:func:`.layer_kinds.layer_kinds` says so)."""
        config = widest_layer(config.get_text_config() if hasattr(config, "get_text_config") else config)
        kinds = layer_kinds(config)
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
            intermediate=kinds["intermediate"] if "intermediate" in kinds else mlp_width(config),
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            rotary_dim=int(head_dim * partial) if partial < 1 else 0,
            streams=next((v for n in _STREAMS if (v := getattr(config, n, None))), 1),
            index_heads=getattr(config, "index_n_heads", None) or 0,
            index_head_dim=getattr(config, "index_head_dim", None) or 0,
            shared_topk=(getattr(config, "index_topk", None) or 0) if getattr(config, "indexer_types", None) else 0,
        )
        return cls(**{**fields, **kinds})

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
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if key in NAMED_MODELS:  # another architecture (the Qwen3.5 hybrids)
            kwargs = dict(NAMED_MODELS[key])
            config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        else:
            config = AutoConfig.from_pretrained(name)
        try:  # its parameters counted on meta tensors: a mixture of experts' every expert, which the formula omits
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM class for this config: the formula's count
            return cls.from_config(config)
        return cls.from_model(model)
