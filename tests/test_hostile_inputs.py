"""What user code can do around a streamed step, and what it gets: the plain model's values and gradients, or a clear
error where the engine cannot give them (issue 16, items 3 to 7).

* a tensor held outside the engine (a hook's stored activation, a pre-hook's argument, a view, a saved-tensor pack
  hook's copy) is never overwritten by a layer's input gradient;
* ``create_graph=True`` is refused by every engine backward (none is differentiable);
* a parameter (trainable or frozen), a layer argument or a kept input changed in place between forward and backward
  is an error, not a silently wrong gradient;
* ``torch.inference_mode()`` runs streamed calls;
* a second backward through the same graph gets one message, whatever ``keep_every``.
"""

import copy

import pytest
import torch
from helpers import max_rel_grad_error, reference_loss
from models import batch, tiny_model

from streambp_trl import enable_streambp
from streambp_trl.logits import chunked_logprobs

LAYERS = 4
TOL = 1e-10


def _pair(keep_every: int = 1, **options):
    reference = tiny_model("llama", num_hidden_layers=LAYERS)
    options = {"stream_chunk_size": 5, "keep_every": keep_every, "verify": False, **options}
    return reference, enable_streambp(copy.deepcopy(reference), **options)


def _loss(model, ids, mask, labels, streamed: bool):
    if streamed:
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return reference_loss(model, ids, mask, labels)


