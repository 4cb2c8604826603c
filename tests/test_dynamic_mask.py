"""Dynamic mask attention (Doge) streamed exactly.

Doge's attention adds a per-key bias ``exp(A * softplus(dt_proj(v_j)))`` to its mask and keeps, in each query row,
the ``keep_window_size`` keys of largest bias. A chunk gets its mask block as a tensor, builds the bias from the keys'
values the chunk cache returns, and ranks full-width rows (:mod:`streambp_trl.layers.dynamic_mask`). In the first
layer a key's value depends on its token alone, so repeated tokens tie, and ``torch.topk`` breaks ties by the row it
is given: the comparison fails when a chunk ranks its own keys only (mutation below).

Tiny float64 models with ``keep_window_size`` 5 (most rows keep fewer keys than they may attend to), token ids from
a small range (every row repeats tokens), compared with plain autograd (relative error <= 1e-10) over chunk sizes that
do not divide the length, right- and left-padded rows, grouped-query heads and a sliding window.
"""

import contextlib
import copy

import pytest
import torch
from model_support import plain_loss, streamed_error
from zoo import tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.layers.adapters import dense_mask

EXACT = 1e-10
T, PAD = 29, 6


def _batch(padding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of T tokens drawn from 6 ids (each row repeats tokens), the second padded by PAD on ``padding``'s
    side; labels -100 where no real token predicts them."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 9, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if padding == "right":
        mask[1, T - PAD :] = 0
    elif padding == "left":
        mask[1, :PAD] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if padding == "left":  # the first real token is not predicted from a padding position (which attends to none)
        labels[1, PAD] = -100
    return ids, mask, labels


def _error(reference, streamed, padding: str) -> float:
    return streamed_error(reference, streamed, *_batch(padding))[0]


VARIANTS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "sliding": {"sliding_window": 9},  # keys from p > 0: the positions before it masked in the ranked rows
}


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 4, 7])
@pytest.mark.parametrize("variant", VARIANTS)
def test_doge_streams_exactly_with_tied_biases(variant, chunk, padding):
    reference = tiny_causal_lm("doge", **VARIANTS[variant])
    assert reference.config.keep_window_size < T // 2
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    assert _error(reference, streamed, padding) < EXACT


def test_the_window_changes_the_loss():
    """The top-k window masks keys the rows could attend to: the tiny model's loss changes without it (so the test
    above compares a selection)."""
    ids, mask, labels = _batch("right")
    narrow = plain_loss(tiny_causal_lm("doge"), ids, mask, labels).item()
    wide = plain_loss(tiny_causal_lm("doge", keep_window_size=T), ids, mask, labels).item()
    assert abs(narrow - wide) > 1e-3 * abs(wide)


def test_ranking_a_chunk_s_keys_alone_is_caught(monkeypatch):
    """Each chunk ranks only its own keys (the module's method on the chunk's biases, which slices the mask block to
    them): the tied biases of repeated tokens are then kept by another tie order, and the comparison fails."""
    monkeypatch.setattr(dense_mask, "full_rows", lambda modules, kv_start, seq_len: contextlib.nullcontext())
    reference = tiny_causal_lm("doge")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=7, verify=False)
    assert _error(reference, streamed, "right") > 1e-6


def test_zero_decay_is_refused():
    """A = 0 (Doge's initial value) gives every key the same bias: the window's choice is the sort's tie order."""
    model = tiny_causal_lm("doge")
    with torch.no_grad():
        model.model.layers[1].self_attn.A[2] = 0.0
    with pytest.raises(ValueError, match=r"DogeAttention\) has A = 0 in a head.*initialise A with nonzero values"):
        enable_streambp(model, stream_chunk_size=4)
