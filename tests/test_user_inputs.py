"""What a user's own inputs and settings get from a streaming model: plain autograd's loss and gradients (float64,
relative error < 1e-10), or a clear error naming the problem and the fix, never a silently different result.

* the probe of ``enable_streambp`` leaves the model's state as it found it (a dynamic rotary embedding's frequencies);
* a rotary embedding computed inside the layers whose frequencies depend on each call's positions is refused;
* a 4D attention mask that lets a query see a later key is refused at the first forward;
* the loss takes ``ignore_index`` as transformers' does, and refuses other arguments of the model's loss function;
* packed rows given by position ids alone attend as plain's do, across the documents where plain builds a cache;
* eager attention, whose fully masked (left-padding) rows differ from the stream's, is warned about at enable.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_plain, max_rel_grad_error
from model_support import packed_row
from models import batch, tiny_model
from zoo import tiny_causal_lm

from streambp_trl import disable_streambp, enable_streambp

CHUNK = 5
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _rotary_state(model) -> dict:
    rotary = model.model.rotary_emb
    return {
        "inv_freq": rotary.inv_freq.clone(),
        "original_inv_freq": rotary.original_inv_freq.clone(),
        "max_seq_len_cached": int(rotary.max_seq_len_cached),
        "attention_scaling": float(rotary.attention_scaling),
    }


def test_the_probe_leaves_a_dynamic_rope_as_it_found_it():
    """A dynamic-NTK Llama that has run 64 positions keeps frequencies for 64; the probe's 11-token forwards hit
    transformers' reset branch and put them back to those of 16 positions, so the streamed model computed other
    frequencies than the plain one (gradient 5e-2 off) and ``disable_streambp`` did not bring them back."""
    reference = tiny_model("llama", rope_parameters=DYNAMIC_ROPE, max_position_embeddings=16)
    with torch.no_grad():
        reference(input_ids=torch.randint(3, 100, (1, 64)), use_cache=False)
    before = _rotary_state(reference)
    assert before["max_seq_len_cached"] == 64
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK, verify=True)
    for key, value in _rotary_state(streamed).items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(before[key])), key
    assert_matches_plain(reference, streamed, *batch())
    after = _rotary_state(streamed)
    disable_streambp(streamed)
    for key, value in _rotary_state(streamed).items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key])), key


@pytest.mark.parametrize(
    ("model_type", "rope"),
    [
        ("moshi", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        (
            "moshi",
            {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 8,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
            },
        ),
        (
            "deepseek_v4",
            {
                "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                "compress": {
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "rope_theta": 160000.0,
                    "partial_rotary_factor": 0.125,
                },
            },
        ),
    ],
)
def test_a_rope_computed_in_the_layers_from_each_calls_positions_is_refused(model_type, rope):
    """Moshi's attention computes its rotary embedding in each call: with dynamic scaling each chunk saw its own
    highest position (21, 28, ... instead of 45) and the backward, last chunk first, another cache state (streamed
    gradient 0.07 off plain's here). DeepSeek-V4's compressor and indexer do the same. The probe's 11 tokens stay
    under max_position_embeddings, so the refusal reads the structure: a transformers dynamic rope inside a layer."""
    model = tiny_causal_lm(model_type, rope_parameters=rope, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"inside its decoder layers, .* highest position of each call .* rope_type"):
        enable_streambp(model, stream_chunk_size=CHUNK)


def _prefix_lm_mask(mask2d: torch.Tensor, prefix: int) -> torch.Tensor:
    """Causal and padding, and the first ``prefix`` positions attending to each other both ways (a prefix LM)."""
    seq = mask2d.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    causal[:prefix, :prefix] = True
    return (causal[None, None] & mask2d.bool()[:, None, None, :]) | torch.eye(seq, dtype=torch.bool)


@pytest.mark.parametrize("additive", [False, True])
def test_a_4d_mask_that_looks_ahead_is_refused(additive):
    """A prefix-LM mask given as a 4D mask: each chunk was cut with keys up to its own end, so the allowed entries
    above the diagonal were dropped silently (a block inside one chunk came out exact, so the result depended on the
    chunk size). Refused at the first forward, naming the fix; a causal 4D mask is still honoured."""
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK)
    ids, mask2d, labels = batch(padding="right")
    look_ahead = _prefix_lm_mask(mask2d, prefix=9)
    if additive:
        look_ahead = torch.zeros(look_ahead.shape, dtype=torch.float64).masked_fill(~look_ahead, -torch.inf)
    with pytest.raises(ValueError, match="4D attention mask lets a query attend to a later key .* causal mask"):
        streamed(input_ids=ids, attention_mask=look_ahead, labels=labels)
    causal = _prefix_lm_mask(mask2d, prefix=1)
    if additive:
        causal = torch.zeros(causal.shape, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    logits = reference(input_ids=ids, attention_mask=causal, use_cache=False).logits
    ref_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=causal, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-10 * ref_loss.item()
    assert max_rel_grad_error(reference, streamed)[0] < 1e-10


def test_the_loss_takes_ignore_index_as_transformers_loss_does():
    """``model(..., labels=..., ignore_index=0)``: transformers' loss ignores the labels equal to 0; the streamed loss
    was plain's without ``ignore_index`` (5.6877 against 5.7091). Loss and gradients now equal plain's."""
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK)
    ids, mask, _ = batch(padding="right")
    labels = ids.clone()  # padding is token 0: ignored with the prompt
    labels[:, :6] = 0
    out = reference(input_ids=ids, attention_mask=mask, labels=labels, ignore_index=0)
    # transformers' loss takes float32 logits: the same loss in float64
    expected = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=0)
    assert abs(out.loss.item() - expected.item()) < 1e-6 * expected.item()
    expected.backward()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels, ignore_index=0).loss
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert max_rel_grad_error(reference, streamed)[0] < 1e-10
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 101\) or 0 \(ignore_index"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(labels == 0, -100), ignore_index=0)


def test_a_loss_argument_the_kernel_does_not_take_is_refused():
    """A model whose loss function takes another argument (here label smoothing) gets it from a plain call's
    ``**kwargs``; the streamed loss dropped it silently."""

    def smoothed(logits, labels, vocab_size, label_smoothing=0.0, **kwargs):
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), label_smoothing=label_smoothing
        )

    streamed = enable_streambp(tiny_model("llama"), stream_chunk_size=CHUNK)
    streamed.loss_function = smoothed
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match=r"not \['label_smoothing'\] .* disable_streambp"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels, label_smoothing=0.1)


@pytest.mark.parametrize("use_cache", [None, False])
def test_packed_rows_without_a_mask_attend_as_plain(use_cache):
    """One row of documents, position ids that restart, no mask: with ``use_cache`` at its default (on) the plain
    forward builds a cache, which turns off transformers' packed-row detection, so it attends across the documents;
    the stream kept them apart (loss 4.67021 against plain's 4.67158). Now as plain either way: across the documents
    by default, apart with ``use_cache=False`` (TRL's padding-free batches); the decoder's own call too."""
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK)
    _, inputs = packed_row()
    ids, positions, labels = inputs["input_ids"], inputs["position_ids"], inputs["labels"]
    call = {} if use_cache is None else {"use_cache": use_cache}
    logits = reference(input_ids=ids, position_ids=positions, **call).logits
    expected = F.cross_entropy(logits[0, :-1], labels[0, 1:])
    expected.backward()
    loss = streamed(input_ids=ids, position_ids=positions, labels=labels, **call).loss
    loss.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10 * expected.item()
    assert max_rel_grad_error(reference, streamed)[0] < 1e-10
    with torch.no_grad():
        hidden = streamed.model(input_ids=ids, position_ids=positions, **call).last_hidden_state
        plain = reference.model(input_ids=ids, position_ids=positions, **call).last_hidden_state
    torch.testing.assert_close(hidden, plain, rtol=1e-10, atol=1e-12)


def test_eager_attention_says_at_enable_what_left_padding_changes(caplog):
    """Under eager attention a fully masked pad query averages over every key (in float32; NaN in float64), and the
    first real token of a left-padded row is predicted from it; the stream gives that row zero output, as SDPA does,
    so that loss term of a plain ``model(..., labels=...)`` call differs (Qwen3 eager 0.28, Gemma 2 0.39, silently).
    Said at enable; the streamed result is the SDPA model's, exactly."""
    with caplog.at_level("WARNING", logger="streambp_trl.engine.support"):
        streamed = enable_streambp(tiny_model("qwen3", attn_implementation="eager"), stream_chunk_size=CHUNK)
    assert "first real token of a left-padded row" in caplog.text and "attn_implementation='sdpa'" in caplog.text
    caplog.clear()
    reference = tiny_model("qwen3")
    with caplog.at_level("WARNING", logger="streambp_trl.engine.support"):
        enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK)
    assert "left-padded" not in caplog.text
    ids, mask, _ = batch(padding="left")
    labels = ids.masked_fill(mask == 0, -100)  # the first real token scored
    assert_matches_plain(reference, streamed, ids, mask, labels)


def test_a_dynamic_mask_attention_says_at_enable_what_left_padding_changes(caplog):
    """Doge's dynamic mask adds a finite bias to masked positions, so even under SDPA a fully masked pad query takes
    a softmax over the row, and the first real token of a left-padded row is scored from it (loss 4e-4 relative,
    silently, before this was said). Said at enable, with the fixes that apply (not attn_implementation='sdpa', which
    it already is); with that label -100 the streamed loss is the plain model's."""
    reference = tiny_causal_lm("doge")
    assert reference.config._attn_implementation == "sdpa"
    with caplog.at_level("WARNING", logger="streambp_trl.engine.support"):
        streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=CHUNK)
    assert "its dynamic mask adds a finite per-key bias" in caplog.text
    assert "first real token of a left-padded row" in caplog.text and "'sdpa'" not in caplog.text
    ids, mask, labels = batch(padding="left")
    assert (labels[-1, :8] == -100).all()  # the first real token (position 7) is not scored
    assert_matches_plain(reference, streamed, ids, mask, labels)
