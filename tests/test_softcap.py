"""Attention-logit softcapping (Gemma 2, VaultGemma): the tiled kernel against the eager definition, in float64.

``S = softcap * tanh(scale * Q K^T / softcap)``, masked, softmax, times V: computed one block of keys at a time with
an online softmax (no (q_len x kv_len) score tensor beyond one block), its backward recomputing each block."""

import copy

import pytest
import torch
from helpers import EXACT
from model_support import Float64Internals, plain_loss, relative_errors
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.attention import softcap


def _eager(query, key, value, visible, scale, cap):
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = cap * torch.tanh(query @ k.transpose(-1, -2) * scale / cap)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("tile", [3, 512])
@pytest.mark.parametrize("masked", ["causal", "padding_window"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_tiled_softcap_attention_is_exact(monkeypatch, tile, masked, kv_heads):
    monkeypatch.setattr(softcap, "TILE", tile)
    g = torch.Generator().manual_seed(0)
    q_len, kv_len = 5, 13
    query = torch.randn(2, 4, q_len, 8, dtype=torch.float64, generator=g, requires_grad=True)
    key = torch.randn(2, kv_heads, kv_len, 8, dtype=torch.float64, generator=g, requires_grad=True)
    value = torch.randn(2, kv_heads, kv_len, 6, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.arange(q_len)[:, None] + kv_len - q_len
    visible = torch.arange(kv_len)[None, :] <= rows
    block = None
    if masked == "padding_window":
        keep = torch.ones(2, kv_len, dtype=torch.bool)
        keep[1, :10] = False  # the second row's first query sees no key at all
        visible = visible & (rows - torch.arange(kv_len)[None, :] < 4) & keep[:, None, None, :]
        block = visible
    grad = torch.randn(2, q_len, 4, 6, dtype=torch.float64, generator=g)
    ours = softcap.softcap_attention(query, key, value, block, 0.3, 2.0)
    parts = torch.autograd.grad(ours, (query, key, value), grad)
    expected = _eager(query, key, value, visible.expand(2, 1, q_len, kv_len), 0.3, 2.0)
    wanted = torch.autograd.grad(expected, (query, key, value), grad)
    assert (ours - expected).norm() <= EXACT * expected.norm()
    for a, b in zip(parts, wanted, strict=True):
        assert (a - b).norm() <= EXACT * b.norm()


@pytest.mark.parametrize("family", ["gemma2", "vaultgemma"])
def test_softcapped_models_are_exact(family):
    reference = tiny_causal_lm(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    ids, mask, labels = batch(padding="none")
    with Float64Internals():  # the models' softmax runs in float32: here in float64
        ref_loss = plain_loss(reference, ids, mask, labels)
        ref_loss.backward()
        loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= EXACT * abs(ref_loss.item())
    assert relative_errors(reference, streamed)[0] < EXACT
