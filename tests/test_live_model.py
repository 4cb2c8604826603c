"""The model as it is at each call (issue 46): what user code changes on a model after ``enable_streambp`` (a hook on
the decoder or on a module around it, the final norm replaced or wrapped by PEFT's ``modules_to_save``, a decoder or a
decoder layer replaced, removed or added) is either picked up by the next streamed call, exactly, or refused there by
name; never a fact found at enable and silently stale. Each case against plain autograd on a model changed the same
way, in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import EXACT, assert_matches_plain, max_rel_grad_error
from models import batch, tiny_model
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForSequenceClassification

from streambp_trl import enable_streambp


def _pair(family: str = "llama"):
    reference = tiny_model(family)
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, logits_chunk_size=4)
    return reference, streamed


def _shift(module, args, out):
    """A forward hook that changes a decoder's output (as a user's steering or noise hook does)."""
    out.last_hidden_state = out.last_hidden_state + 0.5
    return out


@pytest.mark.parametrize("where", ["decoder", "global_backward"])
def test_a_hook_that_changes_the_decoders_output_sees_the_normed_states(where):
    """A forward hook on the decoder that changes its output, or a global backward hook: the decoder applies the
    final norm itself (the hook sees, and changes, the normed states the plain model returns), and the loss and every
    gradient are the plain model's. (The head used to apply the norm after the hook: loss 3e-3, gradients 1.9
    relative.)"""
    reference, streamed = _pair()
    ids, mask, labels = batch()
    seen = {}
    handles = []
    if where == "decoder":
        handles += [model.model.register_forward_hook(_shift) for model in (reference, streamed)]
    else:
        norms = {reference.model.norm: "plain", streamed.model.norm: "stream"}

        def see_norm(module, grad_input, grad_output):
            if module in norms:
                seen[norms[module]] = grad_output[0]

        handles.append(nn.modules.module.register_module_full_backward_hook(see_norm))
    try:
        assert_matches_plain(reference, streamed, ids, mask, labels)
    finally:
        for handle in handles:
            handle.remove()
    if where == "global_backward":  # the norm's backward hook ran, and saw the plain gradient
        torch.testing.assert_close(seen["stream"], seen["plain"], rtol=1e-12, atol=1e-12)


def test_a_read_only_hook_on_the_decoder_feeding_an_auxiliary_loss_is_exact():
    """A hook reading the decoder's output for an auxiliary loss sees the normed states, as without streaming (it saw
    the un-normed ones: a norm of 36.4 where the plain model gives 3.7)."""
    reference, streamed = _pair()
    ids, mask, labels = batch()
    losses = {}
    for name, model in (("plain", reference), ("stream", streamed)):
        kept = {}
        handle = model.model.register_forward_hook(lambda m, a, out, k=kept: k.update(h=out.last_hidden_state))
        if name == "plain":
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        handle.remove()
        losses[name] = loss + 1e-2 * kept["h"].pow(2).mean()
        losses[name].backward()
    torch.testing.assert_close(losses["stream"], losses["plain"], rtol=EXACT, atol=0)
    err, where = max_rel_grad_error(reference, streamed)
    assert err < EXACT, f"relative gradient error {err:.3e} at {where}"


def test_a_hook_on_a_reward_models_decoder_sees_the_normed_states():
    """The score head's side follows the same rule (loss 1.6e-1 relative before)."""
    model_config = tiny_model("qwen3").config
    model_config.num_labels = 1
    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_config(model_config).to(torch.float64).train()
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4)
    ids, mask, _ = batch()
    scores = torch.tensor([0.3, -1.2], dtype=torch.float64)
    losses = []
    for model in (reference, streamed):
        model.model.register_forward_hook(_shift)
        loss = model(input_ids=ids, attention_mask=mask, labels=scores).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) <= EXACT * abs(losses[0])
    err, where = max_rel_grad_error(reference, streamed)
    assert err < EXACT, f"relative gradient error {err:.3e} at {where}"


def test_a_final_norm_replaced_after_enabling_is_the_one_applied():
    """``model.model.norm = new_norm`` after enabling: the new norm runs once, in the head (both norms ran before:
    loss 2.2e-2, gradients 0.76 relative)."""
    reference, streamed = _pair()
    new_norm = copy.deepcopy(reference.model.norm)
    with torch.no_grad():
        new_norm.weight.normal_(generator=torch.Generator().manual_seed(5))
    reference.model.norm = new_norm
    streamed.model.norm = copy.deepcopy(new_norm)
    ids, mask, labels = batch()
    assert_matches_plain(reference, streamed, ids, mask, labels)
    assert streamed._streambp.final_norm() is streamed.model.norm  # still applied to the scored rows only


