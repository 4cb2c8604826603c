"""Sparse indexed attention (DeepSeek Sparse Attention: DeepSeek-V3.2's indexer) streamed exactly.

Each query attends only to the ``index_topk`` keys its indexer scores highest among the keys its mask allows. A chunk
[s, e) gets its indexer keys from the chunk cache: those of every position, the earlier chunks' and its own (later
positions zeros, masked), so the indexer's top-k runs over the same T-long row as in the full-sequence forward
(:meth:`streambp_trl.layers.carry.ChunkCache.update_indexer`); the layer gets its mask as a (chunk x T) tensor.

Tiny float64 models with ``index_topk`` below the number of keys most queries see, so the selection changes the
loss (checked), compared with plain autograd (relative error <= 1e-10) over chunk sizes that do not divide the
length, with a left-padded row. The comparison fails when a chunk's indexer sees its own chunk's keys only, and when
all scores tie (the indexer's queries zero) and the top-k rows are cut at the chunk's end: ``torch.topk`` breaks ties
by the row's length.
"""

import copy

import pytest
import torch
from helpers import ShapeRecorder
from model_support import plain_loss, relative_errors
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from streambp_trl import enable_streambp
from streambp_trl.attention import StreamMask, stream_attention
from streambp_trl.layers import carry, hook
from streambp_trl.layers.adapters import dense_mask
from streambp_trl.layers.layer_args import cache_argument

EXACT = 1e-10
T, TOPK, PAD = 29, 6, 6  # left padding of the second row
_REAL_UPDATE_INDEXER = carry.ChunkCache.update_indexer
# the tiny DeepSeek Sparse Attention shape both models below share (float64, dense MLPs: no float32 router; weights
# large enough that the indexer's scores spread)
_TINY_DSA = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    index_n_heads=4,
    index_head_dim=8,
    pad_token_id=0,
    initializer_range=0.2,
    attn_implementation="sdpa",
)


def _model(index_topk: int = TOPK, seed: int = 0) -> DeepseekV32ForCausalLM:
    """A 2-layer DeepSeek-V3.2 in float64, dense MLPs (no float32 router), weights large enough that the indexer's
    scores spread."""
    torch.manual_seed(seed)
    config = DeepseekV32Config(**_TINY_DSA, num_hidden_layers=2, index_topk=index_topk, mlp_layer_types=["dense"] * 2)
    return DeepseekV32ForCausalLM(config).to(torch.float64)


def _batch(seq_len: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 101, (2, seq_len), generator=generator)
    mask = torch.ones(2, seq_len, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _errors(reference, chunk: int, mutate=None, **options) -> tuple[float, float]:
    """Relative loss and worst relative gradient error of the streamed copy of ``reference`` against plain autograd;
    ``mutate()`` runs once the engine is enabled (its probe would refuse a mutated engine)."""
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk, **options)
    if mutate is not None:
        mutate()
    ids, mask, labels = _batch()
    reference.zero_grad()
    ref_loss = plain_loss(reference, ids, mask, labels)
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), relative_errors(reference, streamed)[0]


def test_the_selection_matters():
    """With index_topk below the keys a query sees, the loss differs from attending to every key: the tests below
    compare a real selection."""
    ids, mask, labels = _batch()
    model = _model()
    with torch.no_grad():
        sparse = plain_loss(model, ids, mask, labels)
        for indexer in (layer.self_attn.indexer for layer in model.model.layers):
            indexer.index_topk = T
        dense = plain_loss(model, ids, mask, labels)
    assert abs(sparse - dense) > 1e-3 * abs(dense)


@pytest.mark.parametrize("kv_mode", ["recompute", "capture"])
@pytest.mark.parametrize("chunk", [4, 7, 10])
def test_gradient_exact(chunk, kv_mode):
    loss_err, grad_err = _errors(_model(), chunk, kv_mode=kv_mode)
    assert loss_err <= EXACT and grad_err <= EXACT, (loss_err, grad_err)


def _own_chunk_only(self, key_states, layer_idx, *args, **kwargs):
    """A mutated ``update_indexer``: the chunk's indexer sees its own chunk's keys only (the prefix's as zeros)."""
    served = _REAL_UPDATE_INDEXER(self, key_states, layer_idx).clone()
    served[:, : self.prefix_len] = 0
    return served


def test_fails_when_the_indexer_sees_its_own_chunk_only(monkeypatch):
    """The comparison can fail: without the prefix's indexer keys a chunk selects other keys."""
    loss_err, grad_err = _errors(
        _model(), 7, mutate=lambda: monkeypatch.setattr(carry.ChunkCache, "update_indexer", _own_chunk_only)
    )
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)