@pytest.mark.parametrize("keep_every", [1, 2, 3])
def test_activations_kept_by_hooks_survive_the_backward(keep_every):
    """Layer 1's forward hook keeps its output (and a detached view of it), layer 2's pre-hook keeps its input: the
    next layer's backward used to write its input gradient over them (absolute error 0.15)."""
    data = batch()
    stored = {}
    for name, model in zip(("plain", "stream"), _pair(keep_every), strict=True):
        kept = stored[name] = {}
        layers = model.model.layers
        layers[1].register_forward_hook(lambda m, a, out, k=kept: k.update(out=out, view=out.detach()[:, 2:9]))
        layers[2].register_forward_pre_hook(lambda m, args, k=kept: k.update(pre=args[0]))
        layers[3].register_forward_pre_hook(lambda m, args, kw, k=kept: k.update(kw=args[0]), with_kwargs=True)
        _loss(model, *data, streamed=name == "stream").backward()
    for key, expected in stored["plain"].items():
        torch.testing.assert_close(stored["stream"][key], expected, rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("keep_every", [1, 3])
def test_tensors_kept_by_a_pack_hook_survive_the_backward(keep_every):
    """A saved-tensor pack hook that keeps what autograd saves (activation inspection) finds it unchanged after the
    backward: what a layer saves is handed to the hook, so its memory is not reused for the input gradient."""
    _, streamed = _pair(keep_every)
    kept = []

    def pack(t):
        kept.append((t, t.detach().clone()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = streamed(input_ids=batch()[0], attention_mask=batch()[1], labels=batch()[2]).loss
    loss.backward()
    assert kept
    assert all(torch.equal(t, copy) for t, copy in kept)


def test_create_graph_is_refused_by_the_layers_and_the_logit_kernel():
    """First-order gradients without a graph would silently drop the second-order term (relative error 0.94)."""
    _, streamed = _pair()
    ids, mask, labels = batch()
    hidden = streamed.model(input_ids=ids, attention_mask=mask).last_hidden_state
    params = [p for p in streamed.model.layers.parameters()]
    with pytest.raises(RuntimeError, match="create_graph=True .* disable_streambp"):
        torch.autograd.grad(hidden.square().sum(), params, create_graph=True)
    h = torch.randn(7, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 32, dtype=torch.float64, requires_grad=True)
    logp = chunked_logprobs(h, w, None, torch.randint(0, 11, (7,)), token_chunk=3, vocab_chunk=4)["log_probs"]
    with pytest.raises(RuntimeError, match="logit kernel has no differentiable backward"):
        torch.autograd.grad(logp.sum(), [h, w], create_graph=True)
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, params, create_graph=True)


@pytest.mark.parametrize("keep_every", [1, 2, 3])
def test_a_weight_changed_before_the_backward_is_an_error(keep_every):
    """An optimizer step (or any in-place edit) between forward and backward: plain autograd raises its in-place
    error; the streamed backward, which recomputes from the weights, used to use the new values silently. Frozen
    weights (LoRA's base weights) as well as trainable ones, in every layer of a segment and in the final norm."""
    _, streamed = _pair(keep_every)
    ids, mask, labels = batch()
    weights = dict(streamed.named_parameters())
    for name, trainable in [
        ("model.layers.1.mlp.up_proj.weight", True),
        ("model.layers.0.self_attn.q_proj.weight", False),
        ("model.layers.2.post_attention_layernorm.weight", True),
        ("model.norm.weight", False),
    ]:
        weight = weights[name].requires_grad_(trainable)
        loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
        with torch.no_grad():
            weight.mul_(1.01)
        with pytest.raises(RuntimeError, match="modified by an inplace operation|modified in place"):
            loss.backward()
        weight.requires_grad_(True)
        del loss


def test_a_layer_argument_changed_before_the_backward_is_an_error():
    """The layers read their arguments again in backward: a caller's position_ids changed in place since the forward
    would silently change the recomputed layers."""
    _, streamed = _pair()
    ids, mask, labels = batch(padding="none")
    positions = torch.arange(ids.shape[1]).expand_as(ids).clone()
    loss = streamed(input_ids=ids, attention_mask=mask, labels=labels, position_ids=positions).loss
    positions.add_(1)
    with pytest.raises(RuntimeError, match="the argument `position_ids` of decoder layer 3 .* modified in place"):
        loss.backward()


def test_a_segment_input_changed_before_the_backward_is_an_error():
    """keep_every=2: layer 2 keeps its input for the segment [2, 3]; a pre-hook holding it (layer 1's output) and
    changing it after the forward would silently change what both layers' backwards rebuild from."""
    _, streamed = _pair(keep_every=2)
    held = {}
    streamed.model.layers[2].register_forward_pre_hook(lambda m, args: held.update(x=args[0]))
    loss = streamed(input_ids=batch()[0], attention_mask=batch()[1], labels=batch()[2]).loss
    with torch.no_grad():
        held["x"].mul_(2)
    with pytest.raises(RuntimeError, match="the kept input .* of decoder layer 2 .* modified in place"):
        loss.backward()


@pytest.mark.parametrize("keep_every", [1, 2])
def test_inference_mode_runs_streamed_calls(keep_every):
    """stream_eval streams eval calls (and StreamSFTTrainer leaves it on after training): under inference mode they
    used to crash reading a version counter, which inference tensors do not have."""
    reference, streamed = _pair(keep_every, stream_eval=True)
    ids, mask, labels = batch()
    reference.eval()
    streamed.eval()
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        logits = streamed(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits, expected, rtol=1e-12, atol=1e-12)
    streamed.train()
    with torch.inference_mode():
        loss = streamed(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss, reference_loss(reference, ids, mask, labels), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("keep_every", [1, 2, 3])
def test_a_second_backward_gets_one_clear_message(keep_every, offload):
    """retain_graph=True, then a second backward: before, PyTorch's in-place message (keep_every=1), advice to use
    keep_every=1 (2), or 'a segment layer's graph was freed' (3)."""
    _, streamed = _pair(keep_every, offload_checkpoints=offload)
    if offload:  # the copy path runs on the CPU too, as in test_offload
        streamed._streambp.offloader.offloads = lambda t: True
        streamed._streambp.offloader.pin_memory = False
    loss = streamed(input_ids=batch()[0], attention_mask=batch()[1], labels=batch()[2]).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="decoder layer 3 .* asked for twice .* Run the forward again"):
        loss.backward()


def test_one_backward_with_retain_graph_is_exact():
    """retain_graph=True alone (one backward) changes nothing."""
    reference, streamed = _pair(keep_every=2)
    data = batch()
    _loss(reference, *data, streamed=False).backward()
    _loss(streamed, *data, streamed=True).backward(retain_graph=True)
    err, where = max_rel_grad_error(reference, streamed)
    assert err < TOL, f"relative gradient error {err:.3e} at {where}"


def test_sole_holder_sees_tensor_subclasses_like_plain_tensors():
    """FakeTensors (the CUDA memory simulator's) are a tensor subclass: the input gradient must take the input's
    place for them as for plain tensors, else the simulator measures one (T x hidden) buffer more than a GPU holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from streambp_trl.layers.call.guards import sole_holder

    with FakeTensorMode():
        x = torch.empty(4, 8)
        assert sole_holder(x)
        view = x[1:]
        assert not sole_holder(x)
        del view
        assert sole_holder(x)
