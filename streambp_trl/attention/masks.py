"""The attention mask of a streamed call, described rather than materialised.

The model-level mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``, ...) return a
:class:`StreamMask` during a streamed call (:func:`stream_mask` is registered as transformers' mask interface
function): the model's own index-based ``mask_function``, the 2D padding mask and the sliding window, not a
(T x T) tensor. The stream decoder hands each layer call ``mask.at(q_start, kv_start)``, and the attention builds at
most that call's (q_len x kv_len) block with ``masking_utils.sdpa_mask``, evaluated with absolute indices, so a
chunk sees exactly the rows of the full mask it needs. A plainly causal block (no padding, packing, window or
overlay) is :class:`LowerRight`, PyTorch's bottom-right causal bias, which holds no memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant
from transformers.masking_utils import causal_mask_function, sdpa_mask


@dataclasses.dataclass(frozen=True)
class StreamMask:
    """A causal attention mask described, not materialised.

    Either ``mask_function`` (absolute ``(batch, head, q_idx, kv_idx) -> bool``, as transformers builds it,
    with ``padding`` the (batch, T) bool padding mask or ``None``) or ``dense``, a user-given 4D mask over the
    whole sequence that is only sliced. ``q_start``/``kv_start`` place the current call's queries and keys.
    ``prefix_grads``: in a backward recompute of a chunk, the :class:`~streambp_trl.attention.PrefixGrad` pairs of
    the joined keys/values the chunk's cache returned (the cache appends them as the layer runs), which the attention
    looks up by the tensors it is given. ``documents``: the positions where a packed row's documents start (but the
    first), which the attention keeps apart besides the mask (as flash attention's variable-length kernel does with a
    packed row's ``cu_seq_lens``; :meth:`apart`).
    """

    batch_size: int
    mask_function: Callable | None = None
    padding: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    local_size: int | None = None
    use_vmap: bool = False
    q_start: int = 0
    kv_start: int = 0
    prefix_grads: list = dataclasses.field(default_factory=list, compare=False)
    documents: tuple[int, ...] = ()

    @property
    def plain_causal(self) -> bool:
        """True when the mask is exactly causal: no padding, packing, window or overlay."""
        described = self.mask_function is causal_mask_function and self.padding is None
        return self.dense is None and described and not self.documents

    __iter__ = None  # (indexable for whole slices only, not a sequence)

    def __getitem__(self, index: object) -> StreamMask:
        """The mask itself, for an index that keeps every position (``mask[:, :, slice(0, None), :]``: Gemma 4 slices
        its masks to the positions whose logits it keeps, all of them in a streamed call, whose decoder is handed
        ``logits_to_keep=0``); any other index is refused."""
        parts = index if isinstance(index, tuple) else (index,)
        if all(
            isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step in (None, 1) for i in parts
        ):
            return self
        raise TypeError(f"StreamBP's attention mask describes the whole sequence and is not sliced ({index!r}).")

    @classmethod
    def of_dense(cls, mask: torch.Tensor, batch_size: int) -> StreamMask:
        """A user-given 4D mask (batch or 1, 1 or heads, T, T; bool, or additive with its dtype's lowest value or -inf
        where masked) over the whole sequence, to be sliced per chunk. Refused if it lets a query attend to a later key
        (a prefix-LM mask's bidirectional block): a chunk attends to the keys up to its own end, and the later ones do
        not exist yet when it runs. Holds one (T x T) bool tensor per mask row while it checks (one host read)."""
        attends = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        if bool(attends.triu(1).any()):
            raise ValueError(
                "StreamBP: the 4D attention mask lets a query attend to a later key (an allowed entry above the "
                "diagonal, e.g. a prefix-LM block that sees its whole prefix): a streamed chunk attends only to keys "
                "up to its own end, so those entries would be dropped. Pass a causal mask (nothing allowed above the "
                "diagonal), or disable_streambp(model) to train with this one."
            )
        return cls(batch_size=batch_size, dense=mask)

    def apart(self, documents: tuple[int, ...]) -> StreamMask:
        """The same mask, keeping the documents that start at ``documents`` (absolute positions) apart as well."""
        return dataclasses.replace(self, documents=documents)

    def at(self, q_start: int, kv_start: int, prefix_grads: list | None = None) -> StreamMask:
        """The same mask, for queries from absolute position ``q_start`` and keys from ``kv_start`` (and, in a
        backward recompute, the chunk's ``prefix_grads``)."""
        return dataclasses.replace(
            self, q_start=q_start, kv_start=kv_start, prefix_grads=[] if prefix_grads is None else prefix_grads
        )

    def block(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
        """The (batch, 1, q_len, kv_len) bool block of the mask, or ``None`` for a bottom-right causal block.

        ``None`` is only returned when the queries end where the keys end, which is how the stream decoder
        always calls a layer, so bottom-right causal alignment is the exact mask.
        """
        if self.plain_causal and self.q_start + q_len == self.kv_start + kv_len:
            return None
        return self.materialise(q_len, kv_len, device)

    def materialise(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
        """The (batch, 1, q_len, kv_len) block as a tensor (bool, or a user-given mask's dtype), even where it is
        plainly causal: for a layer whose own code reads the mask as a tensor (a sparse indexed attention's indexer).
        Holds q_len x kv_len per batch row."""
        q_end, kv_end = self.q_start + q_len, self.kv_start + kv_len
        if self.dense is not None:
            block = self.dense[:, :, self.q_start : q_end, self.kv_start : kv_end]
        else:
            block = self._described(q_len, kv_len, device)
        if not self.documents:
            return block
        starts = torch.tensor(self.documents, device=device)
        same = _document(starts, self.q_start, q_end)[:, None] == _document(starts, self.kv_start, kv_end)[None, :]
        if block.dtype == torch.bool:
            return block & same
        return block.masked_fill(~same, torch.finfo(block.dtype).min)

    def _described(self, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
        return sdpa_mask(
            batch_size=self.batch_size,
            q_length=q_len,
            kv_length=kv_len,
            q_offset=self.q_start,
            kv_offset=self.kv_start,
            mask_function=self.mask_function,
            attention_mask=self.padding,
            allow_is_causal_skip=False,
            use_vmap=self.use_vmap,
            device=device,
        )


def _document(starts: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The document index of each position in [start, end) of a packed row whose documents start at ``starts``."""
    return torch.searchsorted(starts, torch.arange(start, end, device=starts.device), right=True)


class LowerRight(CausalBias):
    """PyTorch's bottom-right causal bias (``torch.nn.attention.bias.causal_lower_right``) for q_len queries ending
    where kv_len keys end, without memory.

    ``CausalBias`` is built by the legacy ``torch.Tensor(*sizes)`` constructor, which allocates a (2, q_len, kv_len)
    float32 host tensor (128 GiB of address space for a 16k chunk against a 1M prefix) and cannot be created under a
    dispatch mode. This subclass is a storage-less wrapper holding the same three fields; SDPA dispatches it through
    ``CausalBias``'s own ``__torch_function__`` exactly as it does the original (to flash's native lower-right causal
    mask, the memory-efficient kernel's, or on the CPU the materialised block). No other operation applies to it.
    """

    @staticmethod
    def __new__(cls, seq_len_q: int, seq_len_kv: int):
        return torch.Tensor._make_wrapper_subclass(cls, (seq_len_q, seq_len_kv), dtype=torch.bool)

    def __init__(self, seq_len_q: int, seq_len_kv: int):
        self.variant, self.seq_len_q, self.seq_len_kv = CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not defined on a causal bias (it only masks attention).")


def stream_mask(**kwargs) -> StreamMask:
    """Mask interface function: a :class:`StreamMask` describing the whole sequence's mask."""
    if kwargs.get("q_offset", 0) or kwargs.get("kv_offset", 0) or kwargs["q_length"] != kwargs["kv_length"]:
        raise ValueError(
            "StreamBP streams whole sequences without a key/value cache, but this call has cached positions "
            f"(q_offset={kwargs.get('q_offset', 0)}, kv_length={kwargs['kv_length']}, q_length={kwargs['q_length']})."
        )
    padding = kwargs.get("attention_mask")
    if padding is not None and bool(padding.all()):
        padding = None
    return StreamMask(
        batch_size=kwargs["batch_size"],
        mask_function=kwargs["mask_function"],
        padding=padding,
        local_size=kwargs.get("local_size"),
        use_vmap=kwargs.get("use_vmap", False),
    )
