"""Keys/values shared across layers (Gemma 4's E models and Gemma 3n, ``num_kv_shared_layers``) streamed exactly.

The last layers of such a model attend to the keys/values an earlier layer of their type stored, and their attention's
gradient reaches that layer's key and value projections through them (:mod:`streambp_trl.layers.shared_kv`). Tiny
float64 Gemma 4 text models of four layers (sliding, full, sliding, full; the last two reusing the first two's keys
and values), with their float32 internals in float64, against plain autograd (relative error <= 1e-10): right and left
padding, chunk sizes that do not divide the length, one chunk, kept keys/values and input segments. The comparison
fails when the reusing layers' gradient does not reach the storing layers. Gemma 3n shares keys/values the same way
and its layers carry four stacked hidden-state streams (AltUp: (streams, batch, T, hidden)), which the engine streams
as (batch, T, streams, hidden) views: its tiny model (sliding, full, sliding reusing the first), right-padded
(transformers' own backward gives NaN gradients on its left-padded batches).
"""

import copy

import pytest
import torch
from model_support import Float64Internals, relative_errors, streamed_error
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.attention import StreamMask
from streambp_trl.layers import kept
from streambp_trl.layers.carry import LayerCarry

EXACT = 1e-10


def _error(options: dict, padding: str, family: str = "gemma4_text") -> float:
    reference = tiny_causal_lm(family)
    assert reference.config.kv_sharing_modes[-1] == "reuse"
    streamed = enable_streambp(copy.deepcopy(reference), **options)
    return streamed_error(reference, streamed, *batch(padding=padding), Float64Internals)[0]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 23])
def test_shared_keys_values_are_exact(chunk, padding):
    assert _error({"stream_chunk_size": chunk}, padding) < EXACT


@pytest.mark.parametrize("options", [{"kv_mode": "capture"}, {"keep_every": 2}], ids=["capture", "keep_every"])
def test_shared_keys_values_with_kept_keys_and_segments(options):
    assert _error({"stream_chunk_size": 5, **options}, "left") < EXACT


def test_the_reusing_layers_gradient_must_reach_the_storing_layer(monkeypatch):
    monkeypatch.setattr(LayerCarry, "seed", lambda self, slot, grads: None)
    assert _error({"stream_chunk_size": 5}, "right") > 1e-3


def test_a_stream_mask_is_sliced_only_whole():
    mask = StreamMask(batch_size=1)
    assert mask[:, :, slice(0, None), :] is mask
    with pytest.raises(TypeError, match="describes the whole sequence"):
        mask[:, :, slice(-1, None), :]


@pytest.mark.parametrize("options", [{"stream_chunk_size": 1}, {"stream_chunk_size": 5}, {"stream_chunk_size": 23}])
def test_gemma3n_stacked_streams_and_shared_keys_values_are_exact(options):
    assert _error(options, "right", "gemma3n_text") < EXACT


def test_gemma3n_layers_join_input_segments(monkeypatch):
    """With ``keep_every=2`` a layer whose input is the previous layer's stacked output joins its segment (the stacked
    layout changes no identity the segments follow), so every second layer keeps no input."""
    positions = []
    join = kept.Segment.join

    def counted(self, recorded, position):
        positions.append(join(self, recorded, position))
        return positions[-1]

    monkeypatch.setattr(kept.Segment, "join", counted)
    assert _error({"stream_chunk_size": 5, "keep_every": 2}, "right", "gemma3n_text") < EXACT
    assert positions == [0, 1, 0]


def test_kept_logits_of_a_training_call_without_labels():
    """A training-mode call without labels runs the model's own forward around the streamed decoder; with
    ``logits_to_keep`` Gemma 4's decoder would run its KV-reusing layers on the kept positions only, through masks a
    streamed call describes rather than holds: the streamed decoder gets every position, and the model's head keeps
    the rows it keeps. Logits and their gradient match plain autograd."""
    reference = tiny_causal_lm("gemma4_text")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=5)
    ids, mask, _ = batch(padding="right")
    with Float64Internals():
        ref_logits = reference(input_ids=ids, attention_mask=mask, logits_to_keep=4).logits
        logits = streamed(input_ids=ids, attention_mask=mask, logits_to_keep=4).logits
        assert logits.shape == ref_logits.shape == (2, 4, reference.config.vocab_size)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
        ref_logits.logsumexp(-1).sum().backward()
        logits.logsumexp(-1).sum().backward()
    assert relative_errors(reference, streamed)[0] < EXACT


def test_gemma4_assistant_attends_to_later_positions_and_is_refused():
    """Gemma 4's speculative-decoding assistant: every layer reads the target model's keys/values
    (``shared_kv_states``) through the masks its forward builds with ``create_bidirectional_mask``. The zoo builds its
    layers unshared (transformers 5.23 cannot build a config whose layers all reuse), so here they are set to reuse,
    as the real assistant's are. Changing the target's key at the last position changes the logits at the first:
    a position's output depends on later positions, and ``enable_streambp`` refuses it, saying so."""
    model = tiny_causal_lm("gemma4_assistant")
    for layer in model.model.layers:
        layer.self_attn.is_kv_shared_layer = True
    g = torch.Generator().manual_seed(0)
    attention = model.model.layers[0].self_attn
    kv_shape = (1, attention.k_proj.out_features // attention.head_dim, 6, attention.head_dim)
    states = {
        kind: tuple(torch.randn(kv_shape, generator=g, dtype=torch.float64) for _ in "kv")
        for kind in ("full_attention", "sliding_attention")
    }
    embeds = torch.randn(1, 6, 2 * model.config.backbone_hidden_size, generator=g, dtype=torch.float64)

    def first_logits(shared: dict) -> torch.Tensor:
        with torch.no_grad():
            return model(inputs_embeds=embeds, shared_kv_states=shared, attention_mask=torch.ones(1, 6)).logits[0, 0]

    later = {kind: (k.clone(), v) for kind, (k, v) in states.items()}
    for k, _ in later.values():
        k[:, :, -1] += 1.0
    assert (first_logits(later) - first_logits(states)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"Gemma4AssistantForCausalLM exactly: its forward builds bidirectional"):
        enable_streambp(model, stream_chunk_size=2)
