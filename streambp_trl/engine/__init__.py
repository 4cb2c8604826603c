"""The stream engine: installing StreamBP on a Hugging Face causal LM.

* :mod:`.options`: :class:`StreamOptions`, the engine's options, validated once;
* :mod:`.install`: :func:`enable_streambp` / :func:`disable_streambp`, :func:`is_streaming`, :func:`chunk_sizes`,
  :func:`count_optimizer`, :func:`last_head_form`, :func:`last_plan`, :func:`plan_fields`,
  :func:`packed_rows_refusal`; :data:`PACKING_KWARGS`, packed rows' sequence descriptors (a split call takes the
  rows' position ids alone);
* :mod:`.state`: :class:`EngineState`, what the engine found and chose once, kept on the model;
* :mod:`.decoder_forward`: the decoder's forward it installs (streamed calls, a rank's share under a split);
* :mod:`.lm_forward`: the causal LM's forward it installs (the logit kernel as LM head);
* :mod:`.head_side`: :func:`decode_for_head`, the decoder call every head side makes (the LM head's, the score
  head's, the distillation divergence's), with one rule for the final norm; :func:`logits_tile`,
  :func:`logit_gradient_form`;
* :mod:`.model_parts`: finding the decoder, its layers, its final norm and the LM head;
* :mod:`.support` and :mod:`.probe`: the checks that refuse a model the engine cannot run exactly;
* :mod:`.zero3`: DeepSpeed ZeRO-3 leaf layers and parameter gathers.
"""

from ..layers.layer_args import PACKING_KWARGS
from .head_side import HeadSide, decode_for_head, kernel_head, logit_gradient_form, logits_tile
from .install import (
    check_fits,
    chunk_sizes,
    count_optimizer,
    disable_streambp,
    enable_streambp,
    is_streaming,
    last_head_form,
    last_plan,
    packed_rows_refusal,
    plan_fields,
)
from .model_parts import lm_head_linear
from .options import StreamOptions
from .zero3 import mark_zero3_leaves, zero3_enabled

__all__ = [
    "PACKING_KWARGS",
    "HeadSide",
    "StreamOptions",
    "check_fits",
    "chunk_sizes",
    "count_optimizer",
    "decode_for_head",
    "kernel_head",
    "disable_streambp",
    "enable_streambp",
    "last_head_form",
    "last_plan",
    "plan_fields",
    "is_streaming",
    "packed_rows_refusal",
    "lm_head_linear",
    "logit_gradient_form",
    "logits_tile",
    "mark_zero3_leaves",
    "zero3_enabled",
]
