"""keep_every: only the first of every k consecutive layers keeps its input; the others rebuild theirs in backward,
bit-identical to the forward's, so the gradient is exactly that of keep_every=1."""

import copy

import pytest
import torch
from helpers import CopyingOffload, loss_and_grads, max_rel_grad_error, reference_loss, saved_hidden_sized
from models import batch, tiny_model

from streambp_trl import StreamSFTConfig, enable_streambp
from streambp_trl.layers import sharding
from streambp_trl.layers.call import layer_call
from streambp_trl.layers.kept import segments

LAYERS = 5


@pytest.fixture
def counts(monkeypatch):
    """First inputs kept by segments, and layer forwards replayed to rebuild the others."""
    seen = {"kept": 0, "replayed": 0}
    keep_first_input = segments.Segment.keep_first_input
    replay_chunks = layer_call.LayerCall.replay_chunks

    def counted_keep(self, kept):
        seen["kept"] += 1
        return keep_first_input(self, kept)

    def counted_replay(self, x, record):
        seen["replayed"] += 1
        return replay_chunks(self, x, record)

    monkeypatch.setattr(segments.Segment, "keep_first_input", counted_keep)
    monkeypatch.setattr(layer_call.LayerCall, "replay_chunks", counted_replay)
    return seen


@pytest.mark.parametrize("kv_mode", ["recompute", "capture"])
@pytest.mark.parametrize(("keep_every", "kept", "replayed"), [(2, 2, 2), (3, 1, 3), (5, 0, 4), (8, 0, 4)])
def test_segments_give_the_same_gradient_bit_for_bit(counts, kv_mode, keep_every, kept, replayed):
    """Segments of 5 layers: k=2 -> [0,1] [2,3] [4] (first inputs of layers 2 and 4 kept; layer 0's is rebuilt from
    the ids), k=3 -> [0,1,2] [3,4], k>=5 -> one segment. With dropout on, so each chunk's random state is replayed."""
    model = tiny_model("qwen3", num_hidden_layers=LAYERS, attention_dropout=0.2)
    plain = enable_streambp(copy.deepcopy(model), stream_chunk_size=4, kv_mode=kv_mode)
    segmented = enable_streambp(model, stream_chunk_size=4, kv_mode=kv_mode, keep_every=keep_every)
    ids, mask, labels = batch(padding="left")
    torch.manual_seed(5)
    loss, grads = loss_and_grads(plain, ids, mask, labels)
    counts.update(kept=0, replayed=0)
    torch.manual_seed(5)
    segmented.zero_grad(set_to_none=True)
    loss_seg, saved = saved_hidden_sized(segmented, ids, mask, labels)
    loss_seg.backward()
    assert torch.equal(loss, loss_seg.detach())
    for name, g in grads.items():
        assert torch.equal(g, dict(segmented.named_parameters())[name].grad), name
    assert (counts["kept"], counts["replayed"], saved) == (kept, replayed, 0)


def test_segments_are_exact_against_plain_autograd():
    reference = tiny_model("llama", num_hidden_layers=LAYERS)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, keep_every=2)
    ids, mask, labels = batch(padding="right")
    ref_loss = reference_loss(reference, ids, mask, labels)
    ref_loss.backward()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-10 * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, streamed)
    assert err < 1e-10, f"relative gradient error {err:.3e} at {where}"


def test_segments_with_offload_copy_only_first_inputs():
    model = tiny_model("qwen3", num_hidden_layers=LAYERS)
    plain = enable_streambp(copy.deepcopy(model), stream_chunk_size=4)
    offloaded = enable_streambp(model, stream_chunk_size=4, offload_checkpoints=True, keep_every=2)
    recorder = CopyingOffload()
    offloaded._streambp.offloader = recorder
    data = batch(padding="left")
    loss, grads = loss_and_grads(plain, *data)
    loss_off, grads_off = loss_and_grads(offloaded, *data)
    assert torch.equal(loss, loss_off) and all(torch.equal(g, grads_off[n]) for n, g in grads.items())
    # the first inputs of segments [2, 3] and [4] go to the host and come back, the later one first
    assert recorder.events == [("save", 0), ("save", 1), ("load", 1), ("prefetch", 1), ("prefetch", 0), ("load", 0)]


def test_hidden_states_asked_for_keep_every_input(counts):
    streamed = enable_streambp(tiny_model("qwen3", num_hidden_layers=3), stream_chunk_size=4, keep_every=3)
    ids, mask, labels = batch()
    out = streamed(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    out.loss.backward()
    assert counts["replayed"] == 0 and counts["kept"] == 3  # each layer its own segment: the hidden states are kept


def test_a_second_backward_through_a_segment_is_an_error():
    streamed = enable_streambp(tiny_model("qwen3", num_hidden_layers=3), stream_chunk_size=4, keep_every=3)
    ids, mask, labels = batch()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="asked for twice"):
        loss.backward()


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2"])
def test_keep_every_is_checked(value):
    with pytest.raises(ValueError, match="keep_every"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=4, keep_every=value)
    with pytest.raises(ValueError, match="stream_keep_every"):
        StreamSFTConfig(output_dir="unused", stream_keep_every=value)


def test_sharded_parameters_are_refused():
    model = tiny_model("llama")
    model.model.layers[0].mlp.up_proj.weight.ds_id = 7  # what a ZeRO-3 partitioned parameter carries
    sharding.check_segmentable(model, 1)
    with pytest.raises(ValueError, match="keep_every=2 needs each decoder layer's parameters whole"):
        sharding.check_segmentable(model, 2)


def test_a_layer_output_changed_in_place_starts_a_new_segment(counts):
    """A forward hook that scales layer 0's output in place (activation steering): layer 1 cannot rebuild its input by
    running layer 0 again, so it starts a segment and keeps the changed input; the gradient is the hooked model's."""
    reference = tiny_model("llama", num_hidden_layers=3)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, keep_every=3)
    for model in (reference, streamed):
        model.model.layers[0].register_forward_hook(lambda module, args, output: output.mul_(1.5))
    ids, mask, labels = batch()
    reference_loss(reference, ids, mask, labels).backward()
    streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    # segments [0] (a hooked layer keeps its input) and [1, 2] (layer 1's input kept, layer 2's rebuilt from it)
    assert (counts["kept"], counts["replayed"]) == (2, 1), counts
    err, where = max_rel_grad_error(reference, streamed)
    assert err < 1e-10, f"relative gradient error {err:.3e} at {where}"