@pytest.mark.parametrize("order", ["after", "before"])
def test_peft_modules_to_save_on_the_final_norm_in_either_order(order):
    """PEFT wrapping the final norm in ``modules_to_save`` after enabling (TRL wraps after loading; users wrap in
    either order) or before: the trained copy gets the plain gradient (0.48 relative error before, when wrapped
    after), and the head still applies it to the scored rows only."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["model.norm"])
    base = tiny_model("llama")
    reference = get_peft_model(copy.deepcopy(base), config)
    reference.base_model.model.model.norm.modules_to_save["default"].weight.data.normal_(
        generator=torch.Generator().manual_seed(5)
    )
    if order == "after":
        streamed = get_peft_model(
            enable_streambp(copy.deepcopy(base), stream_chunk_size=4, logits_chunk_size=4), config
        )
    else:
        streamed = enable_streambp(
            get_peft_model(copy.deepcopy(base), config), stream_chunk_size=4, logits_chunk_size=4
        )
    streamed.load_state_dict(reference.state_dict())
    ids, mask, labels = batch()
    assert_matches_plain(reference, streamed, ids, mask, labels)
    trained = streamed.base_model.model.model.norm.modules_to_save["default"].weight
    assert trained.grad is not None and trained.grad.abs().sum() > 0
    lm = streamed.get_base_model()
    assert lm._streambp.final_norm() is lm.model.norm


def _loss(model):
    ids, mask, labels = batch()
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


@pytest.mark.parametrize("change", ["replaced", "removed", "added"])
def test_a_decoder_layer_changed_after_enabling_is_refused_by_name(change):
    """A decoder layer replaced, removed or added after enabling would run without the stream hook (or not be
    counted): the next streamed call refuses, naming the layer and the fix; enabling again streams it exactly."""
    reference, streamed = _pair()
    for model in (reference, streamed):
        layers = model.model.layers
        if change == "replaced":
            layers[1] = copy.deepcopy(layers[0])
        elif change == "removed":
            del layers[1]
        else:
            layers.append(copy.deepcopy(layers[0]))
        model.config.num_hidden_layers = len(layers)
        for i, layer in enumerate(layers):
            layer.self_attn.layer_idx = i
    expected = {"replaced": "layer `layers.1` is not the", "removed": "was removed", "added": "layer `layers.2` was"}
    with pytest.raises(ValueError, match=f"{expected[change]}.*enable_streambp\\(model\\) again"):
        _loss(streamed)
    enable_streambp(streamed, stream_chunk_size=4, logits_chunk_size=4)
    ids, mask, labels = batch()
    assert_matches_plain(reference, streamed, ids, mask, labels)


def test_a_decoder_replaced_after_enabling_is_refused_by_name():
    """The causal LM's decoder replaced after enabling (the new one has no stream hooks): refused at the next
    training call, with or without labels."""
    _, streamed = _pair()
    streamed.model = copy.deepcopy(tiny_model("llama").model)
    with pytest.raises(ValueError, match="decoder `model` was replaced by a LlamaModel after enable_streambp"):
        _loss(streamed)
    ids, mask, _ = batch()
    with pytest.raises(ValueError, match="decoder `model` was replaced"):
        streamed(input_ids=ids, attention_mask=mask)


def test_router_logits_asked_in_the_config_after_enabling_are_refused():
    """``config.output_router_logits = True`` after enabling (refused at enable): the plain call adds the
    load-balancing loss (2.0 on the tiny Qwen3-MoE), which the streamed loss silently lacked; refused at the call,
    with labels or without (the decoder's router logits would get no gradient)."""
    _, streamed = _pair("qwen3_moe")
    streamed.config.output_router_logits = True
    ids, mask, labels = batch()
    with pytest.raises(ValueError, match=r"config.output_router_logits=True.*keep config.output_router_logits=False"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels)
    with pytest.raises(ValueError, match=r"load-balancing loss \(output_router_logits=True"):
        streamed(input_ids=ids, attention_mask=mask)  # (the model's forward passes the config's value on)
    with torch.no_grad():  # the decoder's router logits without grad are exact values
        streamed.model(input_ids=ids, attention_mask=mask)


def test_a_loss_function_set_on_the_model_is_refused():
    """``model.loss_function = f`` (transformers' setter) changes the plain call's loss; the logit kernel computes
    the causal-LM loss, so a streamed labels= call says so instead of ignoring it. TRL's fused head, whose loss is
    TRL's, is not affected."""
    reference, streamed = _pair()
    streamed.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    with pytest.raises(ValueError, match=r"not the loss_function set on the model.*del model._loss_function"):
        _loss(streamed)
    ids, mask, labels = batch()
    streamed(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    del streamed._loss_function
    assert_matches_plain(reference, streamed, ids, mask, labels)
