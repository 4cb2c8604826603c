"""Inkling 2 streamed exactly: a relative-position bias of the scores and a sink logit per query, both with gradient.

Its attention hands the attention interface ``position_bias`` (batch, heads, q_len, kv_len), each query's projected
bias by its distance to each key, and ``sinks`` (batch, heads, q_len, 1), a projected sink logit per query, beside its
block-attention residuals, short convolutions (states through the cache) and float32 router. A chunk's bias comes from
its own queries against the keys [p, e) the cache places (``get_mask_sizes``); the stream attention adds it to the mask
block (``kernels._biased``) and puts a per-query sink in the queries' extra dimension (:mod:`.attention.sinks`).

transformers' own float64 build fails (its router casts to float32 against its own float64 weight), so the tiny
float64 model runs with its float32 internals in float64 (:class:`Float64Internals`), and must agree with plain
autograd to 1e-10: right and left padding, chunks of 1, 5 and 23 tokens. It fails when the bias is dropped.

That is transformers 5.23's Inkling 2. transformers 5.24's passes block states (its block attention residuals)
from layer to layer beside the hidden states, which the engine does not stream: there ``enable_streambp`` refuses it.
"""

import copy

import pytest
import zoo
from model_support import Float64Internals, streamed_error, streamed_here
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.attention import kernels

EXACT = 1e-10
STREAMED = streamed_here("inkling2_text")
streamed_only = pytest.mark.skipif(not STREAMED, reason="this transformers' Inkling 2 is refused (its block states)")


def _error(monkeypatch, chunk: int, padding: str) -> float:
    monkeypatch.setattr(zoo, "FLOAT32_KEPT", set())  # every weight float64: the float32 casts run in float64 below
    reference = tiny_causal_lm("inkling2_text")
    streamed = copy.deepcopy(reference)
    with Float64Internals():  # (the probe runs the model's own forward, whose router needs the float64 casts)
        enable_streambp(streamed, stream_chunk_size=chunk)
    return streamed_error(reference, streamed, *batch(padding=padding), Float64Internals)[0]


@streamed_only
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_relative_position_bias_and_query_sinks_are_exact(monkeypatch, chunk, padding):
    assert _error(monkeypatch, chunk, padding) < EXACT


@streamed_only
def test_dropping_the_position_bias_is_caught(monkeypatch):
    monkeypatch.setattr(kernels, "_biased", lambda block, bias, q_len, kv_len: block)
    with pytest.raises(ValueError, match="give a different result when streamed"):
        _error(monkeypatch, 5, "right")


@pytest.mark.skipif(STREAMED, reason="this transformers' Inkling 2 streams (tested above)")
def test_block_states_between_layers_are_refused_at_enable():
    model = tiny_causal_lm("inkling2_text")
    with pytest.raises(ValueError, match="cannot train Inkling2ForCausalLM exactly: Inkling2BlockAttentionResidual"):
        enable_streambp(model, stream_chunk_size=5)
