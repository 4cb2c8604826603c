"""The first layer's input rebuilt from the token ids in backward: exact, kept nowhere, and only where it is safe."""

import copy

import pytest
import torch
from helpers import RECOMPUTED, count_calls, max_rel_grad_error, reference_loss, saved_hidden_sized
from models import batch, tiny_model

from streambp_trl import enable_streambp
from streambp_trl.layers.kept import rebuild

TOL = 1e-10


@pytest.fixture
def rebuilds(monkeypatch):
    """How many times the first layer's input was rebuilt."""
    return count_calls(monkeypatch, rebuild.EmbeddingSource, "rebuild", lambda self, autocast: self.ids.shape)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # gemma3: a scaled embedding (an nn.Embedding subclass)
def test_first_layer_input_is_rebuilt_not_kept(family, rebuilds):
    reference = tiny_model(family, num_hidden_layers=3, layer_types=None)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, **RECOMPUTED)
    ids, mask, labels = batch(padding="left")
    ref_loss = reference_loss(reference, ids, mask, labels)
    ref_loss.backward()
    loss, kept = saved_hidden_sized(streamed, ids, mask, labels)
    loss.backward()
    assert rebuilds == [ids.shape]
    assert kept == 2  # layers 1 and 2; layer 0 keeps the ids (and the logit kernel, flattened rows, its input)
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, streamed)
    assert err < (1e-5 if family == "gemma3" else TOL), f"relative gradient error {err:.3e} at {where}"


def test_a_hooked_embedding_is_kept(rebuilds):
    """A forward hook on the embedding (NEFTune's noise is one) could change its output or draw random numbers: the
    input is then kept, and the gradient is that of the hooked model."""
    reference = tiny_model("llama", num_hidden_layers=2)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, **RECOMPUTED)
    for model in (reference, streamed):
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output * 1.5 + 0.25)
    ids, mask, labels = batch()
    reference_loss(reference, ids, mask, labels).backward()
    loss, kept = saved_hidden_sized(streamed, ids, mask, labels)
    loss.backward()
    assert rebuilds == [] and kept == 2
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


def test_hidden_states_asked_for_keep_the_input(rebuilds):
    streamed = enable_streambp(tiny_model("qwen3", num_hidden_layers=2), stream_chunk_size=4, **RECOMPUTED)
    ids, mask, labels = batch()
    out = streamed(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    first = out.hidden_states[0].detach().clone()
    out.loss.backward()
    assert rebuilds == [] and torch.equal(out.hidden_states[0], first)


def test_an_embedding_changed_before_backward_is_an_error():
    streamed = enable_streambp(tiny_model("qwen3", num_hidden_layers=2), stream_chunk_size=4, **RECOMPUTED)
    loss = streamed(*batch()[:1], attention_mask=batch()[1], labels=batch()[2]).loss
    with torch.no_grad():
        streamed.get_input_embeddings().weight.mul_(2)
    with pytest.raises(RuntimeError, match="embedding's weight .* was replaced or modified in place"):
        loss.backward()


def test_an_embedding_output_changed_in_place_is_kept(rebuilds):
    """A pre-hook of the first layer that scales its input in place: the changed input is what the layer used, so it
    is kept (its version no longer matches the embedding's output) and the gradient is the hooked model's."""
    reference = tiny_model("llama", num_hidden_layers=2)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, **RECOMPUTED)
    for model in (reference, streamed):
        model.model.layers[0].register_forward_pre_hook(lambda module, args: args[0].mul_(1.5))
    ids, mask, labels = batch()
    reference_loss(reference, ids, mask, labels).backward()
    streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert rebuilds == []
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


def test_ids_changed_after_the_forward_do_not_change_the_gradient(rebuilds):
    """The rebuild uses a copy of the ids: a caller reusing its id buffer before the backward changes nothing (with a
    frozen embedding plain autograd keeps no ids either)."""
    reference = tiny_model("llama", num_hidden_layers=2)
    reference.get_input_embeddings().weight.requires_grad_(False)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, **RECOMPUTED)
    ids, mask, labels = batch()
    reference_loss(reference, ids, mask, labels).backward()
    buffer = ids.clone()
    loss = streamed(input_ids=buffer, attention_mask=mask, labels=labels).loss
    buffer.fill_(5)
    loss.backward()
    assert rebuilds == [ids.shape]
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


def test_input_require_grads_hook_still_rebuilds(rebuilds):
    """transformers' `enable_input_require_grads` (PEFT's k-bit preparation) hooks the embedding only to flag its
    output as requiring grad: the input is still rebuilt, and exact."""
    reference = tiny_model("qwen3", num_hidden_layers=2)
    reference.get_input_embeddings().weight.requires_grad_(False)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, **RECOMPUTED)
    for model in (reference, streamed):
        model.enable_input_require_grads()
    ids, mask, labels = batch()
    reference_loss(reference, ids, mask, labels).backward()
    streamed(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert rebuilds == [ids.shape]
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"
