"""The shape of a decoder-only model as the memory model (:mod:`.memory_model`) sees it: widths, layer counts by
kind (softmax attention, Gated DeltaNet), vocabulary, parameter count; from a config, a loaded model or a name."""

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
    inputs. The other fields describe the softmax-attention layers; ``linear_layers`` empty: every layer is one.
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

    def __post_init__(self):
        if not self.params:
            decoder = self.full_layers * self.layer_params + len(self.linear_layers) * self.linear_layer_params
            object.__setattr__(self, "params", decoder + self.embedding_params)

    @property
    def full_layers(self) -> int:
        """Softmax-attention layers (with keys/values)."""
        return self.layers - len(self.linear_layers)

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
        return mixer + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one softmax-attention decoder layer: attention projections, SwiGLU MLP, norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (
            self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (its text config for a multimodal one)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kinds = getattr(config, "layer_types", None) or ()
        linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
        hybrid = (
            dict(
                linear_layers=linear,
                linear_k_heads=config.linear_num_key_heads,
                linear_v_heads=config.linear_num_value_heads,
                linear_k_dim=config.linear_key_head_dim,
                linear_v_dim=config.linear_value_head_dim,
                linear_kernel=config.linear_conv_kernel_dim,
            )
            if linear
            else {}
        )
        rope = getattr(config, "rope_parameters", None)
        rope = rope if isinstance(rope, dict) else {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            rotary_dim=int(head_dim * partial) if partial < 1 else 0,
            **hybrid,
        )

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
