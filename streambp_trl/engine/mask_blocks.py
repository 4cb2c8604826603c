"""The attention mask blocks a streamed call's layers will build, read from the call's arguments and the model's config
before the call runs, so its plan counts them (:class:`~streambp_trl.sizing.choices.MaskBlocks`).

A layer's chunk attends under a materialised mask block wherever its mask is not plainly causal
(:meth:`~streambp_trl.attention.StreamMask.block`): over the whole prefix where the rows are padded, packed (position
ids that restart, or flash attention's sequence descriptors) or given as a 4D mask; over a window where the layer is a
sliding-window or chunked attention, whatever the inputs. Under a sequence split the whole rows' padding and documents
decide, which every rank of the group knows alike (:class:`~streambp_trl.layers.sequence_split.SequenceSplit`), so
every rank plans the same blocks.
"""

from __future__ import annotations

import torch

from ..layers.layer_args import PASS_THROUGH
from ..layers.sequence_split import SequenceSplit
from ..sizing.choices import MaskBlocks

_WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def call_masks(config, kwargs: dict, split: SequenceSplit | None, kernel_apart: bool) -> MaskBlocks:
    """The mask blocks of a decoder call with ``kwargs`` (its ``attention_mask``, ``position_ids`` and packed rows'
    descriptors, as the decoder's forward will read them), on a model with text config ``config``; ``split``: the
    sequence split the call is one rank's share of; ``kernel_apart``: some layer's attention keeps packed documents
    apart whatever the mask (flash attention's variable-length kernel). Reads the 2D mask and the position ids on the
    host where they are given (one synchronisation each, as transformers' own mask preparation makes)."""
    return MaskBlocks(whole=_over_whole_prefix(kwargs, split, kernel_apart), window=model_window(config))


def model_window(config) -> int | None:
    """The widest span of keys the model's windowed layers attend to (``None``: no layer is windowed): a sliding-window
    layer's ``sliding_window``, a chunked attention's ``attention_chunk_size``, for the layer types ``layer_types``
    names; a config without them windows every layer where it sets ``sliding_window`` (Mistral's), unless
    ``use_sliding_window`` is off."""
    types = set(getattr(config, "layer_types", None) or ())
    if not types:
        sliding = getattr(config, "use_sliding_window", True) is not False
        return getattr(config, "sliding_window", None) if sliding else None
    spans = [getattr(config, field, None) for kind, field in _WINDOWED.items() if kind in types]
    return max((span for span in spans if span), default=None)


def _over_whole_prefix(kwargs: dict, split: SequenceSplit | None, kernel_apart: bool) -> bool:
    """Whether the layers that attend over the whole prefix build a mask block: the rows are padded, packed or given a
    4D mask."""
    if split is not None:
        return split.padding is not None or bool(split.documents)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and (mask.dim() == 4 or (mask.dim() == 2 and not bool(mask.all()))):
        return True
    if any(kwargs.get(name) is not None for name in PASS_THROUGH):
        return True
    positions = kwargs.get("position_ids")
    if (mask is None or kernel_apart) and isinstance(positions, torch.Tensor) and positions.dim() == 2:
        # transformers reads packed rows from position ids that restart where no mask is given; flash's kernel keeps
        # them apart whatever the mask
        return positions.shape[1] > 1 and bool((positions.diff(dim=1) != 1).any())
    return False
