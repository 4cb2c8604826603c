"""The streamed ``labels=`` loss is the model's own, labels paired with logits as its forward pairs them.

The decoders of the encoder-decoder families (``BartForCausalLM``, MBart, Marian, Pegasus, PLBart, Blenderbot,
BlenderbotSmall, ``WhisperForCausalLM``) compute ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``: the
logits of position t score ``labels[:, t]``, not ``labels[:, t + 1]`` as transformers' causal-LM loss does. The engine
shifted them (BART: plain 4.169, streamed 4.615, the shifted cross-entropy; gradients 1.7 relative), and the support
sweep compared with a shifted loss it wrote itself, so it marked them exact. Tiny float64 models from their configs,
against plain autograd on the model's own loss (``model_support.own_loss``), every gradient, to 1e-10.
"""

from __future__ import annotations

import copy

import model_support
import pytest
import torch
import transformers
from model_support import Float64Internals, own_loss, relative_errors, streamed_errors
from trl.trainer.utils import add_fused_lm_head
from zoo import batch, tiny_causal_lm

from streambp_trl import enable_streambp
from streambp_trl.engine.own_loss import labels_shifted

EXACT = 1e-10
UNSHIFTED = ["bart", "mbart", "marian", "pegasus", "plbart", "blenderbot", "blenderbot-small", "whisper"]


def _streamed(model_type: str):
    reference = tiny_causal_lm(model_type)
    return reference, enable_streambp(copy.deepcopy(reference), stream_chunk_size=5, logits_chunk_size=7)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("model_type", UNSHIFTED)
def test_unshifted_decoders_stream_their_own_loss(model_type, padding):
    reference, streamed = _streamed(model_type)
    assert not labels_shifted(type(reference))
    loss_err, grad_err, at = streamed_errors(reference, streamed, *batch(padding=padding))
    assert loss_err < EXACT and grad_err < EXACT, (loss_err, grad_err, at)


def test_the_reference_is_not_the_shifted_loss():
    """The comparison above can fail: BART's own loss is not the shifted cross-entropy of its logits."""
    model = tiny_causal_lm("bart")
    ids, mask, labels = batch(padding="right")
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    shifted = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    assert abs(out.loss - shifted) > 1e-2 * shifted


@pytest.mark.parametrize("keep", [9, torch.tensor([0, 4, 5, 11, 22])], ids=["last 9", "positions"])
def test_logits_to_keep(keep):
    """BART scores the kept positions' logits against labels of their shape, not shifted."""
    reference, streamed = _streamed("bart")
    ids, mask, labels = batch(padding="right")
    kept = (labels[:, -keep:] if isinstance(keep, int) else labels[:, keep]).contiguous()  # (BART views them)
    ref_loss = own_loss(reference, input_ids=ids, attention_mask=mask, labels=kept, logits_to_keep=keep)
    loss = streamed(input_ids=ids, attention_mask=mask, labels=kept, logits_to_keep=keep).loss
    assert abs(loss.item() - ref_loss.item()) < EXACT * ref_loss.item()


def test_num_items_in_batch_is_ignored_as_the_model_ignores_it():
    """transformers' Trainer passes ``num_items_in_batch`` to a model whose forward takes ``**kwargs``; BART's own
    loss ignores it (a mean over its labels that are not -100), and so does the streamed one."""
    reference, streamed = _streamed("bart")
    ids, mask, labels = batch(padding="right")
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7))
    ref_loss = own_loss(reference, **inputs)
    ref_loss.backward()
    loss = streamed(**inputs).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < EXACT * ref_loss.item()
    assert relative_errors(reference, streamed)[0] < EXACT


@pytest.mark.parametrize(
    ("argument", "message"),
    [("shift_labels", "takes no shift_labels"), ("ignore_index", "ignores the labels -100 only")],
)
def test_arguments_the_model_does_not_read_are_refused(argument, message):
    """BART's own loss reads neither ``shift_labels`` nor ``ignore_index`` (its forward hands them to its decoder):
    each is refused in one line naming the fix, not applied."""
    _, streamed = _streamed("bart")
    ids, mask, labels = batch(padding="right")
    value = {"shift_labels": labels, "ignore_index": 0}[argument]
    with pytest.raises(ValueError, match=f"^BartForCausalLM's own loss .*{message}"):
        streamed(input_ids=ids, attention_mask=mask, labels=labels, **{argument: value})


def test_the_fused_head_shifts_as_trls_does():
    """``fused_lm_head=True`` is TRL's definition, which shifts the labels whatever the model's own loss: the streamed
    BART gives what TRL's own fused head gives on the plain model (its float32 arithmetic in float64)."""
    reference, streamed = _streamed("bart")
    add_fused_lm_head(reference)
    ids, mask, labels = batch(padding="left")
    with Float64Internals():
        ref = reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out = streamed(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        ref.loss.backward()
        out.loss.backward()
    assert (out.log_probs - ref.log_probs).abs().max() < EXACT * ref.log_probs.abs().max()
    assert relative_errors(reference, streamed)[0] < EXACT


def test_the_rule_reads_the_forward():
    """Among the causal LMs the engine serves (the support table's exact ones), the forwards read as not shifting
    are the eight families' decoders; a subclass that wraps a transformers forward keeps its pairing; a class from
    outside transformers (remote code) is taken to shift, as transformers' causal-LM loss does."""
    table = model_support.support_table()
    served = {t: getattr(transformers, r["class"]) for t, r in table.items() if r["status"] != "refused"}
    assert sorted(t for t, cls in served.items() if not labels_shifted(cls)) == sorted(UNSHIFTED)

    class Wrapped(transformers.BartForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class Remote(transformers.PreTrainedModel):
        def forward(self, input_ids, labels=None):
            return torch.nn.CrossEntropyLoss()

    assert not labels_shifted(Wrapped) and labels_shifted(Remote) and labels_shifted(transformers.LlamaForCausalLM)
