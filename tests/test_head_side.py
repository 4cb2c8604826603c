"""The head side, one function for every head (issue 38): :func:`~streambp_trl.engine.decode_for_head` runs the
decoder for the LM head's logit kernel, a reward model's score head and the distillation divergence, leaving the final
norm to the head under one rule (not when hidden states are asked for, the call's or the config's, nor when user code
hooks it, backward hooks included); no trainer reads the engine's state."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import EXACT, ROOT, args, load_model, load_tokenizer, max_rel_grad_error, reference_loss, tiny_dataset
from models import batch, tiny_model
from test_distillation_trainer import wide_teacher
from torch import nn
from trl import DistillationConfig, DistillationTrainer

from streambp_trl import StreamDistillationConfig, StreamDistillationTrainer, enable_streambp
from streambp_trl.engine import decode_for_head, logits_tile

CASES = ["none", "asked", "config", "forward", "forward_pre", "backward", "global"]


def _pair():
    reference = tiny_model("llama")
    streamed = enable_streambp(copy.deepcopy(reference), stream_chunk_size=4, logits_chunk_size=4)
    return reference, streamed


@pytest.mark.parametrize("case", CASES)
def test_the_norm_is_left_to_the_head_unless_hidden_states_are_asked_or_it_is_hooked(case):
    """The head applies the final norm itself only without hidden states asked for and without a user hook on it;
    either way the normed states are the plain model's, and a backward hook on the norm sees the plain gradient."""
    reference, streamed = _pair()
    ids, mask, _ = batch()
    seen = {}
    asked = case == "asked"
    if case == "config":
        streamed.config.output_hidden_states = True
    norm = streamed.model.norm
    handles = []
    if case == "forward":
        handles.append(norm.register_forward_hook(lambda m, a, out: None))
    elif case == "forward_pre":
        handles.append(norm.register_forward_pre_hook(lambda m, a: None))
    elif case == "backward":
        handles.append(norm.register_full_backward_hook(lambda m, gin, gout: seen.update(grad=gout[0])))
    elif case == "global":
        handles.append(nn.modules.module.register_module_forward_hook(lambda m, a, out: None))
    try:
        side = decode_for_head(
            streamed, lambda: streamed.model(input_ids=ids, attention_mask=mask, output_hidden_states=asked), asked
        )
        normed = side.norm(side.hidden) if side.norm is not None else side.hidden
        (normed * normed).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert (side.norm is norm) == (case == "none")
    expected = reference.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(normed, expected, rtol=1e-12, atol=1e-12)
    if case == "backward":
        torch.testing.assert_close(seen["grad"], 2 * expected, rtol=1e-12, atol=1e-12)


def test_hidden_states_the_config_asks_for_are_the_models_own():
    """With ``config.output_hidden_states`` the decoder's last hidden state is returned normed, as the plain model
    returns it (the logit kernel then gets no norm); the loss and the gradients are the plain model's."""
    reference, streamed = _pair()
    for model in (reference, streamed):
        model.config.output_hidden_states = True
    ids, mask, labels = batch()
    ref_loss = reference_loss(reference, ids, mask, labels)
    ref_loss.backward()
    with torch.no_grad():
        ref_hidden = reference(input_ids=ids, attention_mask=mask).hidden_states
    out = streamed(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert len(out.hidden_states) == len(ref_hidden)
    for got, expected in zip(out.hidden_states, ref_hidden, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert abs(out.loss.item() - ref_loss.item()) <= EXACT * abs(ref_loss.item())
    err, where = max_rel_grad_error(reference, streamed)
    assert err < EXACT, f"relative gradient error {err:.3e} at {where}"


def test_logits_tile_takes_the_model():
    _, streamed = _pair()
    assert logits_tile(streamed, torch.zeros(2, 23, streamed.config.hidden_size)) == 4
    with pytest.raises(ValueError, match="does not stream"):
        logits_tile(tiny_model("llama"), torch.zeros(2, 23, 32))


def _distillation(trainer_cls, config_cls, tmp_path):
    trainer = trainer_cls(
        model=load_model(),
        teacher_model=wide_teacher(),
        args=args(config_cls, tmp_path),
        train_dataset=tiny_dataset("prompt_completion", 4),
        processing_class=load_tokenizer(),
    )
    student = trainer.accelerator.unwrap_model(trainer.model)
    student.train()
    seen = {}
    student.model.norm.register_full_backward_hook(lambda m, gin, gout: seen.update(grad=gout[0]))
    g = torch.Generator().manual_seed(0)
    vocab = student.config.vocab_size
    completion_mask = torch.ones(2, 12, dtype=torch.long)
    completion_mask[1, 9:] = 0
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (2, 10), generator=g),
        "prompt_mask": torch.ones(2, 10, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (2, 12), generator=g),
        "completion_mask": completion_mask,
    }
    loss = trainer._compute_loss(student, inputs, None)[0]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return loss.detach(), seen["grad"], grads


def test_a_backward_hook_on_the_students_final_norm_sees_what_trl_shows_it(tmp_path):
    """The distillation trainer leaves a final norm with a backward hook to the student's decoder, as the LM head
    does: the hook sees TRL's gradient of the normed states, and the loss and gradients are TRL's."""
    ref_loss, ref_seen, ref_grads = _distillation(DistillationTrainer, DistillationConfig, tmp_path / "trl")
    loss, seen, grads = _distillation(StreamDistillationTrainer, StreamDistillationConfig, tmp_path / "stream")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(seen, ref_seen, rtol=1e-4, atol=1e-7)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        err = ((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp(min=1e-12)).item()
        assert err < 1e-4, name


def test_no_trainer_reads_the_engine_state():
    """The trainers reach the engine through its functions: no ``model._streambp``."""
    for path in sorted((ROOT / "streambp_trl" / "trainers").glob("*.py")):
        assert re.search(r"\b_streambp\b", path.read_text()) is None, path.name
