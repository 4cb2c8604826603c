"""A second per-token stream through the decoder layers (Zaya's router hidden states) streamed exactly.

Each Zaya decoder layer returns its router's hidden states (batch, T, router_hidden) beside its output, and the next
layer's router adds them to its own: a floating per-token output with gradient. The stream layer returns it beside
the hidden states (the chunks' pieces assembled), takes the next layer's gradient of it, and chains that gradient
into each chunk's backward beside the hidden states' (``ChunkBackward._chunk_backwards``). Zaya's attention also
takes a mapping of masks (``{"causal": ..., "conv": ...}``), whose causal mask each chunk gets placed at its
positions and whose (batch, T) convolution mask it gets sliced, and its CCA projection carries a convolution state
and a delayed value through the cache.

Tiny float64 models against plain autograd (relative error <= 1e-10), right and left padding, chunk sizes that do
not divide the length, a sliding-window layer, input segments (``keep_every``) and kept keys/values
(``kv_mode="capture"``). The comparison fails when the stream's gradient is dropped.
"""

import copy

import pytest
from model_support import streamed_error
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.layers.call import backward

EXACT = 1e-10
# three layers: the second sliding (window 6), so the router stream passes through a windowed layer's chunks
THREE_LAYERS = {"num_hidden_layers": 3, "layer_types": ["hybrid", "hybrid_sliding", "hybrid"], "sliding_window": 6}


def _error(reference, streamed, padding: str) -> float:
    return streamed_error(reference, streamed, *batch(padding=padding))[0]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [2, 5, 23])
def test_router_stream_is_exact(chunk, padding):
    reference = tiny_causal_lm("zaya", **THREE_LAYERS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk)
    assert _error(reference, streamed, padding) < EXACT


@pytest.mark.parametrize("options", [{"keep_every": 2}, {"kv_mode": "capture"}], ids=["keep_every", "capture"])
def test_router_stream_with_segments_and_kept_keys(options):
    reference = tiny_causal_lm("zaya", **THREE_LAYERS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, **options)
    assert _error(reference, streamed, "left") < EXACT


def test_dropping_the_stream_gradient_is_caught(monkeypatch):
    """The router stream's gradient not chained into the chunks' backward: the routers' gradients go wrong."""
    backward_chunks = backward.ChunkBackward.backward_chunks

    def dropped(self, x, dy, kv, params, need_dx, need_extra, dx_over_x, dstreams=(), kept=None):
        dropped = (None,) * len(dstreams)
        return backward_chunks(self, x, dy, kv, params, need_dx, need_extra, dx_over_x, dropped, kept)

    monkeypatch.setattr(backward.ChunkBackward, "backward_chunks", dropped)
    reference = tiny_causal_lm("zaya", **THREE_LAYERS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    assert _error(reference, streamed, "right") > 1e-6