def _tied(model: DeepseekV32ForCausalLM) -> DeepseekV32ForCausalLM:
    """Every indexer query zero: every score is exactly 0 (relu of 0), so all keys a query may see tie and the
    top-k chooses among them by its tie-breaking alone."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.wq_b.weight.zero_()
    return model


def test_exact_when_scores_tie_at_the_topk_boundary():
    loss_err, grad_err = _errors(_tied(_model()), 7)
    assert loss_err <= EXACT and grad_err <= EXACT, (loss_err, grad_err)


def _rows_to_the_chunk_end(func, dynamic, layer, x, **kwargs):
    """A mutated mask hand-over: the mask block and the indexer keys reach only to the chunk's end."""
    cache = cache_argument(kwargs)
    for name, mask in list(kwargs.items()):
        if isinstance(mask, StreamMask):
            kwargs[name] = mask.materialise(x.shape[1], cache.prefix_len + x.shape[1], x.device)
    return func(layer, x, **kwargs)


def _served_to_the_chunk_end(self, key_states, layer_idx, *args, **kwargs):
    return _REAL_UPDATE_INDEXER(self, key_states, layer_idx)[:, : self.prefix_len + key_states.shape[1]]


def test_ties_choose_by_row_length(monkeypatch):
    """Why the rows reach to T: with every score tied, (prefix + chunk)-long top-k rows choose other keys than the
    full forward's T-long ones."""

    def mutate():
        monkeypatch.setattr(dense_mask, "dense_mask_run", _rows_to_the_chunk_end)
        monkeypatch.setattr(carry.ChunkCache, "update_indexer", _served_to_the_chunk_end)

    loss_err, grad_err = _errors(_tied(_model()), 7, mutate)
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)


def test_no_full_size_tensor():
    """No tensor with two dimensions of at least T in a streamed step (the mask reaches (chunk x T), the indexer's
    scores (batch, chunk, heads, T)); the plain model builds a (T x T) mask, so the check can fail."""
    seq_len, chunk = 96, 8
    model = _model(index_topk=16)
    ids, mask, labels = _batch(seq_len)

    with ShapeRecorder() as plain:
        plain_loss(model, ids, mask, labels).backward()
    assert plain.full_size(seq_len)
    streamed = enable_streambp(model, stream_chunk_size=chunk, logits_chunk_size=chunk)
    with ShapeRecorder() as rec:
        streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert rec.full_size(seq_len) == []


def test_tensor_masks_other_than_a_chunk_block_are_refused():
    """The attention takes a tensor mask only as a chunk's block: (chunk x keys from the chunk's first on), nothing
    attended past the chunk's keys."""
    module = torch.nn.Module()
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k = v = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    block = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with pytest.raises(RuntimeError, match="instead of a StreamMask or the chunk's mask block"):
        stream_attention(module, q, k, v, block)  # 5 queries' rows for 3 queries
    later = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="attend to later positions"):
        stream_attention(module, q, k, v, later)
    chunk_block = block[:, :, 2:, :].expand(1, 1, 3, 5)
    out, _ = stream_attention(module, q, k, v, torch.cat([chunk_block, chunk_block.new_zeros(1, 1, 3, 2)], -1))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=chunk_block)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-14)


def _shared_model(seed: int = 0) -> GlmMoeDsaForCausalLM:
    """A 3-layer float64 GLM-MoE-DSA whose second layer's indexer is "shared": it attends to the keys the first
    layer's indexer chose, which that layer returns beside its hidden states (dense MLPs: no float32 router)."""
    torch.manual_seed(seed)
    config = GlmMoeDsaConfig(
        **_TINY_DSA,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        index_topk=TOPK,
        indexer_types=["full", "shared", "full"],
        mlp_layer_types=["dense"] * 3,
    )
    return GlmMoeDsaForCausalLM(config).to(torch.float64)


@pytest.mark.parametrize("chunk", [4, 7])
def test_shared_indexer_reuses_the_returned_indices_exactly(chunk):
    """A layer returns its top-k indices beside its hidden states; the streamed layer assembles its chunks' into the
    full-length tensor the next ("shared") layer slices per chunk."""
    model = _shared_model()
    assert model.model.layers[1].self_attn.indexer is None
    loss_err, grad_err = _errors(model, chunk)
    assert loss_err <= EXACT and grad_err <= EXACT, (loss_err, grad_err)


def test_fails_when_the_shared_layer_gets_other_indices(monkeypatch):
    """The comparison can fail: handing the shared layer the first key position for every choice instead of the
    indices the previous layer returned changes the loss and the gradients."""
    real = hook.returned

    def zeroed(y, extras, nones):
        out = real(y, extras, nones)
        return (out[0], *(torch.zeros_like(t) for t in out[1:])) if isinstance(out, tuple) else out

    loss_err, grad_err = _errors(_shared_model(), 7, mutate=lambda: monkeypatch.setattr(hook, "returned", zeroed))
    assert loss_err > 1e-6 and grad_err > 1e-6, (loss_err, grad_err)
