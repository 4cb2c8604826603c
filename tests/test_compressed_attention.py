"""DeepSeek-V4 streamed exactly: compressed sparse attention (CSA) and heavily compressed attention (HCA).

Each of its layers attends to a sliding window of keys and to *compressed entries*, one per window of ``m`` tokens (a
softmax-gated sum of the window's projections; CSA's windows overlap by half and a lightning indexer picks the top-k
entries per query). The compressors keep, across positions, the projections of the window not yet closed, the last
window's first half (CSA) and the entries so far, through the model's cache layer; the stream engine serves those as
carried states with gradient (:mod:`streambp_trl.layers.carry.compressed`), the entries padded to the full forward's
T // m so the indexer ranks the same rows.

The tiny float64 model (the zoo's two layers: one HCA, one CSA; windows of 6 and 4 tokens so both compress within
23 tokens; top-2 entries per query), its float32 internals computed in float64 (:class:`Float64Internals`), must agree
with plain autograd to 1e-10: right, left and no padding, chunks of 1, 3 (chunks that close no window), 5 and 23.
It fails when the carried entries are dropped (refused at enable by the probe) and when a chunk's backward skips a
linear map whose output the chunk only stores for a later chunk (the compressor's window projections when the first
chunk closes no window: :func:`~streambp_trl.layers.call.unread.unread_outputs` takes the carried states as read).
"""

import copy

import pytest
import torch
from model_support import Float64Internals, streamed_error
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.layers.call import layer_call, unread
from streambp_trl.layers.carry import compressed

EXACT = 1e-10
WINDOWS = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 6}, index_topk=2)


def _error(chunk: int, padding: str, verify: bool = True) -> float:
    reference = tiny_causal_lm("deepseek_v4", **WINDOWS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=chunk, verify=verify)
    return streamed_error(reference, streamed, *batch(padding=padding), Float64Internals)[0]


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize("chunk", [1, 3, 5, 23])
def test_compressed_attention_streams_exactly(chunk, padding):
    assert _error(chunk, padding) < EXACT


def test_dropping_the_carried_entries_is_refused(monkeypatch):
    def forgetful(self, name, new):  # each chunk sees its own entries only
        self.outgoing[compressed._key(compressed.COMPRESSED, self.layer_idx, name)] = new
        later = new.new_zeros(new.shape[:1] + (self.seq_len // self.rate - new.shape[1],) + new.shape[2:])
        return torch.cat([new, later], dim=1)

    monkeypatch.setattr(compressed.CompressorStates, "update_compressor_states", forgetful)
    with pytest.raises(ValueError, match="give a different result when streamed"):
        _error(5, "right")


def test_a_stored_projection_is_recomputed_for_the_chunk_that_reads_it(monkeypatch):
    original = unread.unread_outputs
    monkeypatch.setattr(layer_call, "unread_outputs", lambda layer, carried=tuple: original(layer))
    assert _error(3, "right", verify=False) > 1e-3
