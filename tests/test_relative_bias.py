"""Inkling 2 streamed exactly: a relative-position bias of the scores and a sink logit per query, both with gradient.

Its attention hands the attention interface ``position_bias`` (batch, heads, q_len, kv_len), each query's projected
bias by its distance to each key, and ``sinks`` (batch, heads, q_len, 1), a projected sink logit per query, beside its
block-attention residuals, short convolutions (states through the cache) and float32 router. A chunk's bias comes from
its own queries against the keys [p, e) the cache places (``get_mask_sizes``); the stream attention adds it to the mask
block (``kernels._biased``) and puts a per-query sink in the queries' extra dimension (:mod:`.attention.sinks`).

transformers' own float64 build fails (its router casts to float32 against its own float64 weight), so the tiny
float64 model runs with its float32 internals in float64 (:class:`Float64Internals`), and must agree with plain
autograd to 1e-10: right and left padding, chunks of 1, 5 and 23 tokens. It fails when the bias is dropped.
"""

import copy

import pytest
import zoo
from model_support import Float64Internals, streamed_error
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.attention import kernels

EXACT = 1e-10


def _error(monkeypatch, chunk: int, padding: str) -> float:
    monkeypatch.setattr(zoo, "FLOAT32_KEPT", set())  # every weight float64: the float32 casts run in float64 below
    reference = tiny_causal_lm("inkling2_text")
    streamed = copy.deepcopy(reference)
    with Float64Internals():  # (the probe runs the model's own forward, whose router needs the float64 casts)
        enable_streambp(streamed, stream_chunk_size=chunk)
    return streamed_error(reference, streamed, *batch(padding=padding), Float64Internals)[0]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 5, 23])
def test_relative_position_bias_and_query_sinks_are_exact(monkeypatch, chunk, padding):
    assert _error(monkeypatch, chunk, padding) < EXACT


def test_dropping_the_position_bias_is_caught(monkeypatch):
    monkeypatch.setattr(kernels, "_biased", lambda block, bias, q_len, kv_len: block)
    with pytest.raises(ValueError, match="give a different result when streamed"):
        _error(monkeypatch, 5, "right")
