"""Checkpoint offload: the saved inputs go through host copies and come back bit-identical, one layer ahead."""

import copy

import pytest
import torch
from helpers import RECOMPUTED, CopyingOffload, loss_and_grads
from models import batch, tiny_model

from streambp_trl import enable_streambp
from streambp_trl.layers.kept.offload import CheckpointOffload


@pytest.mark.parametrize("kv_mode", ["recompute", "capture"])
def test_offload_gives_identical_gradients_and_prefetches_one_layer_ahead(kv_mode):
    layers = 3
    model = tiny_model("qwen3", num_hidden_layers=layers)
    plain = enable_streambp(copy.deepcopy(model), stream_chunk_size=4, kv_mode=kv_mode, **RECOMPUTED)
    offloaded = enable_streambp(model, stream_chunk_size=4, kv_mode=kv_mode, offload_checkpoints=True, **RECOMPUTED)
    recorder = CopyingOffload()
    offloaded._streambp.offloader = recorder  # the model's one offloader, which each call's layers use
    data = batch(padding="left")
    loss, grads = loss_and_grads(plain, *data)
    loss_off, grads_off = loss_and_grads(offloaded, *data)
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_off[name]), name
    # forward saves the layers' inputs (all but the first, rebuilt from the token ids, unless keys/values are kept
    # too), numbered 0..n-1; backward loads n-1 (prefetching n-2), then n-2 (already there; prefetching n-3), ...
    n = layers if kv_mode == "capture" else layers - 1
    expected = [("save", i) for i in range(n)] + [("load", n - 1), ("prefetch", n - 1)]
    for i in reversed(range(n - 1)):
        expected += [("prefetch", i), ("load", i)]
    assert recorder.events == expected


def test_offload_is_a_no_op_on_cpu():
    model = tiny_model("llama", num_hidden_layers=2)
    plain = enable_streambp(copy.deepcopy(model), stream_chunk_size=5)
    offloaded = enable_streambp(model, stream_chunk_size=5, offload_checkpoints=True)
    offload = offloaded._streambp.offloader
    assert isinstance(offload, CheckpointOffload) and offload._last is None
    data = batch()
    loss, grads = loss_and_grads(plain, *data)
    loss_off, grads_off = loss_and_grads(offloaded, *data)
    assert torch.equal(loss, loss_off) and all(torch.equal(g, grads_off[n]) for n, g in grads.items())
    assert offload._last is None  # nothing was copied
    assert copy.deepcopy(offloaded)._streambp.offloader is not offload


def test_offload_option_is_checked():
    with pytest.raises(ValueError, match="offload_checkpoints"):
        enable_streambp(tiny_model("llama"), stream_chunk_size=4, offload_checkpoints="yes")


def test_layer_outputs_are_recycled_only_when_nothing_else_keeps_them():
    """A layer's input gradient takes the place of its saved input (the previous layer's output); with hidden states
    asked for, those outputs are the caller's and are left alone."""
    reference = tiny_model("qwen3", num_hidden_layers=3)
    model = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, labels = batch(padding="right")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    kept = [h.detach().clone() for h in out.hidden_states]
    out.loss.backward()
    assert all(torch.equal(h, k) for h, k in zip(out.hidden_states, kept, strict=True))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert all(torch.allclose(h, e, rtol=1e-12, atol=1e-12) for h, e in zip(kept, expected, strict=True))
    layer = model.model.layers[1]
    handle = layer.register_forward_hook(lambda module, args, output: None)
    model.train()
    from streambp_trl.layers import hook

    seen = []
    original = hook.input_rebuildable
    hook.input_rebuildable = lambda layer, call: seen.append(original(layer, call)) or seen[-1]
    try:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        hook.input_rebuildable = original
        handle.remove()
    # every layer is asked (layer 0's input, the embedding output, is rebuilt when unobserved); layer 1 is watched
    assert seen == [True, False, True]
