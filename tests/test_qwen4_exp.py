"""Qwen4-Exp streamed exactly: Gated DeltaNet layers beside a sparse indexed attention that reads a position history,
per-layer n-gram embeddings (PLE) and hyper-connection streams.

Its decoder hands every layer the rotary embeddings of every position it attends to: the indexer rotates each key
block by its first position and its queries by the last embeddings given, the attention takes the last ones for its
chunk. A streamed chunk [s, e) is given positions [p, e) from its first key position p
(:func:`streambp_trl.layers.traits.keeps_position_history`). The n-gram embedding keeps the last ``ngram_size - 1``
token ids as a "convolution state" of integers, carried between chunks without gradient; the PLE's dilated
convolution keeps its float inputs, carried with it.

Tiny float64 models with an indexer budget below the keys most queries see (the selection changes the loss, checked),
end-of-sequence tokens inside the rows (the n-grams restart after them), a left-padded row, chunk sizes that do not
divide the length; compared with plain autograd with the model's float32 internals computed in float64
(:class:`~model_support.Float64Internals`, relative error <= 1e-10). The comparison fails when the
token ids are not carried between chunks.
"""

import copy

import pytest
import torch
from helpers import ShapeRecorder
from model_support import Float64Internals, plain_loss, streamed_errors
from zoo import tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.layers import carry

pytestmark = pytest.mark.slow  # the model's indexer loops over every query in Python: ~2 minutes

EXACT = 1e-10
T, PAD, EOS = 29, 6, 5
# PLE on the first (Gated DeltaNet) layer, 3-grams of 4 hashed heads
_PLE = dict(
    ple_layer_ids=[1],
    ple_embed_dim=16,
    heads_per_ngram=2,
    ngram_vocab_size_base=101,
    make_ngram_vocab_size_divisible_by=8,
    eos_token_id=EOS,
)
_REAL_GET_CONV_STATE = carry.ChunkCache.get_conv_state


def _model(budget: int = 8) -> torch.nn.Module:
    return tiny_causal_lm("qwen4_exp_text", indexer_budget=budget, initializer_range=0.2, **_PLE)


def _batch(seq_len: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 101, (2, seq_len), generator=generator)
    ids[0, 11] = ids[1, 17] = EOS  # documents end inside the rows
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _errors(reference, chunk: int, mutate=None) -> tuple[float, float]:
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk, logits_chunk_size=7)
    if mutate is not None:
        mutate()
    return streamed_errors(reference, streamed, *_batch(), Float64Internals)[:2]


def test_the_selection_and_the_ngrams_matter():
    """With weights large enough that the indexer's scores spread, a budget below the keys a query sees changes the
    loss, and so does the n-gram embedding: the tests below compare a real selection and real n-grams."""
    ids, mask, labels = _batch()
    model = _model()
    with torch.no_grad():
        sparse = plain_loss(model, ids, mask, labels)
        dense = plain_loss(_model(budget=2 * T), ids, mask, labels)
        model.model.layers[0].ple.ple_embedding.ngram_embedding.weight.zero_()
        without_ngrams = plain_loss(model, ids, mask, labels)
    assert abs(sparse - dense) > 1e-4 * abs(dense)
    assert abs(sparse - without_ngrams) > 1e-4 * abs(sparse)


@pytest.mark.parametrize("chunk", [4, 7, 10])
def test_gradient_exact(chunk):
    loss_err, grad_err = _errors(_model(), chunk)
    assert loss_err <= EXACT and grad_err <= EXACT, (loss_err, grad_err)


def _token_ids_dropped(self, layer_idx: int, state_idx: int = 0):
    """A mutated cache: the n-gram embedding's token ids (an integer state) are not carried to the next chunk."""
    state = _REAL_GET_CONV_STATE(self, layer_idx, state_idx)
    return None if state is not None and not state.is_floating_point() else state


def test_fails_when_the_token_ids_are_not_carried(monkeypatch):
    loss_err, grad_err = _errors(
        _model(), 7, mutate=lambda: monkeypatch.setattr(carry.ChunkCache, "get_conv_state", _token_ids_dropped)
    )
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)


def test_no_full_size_tensor():
    """No tensor with two dimensions of at least T in a streamed step; the plain model builds a (T x T) mask, so the
    check can fail. Longer than the hyper-connection streams' width (4 x 32)."""
    seq_len, chunk = 160, 16
    model = _model()
    ids, mask, labels = _batch(seq_len)

    with ShapeRecorder() as plain:
        plain_loss(model, ids, mask, labels).backward()
    assert plain.full_size(seq_len)
    streamed = enable_streambp(model, stream_chunk_size=chunk, logits_chunk_size=chunk)
    with ShapeRecorder() as rec:
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert rec.full_size(seq_len) == [], sorted(set(rec.full_size(seq_len)))[:10]
